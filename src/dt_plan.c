/* ===========================================================================
 * dt_plan.c -- the planner: measure the model, predict every strategy
 * ===========================================================================
 * See dt_plan.h for the models. Measuring runs the user's step function on a
 * graph of its own over the real parameters (so the kernels, the cache and
 * the allocator are the ones training will see), updates them with a
 * scratch optimizer made from the caller's options, and puts the parameters
 * and gradients back as they were. */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_strategy.h"
#include "dt_plan.h"
#include "dt_plan_internal.h"
#include "dt_platform.h"
#include <math.h>

#define DT__PLAN_LOOPBACK_LATENCY 25e-6 /* s: a small message's one-way time over TCP loopback */
#define DT__PLAN_LOOPBACK_BW 2.5e9      /* B/s: one TCP loopback stream's payload rate */

static int dt__plan_dcmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y ? 1 : 0;
}

static double dt__plan_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, dt__plan_dcmp);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* steps steps of forward + backward at b's rows: the median seconds; the
 * update's median into *upd and the spread (1.4826 x the median absolute
 * deviation over the median) into *jit when given */
static dt_result dt__plan_time(dt_graph *g, dt_params *P, dt_optim *o, dt_step_fn fn, void *user,
                               const dt_minibatch *b, int steps, double *fb, double *upd, int64_t *arena,
                               double *jit) {
  double t[64], u[64];
  const int warm = 2;
  size_t n = dt_params_size(P);
  for (int s = 0; s < steps + warm; s++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    double t0 = dt__now();
    dt_tensor *loss = fn(g, 0, b, user);
    if (!loss) return dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_INTERNAL;
    dt_result r = dt_backward(g, loss);
    if (r != DTRAIN_OK) return r;
    double t1 = dt__now();
    r = dt_optim_update(o, dt_params_data(P), dt_params_grad(P), 0, n);
    if (r != DTRAIN_OK) return r;
    dt_optim_advance(o);
    double t2 = dt__now();
    if (s >= warm) {
      t[s - warm] = t1 - t0;
      u[s - warm] = t2 - t1;
    }
  }
  *fb = dt__plan_median(t, steps);
  if (upd) *upd = dt__plan_median(u, steps);
  if (jit) {
    for (int s = 0; s < steps; s++) t[s] = fabs(t[s] - *fb);
    *jit = *fb > 0 ? 1.4826 * dt__plan_median(t, steps) / *fb : 0.0;
  }
  if (arena) *arena = (int64_t)dt_graph_bytes_reserved(g);
  return DTRAIN_OK;
}

/* The same step on k cores at once: a mirrored strategy of k replicas over b
 * (b->rows / k rows each, on o); the replicas' mean forward + backward per
 * step into *per_replica, the least of 3 rounds of `steps` (a busy machine's
 * other work only ever adds time). Anything failing here (threads compiled
 * out, ...) leaves *per_replica 0: not measured. */
static void dt__plan_busy(dt_params *P, dt_optim *o, dt_step_fn fn, void *user, const dt_minibatch *b, int steps,
                          int k, double *per_replica) {
  *per_replica = 0.0;
  dt_strategy_options sd = dt_strategy_mirrored(k);
  dt_strategy *s = dt_strategy_create(P, o, fn, user, &sd);
  if (!s) return;
  int ok = 1;
  for (int i = 0; i < 2 && ok; i++) ok = dt_strategy_step(s, b, NULL) == DTRAIN_OK;
  double best = 0.0;
  for (int round = 0; round < 3 && ok; round++) {
    dt_strategy_reset_stats(s);
    for (int i = 0; i < steps && ok; i++) ok = dt_strategy_step(s, b, NULL) == DTRAIN_OK;
    dt_strategy_stats st;
    if (ok && dt_strategy_stats_get(s, &st) == DTRAIN_OK && st.steps > 0) {
      double t = st.compute_s_mean / (double)st.steps;
      if (best == 0.0 || t < best) best = t;
    }
  }
  if (ok) *per_replica = best;
  dt_strategy_destroy(s);
}

/* Two passes over a buffer of n floats (buf[0, n)), as a replica makes over
 * its summed gradient: a scale in place, then a copy into buf[n, 2n); the
 * median seconds of 9 after 2 not counted. */
static double dt__plan_pass_s(float *buf, size_t n) {
  double t[9];
  for (int rep = 0; rep < 11; rep++) {
    double t0 = dt__now();
    const float s = rep & 1 ? 2.0f : 0.5f; /* exact both ways: no value drifts towards subnormals */
    for (size_t i = 0; i < n; i++) buf[i] *= s;
    memcpy(buf + n, buf, n * sizeof(float));
    double t1 = dt__now();
    if (rep >= 2) t[rep - 2] = t1 - t0;
  }
  return dt__plan_median(t, 9);
}

