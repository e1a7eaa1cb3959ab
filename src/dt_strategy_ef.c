/* ===========================================================================
 * dt_strategy_ef.c -- gradients compressed with error feedback: top-k
 * sparsification and PowerSGD's low-rank factors (multi_worker_mirrored)
 * ===========================================================================
 * Both send much less than the gradient and keep what they left out: each
 * rank's error e is added to its next gradient before compressing, so every
 * value reaches the update, some of them steps later (error feedback). e is
 * staged while a step runs and kept only when the step goes on, so a failed
 * or skipped step leaves the last one; a non-finite error is never kept.
 *
 * top-k (fraction F): a rank sends the k = ceil(F x trained values) largest
 * |g + e| (ties: the lowest index; NaN and Inf first) as k rising u32 indices
 * (little-endian bytes) and k floats, 2k float slots. An all-gather ring
 * carries every rank's message to everybody, each forwarded as received, and
 * every rank adds them in rank order: the same sums everywhere. e = g + e
 * with the sent values zeroed. Checked on arrival: rising indices, each one
 * of a trained value.
 *
 * PowerSGD (rank R; Vogels, Karimireddy and Jaggi, 2019): a trained
 * parameter of shape [rows, ...] is a rows x cols matrix M = G + e. With Q
 * (cols x r, r = min(R, rows, cols)) the last step's, columns normalised (a
 * warm start; the first from a seed every rank shares):
 *   P = M Q, all-reduced (summed), orthonormalised (Gram-Schmidt);
 *   Q = M^T P, all-reduced;  the sum is taken to be P Q^T;
 *   e = M - P Q_local^T, Q_local this rank's M^T P (what its M lost).
 * P Q^T = P P^T (sum of M): the sum projected on the columns of P, exact when
 * r = min(rows, cols); the errors add up to what the sum lost. Parameters whose factors would be no smaller (vectors,
 * small matrices) ride along with the P all-reduce as floats. Two float
 * all-reduces per step; both give every rank the same values, and the rest
 * is the same arithmetic on the same numbers.
 */
#include "dt_strategy_impl.h"

#if !defined(DTRAIN_NO_DIST)

/* ---- the state ------------------------------------------------------------------------- */

/* Bytes of err and of next (one float for an empty buffer: no zero-size allocation). */
static size_t dt__ef_vbytes(const dt__ef *e) { return (e->n ? e->n : 1) * sizeof(float); }

DTRAIN_PRIVATE void dt__ef_destroy(dt__ef *e) {
  if (!e) return;
  dt__free(e->err, dt__ef_vbytes(e));
  dt__free(e->next, dt__ef_vbytes(e));
  dt__free(e->key, e->ntrain * sizeof(float));
  dt__free(e->msg, (size_t)e->W * 2 * e->k * sizeof(float));
  dt__free(e->pack, e->npack * sizeof(float));
  dt__free(e->q, e->nq * sizeof(float));
  dt__free(e->qloc, e->nq * sizeof(float));
  dt__free(e->qt, e->nqt * sizeof(float));
  dt__free(e->recon, e->nrecon * sizeof(float));
  dt__free(e->run, (size_t)e->nrun * sizeof(dt__ef_run));
  dt__free(e, sizeof *e);
}

/* A uniform value in [-1, 1) from the shared sequence (no libm: the same on every host). */
static float dt__ef_draw(dt__ef *e) {
  return (float)((double)(dt__splitmix64(&e->seed) >> 11) / 4503599627370496.0 - 1.0);
}

/* Column j of a cols x r matrix (row-major): new draws when it is all zero,
 * then scaled to length 1 (P = M Q then has M's magnitude). */
static void dt__ef_norm_col(dt__ef *e, float *Q, size_t cols, size_t r, size_t j) {
  double ss = 0.0;
  for (size_t c = 0; c < cols; c++) ss += (double)Q[c * r + j] * (double)Q[c * r + j];
  if (ss == 0.0) {
    for (size_t c = 0; c < cols; c++) Q[c * r + j] = dt__ef_draw(e);
    ss = 0.0;
    for (size_t c = 0; c < cols; c++) ss += (double)Q[c * r + j] * (double)Q[c * r + j];
  }
  if (!(ss > 0.0) || !isfinite(ss)) return; /* non-finite: the step fails its numerics check anyway */
  float s = (float)(1.0 / sqrt(ss));
  for (size_t c = 0; c < cols; c++) Q[c * r + j] *= s;
}

