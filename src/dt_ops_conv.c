/* ===========================================================================
 * dt_ops_conv.c -- 2-D convolution (im2col + GEMM) and max/average pooling, NCHW
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
 * Winograd F(2x2, 5x5) instead (see below): 2.8x fewer multiplications.
 */
#include "dt_internal.h"
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__CONV_SSE 1
#  include <emmintrin.h>
#endif

#if defined(DT__CONV_SSE) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__CONV_AVX 1 /* picked at run time */
#  include <immintrin.h>
#endif

/* Grouping: images are put side by side only while an image has fewer than
 * DT__CONV_COLS output positions (the GEMM's B panel is 192 wide), and only
 * as far as the column matrix stays within DT__CONV_CAP floats (1 MiB, a
 * typical L2 cache): the matrix im2col writes is read back by the GEMM's
 * packing while it is still in cache, and with one image per GEMM the
 * output and its gradient need no reordering copies. */
#define DT__CONV_COLS 192
#define DT__CONV_CAP (1 << 18)

/* Geometry of one convolution, from the tensors and the saved parameters. */
typedef struct dt__conv_geom {
  int64_t n, c, h, w;      /* input */
  int64_t o, kh, kw;       /* weight */
  int64_t ho, wo;          /* output */
  int64_t s, p;            /* stride, padding */
  int64_t k, pp, nb;       /* K = c*kh*kw, P = ho*wo, images per GEMM */
  int direct;              /* 1x1, stride 1, padding 0, nb == 1: col is x */
} dt__conv_geom;

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

#ifdef DT__CONV_AVX
__attribute__((target("avx"))) static void dt__conv_addto_avx(float *DT__RESTRICT dst, const float *DT__RESTRICT src,
                                                              int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
  for (; i < n; i++) dst[i] += src[i];
}
#endif

/* dst[i] += src[i], 8 or 4 floats at a time (spans of a few hundred floats). */
static void dt__conv_addto(float *DT__RESTRICT dst, const float *DT__RESTRICT src, int64_t n) {
  int64_t i = 0;
#ifdef DT__CONV_AVX
  if (n >= 16 && __builtin_cpu_supports("avx")) {
    dt__conv_addto_avx(dst, src, n);
    return;
  }
#endif
#ifdef DT__CONV_SSE
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(dst + i, _mm_add_ps(_mm_loadu_ps(dst + i), _mm_loadu_ps(src + i)));
#endif
  for (; i < n; i++) dst[i] += src[i];
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
          dt__conv_addto(plane + (rlo - q->p + ki) * q->w + lo + off, row + rlo * wo + lo,
                         (rhi - rlo - 1) * wo + hi - lo);
          continue;
        }
        for (int64_t oh = rlo; oh < rhi; oh++) {
          const float *src = row + oh * wo;
          float *dst = plane + (oh * q->s - q->p + ki) * q->w;
          if (q->s == 1) dt__conv_addto(dst + lo + off, src + lo, hi - lo);
          else for (int64_t ow = lo; ow < hi; ow++) dst[ow * q->s + off] += src[ow];
        }
      }
    }
  }
}

/* ---- Winograd F(2x2, 5x5) ---------------------------------------------------------------
 * 5x5 kernels with stride 1 and enough channels (conv2 of a LeNet-style
 * CNN) run as Winograd minimal filtering: each 2x2 block of outputs (a
 * "tile") is computed from the 6x6 input patch under it as
 *   Y = A^T [ (G g G^T) (.) (B^T d B) ] A
 * (interpolation points 0, 1, -1, 2, -2 and infinity), so the channel sums
 * become 36 GEMMs, one per position xi of the 6x6 transformed tile:
 *   M_xi [O, T] = U_xi [O, C] @ V_xi [C, T]      U = G g G^T, V = B^T d B
 * over the T tiles of a group of images: 36 multiplications per 4 outputs
 * instead of 100. Backward runs the adjoints of the same linear maps:
 *   dM = A dY A^T;  dV_xi = U_xi^T @ dM_xi, dx += scatter of B dV B^T;
 *   dU_xi += dM_xi @ V_xi^T, dw += G^T dU G.
 * The transforms are separable: a 1-D transform along the rows (the input
 * rows deinterleaved into even and odd columns, so that tile tj's columns
 * are at tj + constant), then down the columns, on vectors of 8 tile
 * columns. Every value is computed in one fixed order
 * (a function of the shapes only), so results are deterministic; they
 * differ from the im2col path by rounding (a few float ulps per term
 * magnitude). */

/* Tiles are processed along a tile row in vectors of DT__WINO_L lanes: with
 * GCC and clang a vector type (two SSE or NEON registers, or one AVX
 * register), otherwise an array that the compiler may vectorise. */
#define DT__WINO_L 8
#define DT__WINO_COLS 192 /* tiles per GEMM: at least the B panel width */
/* The transforms are inlined into two copies of the step function, one
 * compiled for AVX2 (x86-64, picked at run time: one 8-lane register per
 * vector instead of two SSE ones) and one for the build's target. */
#if defined(__GNUC__) || defined(__clang__)
#  define DT__WINO_INLINE __attribute__((always_inline)) inline
#else
#  define DT__WINO_INLINE
#endif
#if !defined(DTRAIN_NO_SIMD) && (defined(__GNUC__) || defined(__clang__))
/* Loads and stores through an unaligned, may-alias vector type; macros, as
 * passing a 32-byte vector by value to a function changes the ABI without
 * AVX (GCC warns). */
typedef float dt__wv __attribute__((vector_size(32)));
typedef float dt__wvu __attribute__((vector_size(32), aligned(4), __may_alias__));
typedef int32_t dt__wvi __attribute__((vector_size(32)));
#  define DT__WV_LD(p) (*(const dt__wvu *)(const void *)(p))
#  define DT__WV_ST(p, v) (*(dt__wvu *)(void *)(p) = (v))
#  define DT__WV_ADD(a, b) ((a) + (b))
#  define DT__WV_SUB(a, b) ((a) - (b))
#  define DT__WV_MUL(a, s) ((a) * (s)) /* s: a positive float constant (see DT__WV_NEG) */
#  define DT__WV_NEG(a) (-(a))
/* A mask of the lanes below n; DT__WV_KEEP sets the other lanes to 0
 * (bitwise, so garbage lanes cannot leak NaN). */
