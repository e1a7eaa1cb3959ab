/* ===========================================================================
 * dt_ops_nn.c -- softmax, losses and neural-network layers' ops: softmax,
 * log_softmax, cross_entropy, mse, embedding, dropout, layer_norm,
 * batch_norm, causal_mask
 * ===========================================================================
 * Sums run in double and in a fixed order (deterministic). Saved statistics
 * (row log-sum-exp, mean and 1/std) live in the arena, pointed to by y->aux.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"

/* Checks an optional tensor argument (NULL is fine) belongs to g. */
static int dt__nn_opt(dt_graph *g, const char *op, const char *name, const dt_tensor *t) {
  if (t && t->graph != g) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: %s belongs to another graph", op, name);
    return 0;
  }
  return 1;
}

/* Checks an optional per-feature tensor (NULL is fine) has shape [n]. */
static int dt__nn_vec(dt_graph *g, const char *op, const char *name, const dt_tensor *t, int64_t n,
                      const char *what, const dt_tensor *x) {
  if (!t) return 1;
  if (t->ndim != 1 || t->shape[0] != n) {
    char s1[96], s2[96];
    dt__fail(g, DTRAIN_ERR_SHAPE, "%s: %s has shape %s, expected [%lld] (%s of input %s)", op, name,
             dt_shape_str(t, s1, sizeof s1), (long long)n, what, dt_shape_str(x, s2, sizeof s2));
    return 0;
  }
  return 1;
}

static int dt__nn_eps(dt_graph *g, const char *op, float eps) {
  if (!(eps >= 0.0f) || !isfinite(eps)) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: eps is %g (must be finite and >= 0)", op, (double)eps);
    return 0;
  }
  return 1;
}

/* ---- softmax / log_softmax ------------------------------------------------------------
 * The axis splits x into [outer, n, inner]; element (o,k,i) is at
 * (o*n + k)*inner + i. Each (o,i) line of n elements is normalised. */

static void dt__nn_softmax_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t outer = y->iaux[0], n = y->iaux[1], inner = y->iaux[2];
  int is_log = (int)y->iaux[3];
  const float *yd = y->data, *go = y->grad;
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * n * inner + i;
      double s = 0.0;
      if (is_log) {
        for (int64_t k = 0; k < n; k++) s += (double)go[base + k * inner];
        float fs = (float)s;
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          gx[j] += go[j] - expf(yd[j]) * fs;
        }
      } else {
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          s += (double)go[j] * (double)yd[j];
        }
        float fs = (float)s;
        for (int64_t k = 0; k < n; k++) {
          int64_t j = base + k * inner;
          gx[j] += yd[j] * (go[j] - fs);
        }
      }
    }
  }
}