DTRAIN_PRIVATE size_t dt__ef_lowrank(int R, size_t rows, size_t cols, int lowrank_all) {
  size_t r = R > 0 ? (size_t)R : 0;
  r = DT__MIN(r, DT__MIN(rows, cols));
  return cols > 1 && rows > 1 && r > 0 && (lowrank_all || (rows + cols) * r < rows * cols) ? r : 0;
}

DTRAIN_PRIVATE void dt__ef_param_matrix(const dt_params *P, int i, size_t *rows, size_t *cols) {
  size_t off = 0, b = 0, e = 0;
  int ndim = 0, tr = 0, dec = 0;
  const int64_t *shape = NULL;
  *rows = *cols = 0;
  if (!dt__params_range(P, i, &b, &e, &tr, &dec)) return;
  dt__params_view(P, i, &off, &ndim, &shape, &tr);
  *rows = ndim >= 2 && shape[0] > 0 ? (size_t)shape[0] : 1;
  *cols = (e - b) / *rows;
}

DTRAIN_PRIVATE dt_result dt__ef_create(dt_compress c, size_t n, const dt__ef_part *parts, int nparts, int W,
                                       int lowrank_all, dt__ef **out) {
  *out = NULL;
  if (c.kind != DTRAIN_COMPRESS_TOPK && c.kind != DTRAIN_COMPRESS_POWERSGD)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "error-feedback compression: kind %s", dt_compress_name(c));
  if (c.kind == DTRAIN_COMPRESS_TOPK && !(c.fraction > 0.0f && c.fraction <= 1.0f))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "compress topk: fraction %g outside (0, 1]", (double)c.fraction);
  if (c.kind == DTRAIN_COMPRESS_POWERSGD && (c.rank < 1 || c.rank > 1024))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "compress powersgd: rank %d outside 1..1024", c.rank);
  if (c.kind == DTRAIN_COMPRESS_TOPK && n > 0xFFFFFFFFu)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "compress topk: %zu floats of parameters (the indices are 32-bit)", n);
  dt__ef *e = (dt__ef *)dt__calloc(sizeof *e);
  if (!e) return dt__error(DTRAIN_ERR_NOMEM, "compress %s: out of memory", dt_compress_name(c));
  e->c = c;
  e->W = W < 1 ? 1 : W;
  e->n = n;
  e->seed = 0x5067D5D2ull; /* any constant: every rank draws the same Q */
  e->run = nparts > 0 ? (dt__ef_run *)dt__calloc((size_t)nparts * sizeof(dt__ef_run)) : NULL;
  if (nparts > 0 && !e->run) goto nomem;
  e->nrun = nparts;
  for (int i = 0; i < nparts; i++) {
    dt__ef_run *u = &e->run[i];
    u->off = parts[i].off, u->rows = parts[i].rows, u->cols = parts[i].cols;
    size_t m = u->rows * u->cols;
    if (u->off > n || m > n - u->off || (i > 0 && u->off < e->run[i - 1].off + e->run[i - 1].rows * e->run[i - 1].cols)) {
      size_t off = u->off;
      dt__ef_destroy(e);
      return dt__error(DTRAIN_ERR_INVALID_ARG, "compress: part %d [%zu, +%zu) out of order or past %zu floats", i,
                       off, m, n);
    }
    e->ntrain += m;
    if (c.kind != DTRAIN_COMPRESS_POWERSGD) continue;
    u->r = dt__ef_lowrank(c.rank, u->rows, u->cols, lowrank_all);
    u->poff = e->npack;
    e->npack += u->r ? u->rows * u->r : m;
    u->qoff = e->nq;
    e->nq += u->cols * u->r;
    if (u->r) e->nqt = DT__MAX(e->nqt, u->cols * u->r), e->nrecon = DT__MAX(e->nrecon, m);
  }
  if (c.kind == DTRAIN_COMPRESS_TOPK && e->ntrain > 0) {
    double want = (double)c.fraction * (double)e->ntrain; /* less float's rounding of F: 0.3f x 10 is 3 */
    e->k = (size_t)ceil(want - want * 1e-7);
    e->k = DT__MAX(e->k, (size_t)1);
    e->k = DT__MIN(e->k, e->ntrain);
  }
  e->err = (float *)dt__calloc(dt__ef_vbytes(e));
  e->next = (float *)dt__calloc(dt__ef_vbytes(e));
  if (!e->err || !e->next) goto nomem;
  if (e->ntrain && c.kind == DTRAIN_COMPRESS_TOPK) {
    e->key = (float *)dt__calloc(e->ntrain * sizeof(float));
    e->msg = (float *)dt__calloc((size_t)e->W * 2 * e->k * sizeof(float));
    if (!e->key || !e->msg) goto nomem;
  }
  if (e->npack && !(e->pack = (float *)dt__calloc(e->npack * sizeof(float)))) goto nomem;
  if (e->nq && !(e->q = (float *)dt__calloc(e->nq * sizeof(float)))) goto nomem;
  if (e->nq && !(e->qloc = (float *)dt__calloc(e->nq * sizeof(float)))) goto nomem;
  if (e->nqt && !(e->qt = (float *)dt__calloc(e->nqt * sizeof(float)))) goto nomem;
  if (e->nrecon && !(e->recon = (float *)dt__calloc(e->nrecon * sizeof(float)))) goto nomem;
  for (int i = 0; i < e->nrun; i++) /* zero columns: drawn */
    for (size_t j = 0; j < e->run[i].r; j++) dt__ef_norm_col(e, e->q + e->run[i].qoff, e->run[i].cols, e->run[i].r, j);
  *out = e;
  return DTRAIN_OK;
