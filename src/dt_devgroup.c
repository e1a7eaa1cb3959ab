/* ===========================================================================
 * dt_devgroup.c -- collectives over several devices (dt_device_group): the
 * all-reduce of mirrored training on devices
 * ===========================================================================
 * A ring over the devices' peer copies and their DTRAIN_K_ACC kernel, or the
 * backend's own collective (group hooks: NCCL in dtrain_cuda.h). The core
 * never calls a device API here either: everything goes through the
 * dt_device function table. See dt_device.h for the contract.
 * Layer: comm (a collective, like dt_comm.c; its user is dt_strategy). It
 * cuts the buffers with dt_comm_slice, so that a chunk here is the slice the
 * host all-reduce uses: one rule for both. Below it, it calls only the
 * base and the devices' function tables, nothing of the graph.
 */
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
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"

#if !defined(DTRAIN_NO_DIST) /* the whole file; the stubs at the end stand in without it */

struct dt_device_group {
  int n;
  size_t count;
  dt_device **devs;
  float **scratch;   /* one chunk per device (device memory) */
  size_t chunk;      /* floats in the largest chunk */
  float *host;       /* staging for devices without peer_copy (chunk floats), or NULL */
  void *coll;        /* the backend's collective (group hooks), or NULL */
  float **view;      /* n pointers: buffers offset for a ranged collective */
};

DTRAIN_API const char *dt_device_group_method(const dt_device_group *g) {
  if (!g) return "none";
  if (g->coll) return "collective (group hooks)";
  if (g->n == 1) return "none (one device)";
  return g->host ? "ring through host memory" : "ring over peer copies";
}

DTRAIN_API void dt_device_group_destroy(dt_device_group *g) {
  if (!g) return;
  if (g->coll && g->devs[0]->group_destroy) g->devs[0]->group_destroy(g->coll);
  if (g->scratch)
    for (int i = 0; i < g->n; i++)
      if (g->scratch[i]) g->devs[i]->free(g->devs[i], g->scratch[i], g->chunk * sizeof(float));
  dt__free(g->host, g->chunk * sizeof(float));
  dt__free(g->scratch, (size_t)g->n * sizeof(float *));
  dt__free(g->view, (size_t)g->n * sizeof(float *));
  dt__free(g->devs, (size_t)g->n * sizeof(dt_device *));
  dt__free(g, sizeof *g);
}

DTRAIN_API dt_device_group *dt_device_group_create(dt_device *const *devs, int n, size_t count) {
  const char *fn = "dt_device_group_create";
  if (!devs) {
    dt__error(DTRAIN_ERR_NULL_ARG, "%s: devs is NULL", fn);
    return NULL;
  }
  if (n < 1) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d devices (need >= 1)", fn, n);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    const dt_device *d = devs[i];
    if (!d || !d->alloc || !d->free || !d->copy || !d->sync || !d->run) {
      dt__error(DTRAIN_ERR_NULL_ARG, "%s: device %d is NULL or has a NULL function", fn, i);
      return NULL;
    }
  }
  int hooks = 0;
  dt_device_group *g = (dt_device_group *)dt__calloc(sizeof *g);
  if (!g) {
    dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
    return NULL;
  }
  g->n = n;
  g->count = count;
  g->devs = (dt_device **)dt__calloc((size_t)n * sizeof(dt_device *));
  g->scratch = (float **)dt__calloc((size_t)n * sizeof(float *));
  g->view = (float **)dt__calloc((size_t)n * sizeof(float *));
  if (!g->devs || !g->scratch || !g->view) goto nomem;
  for (int i = 0; i < n; i++) g->devs[i] = devs[i];
  if (n == 1) return g;
  for (int i = 0; i < n; i++) {
    size_t b, e;
    dt_comm_slice(count, n, i, &b, &e);
    if (e - b > g->chunk) g->chunk = e - b;
  }
  if (g->chunk == 0) g->chunk = 1;
  for (int i = 0; i < n; i++)
    if (!devs[i]->peer_copy && !g->host && !(g->host = (float *)dt__alloc(g->chunk * sizeof(float)))) goto nomem;
  /* The backend's collective, when every device has the same one. */
  hooks = devs[0]->group_create && devs[0]->group_allreduce && devs[0]->group_destroy;
  for (int i = 1; i < n && hooks; i++)
    hooks = devs[i]->group_create == devs[0]->group_create && devs[i]->group_allreduce == devs[0]->group_allreduce;
  if (hooks) {
    dt__quiet_push(); /* a failure is logged once, below, with the group's context */
    dt_result r = devs[0]->group_create(g->devs, n, &g->coll);
    dt__quiet_pop(DTRAIN_OK);
    if (r == DTRAIN_ERR_UNSUPPORTED) { /* not for these devices (NCCL: a GPU twice): the ring below */
      dt__log(DTRAIN_LOG_DEBUG, DTRAIN_OK, "%s: the backend's collective refused %d devices (%.300s); using the ring",
              fn, n, dt_last_error());
      g->coll = NULL;
      hooks = 0;
    } else if (r != DTRAIN_OK) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "%.300s", dt_last_error());
      dt__error(r, "%s: collective over %d devices (%s, ...): %s", fn, n, devs[0]->name, what);
      g->coll = NULL;
      goto fail;
    } else {
      return g;
    }
  }
  for (int i = 0; i < n; i++) {
    void *p = NULL;
    dt_result r = devs[i]->alloc(devs[i], g->chunk * sizeof(float), &p);
    if (r != DTRAIN_OK) {
      char what[DT__MSG_CAP];
      snprintf(what, sizeof what, "%.300s", dt_last_error());
      dt__error(r, "%s: scratch of %zu bytes on device %s: %s", fn, g->chunk * sizeof(float), devs[i]->name, what);
      goto fail;
    }
    g->scratch[i] = (float *)p;
  }
  return g;
