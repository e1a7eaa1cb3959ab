"""torch_ddp.py -- PyTorch DistributedDataParallel (gloo) reference for `make bench-net`.

    python3 torch_ddp.py [ranks] [batch_per_rank] [seconds]
    python3 torch_ddp.py W B S --rank R --master host:port [--powersgd R]

The second form runs one rank of W, meeting the others at host:port (rank 0
listens there): bench/run_slowlinks.sh runs each rank in its own network
namespace behind a tbf-shaped veth link. --powersgd R registers DDP's own
PowerSGD communication hook (rank R, error feedback, warm start) instead of
plain all-reduce.

The Fashion-MNIST MLP (784-256-128-10, ReLU, Adam lr 1e-3 foreach) trained with
DDP over the gloo backend by `ranks` processes on this machine (127.0.0.1), one
thread each, `batch_per_rank` samples per rank per step, synthetic data (4096
samples, cycled; the data does not change the speed). Timing as bench_speed.c
and bench/bench_multiworker.c: after 3 warm-up steps, the best of windows of
10 steps on rank 0 (each window ends with every rank past the same step,
because every step all-reduces). Prints one line
"result samples_per_s=... (all ranks together)".
"""
import os
import socket
import sys
import time

def flag(name, default):
    if name in sys.argv:
        i = sys.argv.index(name)
        v = sys.argv[i + 1]
        del sys.argv[i:i + 2]
        return v
    return default


one_rank = int(flag("--rank", "-1"))
master = flag("--master", None)
powersgd = int(flag("--powersgd", "0"))
ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NSAMPLES = 4096
WINDOW = 10


def worker(rank, port, q, host="127.0.0.1"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (host, port), rank=rank, world_size=ranks)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    if powersgd > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.rand(NSAMPLES, 784, generator=g)
    ys = torch.randint(0, 10, (NSAMPLES,), generator=g)
    nb = NSAMPLES // batch
    best = 0.0
    s = 0
    t_end = None
    tw = None
    stop = torch.zeros(1)
    while True:
        if s == 3:
            tw = time.perf_counter()
            t_end = tw + seconds
        bi = s % nb
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(xs[bi * batch:(bi + 1) * batch]), ys[bi * batch:(bi + 1) * batch])
        loss.backward()
        opt.step()
        s += 1
        if s > 3 and (s - 3) % WINDOW == 0:
            now = time.perf_counter()
            best = max(best, WINDOW * batch * ranks / (now - tw))
            tw = now
            # rank 0 decides when to stop; everyone learns it in the same step
            stop[0] = 1.0 if (rank == 0 and now >= t_end) else 0.0
            dist.all_reduce(stop)
            if stop[0] > 0:
                break
    if rank == 0 and q is not None:
        q.put(best)
    elif rank == 0:
        print("result samples_per_s=%.1f ranks=%d batch_per_rank=%d" % (best, ranks, batch))
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


if __name__ == "__main__" and one_rank >= 0:
    host, port = master.rsplit(":", 1)
    worker(one_rank, int(port), None, host)
elif __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    best = q.get(timeout=600)
    for p in procs:
        p.join()
    print("result samples_per_s=%.1f ranks=%d batch_per_rank=%d" % (best, ranks, batch))