DTRAIN_API dt_result dt_plan_measure(dt_params *params, const dt_optim *opt, dt_step_fn fn, void *user,
                                     const dt_minibatch *b, int steps, dt_plan_model *out) {
  const char *f = "dt_plan_measure";
  if (!params || !opt || !fn || !b || !out)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", f,
                     !params ? "params" : !opt ? "opt" : !fn ? "fn" : !b ? "the batch" : "out");
  if (b->rows < 2)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: the batch has %lld rows; at least 2 (it also runs half of it)", f,
                     (long long)b->rows);
  if (steps <= 0) steps = 20;
  if (steps > 64) steps = 64;
  size_t n = dt_params_size(params);
  if (n == 0) return dt__error(DTRAIN_ERR_EMPTY, "%s: the model has no parameters", f);
  float *keep = (float *)dt__alloc(2 * n * sizeof(float));
  if (!keep) return dt__error(DTRAIN_ERR_NOMEM, "%s: no memory for a copy of %zu parameters", f, n);
  memcpy(keep, dt_params_data(params), n * sizeof(float));
  memcpy(keep + n, dt_params_grad(params), n * sizeof(float));
  dt_optim_options od = *dt_optim_get_options(opt);
  dt_optim *o = dt_optim_create(params, &od);
  dt_graph *g = o ? dt_graph_create(params, NULL) : NULL;
  dt_result r = g ? DTRAIN_OK : (dt_last_result() != DTRAIN_OK ? dt_last_result() : DTRAIN_ERR_NOMEM);
  double full = 0, half = 0, upd = 0, jit = 0;
  int64_t arena = 0;
  dt_minibatch hb = *b;
  hb.rows = b->rows / 2;
  dt__quiet_push();
  if (r == DTRAIN_OK) r = dt__plan_time(g, params, o, fn, user, b, steps, &full, &upd, &arena, &jit);
  if (r == DTRAIN_OK) r = dt__plan_time(g, params, o, fn, user, &hb, steps, &half, NULL, NULL, NULL);
  int busy_k = DT__MIN(DT__MIN(dt__cpu_count(), DTRAIN_MAX_REPLICAS), (int)DT__MIN(b->rows, (int64_t)INT_MAX));
  double busy = 0;
  if (r == DTRAIN_OK && busy_k >= 2) dt__plan_busy(params, o, fn, user, b, steps, busy_k, &busy);
  dt__quiet_pop(DTRAIN_OK);
  memcpy(dt_params_data(params), keep, n * sizeof(float));
  memcpy(dt_params_grad(params), keep + n, n * sizeof(float));
  int slots = o ? dt_optim_state_slots(o) : 0;
  double pass = r == DTRAIN_OK ? dt__plan_pass_s(keep, n) : 0.0; /* keep's copies are back in place: scratch now */
  dt__free(keep, 2 * n * sizeof(float));
  dt_graph_destroy(g);
  dt_optim_destroy(o);
  if (r != DTRAIN_OK) return dt__error(r, "%s: the step failed: %s", f, dt_last_error());
  memset(out, 0, sizeof *out);
  const double rows = (double)b->rows, hrows = (double)hb.rows;
  double per = (full - half) / (rows - hrows);
  if (!(per > 0)) per = full / rows; /* too noisy to tell: all of it per sample */
  double fixed = full - per * rows;
  if (fixed < 0) {
    fixed = 0;
    per = full / rows;
  }
  out->fixed_s = fixed;
  out->per_sample_s = per;
  out->update_s = upd;
  out->params = (int64_t)n;
  out->param_bytes = out->grad_bytes = (int64_t)(n * sizeof(float));
  out->optim_bytes = (int64_t)slots * (int64_t)(n * sizeof(float));
  out->activation_bytes_per_sample = (int64_t)((double)arena / rows);
  out->measured_batch = (int)b->rows;
  out->jitter = jit;
  if (pass > 0) out->memory_Bps = 2.0 * (double)n * sizeof(float) / pass;
  /* every core busy against one alone, at the same rows a replica */
  double alone = fixed + per * (double)(b->rows / busy_k);
  if (busy > 0 && alone > 0) {
    out->busy_slowdown = DT__MAX(1.0, busy / alone);
    out->busy_cores = busy_k;
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_plan_measure_loader(dt_loader *l, int batches, dt_plan_model *out) {
  const char *f = "dt_plan_measure_loader";
  if (!l || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", f, !l ? "the loader" : "out");
  if (batches <= 0) batches = 20;
  if (batches > 64) batches = 64;
  int64_t ep0, idx0;
  dt_loader_position(l, &ep0, &idx0);
  double t[64];
  int n = 0, ends = 0;
  dt_result r = DTRAIN_OK;
  for (int i = 0; i < batches + 2 && r == DTRAIN_OK; i++) {
    dt_batch b;
    memset(&b, 0, sizeof b);
    double t0 = dt__now();
    int got = dt_loader_next(l, &b);
    double dt = dt__now() - t0;
    if (got < 0) {
      r = dt__error((dt_result)got, "%s: the loader failed: %s", f, dt_last_error());
    } else if (got == 0) { /* the end of an epoch: the next call starts the next one */
      i--;
      if (++ends > 1) r = dt__error(DTRAIN_ERR_EMPTY, "%s: the loader gives no batches (drop_last, a shard "
                                    "smaller than the batch?)", f);
    } else {
      ends = 0;
      if (i >= 2 && b.size > 0) t[n++] = dt / (double)b.size;
    }
  }
  dt_result back = dt_loader_set_position(l, ep0, idx0);
  if (r != DTRAIN_OK) return r;
  if (back != DTRAIN_OK) return back;
  out->load_per_sample_s = n > 0 ? dt__plan_median(t, n) : 0.0; /* (n is batches here: the loop ran them all) */
  return DTRAIN_OK;
}

/* ---- links ----------------------------------------------------------------------------------- */

/* "100mbit" and the like: bits per second; "2ms": seconds; -1 when not a number with a known unit */
static double dt__plan_unit(const char *v, size_t len, int rate) {
  char buf[48];
  if (len == 0 || len >= sizeof buf) return -1;
  memcpy(buf, v, len);
  buf[len] = '\0';
  char *end = NULL;
  double x = strtod(buf, &end);
  if (end == buf || !(x >= 0) || !isfinite(x)) return -1;
  static const char *const ru[] = {"bit", "kbit", "mbit", "gbit", "bps", "kbps", "mbps", "gbps"};
  static const double rm[] = {1, 1e3, 1e6, 1e9, 8, 8e3, 8e6, 8e9}; /* tc: "bps" is bytes per second */
  static const char *const tu[] = {"s", "ms", "us"};
  static const double tm[] = {1, 1e-3, 1e-6};
  if (rate) {
    for (int i = 0; i < 8; i++)
      if (strcmp(end, ru[i]) == 0) return x * rm[i];
  } else {
    for (int i = 0; i < 3; i++)
      if (strcmp(end, tu[i]) == 0) return x * tm[i];
  }
  return -1;
}

DTRAIN_API dt_result dt_plan_link_parse(const char *spec, dt_plan_link *out) {
  const char *f = "dt_plan_link_parse";
  if (!spec || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", f, !spec ? "spec" : "out");
  dt_plan_link l;
  memset(&l, 0, sizeof l);
  l.latency_s = DT__PLAN_LOOPBACK_LATENCY;
  l.bandwidth_Bps = DT__PLAN_LOOPBACK_BW;
  if (strcmp(spec, "loopback") == 0 || spec[0] == '\0') {
    *out = l;
    return DTRAIN_OK;
  }
  double jitter = 0;
  int exact_bw = 0, exact_lat = 0, emul_bw = 0, emul_lat = 0; /* which spelling gave each */
  const char *p = spec;
  while (*p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    const char *eq = (const char *)memchr(p, '=', len);
    if (!eq)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: '%.*s' in '%s' is not key=value (rate=100mbit,delay=2ms)", f,
                       (int)len, p, spec);
    size_t klen = (size_t)(eq - p), vlen = len - klen - 1;
    double v;
    if (klen == 4 && strncmp(p, "rate", 4) == 0) {
      if ((v = dt__plan_unit(eq + 1, vlen, 1)) <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: rate '%.*s': a number with bit, kbit, mbit, gbit or bps, ...",
                         f, (int)vlen, eq + 1);
      l.bandwidth_Bps = v / 8.0 * 1448.0 / 1514.0; /* the emulation's (and tc's) headers: 66 bytes a segment */
      emul_bw = 1;
    } else if (klen == 9 && strncmp(p, "bandwidth", 9) == 0) {
      if ((v = dt__plan_unit(eq + 1, vlen, 1)) <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG,
                         "%s: bandwidth '%.*s': a number with bit, kbit, mbit, gbit or bps, ...", f, (int)vlen, eq + 1);
      l.bandwidth_Bps = v / 8.0; /* the payload's, as it is: no headers taken off */
      exact_bw = 1;
    } else if (klen == 6 && strncmp(p, "shared", 6) == 0) {
      if (vlen != 1 || (eq[1] != '0' && eq[1] != '1'))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: shared '%.*s': 1 (one medium every transfer shares) or 0", f,
                         (int)vlen, eq + 1);
      l.shared = eq[1] == '1';
    } else if (klen == 7 && strncmp(p, "latency", 7) == 0) {
      if ((v = dt__plan_unit(eq + 1, vlen, 0)) < 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: latency '%.*s': a number with s, ms or us", f, (int)vlen,
                         eq + 1);
      l.latency_s = v; /* one way, as it is: no loopback added */
      exact_lat = 1;
    } else if ((klen == 5 && strncmp(p, "delay", 5) == 0) || (klen == 6 && strncmp(p, "jitter", 6) == 0)) {
      if ((v = dt__plan_unit(eq + 1, vlen, 0)) < 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %.*s '%.*s': a number with s, ms or us", f, (int)klen, p,
                         (int)vlen, eq + 1);
      if (klen == 5) l.latency_s = v + DT__PLAN_LOOPBACK_LATENCY, emul_lat = 1;
      else jitter = v;
    } else {
      return dt__error(DTRAIN_ERR_INVALID_ARG,
                       "%s: '%.*s' in '%s': the planner knows rate, delay, jitter, bandwidth, latency and shared", f,
                       (int)klen, p, spec);
    }
    p += len + (comma ? 1 : 0);
  }
  if ((exact_bw && emul_bw) || (exact_lat && emul_lat))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: '%s' gives the link's %s twice (rate, delay: an emulated link; "
                     "bandwidth, latency: the link as it is)", f, spec, exact_bw && emul_bw ? "rate" : "latency");
  l.latency_s += 0.5 * jitter;
  *out = l;
  return DTRAIN_OK;
}

