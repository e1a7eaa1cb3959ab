/* tests/test_plan.c -- the planner (dt_plan_*): its arithmetic against hand-
 * computed cases (ring and recursive-doubling all-reduce, the parameter
 * server's round, the pipeline bubble, the link spec's units), its
 * recommendation (a tiny model on a 10 Mbit link: do not distribute; a
 * compute-heavy one on a fast link: distribute; a memory limit rules rows
 * out), and the measurement (it leaves the parameters and the caller's
 * optimizer as they were). No timing decides a test. */
#include "harness.h"

#include <math.h>
#include <pthread.h>

#define CHECK_REL(a, b, rel)                                                                    \
  CHECK_MSG(fabs((double)(a) - (double)(b)) <= (rel) * fabs((double)(b)) + 1e-15, "%.9g, want %.9g", \
            (double)(a), (double)(b))
#define CHECK_EQ(a, b) CHECK_MSG((a) == (b), "%lld, want %lld", (long long)(a), (long long)(b))

static void test_collectives_arithmetic(void) {
  dt_plan_link l = {1e-3, 1e8, 0};
  /* ring: 2(n-1) alpha + 2 (n-1)/n bytes/beta = 0.006 + 0.015 */
  CHECK_REL(dt_plan_ring_allreduce_s(4, 1e6, l), 0.021, 1e-12);
  CHECK_REL(dt_plan_ring_allreduce_s(2, 1e6, l), 2e-3 + 1e-2, 1e-12);
  CHECK_EQ(dt_plan_ring_allreduce_s(1, 1e6, l), 0.0);
  /* recursive doubling: log2(n) (alpha + bytes/beta) = 3 x 0.011 */
  CHECK_REL(dt_plan_doubling_allreduce_s(8, 1e6, l), 0.033, 1e-12);
  CHECK_REL(dt_plan_doubling_allreduce_s(2, 1e6, l), 0.011, 1e-12);
  /* a small message: latency-bound, doubling wins at 8; a big one: bandwidth-bound, the ring wins */
  CHECK(dt_plan_doubling_allreduce_s(8, 100, l) < dt_plan_ring_allreduce_s(8, 100, l));
  CHECK(dt_plan_ring_allreduce_s(8, 1e9, l) < dt_plan_doubling_allreduce_s(8, 1e9, l));
  /* one shared medium (Wi-Fi, a hub): the n transfers of a ring step share it, 2(n-1) (alpha +
   * bytes/beta) = 6 x 0.011; doubling's rounds carry n transfers of all the bytes: 3 x (0.001 + 0.08) */
  dt_plan_link sh = {1e-3, 1e8, 1};
  CHECK_REL(dt_plan_ring_allreduce_s(4, 1e6, sh), 0.066, 1e-12);
  CHECK_REL(dt_plan_doubling_allreduce_s(8, 1e6, sh), 0.243, 1e-12);
  /* the bubble: (p-1)/(m+p-1) */
  CHECK_REL(dt_plan_bubble(4, 12), 0.2, 1e-12);
  CHECK_REL(dt_plan_bubble(2, 1), 0.5, 1e-12);
  CHECK_EQ(dt_plan_bubble(1, 8), 0.0);
}