typedef dt__wvi dt__wvm;
static DT__WINO_INLINE void dt__wv_mask(dt__wvm *m, int64_t n) {
  for (int i = 0; i < DT__WINO_L; i++) (*m)[i] = i < n ? -1 : 0;
}
#  define DT__WV_KEEP(v, m) ((v) = (dt__wv)((dt__wvi)(v) & (m)))
#else
typedef struct dt__wv {
  float f[DT__WINO_L];
} dt__wv;
static dt__wv dt__wv_ld(const float *p) {
  dt__wv v;
  memcpy(v.f, p, sizeof v.f);
  return v;
}
static void dt__wv_st(float *p, dt__wv v) { memcpy(p, v.f, sizeof v.f); }
static dt__wv dt__wv_add(dt__wv a, dt__wv b) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] += b.f[i];
  return a;
}
static dt__wv dt__wv_sub(dt__wv a, dt__wv b) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] -= b.f[i];
  return a;
}
static dt__wv dt__wv_mul(dt__wv a, float s) {
  for (int i = 0; i < DT__WINO_L; i++) a.f[i] *= s;
  return a;
}
typedef int64_t dt__wvm;
static void dt__wv_mask(dt__wvm *m, int64_t n) { *m = n; }
static void dt__wv_keep(dt__wv *v, int64_t n) {
  for (int64_t i = n < 0 ? 0 : n; i < DT__WINO_L; i++) v->f[i] = 0.0f;
}
#  define DT__WV_KEEP(v, m) dt__wv_keep(&(v), m)
#  define DT__WV_LD(p) dt__wv_ld(p)
#  define DT__WV_ST(p, v) dt__wv_st(p, v)
#  define DT__WV_ADD(a, b) dt__wv_add(a, b)
#  define DT__WV_SUB(a, b) dt__wv_sub(a, b)
#  define DT__WV_MUL(a, s) dt__wv_mul(a, s)
#  define DT__WV_NEG(a) dt__wv_mul(a, -1.0f)
#endif

typedef struct dt__wino {
  int64_t th, tw, tpi; /* tile rows, tile columns, tiles per image */
  int64_t lw;          /* tw rounded up to DT__WINO_L */
  int64_t rows;        /* padded input rows the tiles read: 2*th + 4 */
  int64_t nb;          /* images per group */
} dt__wino;

static int dt__wino_use(const dt__conv_geom *q) {
  return q->kh == 5 && q->kw == 5 && q->s == 1 && q->c >= 8 && q->o >= 8;
}

static void dt__wino_geometry(const dt__conv_geom *q, dt__wino *z) {
  z->th = (q->ho + 1) / 2;
  z->tw = (q->wo + 1) / 2;
  z->tpi = z->th * z->tw;
  z->lw = (z->tw + DT__WINO_L - 1) / DT__WINO_L * DT__WINO_L;
  z->rows = 2 * z->th + 4;
  /* About one GEMM B panel of tiles per group (fewer were slower, and so
   * were more: V and M of a group then fall out of the caches), and V and M
   * within 4 MiB. */
  int64_t nb = (DT__WINO_COLS + z->tpi - 1) / z->tpi;
  if (nb > q->n) nb = q->n;
  while (nb > 1 && 36 * (q->c + q->o) * nb * z->tpi > (1 << 20)) nb--;
  z->nb = nb;
}

/* Floats of per-plane scratch the transforms need. */
static int64_t dt__wino_scratch(const dt__wino *z) {
  return z->rows * 6 * z->lw + 6 * (z->lw + 16) + 2 * (z->lw + 8) + 12 * z->lw;
}

/* The transformed tiles of a group (V, M and their gradients) are matrices
 * with rows of ld = T + DT__WINO_L floats: a tile row is stored as whole
 * vectors, whose lanes past the row spill into the next tile row (written
 * after it) or into the slack at the end. Entry xi of tile (ti, tj) of a
 * plane is at [xi * xs + ti * tw + tj]. */

/* Input transform of one plane [H, W]: v = B^T d B for every tile. */
static DT__WINO_INLINE void dt__wino_in(const dt__conv_geom *q, const dt__wino *z, const float *plane, float *v, int64_t xs,
                        float *scr) {
  int64_t lw = z->lw, tw = z->tw;
  float *hb = scr, *e = hb + z->rows * 6 * lw, *od = e + lw + 8;
  for (int64_t r = 0; r < z->rows; r++) { /* each padded row: deinterleave, then B^T along it */
    int64_t ir = r - q->p;
    float *hr = hb + r * 6 * lw;
    if (ir < 0 || ir >= q->h) {
      memset(hr, 0, (size_t)(6 * lw) * sizeof(float));
      continue;
    }
    const float *src = plane + ir * q->w;
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
      e[k] = c0 >= 0 && c0 < q->w ? src[c0] : 0.0f;
      od[k] = c1 >= 0 && c1 < q->w ? src[c1] : 0.0f;
    }
    /* column 2*tj + b of the padded row: e[tj + b/2] for even b, od[tj + b/2] for odd b */
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      dt__wv a = DT__WV_LD(e + l), b = DT__WV_LD(od + l), c = DT__WV_LD(e + l + 1), d = DT__WV_LD(od + l + 1);
      dt__wv f = DT__WV_LD(e + l + 2), h = DT__WV_LD(od + l + 2);
      DT__WV_ST(hr + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(a, 4.0f), DT__WV_MUL(c, 5.0f)), f));
      DT__WV_ST(hr + lw + l, DT__WV_SUB(DT__WV_ADD(d, f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)));
      DT__WV_ST(hr + 2 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, c), 4.0f), DT__WV_SUB(f, d)));
      DT__WV_ST(hr + 3 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(d, b), 2.0f), DT__WV_SUB(f, c)));
      DT__WV_ST(hr + 4 * lw + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, d), 2.0f), DT__WV_SUB(f, c)));
      DT__WV_ST(hr + 5 * lw + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(b, 4.0f), DT__WV_MUL(d, 5.0f)), h));
    }
  }
  for (int64_t ti = 0; ti < z->th; ti++) { /* B^T down the 6 padded rows of each tile row */
    for (int64_t xb = 0; xb < 6; xb++) {
      const float *p0 = hb + 2 * ti * 6 * lw + xb * lw;
      float *o = v + xb * xs + ti * tw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * lw + l), c = DT__WV_LD(p0 + 12 * lw + l);
        dt__wv d = DT__WV_LD(p0 + 18 * lw + l), f = DT__WV_LD(p0 + 24 * lw + l), h = DT__WV_LD(p0 + 30 * lw + l);
        DT__WV_ST(o + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(a, 4.0f), DT__WV_MUL(c, 5.0f)), f));
        DT__WV_ST(o + 6 * xs + l, DT__WV_SUB(DT__WV_ADD(d, f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)));
        DT__WV_ST(o + 12 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, c), 4.0f), DT__WV_SUB(f, d)));
        DT__WV_ST(o + 18 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(d, b), 2.0f), DT__WV_SUB(f, c)));
        DT__WV_ST(o + 24 * xs + l, DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(b, d), 2.0f), DT__WV_SUB(f, c)));
        DT__WV_ST(o + 30 * xs + l, DT__WV_ADD(DT__WV_SUB(DT__WV_MUL(b, 4.0f), DT__WV_MUL(d, 5.0f)), h));
      }
    }
  }
}