/* ---- probing a link --------------------------------------------------------------------------- */

#define DT__PLAN_PROBE_TAG DT_COMM_TAG_MAX /* the probe's messages */
#define DT__PLAN_PROBE_CAP ((size_t)1 << 22) /* floats in the largest transfer: 16 MiB */

DTRAIN_PRIVATE double dt__plan_probe_rate(double bytes, double t, double rt, double cpu_a, double cpu_b) {
  double net = t - rt; /* the ack's round trip is not the transfer's */
  double rate = bytes / (net > 0.0 ? net : t), both = cpu_a + cpu_b;
  /* each end busy for at least a quarter of it (one end spinning while the
   * other waits on a wire is not copying), both together for three quarters;
   * cpu_b is the peer's word: believed only within the transfer's time */
  if (cpu_a >= 0.25 * t && cpu_b >= 0.25 * t && cpu_a <= 1.05 * t && cpu_b <= 1.05 * t && both >= 0.75 * t &&
      both > 0.0)
    rate = 2.0 * bytes / both;
  return rate;
}

DTRAIN_API dt_result dt_plan_probe_link(dt_comm *c, int rank, int a, int b, dt_plan_link *out) {
  const char *f = "dt_plan_probe_link";
  if (!c || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", f, !c ? "the communicator" : "out");
  int w = dt_comm_world(c);
  if (a < 0 || b < 0 || a >= w || b >= w || a == b || (rank != a && rank != b))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: ranks %d and %d of %d probe the link between them, each calling "
                     "this (called by rank %d)", f, a, b, w, rank);
  const int lead = rank == a, peer = lead ? b : a;
  float *buf = (float *)dt__calloc(DT__PLAN_PROBE_CAP * sizeof(float));
  if (!buf) return dt__error(DTRAIN_ERR_NOMEM, "%s: no memory for a %zu-byte probe", f, DT__PLAN_PROBE_CAP * sizeof(float));
  /* every page touched first: a transfer into untouched pages pays a page
   * fault every 4 KiB, which the link does not */
  for (size_t i = 0; i < DT__PLAN_PROBE_CAP; i++) buf[i] = 0.5f;
  const int tag = DT__PLAN_PROBE_TAG;
  double rtt[21];
  int k = 0;
  float one = 0.0f;
  dt_result r = DTRAIN_OK;
  /* latency: 3 + 21 round trips of one float; half the median */
  for (int i = 0; i < 24 && r == DTRAIN_OK; i++) {
    double t0 = dt__now();
    if (lead) {
      r = dt_comm_send(c, rank, peer, tag, &one, 1);
      if (r == DTRAIN_OK) r = dt_comm_recv(c, rank, peer, tag, &one, 1);
    } else {
      r = dt_comm_recv(c, rank, peer, tag, &one, 1);
      if (r == DTRAIN_OK) r = dt_comm_send(c, rank, peer, tag, &one, 1);
    }
    if (i >= 3) rtt[k++] = dt__now() - t0;
  }
  double rt = r == DTRAIN_OK ? dt__plan_median(rtt, k) : 0.0, bw = 0.0;
  /* bandwidth: a announces n and sends n floats, b answers one float; n
   * doubles from 64 Ki floats until a transfer takes 50 ms or reaches the cap,
   * then that size goes DT__PLAN_PROBE_REPS times in all (fewer once the
   * repeats have taken 250 ms: a slow link) and the rate is their median
   * (one transfer of a loopback's 16 MiB, a few ms, gave 1.6 to 7.0 GB/s on
   * one idle 2-core machine in eight probes); a announces 0 to end.
   * b's answer is the CPU time its receive took (-1: unknown). Where the
   * two ends' CPU times account for the transfer's time (each end busy for
   * a quarter of it at least), the copies, not a wire, bound it: a loopback, whose rate is then the rate of the kernel's
   * copies, 2 x bytes / (a's + b's CPU time): the two ends copying at once
   * on two cores, or one after the other on one core, where the scheduler
   * puts two processes that wake each other (on that machine the wall-clock
   * rate of the same probe was 4.5 or 1.9 GB/s, by where the two ran). */
  enum { DT__PLAN_PROBE_REPS = 9 };
  double rates[DT__PLAN_PROBE_REPS], rep_s = 0.0;
  int reps = 0;
  size_t n = (size_t)1 << 16;
  while (r == DTRAIN_OK) {
    float hdr = lead ? (float)n : 0.0f;
    r = lead ? dt_comm_send(c, rank, peer, tag, &hdr, 1) : dt_comm_recv(c, rank, peer, tag, &hdr, 1);
    if (r != DTRAIN_OK) break;
    size_t m = (size_t)hdr;
    if (m == 0) break;
    if (!(hdr > 0.0f) || m > DT__PLAN_PROBE_CAP) {
      r = dt__error(DTRAIN_ERR_PROTOCOL, "%s: rank %d announced a transfer of %g floats (at most %zu)", f, peer,
                    (double)hdr, DT__PLAN_PROBE_CAP);
      break;
    }
    double t0 = dt__now(), c0 = dt__thread_cpu_s(), cpu = -1.0;
    if (lead) {
      r = dt_comm_send(c, rank, peer, tag, buf, m);
      double c1 = dt__thread_cpu_s();
      if (c0 >= 0.0 && c1 >= c0) cpu = c1 - c0;
      if (r == DTRAIN_OK) r = dt_comm_recv(c, rank, peer, tag, &one, 1);
    } else {
      r = dt_comm_recv(c, rank, peer, tag, buf, m);
      double c1 = dt__thread_cpu_s();
      float spent = c0 >= 0.0 && c1 >= c0 ? (float)(c1 - c0) : -1.0f;
      if (r == DTRAIN_OK) r = dt_comm_send(c, rank, peer, tag, &spent, 1);
    }
    double t = dt__now() - t0;
    if (lead && r == DTRAIN_OK) {
      double rate = dt__plan_probe_rate((double)(m * sizeof(float)), t, rt, cpu, (double)one);
      if (reps > 0 || t >= 0.05 || m >= DT__PLAN_PROBE_CAP) { /* the size to measure at */
        rates[reps++] = rate;
        if (reps > 1) rep_s += t;
        n = reps < DT__PLAN_PROBE_REPS && rep_s < 0.25 ? m : 0;
      } else {
        n = m * 2;
      }
    }
  }
  if (reps > 0) bw = dt__plan_median(rates, reps);
  /* b gets a's figures */
  float res[2] = {(float)(0.5 * rt), (float)bw};
  if (r == DTRAIN_OK)
    r = lead ? dt_comm_send(c, rank, peer, tag, res, 2) : dt_comm_recv(c, rank, peer, tag, res, 2);
  dt__free(buf, DT__PLAN_PROBE_CAP * sizeof(float));
  if (r != DTRAIN_OK) return dt__error(r, "%s: %s", f, dt_last_error());
  out->latency_s = (double)res[0];
  out->bandwidth_Bps = (double)res[1];
  out->shared = 0; /* (two machines alone cannot tell a shared medium: say so with shared=1) */
  return DTRAIN_OK;
}