static dt_tensor *dt__nn_softmax(dt_graph *g, dt_tensor *x, int axis, int is_log, const char *op) {
  if (!dt__begin(g, op, 1, x)) return NULL;
  int ax = dt__axis(axis, x->ndim);
  if (ax < 0) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, x->ndim == 0 ? DTRAIN_ERR_RANK : DTRAIN_ERR_INDEX,
                                 "%s: axis %d out of range for input %s (%d dims)", op, axis,
                                 dt_shape_str(x, sb, sizeof sb), x->ndim);
  }
  if (g->device) return dt__dev_softmax(g, x, ax, is_log, op);
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t outer = 1, inner = 1, n = x->shape[ax];
  for (int d = 0; d < ax; d++) outer *= x->shape[d];
  for (int d = ax + 1; d < x->ndim; d++) inner *= x->shape[d];
  const float *xd = x->data;
  float *yd = y->data;
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * n * inner + i;
      float m = xd[base];
      for (int64_t k = 1; k < n; k++) m = DT__MAX(m, xd[base + k * inner]);
      double s = 0.0;
      if (is_log) {
        for (int64_t k = 0; k < n; k++) s += (double)expf(xd[base + k * inner] - m);
        float ls = (float)log(s); /* (x - m) - ls keeps precision for large logits */
        for (int64_t k = 0; k < n; k++) yd[base + k * inner] = (xd[base + k * inner] - m) - ls;
      } else {
        for (int64_t k = 0; k < n; k++) {
          float e = expf(xd[base + k * inner] - m);
          yd[base + k * inner] = e;
          s += (double)e;
        }
        float inv = (float)(1.0 / s);
        for (int64_t k = 0; k < n; k++) yd[base + k * inner] *= inv;
      }
    }
  }
  y->iaux[0] = outer;
  y->iaux[1] = n;
  y->iaux[2] = inner;
  y->iaux[3] = is_log;
  dt__record(g, y, op, dt__nn_softmax_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_softmax(dt_graph *g, dt_tensor *x, int axis) {
  return dt__nn_softmax(g, x, axis, 0, "dt_softmax");
}

DTRAIN_API dt_tensor *dt_log_softmax(dt_graph *g, dt_tensor *x, int axis) {
  return dt__nn_softmax(g, x, axis, 1, "dt_log_softmax");
}

/* ---- cross entropy ----------------------------------------------------------------------
 * aux: labels (int32, rows, padded to 4), then per row its max m and
 * ls = log(sum exp(x - m)) (float, rows each); log-sum-exp = m + ls. */

static void dt__nn_xent_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t rows = y->iaux[0], c = y->iaux[1];
  const int32_t *labels = (const int32_t *)y->aux;
  const float *mx = (const float *)y->aux + y->iaux[2], *ls = mx + rows;
  const float *xd = x->data;
  float scale = y->grad[0] / (float)rows;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * c;
    float *gr = gx + r * c;
    float m = mx[r], l = ls[r];
    for (int64_t j = 0; j < c; j++) gr[j] += expf((xr[j] - m) - l) * scale;
    gr[labels[r]] -= scale;
  }
}

DTRAIN_API dt_tensor *dt_cross_entropy(dt_graph *g, dt_tensor *logits, const int32_t *labels) {
  const char *op = "dt_cross_entropy";
  if (!dt__begin(g, op, 1, logits)) return NULL;
  char sb[96];
  if (logits->ndim < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: logits must have at least 1 dim [...,C], got %s", op,
                                 dt_shape_str(logits, sb, sizeof sb));
  if (!labels) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: labels is NULL", op);
  int64_t c = logits->shape[logits->ndim - 1], rows = logits->size / c;
  for (int64_t r = 0; r < rows; r++) {
    if (labels[r] < 0 || (int64_t)labels[r] >= c)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: label %d of row %lld is out of range [0,%lld) (logits %s)",
                                   op, (int)labels[r], (long long)r, (long long)c,
                                   dt_shape_str(logits, sb, sizeof sb));
  }
  if (g->device) return dt__dev_xent(g, logits, labels, rows, c);
  int64_t lab_floats = (rows + 3) / 4 * 4;
  float *aux = dt__arena_floats(g, lab_floats + 2 * rows);
  if (!aux) return NULL;
  int32_t *lab = (int32_t *)(void *)aux;
  float *mx = aux + lab_floats, *ls = mx + rows;
  memcpy(lab, labels, (size_t)rows * sizeof(int32_t));
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  const float *xd = logits->data;
  double loss = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * c;
    float m = xr[0];
    for (int64_t j = 1; j < c; j++) m = DT__MAX(m, xr[j]);
    double s = 0.0;
    for (int64_t j = 0; j < c; j++) s += (double)expf(xr[j] - m);
    double l = log(s);
    mx[r] = m;
    ls[r] = (float)l;
    loss += l + ((double)m - (double)xr[lab[r]]);
  }
  y->data[0] = (float)(loss / (double)rows);
  y->aux = aux;
  y->iaux[0] = rows;
  y->iaux[1] = c;
  y->iaux[2] = lab_floats;
  dt__record(g, y, op, dt__nn_xent_backward, logits, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- mean squared error ---------------------------------------------------------------- */

static void dt__nn_mse_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *a = y->src[0], *b = y->src[1];
  float *ga = dt__grad(g, a), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  const float *ad = a->data, *bd = b->data;
  float k = 2.0f * y->grad[0] / (float)a->size;
  for (int64_t i = 0; i < a->size; i++) {
    float d = k * (ad[i] - bd[i]);
    if (ga) ga[i] += d;
    if (gb) gb[i] -= d;
  }
}

