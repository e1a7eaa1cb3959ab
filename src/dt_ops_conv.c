/* ===========================================================================
 * dt_ops_conv.c -- 2-D convolution, NCHW: im2col + GEMM, and dt_conv2d
 * ===========================================================================
 * Convolution: for a group of nb images the column matrix col [K, nb*P]
 * (K = C*kh*kw rows, P = Ho*Wo output positions per image, images side by
 * side) is built in arena scratch, and out [O, nb*P] = w [O,K] @ col. nb is
 * picked from the shapes alone (enough columns for an efficient GEMM, scratch
 * capped), so results are deterministic. Backward recomputes col per group
 * instead of keeping it for the whole batch:
 *   gw [O,K]    += gy [O, nb*P] @ col^T
 *   gcol [K,nb*P] = w^T @ gy,  then col2im accumulates gcol into gx
 *   gb [O]      += sum of gy over images and positions
 * A 1x1 kernel with stride 1, padding 0 and nb == 1 uses x itself as col.
 * 5x5 kernels with stride 1 and at least 8 channels in and out use
 * Winograd F(2x2, 5x5) instead (dt_ops_wino.c): 2.8x fewer multiplications.
 * Pooling is in dt_ops_pool.c.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_ops_conv.h"
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__CONV_SSE 1
#  include <emmintrin.h>
#endif


/* Grouping: images are put side by side only while an image has fewer than
 * DT__CONV_COLS output positions (a B panel of the GEMM was 192 wide), and only
 * as far as the column matrix stays within DT__CONV_CAP floats (1 MiB, a
 * typical L2 cache): the matrix im2col writes is read back by the GEMM's
 * packing while it is still in cache, and with one image per GEMM the
 * output and its gradient need no reordering copies. */
#define DT__CONV_COLS 192
#define DT__CONV_CAP (1 << 18)

/* The geometry (dt__conv_geom, dt_ops_conv.h) from the tensors and the saved
 * stride and padding. */
static void dt__conv_geometry(dt__conv_geom *q, const dt_tensor *x, const dt_tensor *w, int64_t s, int64_t p) {
  q->n = x->shape[0];
  q->c = x->shape[1];
  q->h = x->shape[2];
  q->w = x->shape[3];
  q->o = w->shape[0];
  q->kh = w->shape[2];
  q->kw = w->shape[3];
  q->s = s;
  q->p = p;
  q->ho = (q->h + 2 * p - q->kh) / s + 1;
  q->wo = (q->w + 2 * p - q->kw) / s + 1;
  q->k = q->c * q->kh * q->kw;
  q->pp = q->ho * q->wo;
  int64_t rows = DT__MAX(q->k, q->o), nb = 1;
  if (q->pp < DT__CONV_COLS) nb = (DT__CONV_COLS + q->pp - 1) / q->pp;
  if (nb > q->n) nb = q->n;
  if (nb > 1 && nb * rows * q->pp > DT__CONV_CAP) nb = DT__MAX(1, DT__CONV_CAP / (rows * q->pp));
  q->nb = nb;
  q->direct = q->kh == 1 && q->kw == 1 && s == 1 && p == 0 && nb == 1;
}