/* ---- the models ------------------------------------------------------------------------------ */

DTRAIN_API double dt_plan_ring_allreduce_s(int n, double bytes, dt_plan_link l) {
  if (n <= 1 || !(bytes >= 0) || !(l.bandwidth_Bps > 0)) return 0.0;
  const double per = (l.shared ? bytes : bytes / (double)n) / l.bandwidth_Bps; /* one step's transfer */
  return 2.0 * (n - 1) * (l.latency_s + per);
}

DTRAIN_API double dt_plan_doubling_allreduce_s(int n, double bytes, dt_plan_link l) {
  if (n <= 1 || !(bytes >= 0) || !(l.bandwidth_Bps > 0)) return 0.0;
  double k = ceil(log2((double)n));
  return k * (l.latency_s + (l.shared ? (double)n : 1.0) * bytes / l.bandwidth_Bps);
}

DTRAIN_API double dt_plan_bubble(int p, int m) {
  if (p <= 1 || m <= 0) return 0.0;
  return (double)(p - 1) / (double)(m + p - 1);
}

typedef struct dt__plan_ctx {
  const dt_plan_model *m;
  dt_plan_options o;
  dt_plan_row *rows;
  int cap, n;
  double base; /* one_device's samples/s */
} dt__plan_ctx;

static double dt__plan_t(const dt__plan_ctx *c, double b) { return c->m->fixed_s + b * c->m->per_sample_s; }

/* E[the largest of n standard normals] (n = 2, 4, ..., 64; between: by
 * log2 n; past 64: 64's): how far past the median the slowest of n workers
 * lags, in sigmas */