/* g_0..g_5 = B applied to a..h: g_i = sum_j BT[j][i] * (a, b, c, d, f, h)[j]. */
#define DT__WINO_B(a, b, c, d, f, h, G0, G1, G2, G3, G4, G5)                                                   \
  do {                                                                                                         \
    G0 = DT__WV_MUL(a, 4.0f);                                                                                  \
    G1 = DT__WV_ADD(DT__WV_ADD(DT__WV_MUL(DT__WV_SUB(c, b), 4.0f), DT__WV_MUL(DT__WV_SUB(f, d), 2.0f)),        \
                    DT__WV_MUL(h, 4.0f));                                                                      \
    G2 = DT__WV_NEG(DT__WV_ADD(DT__WV_ADD(DT__WV_MUL(a, 5.0f), DT__WV_MUL(DT__WV_ADD(b, c), 4.0f)),           \
                               DT__WV_ADD(d, f)));                                                             \
    G3 = DT__WV_SUB(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), DT__WV_MUL(h, 5.0f));    \
    G4 = DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f);                                        \
    G5 = h;                                                                                                    \
  } while (0)

/* The adjoint of the input transform: gx [H, W] += the sum over the tiles
 * of B dv B^T, each at its tile's place. */
static DT__WINO_INLINE void dt__wino_in_adjoint(const dt__conv_geom *q, const dt__wino *z, const float *dv, int64_t xs, float *gx,
                                float *scr) {
  int64_t lw = z->lw, tw = z->tw, gp = lw + 16;
  float *hb = scr, *gb = hb + z->rows * 6 * lw, *e = gb + 6 * gp, *od = e + lw + 8;
  memset(gb, 0, (size_t)(6 * gp) * sizeof(float));
  dt__wvm last;
  dt__wv_mask(&last, tw - (lw - DT__WINO_L));
  for (int64_t ti = 0; ti < z->th; ti++) { /* B down the tile: added to padded rows 2*ti .. 2*ti+5 */
    for (int64_t xb = 0; xb < 6; xb++) {
      const float *p0 = dv + xb * xs + ti * tw;
      float *h0 = hb + 2 * ti * 6 * lw + xb * lw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * xs + l), c = DT__WV_LD(p0 + 12 * xs + l);
        dt__wv d = DT__WV_LD(p0 + 18 * xs + l), f = DT__WV_LD(p0 + 24 * xs + l), h = DT__WV_LD(p0 + 30 * xs + l);
        if (l + DT__WINO_L > tw) { /* lanes past the tile row hold the next row's tiles */
          DT__WV_KEEP(a, last);
          DT__WV_KEEP(b, last);
          DT__WV_KEEP(c, last);
          DT__WV_KEEP(d, last);
          DT__WV_KEEP(f, last);
          DT__WV_KEEP(h, last);
        }
        dt__wv g[6];
        DT__WINO_B(a, b, c, d, f, h, g[0], g[1], g[2], g[3], g[4], g[5]);
        for (int i = 0; i < 6; i++) { /* rows past 2*ti + 3 are new in this tile row */
          float *t = h0 + i * 6 * lw + l;
          if (ti > 0 && i < 4) DT__WV_ST(t, DT__WV_ADD(DT__WV_LD(t), g[i]));
          else DT__WV_ST(t, g[i]);
        }
      }
    }
  }
  for (int64_t r = 0; r < z->rows; r++) { /* B along each padded row, then into gx */
    int64_t ir = r - q->p;
    if (ir < 0 || ir >= q->h) continue;
    const float *p0 = hb + r * 6 * lw;
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + lw + l), c = DT__WV_LD(p0 + 2 * lw + l);
      dt__wv d = DT__WV_LD(p0 + 3 * lw + l), f = DT__WV_LD(p0 + 4 * lw + l), h = DT__WV_LD(p0 + 5 * lw + l);
      dt__wv g[6];
      DT__WINO_B(a, b, c, d, f, h, g[0], g[1], g[2], g[3], g[4], g[5]);
      for (int i = 0; i < 6; i++) DT__WV_ST(gb + i * gp + 2 + l, g[i]);
    }
    /* column 2*k + (0 or 1) of the padded row gets g_b of tile tj = k - b/2
     * for the even (odd) b; gb rows are zero outside [2, 2 + lw) */
    for (int64_t k = 0; k < lw + 2; k += DT__WINO_L) {
      DT__WV_ST(e + k, DT__WV_ADD(DT__WV_ADD(DT__WV_LD(gb + 2 + k), DT__WV_LD(gb + 2 * gp + 1 + k)),
                                  DT__WV_LD(gb + 4 * gp + k)));
      DT__WV_ST(od + k, DT__WV_ADD(DT__WV_ADD(DT__WV_LD(gb + gp + 2 + k), DT__WV_LD(gb + 3 * gp + 1 + k)),
                                   DT__WV_LD(gb + 5 * gp + k)));
    }
    float *dst = gx + ir * q->w;
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
      if (c0 >= 0 && c0 < q->w) dst[c0] += e[k];
      if (c1 >= 0 && c1 < q->w) dst[c1] += od[k];
    }
  }
}
#undef DT__WINO_B