/* Output columns ow in [lo,hi) read input column ow*s - p + kj inside [0, w). */
static void dt__conv_range(const dt__conv_geom *q, int64_t kj, int64_t *lo, int64_t *hi) {
  int64_t a = q->p - kj, b = q->w - 1 + q->p - kj;
  int64_t l = a > 0 ? (a + q->s - 1) / q->s : 0;
  int64_t h = b >= 0 ? b / q->s + 1 : 0;
  if (h > q->wo) h = q->wo;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* Output rows oh in [lo,hi) read input row oh*s - p + ki inside [0, h). */
static void dt__conv_rows(const dt__conv_geom *q, int64_t ki, int64_t *lo, int64_t *hi) {
  int64_t a = q->p - ki, b = q->h - 1 + q->p - ki;
  int64_t l = a > 0 ? (a + q->s - 1) / q->s : 0;
  int64_t h = b >= 0 ? b / q->s + 1 : 0;
  if (h > q->ho) h = q->ho;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* Zero n floats; n is usually tiny (the padding width), where a loop that
 * the compiler turns into a memset call costs more than the stores. */
static void dt__conv_zero_short(float *d, int64_t n) {
  if (n > 4) {
    memset(d, 0, (size_t)n * sizeof(float));
    return;
  }
  if (n > 0) d[0] = 0.0f;
  if (n > 1) d[1] = 0.0f;
  if (n > 2) d[2] = 0.0f;
  if (n > 3) d[3] = 0.0f;
}

/* Column matrix of one image x [C,H,W]: row (c,ki,kj), column oh*Wo+ow holds
 * x[c, oh*s-p+ki, ow*s-p+kj] (0 in the padding); rows are ld floats apart.
 * Rows of the output that fall in the padding are zeroed in one go. With
 * stride 1 and Wo == W (a "same" convolution) the valid part of a column row
 * is one contiguous span of x: it is copied with one memcpy and the few
 * entries that wrapped around from the neighbouring input rows are zeroed,
 * instead of one short copy per output row. */
static void dt__conv_im2col(const dt__conv_geom *q, const float *x, float *col, int64_t ld) {
  int64_t r = 0, wo = q->wo, span = q->s == 1 && q->wo == q->w;
  for (int64_t c = 0; c < q->c; c++) {
    for (int64_t ki = 0; ki < q->kh; ki++) {
      int64_t rlo, rhi;
      dt__conv_rows(q, ki, &rlo, &rhi);
      for (int64_t kj = 0; kj < q->kw; kj++, r++) {
        float *row = col + r * ld;
        int64_t lo, hi, off = kj - q->p;
        dt__conv_range(q, kj, &lo, &hi);
        if (lo == hi || rlo == rhi) {
          memset(row, 0, (size_t)(q->ho * wo) * sizeof(float));
          continue;
        }
        if (rlo > 0) memset(row, 0, (size_t)(rlo * wo) * sizeof(float));
        if (rhi < q->ho) memset(row + rhi * wo, 0, (size_t)((q->ho - rhi) * wo) * sizeof(float));
        const float *plane = x + c * q->h * q->w;
        if (span) {
          const float *src = plane + (rlo - q->p + ki) * q->w + lo + off;
          memcpy(row + rlo * wo + lo, src, (size_t)((rhi - rlo - 1) * wo + hi - lo) * sizeof(float));
          /* The gap between two rows' valid parts is contiguous: [hi, wo) of
           * one row and [0, lo) of the next, |off| floats. */
          dt__conv_zero_short(row + rlo * wo, lo);
          for (int64_t oh = rlo; oh < rhi; oh++)
            dt__conv_zero_short(row + oh * wo + hi, wo - hi + (oh + 1 < rhi ? lo : 0));
          continue;
        }
        for (int64_t oh = rlo; oh < rhi; oh++) {
          float *dst = row + oh * wo;
          const float *src = plane + (oh * q->s - q->p + ki) * q->w;
          for (int64_t ow = 0; ow < lo; ow++) dst[ow] = 0.0f;
          if (q->s == 1) memcpy(dst + lo, src + lo + off, (size_t)(hi - lo) * sizeof(float));
          else for (int64_t ow = lo; ow < hi; ow++) dst[ow] = src[ow * q->s + off];
          for (int64_t ow = hi; ow < wo; ow++) dst[ow] = 0.0f;
        }
      }
    }
  }
}

/* Adjoint of im2col: gx [C,H,W] += the column gradient gcol (rows ld apart).
 * gcol is scratch: in the span case (stride 1, Wo == W, see im2col) the
 * entries that would wrap around to neighbouring input rows are zeroed in
 * gcol first, so that each column row adds to gx as one contiguous span. */
static void dt__conv_col2im(const dt__conv_geom *q, float *gcol, int64_t ld, float *gx) {
  int64_t r = 0, wo = q->wo, span = q->s == 1 && q->wo == q->w;
  for (int64_t c = 0; c < q->c; c++) {
    for (int64_t ki = 0; ki < q->kh; ki++) {
      int64_t rlo, rhi;
      dt__conv_rows(q, ki, &rlo, &rhi);
      for (int64_t kj = 0; kj < q->kw; kj++, r++) {
        float *row = gcol + r * ld;
        int64_t lo, hi, off = kj - q->p;
        dt__conv_range(q, kj, &lo, &hi);
        if (lo == hi || rlo == rhi) continue;
        float *plane = gx + c * q->h * q->w;
        if (span) {
          for (int64_t oh = rlo; oh + 1 < rhi; oh++) dt__conv_zero_short(row + oh * wo + hi, wo - hi + lo);
          float *dst = plane + (rlo - q->p + ki) * q->w + lo + off;
          dt__vec_add(dst, dst, row + rlo * wo + lo, (size_t)((rhi - rlo - 1) * wo + hi - lo));
          continue;
        }
        for (int64_t oh = rlo; oh < rhi; oh++) {
          const float *src = row + oh * wo;
          float *dst = plane + (oh * q->s - q->p + ki) * q->w;
          if (q->s == 1) dt__vec_add(dst + lo + off, dst + lo + off, src + lo, (size_t)(hi - lo));
          else for (int64_t ow = lo; ow < hi; ow++) dst[ow * q->s + off] += src[ow];
        }
      }
    }
  }
}

/* The bias gradient of output channels [lo, hi): each channel alone, so
 * dt__par_range may cut the channels over the intra-op threads. With y
 * (dt_conv2d_relu) the gradient is first masked in place where y <= 0
 * (dt_relu_inplace's backward, the same steps), in the same pass; gb may
 * then be NULL (no bias gradient wanted). The gradient is walked in memory
 * order, image by image, DT__CONV_BIAS_CH channels' sums at a time. */
#define DT__CONV_BIAS_CH 64
typedef struct dt__conv_bias_job {
  float *go;
  const float *y;
  float *gb;
  int64_t n, pp, op;
} dt__conv_bias_job;

static void dt__conv_bias_range(void *arg, int64_t lo, int64_t hi) {
  const dt__conv_bias_job *bj = (const dt__conv_bias_job *)arg;
  /* In double, in four interleaved partial sums per channel (a fixed
   * order): one dependent chain of double adds would take most of this
   * function. */
  double acc[DT__CONV_BIAS_CH][4];
  for (int64_t o0 = lo; o0 < hi; o0 += DT__CONV_BIAS_CH) {
    int64_t o1 = DT__MIN(hi, o0 + DT__CONV_BIAS_CH);
    memset(acc, 0, sizeof acc);
    for (int64_t n = 0; n < bj->n; n++) {
      for (int64_t o = o0; o < o1; o++) {
        float *r = bj->go + n * bj->op + o * bj->pp;
        const float *yr = bj->y ? bj->y + n * bj->op + o * bj->pp : NULL;
        if (!bj->gb) {
          dt__relu_mask_rows(r, yr, 1, bj->pp, NULL);
          continue;
        }
        double *s = acc[o - o0];
        int64_t i = 0;
#ifdef DT__CONV_SSE
        /* The same four sums, two per register (lanes: s0 s1 | s2 s3). */
        __m128d a01 = _mm_loadu_pd(s), a23 = _mm_loadu_pd(s + 2);
        const __m128 z = _mm_setzero_ps();
        for (; i + 4 <= bj->pp; i += 4) {
          __m128 v = _mm_loadu_ps(r + i);
          if (yr) { /* keep where y > 0 or NaN, + 0 (dt__relu_mask_rows) */
            v = _mm_add_ps(_mm_and_ps(_mm_cmpnle_ps(_mm_loadu_ps(yr + i), z), v), z);
            _mm_storeu_ps(r + i, v);
          }
          a01 = _mm_add_pd(a01, _mm_cvtps_pd(v));
          a23 = _mm_add_pd(a23, _mm_cvtps_pd(_mm_movehl_ps(v, v)));
        }
        for (; i < bj->pp; i++) {
          if (yr) r[i] = yr[i] <= 0.0f ? 0.0f : r[i] + 0.0f;
          a01 = _mm_add_sd(a01, _mm_set_sd((double)r[i]));
        }
        _mm_storeu_pd(s, a01);
        _mm_storeu_pd(s + 2, a23);
#else
        if (yr) dt__relu_mask_rows(r, yr, 1, bj->pp, NULL);
        for (; i + 4 <= bj->pp; i += 4) {
          s[0] += (double)r[i];
          s[1] += (double)r[i + 1];
          s[2] += (double)r[i + 2];
          s[3] += (double)r[i + 3];
        }
        for (; i < bj->pp; i++) s[0] += (double)r[i];
#endif
      }
    }
    if (bj->gb)
      for (int64_t o = o0; o < o1; o++) {
        const double *s = acc[o - o0];
        bj->gb[o] += (float)((s[0] + s[1]) + (s[2] + s[3]));
      }
  }
}

/* dt_conv2d's backward, and with relu dt_conv2d_relu's: y's gradient is
 * final when this node runs (as in dt_relu_inplace's backward), so it is
 * masked where it stands, in the bias sum's pass (dt__conv_bias_range). */
static void dt__conv_grads(dt_graph *g, dt_tensor *y, int relu) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, y->iaux[0], y->iaux[1]);
  const float *go = y->grad;
  int64_t chw = q.c * q.h * q.w, op = q.o * q.pp, cols = q.nb * q.pp;
  if (gb || relu) {
    dt__conv_bias_job bj = {y->grad, relu ? y->data : NULL, gb, q.n, q.pp, op};
    if (q.n * op >= ((int64_t)1 << 19)) /* gradient elements above which two threads pay */
      dt__par_range(q.o, 1, 1, dt__conv_bias_range, &bj);
    else
      dt__conv_bias_range(&bj, 0, q.o);
  }
  if (!gx && !gw) return;
  if (dt__wino_use(&q)) {
    dt__wino_backward(g, &q, x->data, w->data, go, gx, gw);
    return;
  }
  dt__arena_pos scratch = dt__arena_mark(g); /* the columns and the regrouped gradient: this call's only */
  float *col = NULL, *gcol = NULL, *gyt = NULL;
  if (gw && !q.direct) col = dt__arena_floats(g, q.k * cols);
  if (gx && !q.direct) gcol = dt__arena_floats(g, q.k * cols);
  if (q.nb > 1) gyt = dt__arena_floats(g, q.o * cols);
  if (g->err != DTRAIN_OK) return;
  for (int64_t n0 = 0; n0 < q.n; n0 += q.nb) {
    int64_t nbb = DT__MIN(q.nb, q.n - n0), ld = nbb * q.pp;
    const float *gy = go + n0 * op;
    if (q.nb > 1) {
      for (int64_t j = 0; j < nbb; j++)
        for (int64_t o = 0; o < q.o; o++)
          memcpy(gyt + o * ld + j * q.pp, go + (n0 + j) * op + o * q.pp, (size_t)q.pp * sizeof(float));
      gy = gyt;
    }
    if (gw) {
      const float *cp = x->data + n0 * chw;
      if (!q.direct) {
        for (int64_t j = 0; j < nbb; j++) dt__conv_im2col(&q, x->data + (n0 + j) * chw, col + j * q.pp, ld);
        cp = col;
      }
      dt_sgemm(0, 1, q.o, q.k, ld, 1.0f, gy, ld, cp, ld, 1.0f, gw, q.k);
    }
    if (gx) {
      if (q.direct) {
        dt_sgemm(1, 0, q.k, ld, q.o, 1.0f, w->data, q.k, gy, ld, 1.0f, gx + n0 * chw, ld);
      } else {
        dt_sgemm(1, 0, q.k, ld, q.o, 1.0f, w->data, q.k, gy, ld, 0.0f, gcol, ld);
        for (int64_t j = 0; j < nbb; j++) dt__conv_col2im(&q, gcol + j * q.pp, ld, gx + (n0 + j) * chw);
      }
    }
  }
  dt__arena_release(g, scratch);
}