static double dt__plan_maxz(int n) {
  static const double z[] = {0.0, 0.5642, 1.0294, 1.4236, 1.7660, 2.0697, 2.3335};
  if (n <= 1) return 0.0;
  double k = log2((double)n);
  if (k >= 6) return z[6];
  int i = (int)k;
  return z[i] + (k - i) * (z[i + 1] - z[i]);
}

/* A synchronous step of n workers waits for the slowest one's compute t:
 * jitter x t x E[max of n standard normals] past the median */
static double dt__plan_lag(const dt_plan_model *m, double t, int n) { return m->jitter * t * dt__plan_maxz(n); }

/* compute's slowdown with k replicas or processes running at once on one
 * machine: the measured busy_slowdown at busy_cores, linear from 1 alone */
static double dt__plan_slow(const dt_plan_model *m, double k) {
  if (!(m->busy_slowdown > 1.0) || m->busy_cores < 2 || k <= 1.0) return 1.0;
  double f = (k - 1.0) / (double)(m->busy_cores - 1);
  return 1.0 + (m->busy_slowdown - 1.0) * DT__MIN(1.0, f);
}

/* The parameter servers' round, as a fluid: n workers start together and
 * cycle through their own time z (compute, loading, latencies), a push of
 * d_in and a pull of d_out (each that long alone on the worker's link), and
 * between them the servers' update u, one push at a time in arrival order.
 * The servers' ports (cap worker links wide: M servers' links, each taking
 * its slice of every push; a port of its own per connection: n) share
 * their bandwidth equally among the transfers in them, each at most its
 * worker's link; the two directions are apart (full duplex). Workers that
 * start in step push together and then pull together; the serial updates
 * spread the pulls, and over the rounds the two directions come to overlap,
 * more or less: the round's rate over the later half of `rounds` rounds
 * (128 for up to 64 workers) is returned as the time of a worker's round,
 * n x the mean gap between pushes. O(n^2) a round; at most DT__PLAN_FLUID_MAX
 * workers (0: more, not modelled). */
#define DT__PLAN_FLUID_MAX 1024
DTRAIN_PRIVATE double dt__plan_ps_fluid(int n, double z, double d_in, double d_out, double u, double cap) {
  enum { COMPUTE, PUSH, QUEUED, UPDATE, PULL };
  static const double eps = 1e-12;
  if (n < 1 || n > DT__PLAN_FLUID_MAX || !(cap > 0)) return 0.0;
  unsigned char ph[DT__PLAN_FLUID_MAX];
  double rem[DT__PLAN_FLUID_MAX];
  int queue[DT__PLAN_FLUID_MAX], qh = 0, qn = 0, busy = -1;
  const int rounds = n <= 64 ? 128 : DT__MAX(16, 8192 / n);
  const long half = (long)n * rounds / 2, all = (long)n * rounds;
  long pushes = 0;
  double t = 0.0, t_half = 0.0, scale = z + d_in + d_out + u;
  for (int i = 0; i < n; i++) ph[i] = COMPUTE, rem[i] = z;
  while (pushes < all) {
    int kin = 0, kout = 0;
    for (int i = 0; i < n; i++) kin += ph[i] == PUSH, kout += ph[i] == PULL;
    double rin = kin ? DT__MIN(1.0, cap / kin) : 0.0, rout = kout ? DT__MIN(1.0, cap / kout) : 0.0, dt = INFINITY;
    for (int i = 0; i < n; i++) { /* the next event: a transfer, a compute or the update ends */
      double r = ph[i] == PUSH ? rin : ph[i] == PULL ? rout : 1.0;
      if (ph[i] != QUEUED) dt = DT__MIN(dt, rem[i] / r);
    }
    if (!(dt < INFINITY)) return 0.0; /* (cannot happen: someone is always under way) */
    t += dt;
    for (int i = 0; i < n; i++)
      if (ph[i] != QUEUED) rem[i] -= dt * (ph[i] == PUSH ? rin : ph[i] == PULL ? rout : 1.0);
    if (busy >= 0 && rem[busy] <= eps * scale) { /* applied: its pull begins */
      ph[busy] = PULL, rem[busy] = d_out, busy = -1;
      if (++pushes == half) t_half = t;
    }
    for (int i = 0; i < n; i++) {
      if (ph[i] == COMPUTE && rem[i] <= eps * scale) ph[i] = PUSH, rem[i] = d_in;
      else if (ph[i] == PUSH && rem[i] <= eps * scale) ph[i] = QUEUED, queue[(qh + qn++) % n] = i;
      else if (ph[i] == PULL && rem[i] <= eps * scale) ph[i] = COMPUTE, rem[i] = z;
    }
    if (busy < 0 && qn > 0) busy = queue[qh], qh = (qh + 1) % n, qn--, ph[busy] = UPDATE, rem[busy] = u;
  }
  return (double)n * (t - t_half) / (double)(all - half);
}

static void dt__plan_add(dt__plan_ctx *c, const char *name, const char *family, int workers, double step_s,
                         double samples_per_step, double mem, double comm_s, double bubble, double staleness) {
  if (!(step_s > 0)) return;
  if (c->n < c->cap) {
    dt_plan_row *r = &c->rows[c->n];
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(r->family, sizeof r->family, "%s", family);
    r->workers = workers;
    r->step_s = step_s;
    r->samples_per_sec = samples_per_step / step_s;
    r->epoch_s = c->o.epoch_samples > 0 ? (double)c->o.epoch_samples / r->samples_per_sec : 0.0;
    r->memory_bytes = mem;
    r->comm_share = comm_s > 0 ? DT__MIN(1.0, comm_s / step_s) : 0.0;
    r->bubble = bubble;
    r->staleness = staleness;
    r->speedup = c->base > 0 ? r->samples_per_sec / c->base : 1.0;
    r->fits = !(c->o.memory_limit_bytes > 0) || mem <= c->o.memory_limit_bytes;
  }
  c->n++;
}