/* Output transform of one output plane [Ho, Wo]: y = A^T m A + bias per tile,
 * the parts of the last tiles past Ho, Wo dropped. A^T = [1 1 1 1 1 0;
 * 0 1 -1 2 -2 1]. */
static DT__WINO_INLINE void dt__wino_out(const dt__conv_geom *q, const dt__wino *z, const float *m, int64_t xs, float *y, float bias,
                         float *scr) {
  int64_t lw = z->lw, tw = z->tw, wo = q->wo;
  float *s = scr, *ev = s + 12 * lw, *od = ev + lw;
  for (int64_t ti = 0; ti < z->th; ti++) {
    for (int64_t xb = 0; xb < 6; xb++) { /* down the columns */
      const float *p0 = m + xb * xs + ti * tw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + 6 * xs + l), c = DT__WV_LD(p0 + 12 * xs + l);
        dt__wv d = DT__WV_LD(p0 + 18 * xs + l), f = DT__WV_LD(p0 + 24 * xs + l), h = DT__WV_LD(p0 + 30 * xs + l);
        DT__WV_ST(s + xb * lw + l, DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f));
        DT__WV_ST(s + (6 + xb) * lw + l, DT__WV_ADD(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), h));
      }
    }
    for (int64_t i = 0; i < 2 && 2 * ti + i < q->ho; i++) { /* along the rows */
      const float *p0 = s + i * 6 * lw;
      for (int64_t l = 0; l < lw; l += DT__WINO_L) {
        dt__wv a = DT__WV_LD(p0 + l), b = DT__WV_LD(p0 + lw + l), c = DT__WV_LD(p0 + 2 * lw + l);
        dt__wv d = DT__WV_LD(p0 + 3 * lw + l), f = DT__WV_LD(p0 + 4 * lw + l), h = DT__WV_LD(p0 + 5 * lw + l);
        DT__WV_ST(ev + l, DT__WV_ADD(DT__WV_ADD(DT__WV_ADD(a, b), DT__WV_ADD(c, d)), f));
        DT__WV_ST(od + l, DT__WV_ADD(DT__WV_ADD(DT__WV_SUB(b, c), DT__WV_MUL(DT__WV_SUB(d, f), 2.0f)), h));
      }
      float *yr = y + (2 * ti + i) * wo;
      int64_t full = wo / 2;
      for (int64_t l = 0; l < full; l++) {
        yr[2 * l] = ev[l] + bias;
        yr[2 * l + 1] = od[l] + bias;
      }
      if (wo % 2) yr[wo - 1] = ev[full] + bias;
    }
  }
}

/* The adjoint of the output transform for one gradient plane gy [Ho, Wo]:
 * dm = A gy A^T per tile (entries past Ho, Wo count as 0). */
static DT__WINO_INLINE void dt__wino_out_adjoint(const dt__conv_geom *q, const dt__wino *z, const float *gy, float *dm, int64_t xs,
                                 float *scr) {
  int64_t lw = z->lw, tw = z->tw, wo = q->wo;
  float *s = scr;
  for (int64_t ti = 0; ti < z->th; ti++) {
    dt__wv r[2][2];
    for (int64_t i = 0; i < 2; i++) { /* rows 2*ti + i deinterleaved into s[i][0] (even), s[i][1] (odd) */
      int64_t oh = 2 * ti + i;
      int64_t l = 0;
      float *ev = s + i * 2 * lw, *od = ev + lw;
      if (oh < q->ho) { /* deinterleave the row */
        const float *gr = gy + oh * wo;
        for (; 2 * l + 1 < wo; l++) {
          ev[l] = gr[2 * l];
          od[l] = gr[2 * l + 1];
        }
        if (2 * l < wo) {
          ev[l] = gr[2 * l];
          od[l] = 0.0f;
          l++;
        }
      }
      for (; l < lw; l++) ev[l] = od[l] = 0.0f;
    }
    for (int64_t l = 0; l < lw; l += DT__WINO_L) {
      for (int i = 0; i < 2; i++) {
        r[i][0] = DT__WV_LD(s + i * 2 * lw + l);
        r[i][1] = DT__WV_LD(s + i * 2 * lw + lw + l);
      }
      /* along the rows: t_i[b] = sum_j gy[i][j] AT[j][b], then down the columns the same way */
      dt__wv t[2][6];
      for (int i = 0; i < 2; i++) {
        dt__wv a = r[i][0], b = r[i][1];
        t[i][0] = a;
        t[i][1] = DT__WV_ADD(a, b);
        t[i][2] = DT__WV_SUB(a, b);
        t[i][3] = DT__WV_ADD(a, DT__WV_MUL(b, 2.0f));
        t[i][4] = DT__WV_SUB(a, DT__WV_MUL(b, 2.0f));
        t[i][5] = b;
      }
      float *o = dm + ti * tw + l;
      for (int xb = 0; xb < 6; xb++) {
        dt__wv a = t[0][xb], b = t[1][xb];
        DT__WV_ST(o + xb * xs, a);
        DT__WV_ST(o + (6 + xb) * xs, DT__WV_ADD(a, b));
        DT__WV_ST(o + (12 + xb) * xs, DT__WV_SUB(a, b));
        DT__WV_ST(o + (18 + xb) * xs, DT__WV_ADD(a, DT__WV_MUL(b, 2.0f)));
        DT__WV_ST(o + (24 + xb) * xs, DT__WV_SUB(a, DT__WV_MUL(b, 2.0f)));
        DT__WV_ST(o + (30 + xb) * xs, b);
      }
    }
  }
}