DTRAIN_API dt_tensor *dt_mse(dt_graph *g, dt_tensor *a, dt_tensor *b) {
  const char *op = "dt_mse";
  if (!dt__begin(g, op, 2, a, b)) return NULL;
  if (!dt_same_shape(a, b)) {
    char s1[96], s2[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: shapes %s and %s differ", op,
                                 dt_shape_str(a, s1, sizeof s1), dt_shape_str(b, s2, sizeof s2));
  }
  if (g->device) return dt__dev_mse(g, a, b);
  dt_tensor *y = dt__new(g, op, 0, NULL);
  if (!y) return NULL;
  double s = 0.0;
  for (int64_t i = 0; i < a->size; i++) {
    double d = (double)a->data[i] - (double)b->data[i];
    s += d * d;
  }
  y->data[0] = (float)(s / (double)a->size);
  dt__record(g, y, op, dt__nn_mse_backward, a, b, NULL);
  return dt__finish(g, y);
}

/* ---- embedding ----------------------------------------------------------------------------
 * aux: the ids (int32, n). */

static void dt__nn_embedding_backward(dt_graph *g, dt_tensor *y) {
  float *gt = dt__grad(g, y->src[0]);
  if (!gt) return;
  const int32_t *ids = (const int32_t *)y->aux;
  int64_t n = y->shape[0], d = y->shape[1];
  const float *go = y->grad;
  for (int64_t i = 0; i < n; i++) {
    float *row = gt + (int64_t)ids[i] * d;
    const float *gr = go + i * d;
    for (int64_t j = 0; j < d; j++) row[j] += gr[j];
  }
}

DTRAIN_API dt_tensor *dt_embedding(dt_graph *g, dt_tensor *table, const int32_t *ids, int64_t n) {
  const char *op = "dt_embedding";
  if (!dt__begin(g, op, 1, table)) return NULL;
  char sb[96];
  if (table->ndim != 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: table must be 2-D [V,D], got %s", op,
                                 dt_shape_str(table, sb, sizeof sb));
  if (!ids) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "%s: ids is NULL", op);
  if (n <= 0)
    return (dt_tensor *)dt__fail(g, n == 0 ? DTRAIN_ERR_EMPTY : DTRAIN_ERR_INVALID_ARG,
                                 "%s: n is %lld (must be >= 1)", op, (long long)n);
  int64_t v = table->shape[0], d = table->shape[1];
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || (int64_t)ids[i] >= v)
      return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "%s: id %d at position %lld is out of range [0,%lld) (table %s)",
                                   op, (int)ids[i], (long long)i, (long long)v, dt_shape_str(table, sb, sizeof sb));
  }
  if (g->device) return dt__dev_embedding(g, table, ids, n, d);
  int64_t shape[2];
  shape[0] = n;
  shape[1] = d;
  dt_tensor *y = dt__new(g, op, 2, shape); /* validates the size, so n * 4 bytes cannot overflow */
  if (!y) return NULL;
  int32_t *copy = (int32_t *)dt__arena_alloc(g, (size_t)n * sizeof(int32_t));
  if (!copy) return NULL;
  memcpy(copy, ids, (size_t)n * sizeof(int32_t));
  for (int64_t i = 0; i < n; i++)
    memcpy(y->data + i * d, table->data + (int64_t)copy[i] * d, (size_t)d * sizeof(float));
  y->aux = copy;
  dt__record(g, y, op, dt__nn_embedding_backward, table, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- dropout --------------------------------------------------------------------------------
 * aux: the mask as scales (0 or 1/(1-p)), one per element. */

static void dt__nn_dropout_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  const float *mask = (const float *)y->aux, *go = y->grad;
  for (int64_t i = 0; i < y->size; i++) gx[i] += go[i] * mask[i];
}