nomem:
  dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", fn);
fail:
  dt_device_group_destroy(g);
  return NULL;
}

/* bytes from device `from` (src) to device `to` (dst). */
static dt_result dt__devgroup_copy(dt_device_group *g, int to, float *dst, int from, const float *src, size_t bytes,
                                   const char *what) {
  dt_device *d = g->devs[to], *f = g->devs[from];
  dt_result r;
  const char *who = d->name;
  if (bytes == 0) return DTRAIN_OK;
  if (d->peer_copy) {
    r = d->peer_copy(d, dst, f, src, bytes);
  } else {
    who = f->name;
    r = f->copy(f, g->host, src, bytes, DTRAIN_COPY_D2H);
    if (r == DTRAIN_OK) {
      who = d->name;
      r = d->copy(d, dst, g->host, bytes, DTRAIN_COPY_H2D);
    }
  }
  if (r != DTRAIN_OK) {
    char msg[DT__MSG_CAP];
    snprintf(msg, sizeof msg, "%.300s", dt_last_error());
    return dt__error(r, "%s: copy %s -> %s: device %s: %s", what, f->name, d->name, who, msg);
  }
  return DTRAIN_OK;
}

static dt_result dt__devgroup_sync_all(dt_device_group *g, const char *what) {
  for (int i = 0; i < g->n; i++) {
    dt_result r = g->devs[i]->sync(g->devs[i]);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: device %s: %s", what, g->devs[i]->name, msg);
    }
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_device_group_allreduce(dt_device_group *g, float *const *bufs) {
  const char *fn = "dt_device_group_allreduce";
  if (!g || !bufs) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !g ? "group" : "bufs");
  const int n = g->n;
  if (n == 1 || g->count == 0) return DTRAIN_OK;
  for (int i = 0; i < n; i++)
    if (!bufs[i]) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: buffer %d is NULL", fn, i);
  dt_result r;
  char what[96];
  if (g->coll) {
    r = g->devs[0]->group_allreduce(g->coll, bufs, g->count);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: collective over %d devices: %s", fn, n, msg);
    }
    return dt__devgroup_sync_all(g, fn);
  }
  /* reduce-scatter: in round k device i sends chunk (i - k) mod n to device
   * i + 1, which adds it to its own; after n - 1 rounds device i holds the
   * whole sum of chunk (i + 1) mod n. */
  for (int k = 0; k < n - 1; k++) {
    snprintf(what, sizeof what, "%s: reduce-scatter round %d of %d", fn, k + 1, n - 1);
    for (int i = 0; i < n; i++) {
      int to = (i + 1) % n, c = ((i - k) % n + n) % n;
      size_t b, e;
      dt_comm_slice(g->count, n, c, &b, &e);
      if (b == e) continue;
      r = dt__devgroup_copy(g, to, g->scratch[to], i, bufs[i] + b, (e - b) * sizeof(float), what);
      if (r != DTRAIN_OK) return r;
      dt_kernel_args a;
      memset(&a, 0, sizeof a);
      a.p[0] = bufs[to] + b;
      a.p[1] = g->scratch[to];
      a.n[0] = (int64_t)(e - b);
      a.f[0] = 1.0f;
      dt_device *d = g->devs[to];
      r = d->run(d, DTRAIN_K_ACC, &a);
      if (r != DTRAIN_OK) {
        char msg[DT__MSG_CAP];
        snprintf(msg, sizeof msg, "%.300s", dt_last_error());
        return dt__error(r, "%s: accumulate on device %s: %s", what, d->name, msg);
      }
    }
    if ((r = dt__devgroup_sync_all(g, what)) != DTRAIN_OK) return r;
  }
  /* all-gather: in round k device i sends its finished chunk (i + 1 - k)
   * mod n to device i + 1. */
  for (int k = 0; k < n - 1; k++) {
    snprintf(what, sizeof what, "%s: all-gather round %d of %d", fn, k + 1, n - 1);
    for (int i = 0; i < n; i++) {
      int to = (i + 1) % n, c = ((i + 1 - k) % n + n) % n;
      size_t b, e;
      dt_comm_slice(g->count, n, c, &b, &e);
      r = dt__devgroup_copy(g, to, bufs[to] + b, i, bufs[i] + b, (e - b) * sizeof(float), what);
      if (r != DTRAIN_OK) return r;
    }
    if ((r = dt__devgroup_sync_all(g, what)) != DTRAIN_OK) return r;
  }
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_device_group_broadcast(dt_device_group *g, float *const *bufs, size_t begin, size_t end,
                                               int root) {
  const char *fn = "dt_device_group_broadcast";
  if (!g || !bufs) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !g ? "group" : "bufs");
  if (root < 0 || root >= g->n) return dt__error(DTRAIN_ERR_INDEX, "%s: root %d outside [0, %d)", fn, root, g->n);
  if (begin > end || end > g->count)
    return dt__error(DTRAIN_ERR_INDEX, "%s: range [%zu, %zu) outside the group's %zu floats", fn, begin, end, g->count);
  if (g->n == 1 || begin == end) return DTRAIN_OK;
  for (int i = 0; i < g->n; i++)
    if (!bufs[i]) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: buffer %d is NULL", fn, i);
  dt_result r;
  if (g->coll && g->devs[0]->group_broadcast) {
    for (int i = 0; i < g->n; i++) g->view[i] = bufs[i] + begin;
    r = g->devs[0]->group_broadcast(g->coll, g->view, end - begin, root);
    if (r != DTRAIN_OK) {
      char msg[DT__MSG_CAP];
      snprintf(msg, sizeof msg, "%.300s", dt_last_error());
      return dt__error(r, "%s: collective over %d devices: %s", fn, g->n, msg);
    }
    return dt__devgroup_sync_all(g, fn);
  }
  /* Host staging copies at most a chunk at a time. */
  size_t step = g->host ? g->chunk : end - begin;
  for (int i = 0; i < g->n; i++) {
    if (i == root) continue;
    for (size_t off = begin; off < end; off += step) {
      size_t m = DT__MIN(step, end - off);
      r = dt__devgroup_copy(g, i, bufs[i] + off, root, bufs[root] + off, m * sizeof(float), fn);
      if (r != DTRAIN_OK) return r;
    }
  }
  return dt__devgroup_sync_all(g, fn);
}

#else /* DTRAIN_NO_DIST: every entry point says so */

DTRAIN_API const char *dt_device_group_method(const dt_device_group *g) {
  (void)g;
  return "none";
}
DTRAIN_API void dt_device_group_destroy(dt_device_group *g) { (void)g; }
DTRAIN_API dt_device_group *dt_device_group_create(dt_device *const *devs, int n, size_t count) {
  (void)devs; (void)n; (void)count;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_device_group_create: compiled out (DTRAIN_NO_DIST)");
  return NULL;
}
DTRAIN_API dt_result dt_device_group_allreduce(dt_device_group *g, float *const *bufs) {
  (void)g; (void)bufs;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_device_group_allreduce: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_device_group_broadcast(dt_device_group *g, float *const *bufs, size_t begin, size_t end,
                                               int root) {
  (void)g; (void)bufs; (void)begin; (void)end; (void)root;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_device_group_broadcast: compiled out (DTRAIN_NO_DIST)");
}

#endif /* DTRAIN_NO_DIST */