static void test_link_parse(void) {
  dt_plan_link l;
  CHECK_EQ(dt_plan_link_parse("rate=100mbit,delay=2ms", &l), DTRAIN_OK);
  CHECK_REL(l.bandwidth_Bps, 100e6 / 8 * 1448.0 / 1514.0, 1e-12); /* headers: 66 bytes a 1448-byte segment */
  CHECK_REL(l.latency_s, 2e-3 + 25e-6, 1e-12);                 /* the delay on top of loopback's own */
  CHECK_EQ(dt_plan_link_parse("delay=1ms,jitter=2ms,rate=10mbit", &l), DTRAIN_OK);
  CHECK_REL(l.latency_s, 1e-3 + 25e-6 + 1e-3, 1e-12);
  CHECK_REL(l.bandwidth_Bps, 10e6 / 8 * 1448.0 / 1514.0, 1e-12);
  CHECK_EQ(dt_plan_link_parse("rate=1gbps", &l), DTRAIN_OK); /* tc's bps: bytes */
  CHECK_REL(l.bandwidth_Bps, 1e9 * 1448.0 / 1514.0, 1e-12);
  CHECK_EQ(dt_plan_link_parse("loopback", &l), DTRAIN_OK);
  CHECK(l.bandwidth_Bps > 1e8 && l.latency_s > 0);
  CHECK_EQ(dt_plan_link_parse("rate=fast", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "rate 'fast'") != NULL);
  CHECK_EQ(dt_plan_link_parse("loss=1%", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "'loss'") != NULL);
  CHECK_EQ(dt_plan_link_parse("delay", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK_EQ(dt_plan_link_parse("delay=-1ms", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK_EQ(dt_plan_link_parse("rate=0mbit", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK_EQ(dt_plan_link_parse(NULL, &l), DTRAIN_ERR_NULL_ARG);
  /* the link as it is (a simulator's platform): nothing added or taken off */
  CHECK_EQ(dt_plan_link_parse("bandwidth=10gbit,latency=11us", &l), DTRAIN_OK);
  CHECK_REL(l.bandwidth_Bps, 10e9 / 8, 1e-12);
  CHECK_REL(l.latency_s, 11e-6, 1e-12);
  CHECK_EQ(dt_plan_link_parse("latency=3ms,rate=50mbit", &l), DTRAIN_OK); /* the spellings mix per quantity */
  CHECK_REL(l.latency_s, 3e-3, 1e-12);
  CHECK_REL(l.bandwidth_Bps, 50e6 / 8 * 1448.0 / 1514.0, 1e-12);
  CHECK_EQ(dt_plan_link_parse("rate=1gbit,bandwidth=1gbit", &l), DTRAIN_ERR_INVALID_ARG); /* one quantity twice */
  CHECK(strstr(dt_last_error(), "rate twice") != NULL);
  CHECK_EQ(dt_plan_link_parse("latency=1ms,delay=1ms", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "latency twice") != NULL);
  CHECK_EQ(dt_plan_link_parse("bandwidth=0bit", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK_EQ(l.shared, 0);
  CHECK_EQ(dt_plan_link_parse("bandwidth=50mbit,latency=3ms,shared=1", &l), DTRAIN_OK);
  CHECK_EQ(l.shared, 1);
  CHECK_REL(l.bandwidth_Bps, 50e6 / 8, 1e-12);
  CHECK_EQ(dt_plan_link_parse("rate=50mbit,shared=yes", &l), DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "shared 'yes'") != NULL);
  CHECK_EQ(dt_plan_link_parse("latency=soon", &l), DTRAIN_ERR_INVALID_ARG);
}

static const dt_plan_row *row(const dt_plan_row *r, int n, const char *name, int workers) {
  for (int i = 0; i < n; i++)
    if (strcmp(r[i].name, name) == 0 && r[i].workers == workers) return &r[i];
  return NULL;
}

/* a hand-made model: 10 us a sample, 0.1 ms for the optimizer, 1 MB of weights */
static dt_plan_model hand_model(void) {
  dt_plan_model m;
  memset(&m, 0, sizeof m);
  m.fixed_s = 0;
  m.per_sample_s = 1e-5;
  m.update_s = 1e-4;
  m.params = 250000;
  m.param_bytes = m.grad_bytes = 1000000;
  m.optim_bytes = 2000000;
  m.activation_bytes_per_sample = 1000;
  return m;
}

/* options for a global batch of 64 over up to max_workers on `cores` cores, link lat/bw */
static dt_plan_options opts64(int max_workers, int cores, double lat, double bw) {
  dt_plan_options o;
  memset(&o, 0, sizeof o);
  o.batch = 64;
  o.max_workers = max_workers;
  o.cores = cores;
  o.link.latency_s = lat;
  o.link.bandwidth_Bps = bw;
  return o;
}

static void test_rows_arithmetic(void) {
  dt_plan_model m = hand_model();
  dt_plan_options o = opts64(4, 1, 1e-3, 1e8);
  o.epoch_samples = 64000;
  dt_plan_row r[64];
  int n = dt_plan_predict(&m, &o, r, 64);
  CHECK(n > 4 && n <= 64);
  const dt_plan_row *one = row(r, n, "one_device", 1);
  CHECK(one != NULL);
  if (!one) return;
  CHECK_REL(one->step_s, 64e-5 + 1e-4, 1e-12);
  CHECK_REL(one->samples_per_sec, 64 / (64e-5 + 1e-4), 1e-12);
  CHECK_REL(one->epoch_s, 64000 / one->samples_per_sec, 1e-12);
  CHECK_REL(one->memory_bytes, 1e6 + 1e6 + 2e6 + 64 * 1000, 1e-12);
  /* multi_worker_mirrored, ring, 2 workers: t(32) + update + its two passes over the
   * gradient (scaled, copied back: 2 x 1 MB at 5 GB/s) + ring(2, 1 MB) */
  const dt_plan_row *mw = row(r, n, "multi_worker_mirrored ring", 2);
  CHECK(mw != NULL);
  if (mw) {
    double ring = 2 * 1e-3 + 1e6 / 1e8;
    CHECK_REL(mw->step_s, 32e-5 + 1e-4 + 2 * 1e6 / 5e9 + ring, 1e-12);
    CHECK_REL(mw->comm_share, ring / mw->step_s, 1e-12);
    CHECK_REL(mw->speedup, mw->samples_per_sec / one->samples_per_sec, 1e-12);
  }
  /* parameter server, 4 workers, 1 server: the round of the fluid (test_plan_fluid.c has
   * its hand cases): the server's full-duplex link takes 4 pushes in and 4 pulls out of
   * 1e6 / 1e8 s each a round, together at most (4 x 0.01), one after the other at worst
   * (workers in step, 8 x 0.01, + the compute and the updates); here the updates' spread
   * leaves them partly in step, between the two */
  const dt_plan_row *ps = row(r, n, "parameter_server 1 server", 4);
  CHECK(ps != NULL);
  if (ps) {
    double worker = 16e-5 + 2 * 1e-3 + 2e6 / 1e8 + 1e-4;
    CHECK(ps->step_s > 4 * 1e6 / 1e8 + 4 * 1e-4 && ps->step_s > worker);
    CHECK(ps->step_s > 0.05 && ps->step_s < 8 * 1e6 / 1e8 + 2.16e-3 + 4 * 1e-4);
    CHECK_REL(ps->staleness, 3, 1e-12);
    CHECK_REL(ps->memory_bytes, 1e6 + 1e6 + 16 * 1000, 1e-12); /* the optimizer state is on the server */
  }
  /* a link per connection (DTRAIN_NETEM's): the server's link no longer bounds the round; the
   * worker's own path does: compute, push, the server's update of its push, pull (the
   * updates, 4 x 1e-4 a round, spread the workers once and then never make one wait) */
  o.links_per_connection = 1;
  {
    dt_plan_row rl[64];
    int nl = dt_plan_predict(&m, &o, rl, 64);
    const dt_plan_row *pl = row(rl, nl, "parameter_server 1 server", 4);
    CHECK(pl != NULL);
    if (pl) CHECK_REL(pl->step_s, 16e-5 + 2 * 1e-3 + 2e6 / 1e8 + 1e-4, 1e-9);
  }
  o.links_per_connection = 0;
  /* a fast link (1e10 B/s: 1e-4 s a push, as long as the update): the updates spread the
   * 4 workers so that no push or pull shares the link (4 x 1e-4 of each a round, and 4 x
   * 1e-4 of updates, fit in a worker's path): the round is the worker's path */
  {
    dt_plan_options of = opts64(4, 1, 1e-6, 1e10);
    dt_plan_row rf[64];
    int nf = dt_plan_predict(&m, &of, rf, 64);
    const dt_plan_row *pf = row(rf, nf, "parameter_server 1 server", 4);
    CHECK(pf != NULL);
    if (pf) {
      CHECK_REL(pf->step_s, 16e-5 + 2e-6 + 2e6 / 1e10 + 1e-4, 1e-9);
    }
  }
  /* async(2) on one core: each replica's step in turn, t(32) + the whole update + three
   * passes over the weights (pull, old values, push) at 5 GB/s; with owners (async
   * sharded) half the update and the passes of the hand-over (1/2 of G written, 1/2 read)
   * and of the weights (its half written into the store, the other half pulled) */
  const dt_plan_row *as = row(r, n, "async", 2), *ao = row(r, n, "async sharded", 2);
  CHECK(as != NULL && ao != NULL);
  if (as && ao) {
    CHECK_REL(as->step_s, 2 * (32e-5 + 1e-4 + 3 * 1e6 / 5e9), 1e-12);
    CHECK_REL(ao->step_s, 2 * (32e-5 + 1e-4 / 2 + (2 * 1e6 / 2 + 1e6) / 5e9), 1e-12);
    CHECK_REL(ao->comm_share, (2 * 1e6 / 2 + 1e6) / 5e9 / ao->step_s, 1e-12);
    CHECK_REL(ao->staleness, 1, 1e-12);
  }
  /* threads on one core take turns: mirrored(2) computes t(32) twice */
  const dt_plan_row *mi = row(r, n, "mirrored", 2);
  CHECK(mi != NULL);
  if (mi) CHECK(mi->step_s >= 2 * 32e-5);
  /* with a machine per worker the processes do not; sharing one machine's core they do */
  o.shared_cores = 1;
  dt_plan_row r2[64];
  int n2 = dt_plan_predict(&m, &o, r2, 64);
  const dt_plan_row *mw2 = row(r2, n2, "multi_worker_mirrored ring", 2);
  CHECK(mw2 && mw && mw2->step_s > mw->step_s + 32e-5 - 1e-12);
  /* pipeline rows only when the model says where it can be cut */
  CHECK(row(r, n, "pipeline 1f1b m=8", 2) == NULL);
  m.pipeline_max_stages = 4;
  m.boundary_bytes_per_sample = 512;
  o.shared_cores = 0;
  n = dt_plan_predict(&m, &o, r, 64);
  const dt_plan_row *pp = row(r, n, "pipeline 1f1b m=8", 2);
  CHECK(pp != NULL);
  if (pp) {
    double micro = 64.0 / 8, stage = micro * 1e-5 / 2, hop = 1e-3 + 2 * 512 * micro / 1e8;
    CHECK_REL(pp->step_s, (8 + 1) * (stage + hop) + 1e-4 / 2, 1e-12);
    CHECK_REL(pp->bubble, 1.0 / 9, 1e-12);
  }
  /* tensor-parallel rows only when the model says what splits: here 90% of
   * the work and weights, 2 all-reduces a step of 512 bytes a sample
   * together, up to 4 ranks; each rank the whole batch of 64 */
  CHECK(row(r, n, "tensor_parallel", 2) == NULL);
  m.tp_max_ranks = 4;
  m.tp_split_share = 0.9;
  m.tp_allreduces = 2;
  m.tp_bytes_per_sample = 512;
  n = dt_plan_predict(&m, &o, r, 64);
  for (int T = 2; T <= 4; T *= 2) {
    const dt_plan_row *tp = row(r, n, "tensor_parallel", T);
    CHECK(tp != NULL);
    if (!tp) continue;
    double part = 0.1 + 0.9 / T, own = 64 * 1e-5 * part + 1e-4 * part;
    double ar = 2 * (T - 1) * (1e-3 + 64.0 * 512 / 2 / T / 1e8); /* one ring all-reduce of half the bytes */
    CHECK_REL(tp->step_s, own + 2 * ar, 1e-12);
    CHECK_REL(tp->memory_bytes, 4e6 * part + 1000 * 64, 1e-12);
    CHECK_REL(tp->comm_share, 2 * ar / (own + 2 * ar), 1e-9);
    CHECK(strcmp(tp->family, "tensor") == 0 && tp->staleness == 0 && tp->bubble == 0);
  }
  /* the parameters' share apart from the work's: the update and the memory follow it */
  m.tp_param_share = 0.5;
  {
    dt_plan_row rq[64];
    int nq = dt_plan_predict(&m, &o, rq, 64);
    const dt_plan_row *tq = row(rq, nq, "tensor_parallel", 2);
    double part = 0.55, qpart = 0.75, ar = 2 * (1e-3 + 64.0 * 512 / 2 / 2 / 1e8);
    CHECK(tq != NULL);
    if (tq) CHECK_REL(tq->step_s, 64 * 1e-5 * part + 1e-4 * qpart + 2 * ar, 1e-12);
    if (tq) CHECK_REL(tq->memory_bytes, 4e6 * qpart + 1000 * 64, 1e-12);
  }
  m.tp_param_share = 0;
  /* with a spread, each of the k = 2 all-reduces waits for the slowest rank's segment: sqrt(2) x the whole
   * step's wait (jitter x compute x E[max of 2 normals] = 0.5642) */
  m.jitter = 0.1;
  {
    dt_plan_row rj[64];
    int nj = dt_plan_predict(&m, &o, rj, 64);
    const dt_plan_row *tj = row(rj, nj, "tensor_parallel", 2), *t0 = row(r, n, "tensor_parallel", 2);
    CHECK(tj && t0);
    if (tj && t0) CHECK_REL(tj->step_s - t0->step_s, 0.1 * (64 * 1e-5 * 0.55) * 0.5642 * sqrt(2.0), 1e-9);
  }
  m.jitter = 0;
  CHECK(row(r, n, "tensor_parallel", 8) == NULL); /* past tp_max_ranks */
  /* on one machine's one core the ranks take turns and the step is at least their CPU work */
  o.shared_cores = 1;
  dt_plan_row rs[64];
  int ns = dt_plan_predict(&m, &o, rs, 64);
  const dt_plan_row *tps = row(rs, ns, "tensor_parallel", 2), *tpl = row(r, n, "tensor_parallel", 2);
  CHECK(tps && tpl && tps->step_s >= 2 * (64 * 1e-5 * 0.55 + 1e-4 * 0.55) - 1e-12 && tps->step_s > tpl->step_s);
  o.shared_cores = 0;
  m.tp_split_share = 1.5;
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  CHECK(strstr(dt_last_error(), "tensor-parallel shares 1.5 (work)") != NULL);
  m.tp_split_share = 0.9;
  m.tp_param_share = -0.25; /* named as itself, not as the work's share */
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  CHECK(strstr(dt_last_error(), "0.9 (work) and -0.25 (parameters)") != NULL);
  m.tp_param_share = 0;
  /* counting only, and bad arguments */
  CHECK_EQ(dt_plan_predict(&m, &o, NULL, 0), n);
  o.batch = 0;
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  CHECK(strstr(dt_last_error(), "dt_plan_predict") != NULL);
  o.batch = 64;
  CHECK_EQ(dt_plan_predict(NULL, &o, r, 64), -1);
  CHECK_EQ(dt_plan_predict(&m, &o, NULL, 4), -1);
}

/* A synchronous step across processes waits for the slowest worker: with a
 * measured spread (jitter) the ring rows add jitter x compute x E[max of N
 * standard normals]; async rows do not wait. A shared medium carries every
 * parameter-server push and pull of a round, whatever the servers. */
static void test_stragglers_and_shared_medium(void) {
  dt_plan_model m = hand_model();
  dt_plan_options o = opts64(8, 1, 1e-3, 1e8);
  dt_plan_row r[64], rj[64];
  int n = dt_plan_predict(&m, &o, r, 64);
  m.jitter = 0.1;
  int nj = dt_plan_predict(&m, &o, rj, 64);
  CHECK_EQ(n, nj);
  const int ws[3] = {2, 4, 8};
  const double z[3] = {0.5642, 1.0294, 1.4236};
  for (int i = 0; i < 3; i++) {
    const dt_plan_row *a = row(r, n, "multi_worker_mirrored ring", ws[i]);
    const dt_plan_row *b = row(rj, nj, "multi_worker_mirrored ring", ws[i]);
    const dt_plan_row *pa = row(r, n, "parameter_server 1 server", ws[i]);
    const dt_plan_row *pb = row(rj, nj, "parameter_server 1 server", ws[i]);
    CHECK(a && b && pa && pb);
    if (!a || !b || !pa || !pb) continue;
    double t = 64.0 / ws[i] * 1e-5; /* a worker's compute */
    CHECK_REL(b->step_s - a->step_s, 0.1 * t * z[i], 1e-9);
    CHECK(b->comm_share > a->comm_share); /* (the wait is spent in the all-reduce) */
    CHECK_REL(pb->step_s, pa->step_s, 1e-12);
  }
  /* a spread that is no number, or below 0, is refused (the other measurements are) */
  m.jitter = -0.1;
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  CHECK(strstr(dt_last_error(), "jitter -0.1") != NULL);
  m.jitter = NAN;
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  m.jitter = INFINITY;
  CHECK_EQ(dt_plan_predict(&m, &o, r, 64), -1);
  m.jitter = 0;
  o.link.shared = 1;
  n = dt_plan_predict(&m, &o, r, 64);
  const dt_plan_row *ps = row(r, n, "parameter_server 1 server", 4), *mw = row(r, n, "multi_worker_mirrored ring", 4);
  CHECK(ps && mw);
  if (ps) CHECK_REL(ps->step_s, 4 * 2e6 / 1e8 + 4 * 1e-4, 1e-12); /* all 4 pushes and pulls through the one medium */
  if (mw) CHECK_REL(mw->step_s, 16e-5 + 1e-4 + 2 * 1e6 / 5e9 + 6 * (1e-3 + 1e6 / 1e8), 1e-12);
  o.servers = 4; /* more servers do not widen a shared medium */
  n = dt_plan_predict(&m, &o, r, 64);
  ps = row(r, n, "parameter_server 4 servers", 4);
  CHECK(ps != NULL);
  if (ps) CHECK_REL(ps->step_s, 16e-5 + 2 * 1e-3 + 2e6 / 1e8 + 1e-4 / 4 > 4 * 2e6 / 1e8 + 1e-4
                                    ? 16e-5 + 2 * 1e-3 + 2e6 / 1e8 + 1e-4 / 4
                                    : 4 * 2e6 / 1e8 + 1e-4, 1e-12);
}

/* data loading: the caller's thread loads the global batch before the
 * replicas start (one_device, threads), each worker process its own part */
static void test_loading_term(void) {
  dt_plan_model m = hand_model();
  m.load_per_sample_s = 2e-6;
  dt_plan_options o = opts64(2, 2, 1e-3, 1e8);
  dt_plan_row r[64];
  int n = dt_plan_predict(&m, &o, r, 64);
  const dt_plan_row *one = row(r, n, "one_device", 1), *mw = row(r, n, "multi_worker_mirrored ring", 2),
                    *mi = row(r, n, "mirrored", 2), *ov = row(r, n, "multi_worker_mirrored ring overlap", 2);
  CHECK(one && mw && mi && ov);
  if (!one || !mw || !mi || !ov) return;
  CHECK_REL(one->step_s, 64e-5 + 1e-4 + 64 * 2e-6, 1e-12);
  double ring = 2 * 1e-3 + 1e6 / 1e8;
  CHECK_REL(mw->step_s, 32e-5 + 32 * 2e-6 + 1e-4 + 4e-4 + ring, 1e-12); /* (4e-4: the gradient's two passes) */
  /* overlap hides the ring behind half the backward, not behind the loading */
  CHECK_REL(ov->step_s, 32e-5 + 32 * 2e-6 + 1e-4 + 4e-4 + ring - 0.5 * 32e-5, 1e-12);
  /* mirrored(2) on 2 cores: t(32) + update/2 + the reduction + loading all 64 rows */
  m.load_per_sample_s = 0;
  dt_plan_row r0[64];
  int n0 = dt_plan_predict(&m, &o, r0, 64);
  const dt_plan_row *mi0 = row(r0, n0, "mirrored", 2);
  CHECK(mi0 != NULL);
  if (mi0) CHECK_REL(mi->step_s - mi0->step_s, 64 * 2e-6, 1e-9);
}

/* One machine shared by every process: compute slowed as measured with all
 * cores busy, and a step no shorter than all the processes' CPU work (their
 * compute and the kernel's copies of each byte at both ends) over the cores */
static void test_shared_machine(void) {
  dt_plan_model m = hand_model();
  m.busy_slowdown = 1.5;
  m.busy_cores = 2;
  dt_plan_options o = opts64(4, 2, 25e-6, 2.5e9);
  o.shared_cores = 1;
  dt_plan_row r[64];
  int n = dt_plan_predict(&m, &o, r, 64);
  const dt_plan_row *mi = row(r, n, "mirrored", 2), *mw = row(r, n, "multi_worker_mirrored ring", 2),
                    *mw4 = row(r, n, "multi_worker_mirrored ring", 4), *one = row(r, n, "one_device", 1);
  CHECK(mi && mw && mw4 && one);
  if (!mi || !mw || !mw4 || !one) return;
  CHECK_REL(one->step_s, 64e-5 + 1e-4, 1e-12); /* alone: no slowdown */
  /* mirrored(2) on 2 cores: t(32) x 1.5 + update/2 + the reduction (2 x 1 MB / 2 at 5 GB/s + 2 barriers) */
  CHECK_REL(mi->step_s, 32e-5 * 1.5 + 1e-4 / 2 + (2.0 * 1e6 / 2 / 5e9 + 2 * 20e-6), 1e-12);
  /* 2 processes: t(32) x 1.5 + update + the gradient's two passes (2 x 1 MB at 5 GB/s) + ring
   * (2 x 25 us + 1 MB at 2.5 GB/s), or the CPU's floor: 2 x (t x 1.5 + update + passes) / 2 cores
   * + the ring's additions ((N - 1) x 1 MB at 5 GB/s over 2 cores) + 2 copies x (2 x 1 x 1 MB)
   * / 2.5 GB/s / 2 cores */
  const double gp = 2 * 1e6 / 5e9;
  double own2 = 32e-5 * 1.5 + 1e-4 + gp + 2 * 25e-6 + 1e6 / 2.5e9;
  double floor2 = 2 * (32e-5 * 1.5 + 1e-4 + gp) / 2 + 1 * 1e6 / 5e9 / 2 + 2.0 * (2.0 * 1e6) / 2.5e9 / 2;
  CHECK_REL(mw->step_s, own2 > floor2 ? own2 : floor2, 1e-12);
  /* 4 processes on 2 cores: they take turns (2 x (t(16) x 1.5 + update)); the floor
   * counts 4 workers' work, their additions (3 x 1 MB) and 2 x 3 x 1 MB sent */
  double own4 = 2 * (16e-5 * 1.5) + 2 * 1e-4 + 2 * gp + dt_plan_ring_allreduce_s(4, 1e6, o.link);
  double floor4 = 4 * (16e-5 * 1.5 + 1e-4 + gp) / 2 + 3 * 1e6 / 5e9 / 2 + 2.0 * (2.0 * 3 * 1e6) / 2.5e9 / 2;
  CHECK_REL(mw4->step_s, own4 > floor4 ? own4 : floor4, 1e-12);
  CHECK(floor4 > own4); /* (the floor is what decides here) */
  /* recursive doubling: log2 4 = 2 rounds, each adding all of 1 MB in every worker and sending it */
  const dt_plan_row *db4 = row(r, n, "multi_worker_mirrored doubling", 4);
  double ownd = 2 * (16e-5 * 1.5) + 2 * 1e-4 + 2 * gp + dt_plan_doubling_allreduce_s(4, 1e6, o.link);
  double floord = 4 * (16e-5 * 1.5 + 1e-4 + gp) / 2 + 4 * 2 * 1e6 / 5e9 / 2 + 2.0 * (4 * 2 * 1e6) / 2.5e9 / 2;
  CHECK(db4 != NULL);
  if (db4) CHECK_REL(db4->step_s, ownd > floord ? ownd : floord, 1e-12);
  /* this machine's loopback as probed (dt_plan_options.loopback_Bps, 02 --plan under the
   * launcher) prices the kernel's copies in the floor instead of 2.5 GB/s */
  o.loopback_Bps = 4e9;
  n = dt_plan_predict(&m, &o, r, 64);
  mw4 = row(r, n, "multi_worker_mirrored ring", 4);
  double floor4p = 4 * (16e-5 * 1.5 + 1e-4 + gp) / 2 + 3 * 1e6 / 5e9 / 2 + 2.0 * (2.0 * 3 * 1e6) / 4e9 / 2;
  CHECK(mw4 != NULL);
  if (mw4) CHECK_REL(mw4->step_s, own4 > floor4p ? own4 : floor4p, 1e-12);
  o.loopback_Bps = 0;
  /* the gradient's passes at the model's measured rate (dt_plan_measure's memory_Bps) instead of
   * 5 GB/s, in the processes' own step and floor and in mirrored's reduction; an option set wins */
  m.memory_Bps = 40e9;
  n = dt_plan_predict(&m, &o, r, 64);
  mw4 = row(r, n, "multi_worker_mirrored ring", 4);
  mi = row(r, n, "mirrored", 2);
  const double gm = 2 * 1e6 / 40e9;
  double own4m = 2 * (16e-5 * 1.5) + 2 * 1e-4 + 2 * gm + dt_plan_ring_allreduce_s(4, 1e6, o.link);
  double floor4m = 4 * (16e-5 * 1.5 + 1e-4 + gm) / 2 + 3 * 1e6 / 40e9 / 2 + 2.0 * (2.0 * 3 * 1e6) / 2.5e9 / 2;
  CHECK(mw4 != NULL && mi != NULL);
  if (mw4) CHECK_REL(mw4->step_s, own4m > floor4m ? own4m : floor4m, 1e-12);
  if (mi) CHECK_REL(mi->step_s, 32e-5 * 1.5 + 1e-4 / 2 + (2.0 * 1e6 / 2 / 40e9 + 2 * 20e-6), 1e-12);
  o.memory_Bps = 5e9;
  n = dt_plan_predict(&m, &o, r, 64);
  mw4 = row(r, n, "multi_worker_mirrored ring", 4);
  CHECK(mw4 != NULL);
  if (mw4) CHECK_REL(mw4->step_s, own4 > floor4 ? own4 : floor4, 1e-12);
  o.memory_Bps = 0;
  m.memory_Bps = 0;
  n = dt_plan_predict(&m, &o, r, 64);
  CHECK(row(r, n, "multi_worker_mirrored hierarchical", 2) == NULL); /* (not on one shared machine) */
  /* a machine per process: neither the slowdown nor the floor */
  o.shared_cores = 0;
  n = dt_plan_predict(&m, &o, r, 64);
  mw = row(r, n, "multi_worker_mirrored ring", 2);
  CHECK(mw != NULL);
  if (mw) CHECK_REL(mw->step_s, 32e-5 + 1e-4 + gp + 2 * 25e-6 + 1e6 / 2.5e9, 1e-12);
  /* hierarchical: each machine's 2 cores run a replica each (t(16) x 1.5), reduce in memory
   * (2 x 1 MB / 2 at 5 GB/s + 2 barriers), replica 0 runs the ring, each replica scales and
   * updates half (update and the gradient's two passes over 2) */
  const dt_plan_row *hi = row(r, n, "multi_worker_mirrored hierarchical", 2);
  CHECK(hi != NULL);
  if (hi) {
    double ring2 = 2 * 25e-6 + 1e6 / 2.5e9;
    CHECK_REL(hi->step_s, 16e-5 * 1.5 + (2.0 * 1e6 / 2 / 5e9 + 2 * 20e-6) + ring2 + (1e-4 + gp) / 2, 1e-12);
    CHECK_REL(hi->comm_share, ring2 / hi->step_s, 1e-12);
    CHECK(mw && hi->step_s < mw->step_s); /* two cores a machine beat one */
  }
}

/* dt_plan_measure_loader: a time per sample, and the loader where it was */
static void test_measure_loader(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_DATA)) TH_SKIP("the data loaders are compiled out (DTRAIN_NO_DATA)");
  int64_t shape[1] = {8};
  dt_dataset *ds = dt_dataset_new(100, 1, shape, 1);
  CHECK(ds != NULL);
  if (!ds) return;
  dt_loader_options lo;
  memset(&lo, 0, sizeof lo);
  lo.batch_size = 16;
  lo.shuffle = 1;
  lo.seed = 3;
  dt_loader *l = dt_loader_new(ds, &lo);
  CHECK(l != NULL);
  dt_batch b;
  CHECK_EQ(dt_loader_next(l, &b), 1);
  int64_t ep, idx, ep2, idx2;
  dt_loader_position(l, &ep, &idx);
  dt_plan_model pm;
  memset(&pm, 0, sizeof pm);
  pm.per_sample_s = 7e-6; /* the rest of the model is left alone */
  CHECK_EQ(dt_plan_measure_loader(l, 20, &pm), DTRAIN_OK); /* 20 batches: over epoch ends (7 a 100-sample epoch) */
  CHECK(pm.load_per_sample_s > 0);
  CHECK_EQ(pm.per_sample_s, 7e-6);
  dt_loader_position(l, &ep2, &idx2);
  CHECK(ep2 == ep && idx2 == idx);
  CHECK_EQ(dt_plan_measure_loader(NULL, 5, &pm), DTRAIN_ERR_NULL_ARG);
  CHECK_EQ(dt_plan_measure_loader(l, 5, NULL), DTRAIN_ERR_NULL_ARG);
  dt_loader_destroy(l);
  /* a loader that gives no batch (drop_last, a batch bigger than the set): an error, not a loop */
  lo.batch_size = 200;
  lo.drop_last = 1;
  l = dt_loader_new(ds, &lo);
  if (l) {
    CHECK_EQ(dt_plan_measure_loader(l, 5, &pm), DTRAIN_ERR_EMPTY);
    CHECK(strstr(dt_last_error(), "no batches") != NULL);
    dt_loader_destroy(l);
  } else {
    CHECK(dt_last_result() != DTRAIN_OK); /* refused at creation instead: also no loop */
  }
  dt_dataset_destroy(ds);
}

/* dt_plan_probe_link between two threads of one communicator: both get the
 * same figures (the leader's), positive; calls that cannot be a probe are
 * refused without communicating */
typedef struct {
  dt_comm *c;
  int rank;
  dt_plan_link l;
  dt_result r;
} probe_job;

static void *probe_main(void *arg) {
  probe_job *j = (probe_job *)arg;
  j->r = dt_plan_probe_link(j->c, j->rank, 0, 1, &j->l);
  return NULL;
}

static void test_probe_link(void) {
  const unsigned need = DTRAIN_FEATURE_THREADS | DTRAIN_FEATURE_DIST;
  if ((dt_build_features() & need) != need) TH_SKIP("no thread communicator in this build (DTRAIN_NO_THREADS or DTRAIN_NO_DIST)");
  dt_comm *c = dt_comm_create_threads(2, 0);
  CHECK(c != NULL);
  if (!c) return;
  probe_job j[2];
  memset(j, 0, sizeof j);
  pthread_t th;
  j[0].c = j[1].c = c;
  j[1].rank = 1;
  pthread_create(&th, NULL, probe_main, &j[1]);
  probe_main(&j[0]);
  pthread_join(th, NULL);
  CHECK_EQ(j[0].r, DTRAIN_OK);
  CHECK_EQ(j[1].r, DTRAIN_OK);
  CHECK(j[0].l.latency_s > 0 && j[0].l.bandwidth_Bps > 0);
  CHECK(j[0].l.latency_s == j[1].l.latency_s && j[0].l.bandwidth_Bps == j[1].l.bandwidth_Bps);
  dt_plan_link l;
  CHECK_EQ(dt_plan_probe_link(c, 0, 0, 0, &l), DTRAIN_ERR_INVALID_ARG); /* a rank with itself */
  CHECK_EQ(dt_plan_probe_link(c, 0, 0, 2, &l), DTRAIN_ERR_INVALID_ARG); /* outside the world */
  CHECK(strstr(dt_last_error(), "ranks 0 and 2 of 2") != NULL);
  CHECK_EQ(dt_plan_probe_link(NULL, 0, 0, 1, &l), DTRAIN_ERR_NULL_ARG);
  CHECK_EQ(dt_plan_probe_link(c, 0, 0, 1, NULL), DTRAIN_ERR_NULL_ARG);
  dt_comm_destroy(c);
  c = dt_comm_create_threads(3, 0);
  if (c) CHECK_EQ(dt_plan_probe_link(c, 2, 0, 1, &l), DTRAIN_ERR_INVALID_ARG); /* rank 2 is not a or b */
  dt_comm_destroy(c);
}

static void test_recommendations(void) {
  dt_plan_row r[64];
  char why[512];
  /* a tiny model (a few thousand weights, 2 us a sample) on a 10 Mbit link, a core a machine: stay on one device */
  dt_plan_model tiny = hand_model();
  tiny.per_sample_s = 2e-6;
  tiny.update_s = 5e-6;
  tiny.params = 5000;
  tiny.param_bytes = tiny.grad_bytes = 20000;
  tiny.optim_bytes = 40000;
  dt_plan_options o = opts64(16, 1, 0, 0);
  CHECK_EQ(dt_plan_link_parse("rate=10mbit,delay=1ms", &o.link), DTRAIN_OK);
  int n = dt_plan_predict(&tiny, &o, r, 64);
  int best = dt_plan_recommend(r, n, why, sizeof why);
  CHECK(best >= 0 && strcmp(r[best].family, "one_device") == 0);
  CHECK_MSG(strstr(why, "do not distribute") != NULL, "%s", why);
  /* compute-heavy (1 ms a sample, 1 MB of weights) on a fast link, 16 machines: distribute */
  dt_plan_model big = hand_model();
  big.per_sample_s = 1e-3;
  CHECK_EQ(dt_plan_link_parse("rate=10gbit,delay=50us", &o.link), DTRAIN_OK);
  n = dt_plan_predict(&big, &o, r, 64);
  best = dt_plan_recommend(r, n, why, sizeof why);
  CHECK(best >= 0 && r[best].workers >= 8 && strcmp(r[best].family, "processes") == 0);
  CHECK_MSG(strstr(why, "one_device") != NULL && strstr(why, "do not") == NULL, "%s", why);
  /* a memory limit below one device's need: a row that fits, and it says why */
  o.memory_limit_bytes = 3.0e6; /* one_device needs 4 MB + activations; a parameter-server worker 2 MB + */
  n = dt_plan_predict(&big, &o, r, 64);
  CHECK(!r[0].fits);
  best = dt_plan_recommend(r, n, why, sizeof why);
  CHECK(best >= 0 && r[best].fits && r[best].memory_bytes <= 3.0e6);
  CHECK_MSG(strstr(why, "over the limit") != NULL, "%s", why);
  o.memory_limit_bytes = 1000; /* nothing fits */
  n = dt_plan_predict(&big, &o, r, 64);
  CHECK_EQ(dt_plan_recommend(r, n, why, sizeof why), -1);
  CHECK(strstr(why, "no strategy fits") != NULL);
  CHECK_EQ(dt_plan_recommend(NULL, 0, why, sizeof why), -1);
}

/* ---- measuring a real model ------------------------------------------------------------------ */
#define NF 32
#define ROWS 64
static float xs[ROWS * NF];
static int32_t ys[ROWS];
typedef struct {
  dt_nn_linear l1, l2;
} net;

static dt_tensor *step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica;
  net *m = (net *)user;
  int64_t s[2] = {b->rows, NF};
  dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_wrap(g, 2, s, (float *)b->x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

static void test_measure(void) {
  dt_params *P = dt_params_create(3);
  net m;
  dt_nn_linear_init(&m.l1, P, "l1", NF, 64, 1);
  dt_nn_linear_init(&m.l2, P, "l2", 64, 4, 1);
  dt_optim_options d = dt_optim_defaults(DTRAIN_OPTIM_ADAM);
  dt_optim *opt = dt_optim_create(P, &d);
  th_seed(5);
  for (int i = 0; i < ROWS * NF; i++) xs[i] = th_uniform(-1, 1);
  for (int i = 0; i < ROWS; i++) ys[i] = i % 4;
  size_t n = dt_params_size(P);
  float *before = (float *)malloc(n * sizeof(float));
  memcpy(before, dt_params_data(P), n * sizeof(float));
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  b.rows = ROWS;
  b.x = xs;
  b.x_cols = NF;
  b.y = ys;
  dt_plan_model pm;
  CHECK_EQ(dt_plan_measure(P, opt, step, &m, &b, 5, &pm), DTRAIN_OK);
  CHECK_EQ(pm.params, (int64_t)n);
  CHECK_EQ(pm.param_bytes, (int64_t)(n * sizeof(float)));
  CHECK_EQ(pm.optim_bytes, 2 * (int64_t)(n * sizeof(float))); /* Adam: two moments */
  CHECK(pm.per_sample_s > 0 && pm.fixed_s >= 0 && pm.update_s > 0);
  CHECK(pm.activation_bytes_per_sample > 0);
  CHECK_EQ(pm.measured_batch, ROWS);
  CHECK_MSG(pm.jitter >= 0 && pm.jitter < 10, "%g", pm.jitter); /* (a spread over the median: any noise, never negative) */
  CHECK_MSG(pm.memory_Bps > 1e8 && isfinite(pm.memory_Bps), "%g", pm.memory_Bps); /* (the gradient's passes, timed) */
  /* every core busy (a mirrored strategy over them) against one alone; 1 core, or a build without
   * threads or strategies beyond one_device: not measured */
  const unsigned need = DTRAIN_FEATURE_THREADS | DTRAIN_FEATURE_DIST;
  if (dt_cpu_count() >= 2 && (dt_build_features() & need) == need) CHECK_MSG(pm.busy_slowdown >= 1.0 && pm.busy_cores >= 2, "%g at %d", pm.busy_slowdown, pm.busy_cores);
  else CHECK(pm.busy_slowdown == 0 && pm.busy_cores == 0);
  CHECK(memcmp(before, dt_params_data(P), n * sizeof(float)) == 0); /* put back bit for bit */
  CHECK_EQ(dt_optim_steps(opt), 0);                                   /* the caller's optimizer never stepped */
  /* the prediction from a measurement: one_device's row is the measured step */
  dt_plan_options o;
  memset(&o, 0, sizeof o);
  o.batch = ROWS;
  dt_plan_row r[64];
  int k = dt_plan_predict(&pm, &o, r, 64);
  CHECK(k > 1);
  CHECK_REL(r[0].step_s, pm.fixed_s + ROWS * pm.per_sample_s + pm.update_s, 1e-12);
  /* bad calls */
  CHECK_EQ(dt_plan_measure(NULL, opt, step, &m, &b, 5, &pm), DTRAIN_ERR_NULL_ARG);
  CHECK_EQ(dt_plan_measure(P, opt, step, &m, NULL, 5, &pm), DTRAIN_ERR_NULL_ARG);
  b.rows = 1;
  CHECK_EQ(dt_plan_measure(P, opt, step, &m, &b, 5, &pm), DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_last_error(), "at least 2") != NULL);
  free(before);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
}

int main(void) {
  TH_RUN(test_collectives_arithmetic);
  TH_RUN(test_link_parse);
  TH_RUN(test_rows_arithmetic);
  TH_RUN(test_stragglers_and_shared_medium);
  TH_RUN(test_loading_term);
  TH_RUN(test_shared_machine);
  TH_RUN(test_measure_loader);
  TH_RUN(test_probe_link);
  TH_RUN(test_recommendations);
  TH_RUN(test_measure);
  return th_summary("test_plan");
}