/* G of F(2, 5): 6 x 5. */
static const float dt__wino_g[6][5] = {
    {1.0f / 4, 0.0f, 0.0f, 0.0f, 0.0f},
    {-1.0f / 6, -1.0f / 6, -1.0f / 6, -1.0f / 6, -1.0f / 6},
    {-1.0f / 6, 1.0f / 6, -1.0f / 6, 1.0f / 6, -1.0f / 6},
    {1.0f / 24, 1.0f / 12, 1.0f / 6, 1.0f / 3, 2.0f / 3},
    {1.0f / 24, -1.0f / 12, 1.0f / 6, -1.0f / 3, 2.0f / 3},
    {0.0f, 0.0f, 0.0f, 0.0f, 1.0f},
};

/* u[xi][o][c] = (G w[o][c] G^T)[xi] for every kernel of w [O, C, 5, 5]. */
static void dt__wino_kernels(const dt__conv_geom *q, const float *w, float *u) {
  int64_t oc = q->o * q->c;
  for (int64_t k = 0; k < oc; k++) {
    const float *g = w + k * 25;
    float t[6][5];
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int i = 0; i < 5; i++) acc += dt__wino_g[a][i] * g[i * 5 + j];
        t[a][j] = acc;
      }
    for (int a = 0; a < 6; a++)
      for (int b = 0; b < 6; b++) {
        float acc = 0.0f;
        for (int j = 0; j < 5; j++) acc += t[a][j] * dt__wino_g[b][j];
        u[(a * 6 + b) * oc + k] = acc;
      }
  }
}

/* The adjoint: gw[o][c] += G^T du[.][o][c] G. */
static void dt__wino_kernels_adjoint(const dt__conv_geom *q, const float *du, float *gw) {
  int64_t oc = q->o * q->c;
  for (int64_t k = 0; k < oc; k++) {
    float t[6][5];
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int b = 0; b < 6; b++) acc += du[(a * 6 + b) * oc + k] * dt__wino_g[b][j];
        t[a][j] = acc;
      }
    float *g = gw + k * 25;
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 5; j++) {
        float acc = 0.0f;
        for (int a = 0; a < 6; a++) acc += dt__wino_g[a][i] * t[a][j];
        g[i * 5 + j] += acc;
      }
  }
}

/* The steps of a group of images, each split over the intra-op threads by
 * planes (transforms) or by xi (GEMMs): every part writes its own planes or
 * matrices, each computed exactly as on one thread, so results do not
 * depend on the number of threads. */
enum { DT__WINO_IN, DT__WINO_MUL, DT__WINO_OUT, DT__WINO_OUT_ADJ, DT__WINO_MUL_DU, DT__WINO_MUL_DV, DT__WINO_IN_ADJ };
typedef struct dt__wino_job {
  const dt__conv_geom *q;
  const dt__wino *z;
  int step;
  int64_t n0, nbb, tt, ld, nscr;
  const float *x, *b, *u, *gy;
  float *v, *m, *y, *du, *dv, *gx, *scr;
} dt__wino_job;

static DT__WINO_INLINE void dt__wino_part_body(void *arg, int part, int nparts) {
  const dt__wino_job *jb = (const dt__wino_job *)arg;
  const dt__conv_geom *q = jb->q;
  const dt__wino *z = jb->z;
  int64_t hw = q->h * q->w, chw = q->c * hw, op = q->o * q->pp, oc = q->o * q->c, ld = jb->ld, tt = jb->tt;
  int64_t total = jb->step == DT__WINO_IN || jb->step == DT__WINO_IN_ADJ    ? q->c
                  : jb->step == DT__WINO_OUT || jb->step == DT__WINO_OUT_ADJ ? q->o
                                                                             : 36;
  int64_t i0 = total * part / nparts, i1 = total * (part + 1) / nparts;
  float *scr = jb->scr + part * jb->nscr;
  const float *x = jb->x + jb->n0 * chw;
  for (int64_t i = i0; i < i1; i++) {
    switch (jb->step) {
    case DT__WINO_IN: /* images in increasing order: see the spill note above */
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_in(q, z, x + j * chw + i * hw, jb->v + i * ld + j * z->tpi, q->c * ld, scr);
      break;
    case DT__WINO_MUL:
      dt_sgemm(0, 0, q->o, tt, q->c, 1.0f, jb->u + i * oc, q->c, jb->v + i * q->c * ld, ld, 0.0f,
               jb->m + i * q->o * ld, ld);
      break;
    case DT__WINO_OUT:
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_out(q, z, jb->m + i * ld + j * z->tpi, q->o * ld, jb->y + (jb->n0 + j) * op + i * q->pp,
                     jb->b ? jb->b[i] : 0.0f, scr);
      break;
    case DT__WINO_OUT_ADJ:
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_out_adjoint(q, z, jb->gy + (jb->n0 + j) * op + i * q->pp, jb->m + i * ld + j * z->tpi, q->o * ld,
                             scr);
      break;
    case DT__WINO_MUL_DU:
      dt_sgemm(0, 1, q->o, q->c, tt, 1.0f, jb->m + i * q->o * ld, ld, jb->v + i * q->c * ld, ld,
               jb->n0 == 0 ? 0.0f : 1.0f, jb->du + i * oc, q->c);
      break;
    case DT__WINO_MUL_DV:
      dt_sgemm(1, 0, q->c, tt, q->o, 1.0f, jb->u + i * oc, q->c, jb->m + i * q->o * ld, ld, 0.0f,
               jb->dv + i * q->c * ld, ld);
      break;
    default: /* DT__WINO_IN_ADJ */
      for (int64_t j = 0; j < jb->nbb; j++)
        dt__wino_in_adjoint(q, z, jb->dv + i * ld + j * z->tpi, q->c * ld, jb->gx + (jb->n0 + j) * chw + i * hw,
                            scr);
      break;
    }
  }
}