nomem:
  dt__ef_destroy(e);
  return dt__error(DTRAIN_ERR_NOMEM, "compress %s: out of memory for the error feedback state", dt_compress_name(c));
}

DTRAIN_PRIVATE dt_result dt__ef_create_params(dt_compress c, const dt_params *P, int W, dt__ef **out) {
  int np = dt_params_count(P), n = 0;
  *out = NULL;
  dt__ef_part *parts = (dt__ef_part *)dt__calloc((size_t)(np > 0 ? np : 1) * sizeof(dt__ef_part));
  if (!parts) return dt__error(DTRAIN_ERR_NOMEM, "compress %s: out of memory", dt_compress_name(c));
  for (int i = 0; i < np; i++) {
    size_t b = 0, e = 0;
    int tr = 0, dec = 0;
    if (!dt__params_range(P, i, &b, &e, &tr, &dec)) break;
    if (!tr || e == b) continue;
    parts[n].off = b;
    dt__ef_param_matrix(P, i, &parts[n].rows, &parts[n].cols);
    n++;
  }
  dt_result rc = dt__ef_create(c, dt_params_size(P), parts, n, W, 0, out);
  dt__free(parts, (size_t)(np > 0 ? np : 1) * sizeof(dt__ef_part));
  return rc;
}

DTRAIN_PRIVATE void dt__ef_commit(dt__ef *e) {
  if (!e || !e->next_ok) return;
  float *t = e->err;
  e->err = e->next;
  e->next = t;
  e->next_ok = 0;
}

DTRAIN_PRIVATE void dt__ef_reset(dt__ef *e) {
  if (!e) return;
  memset(e->err, 0, e->n * sizeof(float));
  memset(e->next, 0, e->n * sizeof(float));
  e->next_ok = 0;
}

DTRAIN_PRIVATE const float *dt__ef_error(const dt__ef *e) { return e ? e->err : NULL; }

/* ---- top-k --------------------------------------------------------------------------- */

/* The value of rank `want` (0-based, ascending) of a[0, n): a[] reordered.
 * Hoare partitions around a median of three; equal keys split evenly. */