static void dt__conv_backward(dt_graph *g, dt_tensor *y) { dt__conv_grads(g, y, 0); }
static void dt__conv_relu_backward(dt_graph *g, dt_tensor *y) { dt__conv_grads(g, y, 1); }

/* The forward pass one image at a time (no grouping, nb == 1, through
 * columns): each part of the batch has its own column buffer and computes
 * its images in order (im2col, then the product with its epilogue). Where each image's product
 * is too small for dt_sgemm to split (below about a million multiply-adds:
 * a layer with few input channels on a large image, the CNN's first), the
 * images go to the intra-op threads instead, each computed exactly as on
 * one thread, so the output is the same bits. Returns 0 (nothing done)
 * for grouped or direct layers, 1 when it ran (or the arena failed:
 * g->err says). */
typedef struct dt__conv_fwd_job {
  const dt__conv_geom *q;
  const float *x, *w;
  const dt__gemm_epi *ep;
  float *y, *col;
} dt__conv_fwd_job;

static void dt__conv_fwd_part(void *arg, int part, int nparts) {
  const dt__conv_fwd_job *j = (const dt__conv_fwd_job *)arg;
  const dt__conv_geom *q = j->q;
  int64_t chw = q->c * q->h * q->w, op = q->o * q->pp;
  float *col = j->col + (int64_t)part * q->k * q->pp;
  for (int64_t n = q->n * part / nparts; n < q->n * (part + 1) / nparts; n++) {
    float *out = j->y + n * op;
    dt__conv_im2col(q, j->x + n * chw, col, q->pp);
    dt__sgemm_epi(0, 0, q->o, q->pp, q->k, j->w, q->k, col, q->pp, out, q->pp, j->ep);
  }
}