static void dt__wino_part(void *arg, int part, int nparts) { dt__wino_part_body(arg, part, nparts); }
#ifdef DT__CONV_AVX
__attribute__((target("avx2"))) static void dt__wino_part_avx2(void *arg, int part, int nparts) {
  dt__wino_part_body(arg, part, nparts);
}
#endif

static void dt__wino_run(dt__wino_job *jb, int step, int parts) {
  jb->step = step;
#ifdef DT__CONV_AVX
  if (__builtin_cpu_supports("avx2")) {
    dt__par_run(parts, dt__wino_part_avx2, jb);
    return;
  }
#endif
  dt__par_run(parts, dt__wino_part, jb);
}

/* Sets up a job: scratch per part, and the group buffers (v and dv only
 * when asked). Returns the number of parts, 0 when the arena failed. */
static int dt__wino_setup(dt_graph *g, dt__wino_job *jb, const dt__conv_geom *q, const dt__wino *z, int want_v,
                          int want_dv) {
  int parts = dt__par_threads();
  if (parts < 1) parts = 1;
  if (parts > 36) parts = 36;
  int64_t ldmax = z->nb * z->tpi + DT__WINO_L;
  memset(jb, 0, sizeof *jb);
  jb->q = q;
  jb->z = z;
  jb->nscr = dt__wino_scratch(z);
  jb->scr = dt__arena_floats(g, parts * jb->nscr);
  jb->u = NULL;
  jb->v = want_v ? dt__arena_floats(g, 36 * q->c * ldmax) : NULL;
  jb->dv = want_dv ? dt__arena_floats(g, 36 * q->c * ldmax) : NULL;
  jb->m = dt__arena_floats(g, 36 * q->o * ldmax);
  return g->err == DTRAIN_OK ? parts : 0;
}

static void dt__wino_group(dt__wino_job *jb, int64_t n0) {
  jb->n0 = n0;
  jb->nbb = DT__MIN(jb->z->nb, jb->q->n - n0);
  jb->tt = jb->nbb * jb->z->tpi;
  jb->ld = jb->tt + DT__WINO_L;
}

static void dt__wino_forward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *b,
                             float *y) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  float *u = dt__arena_floats(g, 36 * q->o * q->c);
  int parts = dt__wino_setup(g, &jb, q, &z, 1, 0);
  if (!parts || g->err != DTRAIN_OK) return;
  dt__wino_kernels(q, w, u);
  jb.u = u;
  jb.x = x;
  jb.b = b;
  jb.y = y;
  for (int64_t n0 = 0; n0 < q->n; n0 += z.nb) {
    dt__wino_group(&jb, n0);
    dt__wino_run(&jb, DT__WINO_IN, parts);
    dt__wino_run(&jb, DT__WINO_MUL, parts);
    dt__wino_run(&jb, DT__WINO_OUT, parts);
  }
}

/* gy: the output gradient; m holds dM. */
static void dt__wino_backward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *gy,
                              float *gx, float *gw) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  int64_t oc = q->o * q->c;
  float *u = gx ? dt__arena_floats(g, 36 * oc) : NULL, *du = gw ? dt__arena_floats(g, 36 * oc) : NULL;
  int parts = dt__wino_setup(g, &jb, q, &z, gw != NULL, gx != NULL);
  if (!parts || g->err != DTRAIN_OK) return;
  if (gx) dt__wino_kernels(q, w, u);
  jb.u = u;
  jb.du = du;
  jb.x = x;
  jb.gy = gy;
  jb.gx = gx;
  for (int64_t n0 = 0; n0 < q->n; n0 += z.nb) {
    dt__wino_group(&jb, n0);
    dt__wino_run(&jb, DT__WINO_OUT_ADJ, parts);
    if (gw) {
      dt__wino_run(&jb, DT__WINO_IN, parts);
      dt__wino_run(&jb, DT__WINO_MUL_DU, parts);
    }
    if (gx) {
      dt__wino_run(&jb, DT__WINO_MUL_DV, parts);
      dt__wino_run(&jb, DT__WINO_IN_ADJ, parts);
    }
  }
  if (gw) dt__wino_kernels_adjoint(q, du, gw);
}

static void dt__conv_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0], *w = y->src[1], *b = y->src[2];
  float *gx = dt__grad(g, x), *gw = dt__grad(g, w), *gb = dt__grad(g, b);
  if (g->err != DTRAIN_OK) return;
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, y->iaux[0], y->iaux[1]);
  const float *go = y->grad;
  int64_t chw = q.c * q.h * q.w, op = q.o * q.pp, cols = q.nb * q.pp;
  if (gb) {
    /* In double, in four interleaved partial sums (a fixed order): one
     * dependent chain of double adds would take most of this function. */
    for (int64_t o = 0; o < q.o; o++) {
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#ifdef DT__CONV_SSE
      /* The same four sums, two per register (lanes: s0 s1 | s2 s3). */
      __m128d a01 = _mm_setzero_pd(), a23 = _mm_setzero_pd();
      for (int64_t n = 0; n < q.n; n++) {
        const float *r = go + n * op + o * q.pp;
        int64_t i = 0;
        for (; i + 4 <= q.pp; i += 4) {
          __m128 v = _mm_loadu_ps(r + i);
          a01 = _mm_add_pd(a01, _mm_cvtps_pd(v));
          a23 = _mm_add_pd(a23, _mm_cvtps_pd(_mm_movehl_ps(v, v)));
        }
        for (; i < q.pp; i++) a01 = _mm_add_sd(a01, _mm_set_sd((double)r[i]));
      }
      s0 = _mm_cvtsd_f64(a01);
      s1 = _mm_cvtsd_f64(_mm_unpackhi_pd(a01, a01));
      s2 = _mm_cvtsd_f64(a23);
      s3 = _mm_cvtsd_f64(_mm_unpackhi_pd(a23, a23));
#else
      for (int64_t n = 0; n < q.n; n++) {
        const float *r = go + n * op + o * q.pp;
        int64_t i = 0;
        for (; i + 4 <= q.pp; i += 4) {
          s0 += (double)r[i];
          s1 += (double)r[i + 1];
          s2 += (double)r[i + 2];
          s3 += (double)r[i + 3];
        }
        for (; i < q.pp; i++) s0 += (double)r[i];
      }
#endif
      gb[o] += (float)((s0 + s1) + (s2 + s3));
    }
  }
  if (!gx && !gw) return;
  if (dt__wino_use(&q)) {
    dt__wino_backward(g, &q, x->data, w->data, go, gx, gw);
    return;
  }
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
}