DTRAIN_PRIVATE float dt__ef_select(float *a, size_t n, size_t want) {
  int64_t lo = 0, hi = (int64_t)n - 1, w = (int64_t)want;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    float x = a[lo], y = a[mid], z = a[hi];
    float p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (a[i] < p) i++;
      while (a[j] > p) j--;
      if (i <= j) {
        float t = a[i];
        a[i] = a[j];
        a[j] = t;
        i++;
        j--;
      }
    }
    if (w <= j) hi = j;
    else if (w >= i) lo = i;
    else return a[w]; /* between j and i: equal to the pivot */
  }
  return a[w];
}

DTRAIN_PRIVATE void dt__ef_put_u32(float *slots, size_t i, uint32_t v) {
  unsigned char *b = (unsigned char *)slots + 4 * i;
  b[0] = (unsigned char)(v & 0xFFu), b[1] = (unsigned char)((v >> 8) & 0xFFu);
  b[2] = (unsigned char)((v >> 16) & 0xFFu), b[3] = (unsigned char)(v >> 24);
}

DTRAIN_PRIVATE uint32_t dt__ef_get_u32(const float *slots, size_t i) {
  const unsigned char *b = (const unsigned char *)slots + 4 * i;
  return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

/* The keys of next's trained values into key (train order); 0 if any is not finite. */
static int dt__ef_topk_keys(dt__ef *e) {
  float *DT__RESTRICT key = e->key;
  const float *DT__RESTRICT nx = e->next;
  int finite = 1;
  for (int p = 0; p < e->nrun; p++) {
    const dt__ef_run *u = &e->run[p];
    const float *v = nx + u->off;
    const size_t m = u->rows * u->cols;
    for (size_t i = 0; i < m; i++) {
      float a = fabsf(v[i]);
      finite &= a <= FLT_MAX;
      key[i] = a <= FLT_MAX ? a : INFINITY; /* NaN counts as Inf: sent first */
    }
    key += m;
  }
  return finite;
}

/* The k-th largest key (key[] is reordered). A sample of about 2048 keys
 * gives a threshold that some 2k of them should reach; when at least k keys
 * reach it the k-th largest is among them, and only they are searched (the
 * same answer as searching all). *above: the keys greater than it. */
static float dt__ef_kth(dt__ef *e, size_t *above) {
  float *key = e->key;
  size_t n = e->ntrain, k = e->k, c = n;
  float thr;
  if (n >= 8 * DT__EF_SAMPLE && k <= n / 8) {
    size_t step = n / DT__EF_SAMPLE, ns = 0;
    for (size_t i = 0; i < n && ns < DT__EF_SAMPLE; i += step) e->sample[ns++] = key[i];
    size_t want = (size_t)(2.0 * (double)k / (double)n * (double)ns) + 8;
    if (want < ns) {
      float lo = dt__ef_select(e->sample, ns, ns - want);
      c = 0;
      for (size_t i = 0; i < n; i++) /* in place: c <= i */
        if (key[i] >= lo) key[c++] = key[i];
      if (c < k) { /* the sample missed: every key again */
        dt__ef_topk_keys(e);
        c = n;
      }
    }
  }
  thr = dt__ef_select(key, c, c - k);
  *above = 0;
  for (size_t i = 0; i < c; i++) *above += key[i] > thr;
  return thr;
}

/* This rank's message into m: g + e staged in next, its k largest sent (and zeroed there). */
DTRAIN_PRIVATE void dt__ef_topk_encode(dt__ef *e, const float *buf, float *m) {
  const size_t k = e->k;
  float *DT__RESTRICT key = e->key;
  int finite = 1;
  for (int p = 0; p < e->nrun; p++) { /* next = g + e and the keys in one pass (as dt__ef_topk_keys) */
    const size_t b = e->run[p].off, len = e->run[p].rows * e->run[p].cols;
    const float *DT__RESTRICT g = buf + b, *DT__RESTRICT er = e->err + b;
    float *DT__RESTRICT nx = e->next + b;
    for (size_t i = 0; i < len; i++) {
      float v = g[i] + er[i], a = fabsf(v);
      nx[i] = v;
      finite &= a <= FLT_MAX;
      key[i] = a <= FLT_MAX ? a : INFINITY;
    }
    key += len;
  }
  size_t above;
  const float thr = dt__ef_kth(e, &above);
  size_t ties = k - above, got = 0; /* of the values equal to thr, the first `ties` go */
  float *DT__RESTRICT nx = e->next;
  for (int p = 0; p < e->nrun; p++) {
    const dt__ef_run *u = &e->run[p];
    for (size_t i = u->off; i < u->off + u->rows * u->cols; i++) {
      float v = nx[i], a = fabsf(v), kv = a <= FLT_MAX ? a : INFINITY;
      if (kv < thr) continue;
      if (kv == thr) {
        if (ties == 0) continue;
        ties--;
      }
      dt__ef_put_u32(m, got, (uint32_t)i);
      m[k + got] = v;
      nx[i] = 0.0f;
      got++;
    }
  }
  /* the error kept is finite when g + e was, or when every non-finite value went */
  if (!finite) {
    finite = 1;
    for (int p = 0; p < e->nrun; p++)
      for (size_t i = e->run[p].off; i < e->run[p].off + e->run[p].rows * e->run[p].cols; i++)
        finite &= isfinite(nx[i]) != 0;
  }
  e->next_ok = finite && got == k;
}

/* Rank `from`'s message added into buf. DTRAIN_ERR_PROTOCOL for indices that
 * do not rise or are not of a trained value. */
DTRAIN_PRIVATE dt_result dt__ef_topk_add(const dt__ef *e, const float *m, int from, float *buf) {
  int p = 0;
  uint32_t prev = 0;
  for (size_t j = 0; j < e->k; j++) {
    uint32_t i = dt__ef_get_u32(m, j);
    if (j > 0 && i <= prev)
      return dt__error(DTRAIN_ERR_PROTOCOL, "top-k gradient message from rank %d: index %u after %u (they must rise)",
                       from, i, prev);
    while (p < e->nrun && (size_t)i >= e->run[p].off + e->run[p].rows * e->run[p].cols) p++;
    if (p == e->nrun || (size_t)i < e->run[p].off)
      return dt__error(DTRAIN_ERR_PROTOCOL, "top-k gradient message from rank %d: index %u is not a trained value "
                       "(of %zu floats)", from, i, e->n);
    buf[i] += m[e->k + j];
    prev = i;
  }
  return DTRAIN_OK;
}

static dt_result dt__ef_topk(dt__ef *e, dt_comm *x, int rank, float *buf, uint64_t *sent) {
  const int W = e->W;
  const size_t slots = 2 * e->k;
  dt__ef_topk_encode(e, buf, e->msg + (size_t)rank * slots);
  /* all-gather: at step s send rank-s's message on, receive rank-s-1's */
  const int to = (rank + 1) % W, from = (rank + W - 1) % W;
  dt_result rc = DTRAIN_OK;
  for (int s = 0; s < W - 1 && rc == DTRAIN_OK; s++) {
    int cs = (rank - s + W) % W, cr = (rank - s - 1 + W) % W;
    rc = dt__cring_swap(x, rank, to, from, e->msg + (size_t)cs * slots, slots, e->msg + (size_t)cr * slots, slots);
    *sent += slots * sizeof(float);
  }
  if (rc != DTRAIN_OK) {
    e->next_ok = 0;
    return rc;
  }
  for (int p = 0; p < e->nrun; p++)
    memset(buf + e->run[p].off, 0, e->run[p].rows * e->run[p].cols * sizeof(float));
  for (int w = 0; w < W && rc == DTRAIN_OK; w++) rc = dt__ef_topk_add(e, e->msg + (size_t)w * slots, w, buf);
  if (rc != DTRAIN_OK) e->next_ok = 0;
  return rc;
}

/* ---- PowerSGD ------------------------------------------------------------------------ */

/* P (rows x r) = M (rows x cols) Q (cols x r), all row-major (this rank's
 * part of a sum: the kernel may differ between hosts). */
static void dt__ef_mq(const float *M, const float *Q, float *P, size_t rows, size_t cols, size_t r) {
  dt_sgemm(0, 0, (int64_t)rows, (int64_t)r, (int64_t)cols, 1.0f, M, (int64_t)cols, Q, (int64_t)r, 0.0f, P, (int64_t)r);
}

/* Q (cols x r) = M^T P (likewise summed afterwards). */
static void dt__ef_mtp(const float *M, const float *P, float *Q, size_t rows, size_t cols, size_t r) {
  dt_sgemm(1, 0, (int64_t)cols, (int64_t)r, (int64_t)rows, 1.0f, M, (int64_t)cols, P, (int64_t)r, 0.0f, Q, (int64_t)r);
}

/* out (rows x cols) = P Q^T with Qt = Q^T (r x cols): plain C, the terms
 * added in j order, so that every rank makes the same floats from the same
 * P and Q whatever its CPU's GEMM kernel. */
static void dt__ef_pqt(const float *P, const float *Qt, float *out, size_t rows, size_t cols, size_t r) {
  for (size_t i = 0; i < rows; i++) {
    float *o = out + i * cols;
    for (size_t c = 0; c < cols; c++) o[c] = 0.0f;
    for (size_t j = 0; j < r; j++) {
      const float p = P[i * r + j], *q = Qt + j * cols;
      for (size_t c = 0; c < cols; c++) o[c] += p * q[c];
    }
  }
}

static void dt__ef_transpose(const float *Q, float *Qt, size_t cols, size_t r) {
  for (size_t c = 0; c < cols; c++)
    for (size_t j = 0; j < r; j++) Qt[j * cols + c] = Q[c * r + j];
}

DTRAIN_PRIVATE void dt__ef_expand(const float *P, const float *Q, float *out, size_t rows, size_t cols, size_t r,
                                  float *qt) {
  dt__ef_transpose(Q, qt, cols, r);
  dt__ef_pqt(P, qt, out, rows, cols, r);
}

/* The columns of P (rows x r) made orthonormal, in order (modified
 * Gram-Schmidt, sums in double). A column left with less than 1e-6 of its
 * length (in the span of those before it) becomes zero; a non-finite one
 * stays as it is, so that the step's numerics check sees it. */
static void dt__ef_orthonormalise(float *P, size_t rows, size_t r) {
  for (size_t j = 0; j < r; j++) {
    double before = 0.0;
    for (size_t i = 0; i < rows; i++) before += (double)P[i * r + j] * (double)P[i * r + j];
    for (size_t l = 0; l < j; l++) {
      double d = 0.0;
      for (size_t i = 0; i < rows; i++) d += (double)P[i * r + l] * (double)P[i * r + j];
      for (size_t i = 0; i < rows; i++) P[i * r + j] -= (float)d * P[i * r + l];
    }
    double ss = 0.0;
    for (size_t i = 0; i < rows; i++) ss += (double)P[i * r + j] * (double)P[i * r + j];
    if (!isfinite(ss)) continue;
    float s = ss > 1e-12 * before && ss > 0.0 ? (float)(1.0 / sqrt(ss)) : 0.0f;
    for (size_t i = 0; i < rows; i++) P[i * r + j] *= s;
  }
}

/* M = g + e, staged in next; P = M Q (or the values) into the pack. */
static void dt__ef_psgd_p(dt__ef *e, const float *buf) {
  e->next_ok = 0;
  for (int p = 0; p < e->nrun; p++) {
    const dt__ef_run *u = &e->run[p];
    size_t m = u->rows * u->cols;
    if (!u->r) {
      memcpy(e->pack + u->poff, buf + u->off, m * sizeof(float));
      continue;
    }
    float *M = e->next + u->off;
    for (size_t i = 0; i < m; i++) M[i] = buf[u->off + i] + e->err[u->off + i];
    dt__ef_mq(M, e->q + u->qoff, e->pack + u->poff, u->rows, u->cols, u->r);
  }
}

/* P (summed) orthonormalised; Q = M^T P, this rank's, also kept in qloc. */
static void dt__ef_psgd_q(dt__ef *e) {
  for (int p = 0; p < e->nrun; p++) {
    const dt__ef_run *u = &e->run[p];
    if (!u->r) continue;
    dt__ef_orthonormalise(e->pack + u->poff, u->rows, u->r);
    dt__ef_mtp(e->next + u->off, e->pack + u->poff, e->q + u->qoff, u->rows, u->cols, u->r);
  }
  if (e->nq) memcpy(e->qloc, e->q, e->nq * sizeof(float));
}

/* With Q summed: out (when not NULL) gets the sum, ~ P Q^T (the values of
 * parts sent as floats); e = M - P Q_local^T (what this rank's part lost);
 * then Q is normalised for the next step. */
static void dt__ef_psgd_finish(dt__ef *e, float *out) {
  int finite = 1;
  for (int p = 0; p < e->nrun; p++) {
    const dt__ef_run *u = &e->run[p];
    if (!u->r) {
      if (out) memcpy(out + u->off, e->pack + u->poff, u->rows * u->cols * sizeof(float));
      continue;
    }
    const float *P = e->pack + u->poff;
    float *M = e->next + u->off;
    size_t m = u->rows * u->cols;
    if (out) dt__ef_expand(P, e->q + u->qoff, out + u->off, u->rows, u->cols, u->r, e->qt);
    dt__ef_expand(P, e->qloc + u->qoff, e->recon, u->rows, u->cols, u->r, e->qt); /* this rank's part as the sum holds it */
    for (size_t i = 0; i < m; i++) {
      float d = M[i] - e->recon[i];
      M[i] = d;
      finite &= isfinite(d) != 0;
    }
    for (size_t j = 0; j < u->r; j++) dt__ef_norm_col(e, e->q + u->qoff, u->cols, u->r, j);
  }
  e->next_ok = finite;
}

static dt_result dt__ef_powersgd(dt__ef *e, dt_comm *x, int rank, float *buf, uint64_t *sent) {
  dt__ef_psgd_p(e, buf);
  dt_result rc = dt_comm_allreduce(x, rank, e->pack, e->npack);
  *sent += dt__ring_bytes(e->npack, e->W);
  if (rc != DTRAIN_OK) return rc;
  dt__ef_psgd_q(e);
  if (e->nq) {
    rc = dt_comm_allreduce(x, rank, e->q, e->nq);
    *sent += dt__ring_bytes(e->nq, e->W);
    if (rc != DTRAIN_OK) return rc;
  }
  dt__ef_psgd_finish(e, buf);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__ef_local(dt__ef *e, const float *buf) {
  e->next_ok = 0;
  if (e->ntrain == 0) {
    e->next_ok = 1;
    return;
  }
  if (e->c.kind == DTRAIN_COMPRESS_TOPK) {
    dt__ef_topk_encode(e, buf, e->msg);
    return;
  }
  dt__ef_psgd_p(e, buf);
  dt__ef_psgd_q(e);
  dt__ef_psgd_finish(e, NULL);
}

DTRAIN_PRIVATE size_t dt__ef_topk_count(const dt__ef *e) { return e->ntrain ? e->k : 0; }

DTRAIN_PRIVATE void dt__ef_topk_entry(const dt__ef *e, size_t j, uint32_t *index, float *value) {
  *index = dt__ef_get_u32(e->msg, j);
  *value = e->msg[e->k + j];
}

DTRAIN_PRIVATE const float *dt__ef_factors(const dt__ef *e, int part, size_t *r, const float **Q) {
  const dt__ef_run *u = &e->run[part];
  *r = u->r;
  *Q = u->r ? e->qloc + u->qoff : NULL;
  return e->pack + u->poff;
}

DTRAIN_PRIVATE dt_result dt__ef_allreduce(dt__ef *e, dt_comm *x, int rank, float *buf, uint64_t *sent) {
  e->next_ok = 0;
  if (e->W < 2 || e->ntrain == 0) return DTRAIN_OK; /* nothing crosses a wire: the sum is this rank's gradient */
  return e->c.kind == DTRAIN_COMPRESS_TOPK ? dt__ef_topk(e, x, rank, buf, sent) : dt__ef_powersgd(e, x, rank, buf, sent);
}

#undef DT__EF_SAMPLE
#endif /* DTRAIN_NO_DIST */