static int dt__conv_forward_images(dt_graph *g, const dt__conv_geom *q, const dt_tensor *x, const dt_tensor *w,
                                   const dt__gemm_epi *ep, dt_tensor *y) {
  if (q->nb != 1 || q->direct) return 0;
  int t = dt__par_threads(), small = (double)q->o * (double)q->pp * (double)q->k < (double)(1 << 20);
  int parts = t > 1 && small ? (int)DT__MIN((int64_t)t, q->n) : 1;
  dt__arena_pos scratch = dt__arena_mark(g); /* the columns: this call's only */
  float *col = dt__arena_floats(g, (int64_t)parts * q->k * q->pp);
  if (g->err != DTRAIN_OK) return 1;
  dt__conv_fwd_job j = {q, x->data, w->data, ep, y->data, col};
  dt__par_run(parts, dt__conv_fwd_part, &j);
  dt__arena_release(g, scratch);
  return 1;
}

/* dt_conv2d, and with relu dt_conv2d_relu: the bias and the ReLU applied
 * by the GEMM's epilogue tile by tile (dt__sgemm_epi: a row of C is an
 * output channel), or by Winograd's output transform. */
static dt_tensor *dt__conv2d(dt_graph *g, const char *op, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride,
                             int padding, int relu) {
  if (b ? !dt__begin(g, op, 3, x, w, b) : !dt__begin(g, op, 2, x, w)) return NULL;
  char sx[96], sw[96], sb[96];
  dt_shape_str(x, sx, sizeof sx);
  dt_shape_str(w, sw, sizeof sw);
  if (x->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: x %s must have rank 4 [N,C,H,W]", op, sx);
  if (w->ndim != 4)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_RANK, "%s: w %s must have rank 4 [O,C,kh,kw]", op, sw);
  if (w->shape[1] != x->shape[1])
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: channels differ (x %s has %lld, w %s has %lld)", op, sx,
                                 (long long)x->shape[1], sw, (long long)w->shape[1]);
  if (b && (b->ndim != 1 || b->shape[0] != w->shape[0]))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "%s: bias %s must be [%lld] for w %s", op,
                                 dt_shape_str(b, sb, sizeof sb), (long long)w->shape[0], sw);
  if (stride < 1)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: stride %d (must be >= 1), x %s, w %s", op, stride,
                                 sx, sw);
  if (padding < 0)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: padding %d (must be >= 0), x %s, w %s", op,
                                 padding, sx, sw);
  int64_t hp = x->shape[2] + 2 * (int64_t)padding, wp = x->shape[3] + 2 * (int64_t)padding;
  if (w->shape[2] > hp || w->shape[3] > wp)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE,
                                 "%s: kernel %lldx%lld larger than the padded input %lldx%lld (x %s, w %s, padding %d)",
                                 op, (long long)w->shape[2], (long long)w->shape[3], (long long)hp, (long long)wp, sx,
                                 sw, padding);
  if (g->device) { /* on a device, two kernels */
    dt_tensor *y = dt__dev_conv2d(g, x, w, b, stride, padding);
    return relu ? dt_relu_inplace(g, y) : y;
  }
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, stride, padding);
  int64_t shape[4] = {q.n, q.o, q.ho, q.wo};
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  size_t kp;
  if (!dt__mul_size((size_t)q.k, (size_t)q.pp, &kp) || dt__too_many(kp))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrix of x %s, w %s too large", op, sx, sw);
  dt__gemm_epi ep = {NULL, relu, b ? b->data : NULL};
  if (dt__wino_use(&q)) {
    dt__wino_forward(g, &q, x->data, w->data, b ? b->data : NULL, relu, y->data);
  } else if (!dt__conv_forward_images(g, &q, x, w, &ep, y)) { /* one image at a time, or: */
    int64_t chw = q.c * q.h * q.w, op_ = q.o * q.pp, cols = q.nb * q.pp;
    dt__arena_pos scratch = dt__arena_mark(g); /* the columns: this call's only */
    float *col = q.direct ? NULL : dt__arena_floats(g, q.k * cols);
    float *tmp = q.nb > 1 ? dt__arena_floats(g, q.o * cols) : NULL;
    if (g->err != DTRAIN_OK) return NULL;
    for (int64_t n0 = 0; n0 < q.n; n0 += q.nb) {
      int64_t nbb = DT__MIN(q.nb, q.n - n0), ld = nbb * q.pp;
      const float *cp = x->data + n0 * chw;
      if (!q.direct) {
        for (int64_t j = 0; j < nbb; j++) dt__conv_im2col(&q, x->data + (n0 + j) * chw, col + j * q.pp, ld);
        cp = col;
      }
      float *out = q.nb > 1 ? tmp : y->data + n0 * op_;
      dt__sgemm_epi(0, 0, q.o, ld, q.k, w->data, q.k, cp, ld, out, ld, &ep);
      if (q.nb > 1) {
        for (int64_t j = 0; j < nbb; j++)
          for (int64_t o = 0; o < q.o; o++)
            memcpy(y->data + (n0 + j) * op_ + o * q.pp, tmp + o * ld + j * q.pp, (size_t)q.pp * sizeof(float));
      }
    }
    dt__arena_release(g, scratch);
  }
  if (g->err != DTRAIN_OK) return NULL;
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt__record(g, y, op, relu ? dt__conv_relu_backward : dt__conv_backward, x, w, b);
  return dt__finish(g, y);
}

DTRAIN_API dt_tensor *dt_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  return dt__conv2d(g, "dt_conv2d", x, w, b, stride, padding, 0);
}

DTRAIN_API dt_tensor *dt_conv2d_relu(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  return dt__conv2d(g, "dt_conv2d_relu", x, w, b, stride, padding, 1);
}

#undef DT__CONV_COLS
#undef DT__CONV_CAP
#undef DT__CONV_BIAS_CH
#ifdef DT__CONV_SSE
#  undef DT__CONV_SSE
#endif