DTRAIN_API dt_tensor *dt_conv2d(dt_graph *g, dt_tensor *x, dt_tensor *w, dt_tensor *b, int stride, int padding) {
  static const char *op = "dt_conv2d";
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
  if (g->device) return dt__dev_conv2d(g, x, w, b, stride, padding);
  dt__conv_geom q;
  dt__conv_geometry(&q, x, w, stride, padding);
  int64_t shape[4] = {q.n, q.o, q.ho, q.wo};
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  size_t kp;
  if (!dt__mul_size((size_t)q.k, (size_t)q.pp, &kp) || dt__too_many(kp))
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_OVERFLOW, "%s: column matrix of x %s, w %s too large", op, sx, sw);
  if (dt__wino_use(&q)) {
    dt__wino_forward(g, &q, x->data, w->data, b ? b->data : NULL, y->data);
    if (g->err != DTRAIN_OK) return NULL;
    y->iaux[0] = stride;
    y->iaux[1] = padding;
    dt__record(g, y, op, dt__conv_backward, x, w, b);
    return dt__finish(g, y);
  }
  int64_t chw = q.c * q.h * q.w, op_ = q.o * q.pp, cols = q.nb * q.pp;
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
    if (b) {
      for (int64_t o = 0; o < q.o; o++)
        for (int64_t i = 0; i < ld; i++) out[o * ld + i] = b->data[o];
    }
    dt_sgemm(0, 0, q.o, ld, q.k, 1.0f, w->data, q.k, cp, ld, b ? 1.0f : 0.0f, out, ld);
    if (q.nb > 1) {
      for (int64_t j = 0; j < nbb; j++)
        for (int64_t o = 0; o < q.o; o++)
          memcpy(y->data + (n0 + j) * op_ + o * q.pp, tmp + o * ld + j * q.pp, (size_t)q.pp * sizeof(float));
    }
  }
  y->iaux[0] = stride;
  y->iaux[1] = padding;
  dt__record(g, y, op, dt__conv_backward, x, w, b);
  return dt__finish(g, y);
}

/* ---- pooling --------------------------------------------------------------------------
 * No padding; Ho = (H - k)/s + 1. iaux: kernel, stride. Max pooling routes
 * the gradient to the first maximum of each window (a NaN wins). */

static int dt__pool_check(dt_graph *g, const char *op, dt_tensor *x, int kernel, int stride) {
  if (!dt__begin(g, op, 1, x)) return 0;
  char sx[96];
  dt_shape_str(x, sx, sizeof sx);
  if (x->ndim != 4) {
    dt__fail(g, DTRAIN_ERR_RANK, "%s: x %s must have rank 4 [N,C,H,W]", op, sx);
    return 0;
  }
  if (kernel < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: kernel %d (must be >= 1), x %s", op, kernel, sx);
    return 0;
  }
  if (stride < 1) {
    dt__fail(g, DTRAIN_ERR_INVALID_ARG, "%s: stride %d (must be >= 1), x %s", op, stride, sx);
    return 0;
  }
  if (kernel > x->shape[2] || kernel > x->shape[3]) {
    dt__fail(g, DTRAIN_ERR_SHAPE, "%s: kernel %d larger than the input %lldx%lld (x %s)", op, kernel,
             (long long)x->shape[2], (long long)x->shape[3], sx);
    return 0;
  }
  return 1;
}

static dt_tensor *dt__pool_new(dt_graph *g, const char *op, dt_tensor *x, int kernel, int stride) {
  int64_t shape[4] = {x->shape[0], x->shape[1], (x->shape[2] - kernel) / stride + 1,
                      (x->shape[3] - kernel) / stride + 1};
  dt_tensor *y = dt__new(g, op, 4, shape);
  if (!y) return NULL;
  y->iaux[0] = kernel;
  y->iaux[1] = stride;
  return y;
}

/* The window of output (oh, ow) starts at input offset oh*s*w + ow*s. Its
 * maximum is the first element that is greater than all before it, or the
 * first NaN: v replaces best when v > best, or v is NaN and best is not. */
#ifdef DT__CONV_SSE
static __m128 dt__pool_max4(__m128 best, __m128 v) {
  __m128 take = _mm_or_ps(_mm_cmpgt_ps(v, best), _mm_and_ps(_mm_cmpunord_ps(v, v), _mm_cmpord_ps(best, best)));
  return _mm_or_ps(_mm_and_ps(take, v), _mm_andnot_ps(take, best));
}
#endif

/* Backward finds the winner again instead of keeping an index per output
 * from the forward pass: the first element of the window equal to the
 * output (the first NaN when the output is NaN) is the element the forward
 * pass picked, since the maximum is the first occurrence of its value. */
