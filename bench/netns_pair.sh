# netns_pair.sh -- sourced by bench/run_netem.sh and bench/run_slowlinks.sh.
#
#   netns_pair A B NET     two network namespaces A and B joined by a veth pair
#                          (${A}v in A at NET.1/24, ${B}v in B at NET.2/24), links
#                          and loopbacks up; nonzero when a step fails
#   netns_tbf A B RATE     both ends shaped by the kernel's token-bucket shaper
#                          (the burst holds at least one 64 KiB GSO packet: a
#                          smaller bucket drops it)
netns_pair() {
  ip netns add $1 && ip netns add $2 &&
    ip link add ${1}v type veth peer name ${2}v &&
    ip link set ${1}v netns $1 && ip link set ${2}v netns $2 &&
    ip -n $1 addr add $3.1/24 dev ${1}v && ip -n $2 addr add $3.2/24 dev ${2}v &&
    ip -n $1 link set ${1}v up && ip -n $2 link set ${2}v up &&
    ip -n $1 link set lo up && ip -n $2 link set lo up
}

netns_tbf() {
  for ns in $1 $2; do
    tc -n $ns qdisc del dev ${ns}v root 2>/dev/null
    tc -n $ns qdisc add dev ${ns}v root tbf rate $3 burst 256kb latency 200ms
  done
}