DTRAIN_API int dt_plan_predict(const dt_plan_model *m, const dt_plan_options *opt, dt_plan_row *rows, int cap) {
  const char *f = "dt_plan_predict";
  if (!m || !opt || (!rows && cap > 0)) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", f, !m ? "the model" : !opt ? "options" : "rows");
    return -1;
  }
  if (opt->batch <= 0 || cap < 0 || !(m->per_sample_s >= 0) || !(m->fixed_s >= 0) || !(m->update_s >= 0) ||
      m->per_sample_s + m->fixed_s <= 0 || !(m->jitter >= 0) || !isfinite(m->jitter) ||
      !(m->tp_split_share >= 0 && m->tp_split_share <= 1) || !(m->tp_param_share >= 0 && m->tp_param_share <= 1) ||
      m->tp_allreduces < 0 || m->tp_bytes_per_sample < 0) {
    dt__error(DTRAIN_ERR_INVALID_ARG,
              "%s: batch %d, cap %d, model %g s fixed + %g s per sample, update %g s, jitter %g, tensor-parallel "
              "shares %g (work) and %g (parameters), %d all-reduces of %lld bytes a sample", f, opt->batch, cap,
              m->fixed_s, m->per_sample_s, m->update_s, m->jitter, m->tp_split_share, m->tp_param_share,
              m->tp_allreduces, (long long)m->tp_bytes_per_sample);
    return -1;
  }
  dt__plan_ctx c;
  memset(&c, 0, sizeof c);
  c.m = m;
  c.o = *opt;
  c.rows = rows;
  c.cap = cap;
  dt_plan_options *o = &c.o;
  if (o->max_workers <= 0) o->max_workers = 16;
  if (o->max_workers > 64) o->max_workers = 64;
  if (o->cores <= 0) o->cores = dt__cpu_count();
  if (!(o->loopback_Bps > 0)) o->loopback_Bps = DT__PLAN_LOOPBACK_BW;
  if (!(o->link.bandwidth_Bps > 0)) {
    o->link.bandwidth_Bps = o->loopback_Bps;
    if (!(o->link.latency_s > 0)) o->link.latency_s = DT__PLAN_LOOPBACK_LATENCY;
  }
  if (!(o->memory_Bps > 0)) o->memory_Bps = m->memory_Bps > 0 && isfinite(m->memory_Bps) ? m->memory_Bps : 5e9;
  if (!(o->thread_sync_s > 0)) o->thread_sync_s = 20e-6;
  if (o->servers <= 0) o->servers = 1;
  if (!(o->compress_ratio > 0)) o->compress_ratio = 0.5;
  if (!(o->overlap_fraction > 0)) o->overlap_fraction = 0.5;
  const double B0 = (double)o->batch, G = (double)m->grad_bytes, Pb = (double)m->param_bytes,
               Ob = (double)m->optim_bytes, A = (double)m->activation_bytes_per_sample, U = m->update_s,
               LD = m->load_per_sample_s > 0 ? m->load_per_sample_s : 0.0;
  const dt_plan_link L = o->link;
  /* A step on one machine (shared_cores) takes at least the CPU time of every
   * process together plus the kernel's copies of every byte sent through a
   * local socket at both ends (what bounds a loopback stream), over the cores. */