static void dt__pool_max_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t k = y->iaux[0], s = y->iaux[1];
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3];
  const float *go = y->grad, *yd = y->data;
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    float *gp = gx + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      int64_t ow = 0;
#ifdef DT__CONV_SSE
      if (k == 2 && s == 2) { /* 4 windows at a time: masks of the winners, no branches */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
        float *g0 = gp + 2 * oh * w, *g1 = g0 + w;
        for (; ow + 4 <= wo; ow += 4) {
          int64_t o = (pl * ho + oh) * wo + ow;
          __m128 best = _mm_loadu_ps(yd + o), gv = _mm_loadu_ps(go + o);
          __m128 bnan = _mm_cmpunord_ps(best, best);
          __m128 a0 = _mm_loadu_ps(r0 + 2 * ow), a1 = _mm_loadu_ps(r0 + 2 * ow + 4);
          __m128 b0 = _mm_loadu_ps(r1 + 2 * ow), b1 = _mm_loadu_ps(r1 + 2 * ow + 4);
          __m128 v[4], e[4];
          v[0] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
          v[1] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
          v[2] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
          v[3] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
          __m128 taken = _mm_setzero_ps();
          for (int t = 0; t < 4; t++) {
            __m128 eq = _mm_or_ps(_mm_cmpeq_ps(v[t], best), _mm_and_ps(bnan, _mm_cmpunord_ps(v[t], v[t])));
            eq = _mm_andnot_ps(taken, eq); /* the first match only */
            taken = _mm_or_ps(taken, eq);
            e[t] = _mm_and_ps(eq, gv);
          }
          _mm_storeu_ps(g0 + 2 * ow, _mm_add_ps(_mm_loadu_ps(g0 + 2 * ow), _mm_unpacklo_ps(e[0], e[1])));
          _mm_storeu_ps(g0 + 2 * ow + 4, _mm_add_ps(_mm_loadu_ps(g0 + 2 * ow + 4), _mm_unpackhi_ps(e[0], e[1])));
          _mm_storeu_ps(g1 + 2 * ow, _mm_add_ps(_mm_loadu_ps(g1 + 2 * ow), _mm_unpacklo_ps(e[2], e[3])));
          _mm_storeu_ps(g1 + 2 * ow + 4, _mm_add_ps(_mm_loadu_ps(g1 + 2 * ow + 4), _mm_unpackhi_ps(e[2], e[3])));
        }
      }
#endif
      for (; ow < wo; ow++) {
        int64_t o = (pl * ho + oh) * wo + ow, at = oh * s * w + ow * s, t0 = at;
        float best = yd[o];
        int nan = best != best;
        /* Scan backwards so that the first match is the one that stays;
         * no early exit, so the compiler can use conditional moves. */
        for (int64_t i = k - 1; i >= 0; i--) {
          for (int64_t j = k - 1; j >= 0; j--) {
            int64_t t = t0 + i * w + j;
            float v = xp[t];
            if (v == best || (nan && v != v)) at = t;
          }
        }
        gp[at] += go[o];
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_max_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride) {
  static const char *op = "dt_max_pool2d";
  if (!dt__pool_check(g, op, x, kernel, stride)) return NULL;
  if (g->device) return dt__dev_pool(g, x, kernel, stride, 1, op);
  dt_tensor *y = dt__pool_new(g, op, x, kernel, stride);
  if (!y) return NULL;
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3], k = kernel, s = stride;
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      float *yo = y->data + (pl * ho + oh) * wo;
      int64_t ow = 0;
#ifdef DT__CONV_SSE
      if (k == 2 && s == 2) { /* the common 2x2 pooling: 4 outputs from 2 x 8 inputs */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
        for (; ow + 4 <= wo; ow += 4) {
          __m128 a0 = _mm_loadu_ps(r0 + 2 * ow), a1 = _mm_loadu_ps(r0 + 2 * ow + 4);
          __m128 b0 = _mm_loadu_ps(r1 + 2 * ow), b1 = _mm_loadu_ps(r1 + 2 * ow + 4);
          __m128 best = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
          best = dt__pool_max4(best, _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
          best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)));
          best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
          _mm_storeu_ps(yo + ow, best);
        }
      }
#endif
      for (; ow < wo; ow++) {
        const float *win = xp + oh * s * w + ow * s;
        float best = win[0];
        for (int64_t i = 0; i < k; i++) {
          for (int64_t j = 0; j < k; j++) {
            float v = win[i * w + j];
            if (v > best || (v != v && best == best)) best = v;
          }
        }
        yo[ow] = best;
      }
    }
  }
  dt__record(g, y, op, dt__pool_max_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

static void dt__pool_avg_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  float *gx = dt__grad(g, x);
  if (!gx) return;
  int64_t k = y->iaux[0], s = y->iaux[1];
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3];
  float kk = (float)(k * k);
  const float *go = y->grad;
  for (int64_t pl = 0; pl < planes; pl++) {
    float *gp = gx + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      for (int64_t ow = 0; ow < wo; ow++) {
        float d = go[(pl * ho + oh) * wo + ow] / kk;
        for (int64_t i = 0; i < k; i++) {
          float *r = gp + (oh * s + i) * w + ow * s;
          for (int64_t j = 0; j < k; j++) r[j] += d;
        }
      }
    }
  }
}

DTRAIN_API dt_tensor *dt_avg_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride) {
  static const char *op = "dt_avg_pool2d";
  if (!dt__pool_check(g, op, x, kernel, stride)) return NULL;
  if (g->device) return dt__dev_pool(g, x, kernel, stride, 0, op);
  dt_tensor *y = dt__pool_new(g, op, x, kernel, stride);
  if (!y) return NULL;
  int64_t planes = y->shape[0] * y->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t ho = y->shape[2], wo = y->shape[3], k = kernel, s = stride;
  float kk = (float)(k * k);
  for (int64_t pl = 0; pl < planes; pl++) {
    const float *xp = x->data + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      for (int64_t ow = 0; ow < wo; ow++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < k; i++) {
          const float *r = xp + (oh * s + i) * w + ow * s;
          for (int64_t j = 0; j < k; j++) sum += r[j];
        }
        y->data[(pl * ho + oh) * wo + ow] = sum / kk;
      }
    }
  }
  dt__record(g, y, op, dt__pool_avg_backward, x, NULL, NULL);
  return dt__finish(g, y);
}

#undef DT__WINO_L
#undef DT__WINO_COLS
#undef DT__WINO_INLINE
#undef DT__WV_LD
#undef DT__WV_ST
#undef DT__WV_ADD
#undef DT__WV_SUB
#undef DT__WV_MUL
#undef DT__WV_KEEP
#undef DT__WV_NEG
#undef DT__CONV_COLS
#undef DT__CONV_CAP
#ifdef DT__CONV_SSE
#  undef DT__CONV_SSE
#endif
#ifdef DT__CONV_AVX
#  undef DT__CONV_AVX
#endif