DTRAIN_API dt_tensor *dt_dropout(dt_graph *g, dt_tensor *x, float p) {
  const char *op = "dt_dropout";
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!(p >= 0.0f && p < 1.0f))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: p is %g (must be in [0,1))", op, (double)p);
  if (!g->training || p == 0.0f) return x; /* identity */
  if (g->device) return dt__dev_dropout(g, x, p);
  float *mask = dt__arena_floats(g, x->size);
  if (!mask) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < x->size; i++) {
    mask[i] = dt_rng_uniform(&g->rng) >= p ? scale : 0.0f;
    y->data[i] = x->data[i] * mask[i];
  }
  y->aux = mask;
  y->faux[0] = p;
  dt__record(g, y, op, dt__nn_dropout_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

/* ---- normalisation ----------------------------------------------------------------------------
 * Both norms save, per normalised group, the mean and 1/sqrt(var + eps):
 * aux = [mean[0..k), rstd[0..k)]. With xhat = (x - mean) * rstd and
 * dxhat = dy * gamma, the input gradient over a group of m elements is
 *   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)). */

static void dt__nn_layer_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  int64_t d = x->shape[x->ndim - 1], rows = x->size / d;
  const float *mean = (const float *)y->aux, *rstd = mean + rows;
  const float *xd = x->data, *go = y->grad, *gm = gamma ? gamma->data : NULL;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = xd + r * d, *gr = go + r * d;
    float mu = mean[r], rs = rstd[r];
    if (gg || gb) {
      for (int64_t j = 0; j < d; j++) {
        if (gg) gg[j] += gr[j] * (xr[j] - mu) * rs;
        if (gb) gb[j] += gr[j];
      }
    }
    if (!gx) continue;
    double s1 = 0.0, s2 = 0.0;
    for (int64_t j = 0; j < d; j++) {
      double dxh = (double)gr[j] * (gm ? (double)gm[j] : 1.0);
      s1 += dxh;
      s2 += dxh * (double)((xr[j] - mu) * rs);
    }
    float m1 = (float)(s1 / (double)d), m2 = (float)(s2 / (double)d);
    float *gxr = gx + r * d;
    for (int64_t j = 0; j < d; j++) {
      float dxh = gr[j] * (gm ? gm[j] : 1.0f);
      gxr[j] += rs * (dxh - m1 - (xr[j] - mu) * rs * m2);
    }
  }
}