#define DT__PLAN_FLOOR(step, cpu, bytes) \
  (o->shared_cores ? DT__MAX((step), (cpu) + 2.0 * (bytes) / o->loopback_Bps / (double)o->cores) : (step))
  /* one_device */
  double t1 = dt__plan_t(&c, B0) + U + LD * B0;
  c.base = B0 / t1;
  dt__plan_add(&c, "one_device", "one_device", 1, t1, B0, Pb + G + Ob + A * B0, 0, 0, 0);
  for (int N = 2; N <= o->max_workers; N *= 2) {
    const double B = o->weak_scaling ? B0 * N : B0; /* the global batch at N workers */
    if (B / N < 1) break;
    const double b = B / N, tb = dt__plan_t(&c, b);
    const double busy = DT__MIN((double)N, (double)o->cores); /* replicas computing at once on one machine */
    char name[48];
    /* threads, one machine: replicas share its cores (and its caches and memory bandwidth) */
    if (N <= 4 * o->cores) {
      double waves = ceil((double)N / (double)o->cores), tt = tb * dt__plan_slow(m, busy);
      double reduce = 2.0 * G / N / o->memory_Bps * waves + 2 * o->thread_sync_s;
      dt__plan_add(&c, "mirrored", "threads", N, tt * waves + U / N * waves + reduce + LD * B, B,
                   Pb + G * 2 + Ob + A * b, reduce, 0, 0);
      /* async (Hogwild): each replica pulls, computes, updates all, pushes; no waits */
      double own = tt + U + 3.0 * Pb / o->memory_Bps;
      double par = DT__MIN((double)N, (double)o->cores);
      dt__plan_add(&c, "async", "threads", N, own * (double)N / par + LD * B, B, Pb * 3 + G + Ob * N + A * b,
                   3.0 * Pb / o->memory_Bps, 0, (double)(N - 1));
      /* async with owners (async_sharded): each replica computes, hands the
       * other slices of its gradient over ((N-1)/N of G written), sums the
       * slices handed to it into its own ((N-1)/N of G read), updates its
       * slice alone (U/N) and writes it into the store (Pb/N), and copies the
       * others' slices as it pulls ((N-1)/N of Pb); no waits */
      const double moved = (2.0 * G * (N - 1) / N + Pb) / o->memory_Bps;
      dt__plan_add(&c, "async sharded", "threads", N, (tt + U / N + moved) * (double)N / par + LD * B, B,
                   Pb * 2 + G + 2.0 * G * (N - 1) / N + Ob + A * b, moved, 0, (double)(N - 1));
    }
    /* processes over the link (a replica per worker): a core each, or taking
     * turns on one machine's */
    const double pw = o->shared_cores ? ceil((double)N / (double)o->cores) : 1.0;
    const double tbp = tb * (o->shared_cores ? dt__plan_slow(m, busy) : 1.0);
    const double tp = (tbp + LD * b) * pw, Up = U * pw; /* each worker loads its own B/N */
    /* On one machine (shared_cores) a step also needs the CPU time of every
     * process together: their compute, and the kernel's copies of every byte
     * through a local socket at both ends (what bounds a loopback stream);
     * the step takes at least that over the cores. */
    const double cpu_w = (double)N * (tbp + LD * b + U) / (double)o->cores; /* (all workers' own work) */
    const double ring_bytes = 2.0 * (double)(N - 1) * G;                  /* sent by all workers together */
    /* multi_worker_mirrored: besides the all-reduce, each worker makes two
     * passes of its own over the summed gradient (the scale by 1/rows, the
     * copy back into the parameters' gradient) that one_device does not */
    const double Gw = 2.0 * G / o->memory_Bps * pw, tm = tp + Up + Gw, cpu_m = cpu_w + (double)N * Gw / pw / o->cores;
    /* ... and each step waits for the slowest worker's compute (counted as
     * communication: it is spent in the all-reduce, as dtrain's comm_s has it) */
    const double lag = dt__plan_lag(m, tbp, N);
    /* ... and on one machine the floor also counts the all-reduce's additions:
     * in the ring each worker adds N-1 pieces of G/N into its own, a pass
     * over (N-1) G / N bytes at the measured rate (not on the path: a machine
     * per worker's ring is its links' alpha-beta time alone) */
    const double sums = (double)(N - 1) * G / o->memory_Bps / (double)o->cores; /* (all workers') */
    double ring = dt_plan_ring_allreduce_s(N, G, L) + lag, st = DT__PLAN_FLOOR(tm + ring, cpu_m + sums, ring_bytes);
    dt__plan_add(&c, "multi_worker_mirrored ring", "processes", N, st, B, Pb + G + Ob + A * b, st - tm, 0, 0);
    double ringc = dt_plan_ring_allreduce_s(N, G * o->compress_ratio, L) + lag;
    st = DT__PLAN_FLOOR(tm + ringc, cpu_m + sums, ring_bytes * o->compress_ratio);
    dt__plan_add(&c, "multi_worker_mirrored ring fp16", "processes", N, st, B, Pb + G + Ob + A * b, st - tm, 0, 0);
    /* overlap: buckets summed while backward goes on; only what sticks out counts */
    double hidden = DT__MIN(ring - lag, o->overlap_fraction * (tbp - m->fixed_s) * pw); /* behind the backward only */
    st = DT__PLAN_FLOOR(tm + ring - hidden, cpu_m + sums, ring_bytes);
    dt__plan_add(&c, "multi_worker_mirrored ring overlap", "processes", N, st, B, Pb + G + Ob + A * b, st - tm, 0,
                 0);
    /* hierarchical: each worker a machine of `cores` cores running that many
     * replicas (05 --threads): they reduce in memory, replica 0 all-reduces
     * across the machines, each replica scales and updates its slice */
    if (!o->shared_cores && o->cores >= 2 && b >= o->cores) {
      const double C = (double)o->cores, th = dt__plan_t(&c, b / C) * dt__plan_slow(m, C);
      const double local = 2.0 * G / C / o->memory_Bps + 2 * o->thread_sync_s;
      const double own = th + LD * b + local + (U + 2.0 * G / o->memory_Bps) / C;
      const double hr = dt_plan_ring_allreduce_s(N, G, L) + dt__plan_lag(m, th, N);
      dt__plan_add(&c, "multi_worker_mirrored hierarchical", "processes", N, own + hr, B, Pb + G * 2 + Ob + A * b, hr,
                   0, 0);
    }
    if ((N & (N - 1)) == 0) {
      double dbl = dt_plan_doubling_allreduce_s(N, G, L) + lag; /* (each of log2 N rounds adds all of G) */
      st = DT__PLAN_FLOOR(tm + dbl, cpu_m + (double)N * log2((double)N) * G / o->memory_Bps / (double)o->cores,
                          (double)N * log2((double)N) * G);
      dt__plan_add(&c, "multi_worker_mirrored doubling", "processes", N, st, B, Pb + G + Ob + A * b, st - tm, 0, 0);
    }
    /* parameter servers: each worker pushes its gradient, the servers apply
     * it (each its shard: update / M), the worker pulls the parameters; the
     * servers take N pushes and pulls a round, through their own links. On
     * a switch the round is the fluid of dt__plan_ps_fluid: full-duplex
     * ports (M links wide; links_per_connection: one link per connection,
     * as DTRAIN_NETEM emulates, so only the updates are shared), the
     * updates one at a time, workers in step at first; it is at least the
     * worker's own path and the servers' busy time, and between them it
     * counts the rhythm the workers fall into (pushes together, then pulls
     * together, until the updates spread them). On a shared medium every
     * push and pull of the round takes its turn, however many servers. */
    {
      int M = o->servers;
      double wire = 2.0 * L.latency_s + (G + Pb) / L.bandwidth_Bps;
      double worker = tp + wire + Up / (double)M, u = Up / (double)M;
      double ports = L.shared ? (double)N * (G + Pb) / L.bandwidth_Bps
                     : o->links_per_connection ? 0.0
                                               : (double)N * DT__MAX(G, Pb) / ((double)M * L.bandwidth_Bps);
      double bound = DT__MAX(worker, ports + (double)N * u);
      double fluid = L.shared ? 0.0
                              : dt__plan_ps_fluid(N, tp + 2.0 * L.latency_s, G / L.bandwidth_Bps, Pb / L.bandwidth_Bps, u,
                                                  o->links_per_connection ? (double)N : (double)M);
      /* (the floor: the workers' compute and loading, the servers' N updates, each push and pull copied) */
      double round = DT__PLAN_FLOOR(fluid > 0 ? fluid : bound, cpu_w, (double)N * (G + Pb));
      snprintf(name, sizeof name, "parameter_server %d server%s", M, M > 1 ? "s" : "");
      dt__plan_add(&c, name, "parameter_server", N, round, B, Pb + G + A * b, round - tp > 0 ? round - tp : 0, 0,
                   (double)(N - 1));
    }
  }
  /* tensor parallel over the link: T ranks, each the whole batch and 1/T of
   * the split layers; their all-reduces sit between the layers, so nothing
   * hides them */
  if (m->tp_max_ranks >= 2 && m->tp_split_share > 0 && m->tp_allreduces > 0 && m->tp_bytes_per_sample > 0) {
    const double s = DT__MIN(1.0, m->tp_split_share), B = B0; /* the ranks share one batch */
    const double q = m->tp_param_share > 0 ? DT__MIN(1.0, m->tp_param_share) : s;
    const int k = m->tp_allreduces;
    for (int T = 2; T <= DT__MIN(m->tp_max_ranks, o->max_workers); T *= 2) {
      const double part = 1.0 - s + s / T, qpart = 1.0 - q + q / T, busy = DT__MIN((double)T, (double)o->cores);
      const double turns = o->shared_cores ? ceil((double)T / (double)o->cores) : 1.0;
      const double tc = (m->fixed_s + B * m->per_sample_s * part) * (o->shared_cores ? dt__plan_slow(m, busy) : 1.0);
      const double own = (tc + LD * B + U * qpart) * turns; /* every rank loads the whole batch */
      const double bytes = B * (double)m->tp_bytes_per_sample;
      /* each all-reduce waits for the slowest rank's part of the step since the
       * last one: k waits on k segments, whose spreads (independent) add up to
       * sqrt(k) times one wait on the whole step */
      double comm = k * dt_plan_ring_allreduce_s(T, bytes / k, L) + dt__plan_lag(m, tc, T) * sqrt((double)k);
      /* one machine: at least every rank's CPU work and the kernel's copies, over the cores */
      const double st = DT__PLAN_FLOOR(own + comm, (double)T * (tc + LD * B + U * qpart) / o->cores,
                                       2.0 * (T - 1) * bytes);
      dt__plan_add(&c, "tensor_parallel", "tensor", T, st, B, (Pb + G + Ob) * qpart + A * B, st - own, 0, 0);
    }
  }
#undef DT__PLAN_FLOOR
#undef DT__PLAN_FLUID_MAX
  /* pipeline over the link: P stages, m microbatches, 1F1B */
  if (m->boundary_bytes_per_sample > 0 && m->pipeline_max_stages >= 2) {
    for (int P = 2; P <= DT__MIN(m->pipeline_max_stages, o->max_workers); P *= 2) {
      int mb = o->microbatches > 0 ? o->microbatches : 4 * P;
      const double B = B0; /* the stages share one batch */
      if (B / mb < 1) mb = (int)B;
      double micro = B / mb;
      double stage = dt__plan_t(&c, micro) / P; /* each stage: 1/P of a microbatch's work */
      if (o->shared_cores) /* the stages compute at once, sharing the machine's cores and caches */
        stage *= ceil((double)P / (double)o->cores) * dt__plan_slow(m, DT__MIN((double)P, (double)o->cores));
      /* fwd + bwd; on a shared medium the P-1 cuts' transfers of the steady state share it */
      double hop = L.latency_s + (L.shared ? (double)(P - 1) : 1.0) * 2.0 * (double)m->boundary_bytes_per_sample *
                                     micro / L.bandwidth_Bps;
      double step = (mb + P - 1) * (stage + hop) + U / P + LD * B; /* the first stage loads the batch */
      char name[48];
      snprintf(name, sizeof name, "pipeline 1f1b m=%d", mb);
      dt__plan_add(&c, name, "pipeline", P, step, B, (Pb + G + Ob) / P + A * micro, /* 1F1B: P microbatches in flight, 1/P of the layers each */
                   (mb + P - 1) * hop, dt_plan_bubble(P, mb), 0);
    }
  }
  return c.n;
}

DTRAIN_API int dt_plan_recommend(const dt_plan_row *rows, int n, char *why, size_t cap) {
  if (why && cap) why[0] = '\0';
  if (!rows || n <= 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_plan_recommend: no rows");
    return -1;
  }
  int best = -1, one = -1;
  for (int i = 0; i < n; i++) {
    if (strcmp(rows[i].family, "one_device") == 0) one = i;
    if (rows[i].fits && (best < 0 || rows[i].samples_per_sec > rows[best].samples_per_sec)) best = i;
  }
  if (best < 0) {
    if (why && cap) snprintf(why, cap, "no strategy fits the memory limit: the smallest needs %.1f MiB a worker",
                             rows[0].memory_bytes / 1048576.0);
    return -1;
  }
  const dt_plan_row *b = &rows[best];
  if (one >= 0 && rows[one].fits && best != one && rows[one].samples_per_sec >= 0.9 * b->samples_per_sec) {
    if (why && cap)
      snprintf(why, cap, "do not distribute: one_device gives %.0f samples/s, the best distributed choice (%s, %d "
               "workers) %.0f, %.2fx, not worth the workers%s", rows[one].samples_per_sec, b->name, b->workers,
               b->samples_per_sec, b->speedup, b->comm_share > 0.3 ? " (communication would be most of its step)" : "");
    return one;
  }
  if (why && cap) {
    if (best == one) {
      snprintf(why, cap, "do not distribute: one_device is the fastest (%.0f samples/s); every distributed choice is "
               "slower here (communication, shared cores)", b->samples_per_sec);
    } else {
      int k = snprintf(why, cap, "%s with %d workers: %.0f samples/s, %.2fx one_device; %.0f%% of its step "
                       "communicating", b->name, b->workers, b->samples_per_sec, b->speedup, 100 * b->comm_share);
      if (k > 0 && (size_t)k < cap && b->bubble > 0)
        k += snprintf(why + k, cap - (size_t)k, ", %.0f%% pipeline bubble", 100 * b->bubble);
      if (k > 0 && (size_t)k < cap && b->staleness > 0)
        k += snprintf(why + k, cap - (size_t)k, ", updates about %.0f steps stale", b->staleness);
      if (k > 0 && (size_t)k < cap && one >= 0 && !rows[one].fits)
        snprintf(why + k, cap - (size_t)k, "; one device would need %.1f MiB, over the limit",
                 rows[one].memory_bytes / 1048576.0);
    }
  }
  return best;
}