DTRAIN_API dt_tensor *dt_layer_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta, float eps) {
  const char *op = "dt_layer_norm";
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!dt__nn_opt(g, op, "gamma", gamma) || !dt__nn_opt(g, op, "beta", beta)) return NULL;
  if (x->ndim < 1) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must have at least 1 dim, got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  }
  int64_t d = x->shape[x->ndim - 1], rows = x->size / d;
  if (!dt__nn_vec(g, op, "gamma", gamma, d, "last dim", x) || !dt__nn_vec(g, op, "beta", beta, d, "last dim", x) ||
      !dt__nn_eps(g, op, eps))
    return NULL;
  if (g->device) return dt__dev_layer_norm(g, x, gamma, beta, eps, rows, d);
  float *stats = dt__arena_floats(g, 2 * rows);
  if (!stats) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  const float *gm = gamma ? gamma->data : NULL, *bt = beta ? beta->data : NULL;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x->data + r * d;
    float *yr = y->data + r * d;
    double s = 0.0, v = 0.0;
    for (int64_t j = 0; j < d; j++) s += (double)xr[j];
    double mu = s / (double)d;
    for (int64_t j = 0; j < d; j++) {
      double t = (double)xr[j] - mu;
      v += t * t;
    }
    float fmu = (float)mu, rs = (float)(1.0 / sqrt(v / (double)d + (double)eps));
    for (int64_t j = 0; j < d; j++) {
      float h = (xr[j] - fmu) * rs;
      if (gm) h *= gm[j];
      if (bt) h += bt[j];
      yr[j] = h;
    }
    stats[r] = fmu;
    stats[rows + r] = rs;
  }
  y->aux = stats;
  dt__record(g, y, op, dt__nn_layer_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* Batch norm: x [N,C,HW...]: element (n,c,s) at (n*C + c)*hw + s.
 * iaux: [0] N, [1] C, [2] hw, [3] 1 if batch statistics were used. */

static void dt__nn_batch_norm_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *gamma = y->src[1], *beta = y->src[2];
  float *gx = dt__grad(g, x), *gg = dt__grad(g, gamma), *gb = dt__grad(g, beta);
  if (g->err != DTRAIN_OK) return;
  int64_t nb = y->iaux[0], c = y->iaux[1], hw = y->iaux[2];
  int batch = (int)y->iaux[3];
  double m = (double)(nb * hw);
  const float *mean = (const float *)y->aux, *rstd = mean + c;
  const float *xd = x->data, *go = y->grad;
  for (int64_t ch = 0; ch < c; ch++) {
    float mu = mean[ch], rs = rstd[ch], gam = gamma ? gamma->data[ch] : 1.0f;
    double sg = 0.0, sgx = 0.0; /* sum dy, sum dy * xhat */
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t s = 0; s < hw; s++) {
        sg += (double)go[base + s];
        sgx += (double)go[base + s] * (double)((xd[base + s] - mu) * rs);
      }
    }
    if (gg) gg[ch] += (float)sgx;
    if (gb) gb[ch] += (float)sg;
    if (!gx) continue;
    float k = gam * rs;
    if (!batch) {
      for (int64_t n = 0; n < nb; n++) {
        int64_t base = (n * c + ch) * hw;
        for (int64_t s = 0; s < hw; s++) gx[base + s] += go[base + s] * k;
      }
      continue;
    }
    float m1 = (float)(sg / m), m2 = (float)(sgx / m);
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t s = 0; s < hw; s++) {
        float xh = (xd[base + s] - mu) * rs;
        gx[base + s] += k * (go[base + s] - m1 - xh * m2);
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_batch_norm(dt_graph *g, dt_tensor *x, dt_tensor *gamma, dt_tensor *beta,
                                    dt_tensor *running_mean, dt_tensor *running_var,
                                    float momentum, float eps) {
  const char *op = "dt_batch_norm";
  char sb[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (!dt__nn_opt(g, op, "gamma", gamma) || !dt__nn_opt(g, op, "beta", beta) ||
      !dt__nn_opt(g, op, "running_mean", running_mean) || !dt__nn_opt(g, op, "running_var", running_var))
    return NULL;
  if (x->ndim != 2 && x->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must be [N,C] or [N,C,H,W], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t nb = x->shape[0], c = x->shape[1], hw = x->size / (nb * c);
  if (!dt__nn_vec(g, op, "gamma", gamma, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "beta", beta, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "running_mean", running_mean, c, "channel dim 1", x) ||
      !dt__nn_vec(g, op, "running_var", running_var, c, "channel dim 1", x) || !dt__nn_eps(g, op, eps))
    return NULL;
  if ((running_mean == NULL) != (running_var == NULL))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: running_mean and running_var must both be given or both be NULL", op);
  int have_running = running_mean != NULL;
  int batch = g->training || !have_running; /* eval without running stats: batch stats (as PyTorch) */
  if (g->training && have_running && !(momentum >= 0.0f && momentum <= 1.0f))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: momentum is %g (must be in [0,1])", op,
                                 (double)momentum);
  int64_t m = nb * hw;
  if (batch && m < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG,
                                 "%s: batch statistics need more than 1 value per channel (input %s)", op,
                                 dt_shape_str(x, sb, sizeof sb));
  if (g->device)
    return dt__dev_batch_norm(g, x, gamma, beta, running_mean, running_var, momentum, eps, nb, c, hw, batch);
  if (!batch) {
    for (int64_t ch = 0; ch < c; ch++)
      if (!(running_var->data[ch] + eps > 0.0f))
        return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: running_var[%lld] + eps is %g (must be > 0)", op,
                                     (long long)ch, (double)(running_var->data[ch] + eps));
  }
  float *stats = dt__arena_floats(g, 2 * c);
  if (!stats) return NULL;
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  const float *xd = x->data;
  for (int64_t ch = 0; ch < c; ch++) {
    float mu, rs;
    if (batch) {
      double s = 0.0, v = 0.0;
      for (int64_t n = 0; n < nb; n++) {
        const float *p = xd + (n * c + ch) * hw;
        for (int64_t t = 0; t < hw; t++) s += (double)p[t];
      }
      double dmu = s / (double)m;
      for (int64_t n = 0; n < nb; n++) {
        const float *p = xd + (n * c + ch) * hw;
        for (int64_t t = 0; t < hw; t++) {
          double e = (double)p[t] - dmu;
          v += e * e;
        }
      }
      mu = (float)dmu;
      rs = (float)(1.0 / sqrt(v / (double)m + (double)eps));
      if (have_running) { /* training: update the running statistics in place */
        double mom = (double)momentum;
        running_mean->data[ch] = (float)((1.0 - mom) * (double)running_mean->data[ch] + mom * dmu);
        running_var->data[ch] = (float)((1.0 - mom) * (double)running_var->data[ch] + mom * v / (double)(m - 1));
      }
    } else {
      mu = running_mean->data[ch];
      rs = (float)(1.0 / sqrt((double)running_var->data[ch] + (double)eps));
    }
    stats[ch] = mu;
    stats[c + ch] = rs;
    float gam = gamma ? gamma->data[ch] : 1.0f, bet = beta ? beta->data[ch] : 0.0f;
    for (int64_t n = 0; n < nb; n++) {
      int64_t base = (n * c + ch) * hw;
      for (int64_t t = 0; t < hw; t++) y->data[base + t] = (xd[base + t] - mu) * rs * gam + bet;
    }
  }
  y->aux = stats;
  y->iaux[0] = nb;
  y->iaux[1] = c;
  y->iaux[2] = hw;
  y->iaux[3] = batch;
  dt__record(g, y, op, dt__nn_batch_norm_backward, x, gamma, beta);
  return dt__finish(g, y);
}

/* ---- causal mask ------------------------------------------------------------------------------ */

static void dt__nn_causal_backward(dt_graph *g, dt_tensor *y) {
  float *gx = dt__grad(g, y->src[0]);
  if (!gx) return;
  int64_t t = y->shape[y->ndim - 1], mats = y->size / (t * t);
  const float *go = y->grad;
  for (int64_t b = 0; b < mats; b++)
    for (int64_t i = 0; i < t; i++) {
      int64_t row = (b * t + i) * t;
      for (int64_t j = 0; j <= i; j++) gx[row + j] += go[row + j];
    }
}

DTRAIN_API dt_tensor *dt_causal_mask(dt_graph *g, dt_tensor *x) {
  const char *op = "dt_causal_mask";
  char sb[96];
  if (!dt__begin(g, op, 1, x)) return NULL;
  if (x->ndim < 2)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: input must be [...,T,T], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  int64_t t = x->shape[x->ndim - 1];
  if (x->shape[x->ndim - 2] != t)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: last two dims must be equal [...,T,T], got %s", op,
                                 dt_shape_str(x, sb, sizeof sb));
  if (g->device) return dt__dev_causal_mask(g, x, t);
  dt_tensor *y = dt__new_like(g, op, x);
  if (!y) return NULL;
  int64_t mats = x->size / (t * t);
  for (int64_t b = 0; b < mats; b++)
    for (int64_t i = 0; i < t; i++) {
      int64_t row = (b * t + i) * t;
      for (int64_t j = 0; j < t; j++) y->data[row + j] = j <= i ? x->data[row + j] : -INFINITY;
    }
  dt__record(g, y, op, dt__nn_causal_backward, x, NULL, NULL);
  if (g->err != DTRAIN_OK) return NULL;
  /* The -inf entries are intended: check only the kept ones (dt__finish would flag them). */
  if (g->check_numerics) {
    for (int64_t b = 0; b < mats; b++)
      for (int64_t i = 0; i < t; i++)
        for (int64_t j = 0; j <= i; j++) {
          float v = y->data[(b * t + i) * t + j];
          if (!isfinite(v))
            return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NONFINITE, "%s: output %s has %s at element %lld", op,
                                         dt_shape_str(y, sb, sizeof sb), isnan(v) ? "NaN" : "Inf",
                                         (long long)((b * t + i) * t + j));
        }
  }
  return y;
}
