/* ===========================================================================
 * dt_ops_wino.c -- Winograd F(2x2, 5x5) convolution (called by dt_conv2d)
 * ===========================================================================
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
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_ops_conv.h"

/* The steps run in an AVX2 copy where the CPU has it (x86-64 with GCC or
 * clang, picked at run time); the same condition dt_ops_conv.c uses for its
 * AVX paths. AVX-512 CPUs run the AVX2 copy too: the transforms work along
 * a row of 2x2 output tiles, 7 for a 14x14 image, so 16 lanes would be less
 * than half full, and a copy compiled for AVX-512 (32 vector registers)
 * measured no faster (CNN at batch 64, Zen 5: 2,010-2,045 against
 * 2,035-2,045 samples/s). */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#  define DT__WINO_AVX2 1
#endif
/* The rows' deinterleaving into even and odd columns and back, 4 pairs at
 * a time in SSE (pure moves, and the same adds as the scalar loops). */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__WINO_SSE 1
#  include <emmintrin.h>
/* dst_even[0..3], dst_odd[0..3] = the even and odd floats of src[0..7] */
#  define DT__WINO_SPLIT8(src, dst_even, dst_odd)                                              \
    do {                                                                                       \
      __m128 lo_ = _mm_loadu_ps(src), hi_ = _mm_loadu_ps((src) + 4);                           \
      _mm_storeu_ps(dst_even, _mm_shuffle_ps(lo_, hi_, _MM_SHUFFLE(2, 0, 2, 0)));               \
      _mm_storeu_ps(dst_odd, _mm_shuffle_ps(lo_, hi_, _MM_SHUFFLE(3, 1, 3, 1)));                \
    } while (0)
/* dst[0..7] = even[0..3] + vb and odd[0..3] + vb, interleaved; with relu,
 * x <= 0 -> +0 (dt__relu_rows' steps) */
#  define DT__WINO_MERGE8(even, odd, vb, relu, dst)                                            \
    do {                                                                                       \
      __m128 e_ = _mm_add_ps(_mm_loadu_ps(even), vb), o_ = _mm_add_ps(_mm_loadu_ps(odd), vb);   \
      if (relu) {                                                                              \
        e_ = _mm_andnot_ps(_mm_cmple_ps(e_, _mm_setzero_ps()), e_);                            \
        o_ = _mm_andnot_ps(_mm_cmple_ps(o_, _mm_setzero_ps()), o_);                            \
      }                                                                                        \
      _mm_storeu_ps(dst, _mm_unpacklo_ps(e_, o_));                                             \
      _mm_storeu_ps((dst) + 4, _mm_unpackhi_ps(e_, o_));                                       \
    } while (0)
/* [*kl, *kh): the k of a padded row (k < lw + 2) whose columns 2k - p and
 * 2k - p + 1 are both inside the image row */
static void dt__wino_inside(const dt__conv_geom *q, int64_t lw, int64_t *kl, int64_t *kh) {
  *kl = (q->p + 1) / 2;
  *kh = DT__MIN((q->w + q->p) / 2, lw + 2);
}
#endif

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

DTRAIN_PRIVATE int dt__wino_use(const dt__conv_geom *q) {
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
#ifdef DT__WINO_SSE
    int64_t kl, kh;
    dt__wino_inside(q, lw, &kl, &kh);
#endif
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
#ifdef DT__WINO_SSE
      if (k == kl && kh - kl >= 4) { /* the inside 4 at a time, the last 4 again where they overlap */
        for (; k + 4 <= kh; k += 4) DT__WINO_SPLIT8(src + 2 * k - q->p, e + k, od + k);
        if (k < kh) DT__WINO_SPLIT8(src + 2 * (kh - 4) - q->p, e + kh - 4, od + kh - 4);
        k = kh - 1;
        continue;
      }
#endif
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
#ifdef DT__WINO_SSE
    int64_t kl, kh;
    dt__wino_inside(q, lw, &kl, &kh);
#endif
    for (int64_t k = 0; k < lw + 2; k++) {
      int64_t c0 = 2 * k - q->p, c1 = c0 + 1;
#ifdef DT__WINO_SSE
      if (k == kl) /* inside the row, 4 pairs at a time */
        for (; k + 4 <= kh; k += 4, c0 += 8, c1 += 8) {
          __m128 ev4 = _mm_loadu_ps(e + k), od4 = _mm_loadu_ps(od + k);
          _mm_storeu_ps(dst + c0, _mm_add_ps(_mm_loadu_ps(dst + c0), _mm_unpacklo_ps(ev4, od4)));
          _mm_storeu_ps(dst + c0 + 4, _mm_add_ps(_mm_loadu_ps(dst + c0 + 4), _mm_unpackhi_ps(ev4, od4)));
        }
      if (k >= lw + 2) break;
#endif
      if (c0 >= 0 && c0 < q->w) dst[c0] += e[k];
      if (c1 >= 0 && c1 < q->w) dst[c1] += od[k];
    }
  }
}
#undef DT__WINO_B

/* Output transform of one output plane [Ho, Wo]: y = A^T m A + bias per tile
 * (then ReLU with relu: dt_conv2d_relu), the parts of the last tiles past
 * Ho, Wo dropped. A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 1]. */
static DT__WINO_INLINE void dt__wino_out(const dt__conv_geom *q, const dt__wino *z, const float *m, int64_t xs, float *y, float bias,
                         int relu, float *scr) {
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
      int64_t full = wo / 2, l = 0;
#ifdef DT__WINO_SSE
      if (full >= 4) { /* 4 pairs at a time, the last 4 again where they overlap */
        const __m128 vb = _mm_set1_ps(bias);
        for (; l + 4 <= full; l += 4) DT__WINO_MERGE8(ev + l, od + l, vb, relu, yr + 2 * l);
        if (l < full) DT__WINO_MERGE8(ev + full - 4, od + full - 4, vb, relu, yr + 2 * (full - 4));
        l = full;
      }
#endif
      for (; l < full; l++) {
        float e = ev[l] + bias, o = od[l] + bias;
        yr[2 * l] = relu && e <= 0.0f ? 0.0f : e;
        yr[2 * l + 1] = relu && o <= 0.0f ? 0.0f : o;
      }
      if (wo % 2) {
        float e = ev[full] + bias;
        yr[wo - 1] = relu && e <= 0.0f ? 0.0f : e;
      }
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
#ifdef DT__WINO_SSE
        int64_t pairs = wo / 2;
        if (pairs >= 4) { /* 4 pairs at a time, the last 4 again where they overlap */
          for (; l + 4 <= pairs; l += 4) DT__WINO_SPLIT8(gr + 2 * l, ev + l, od + l);
          if (l < pairs) DT__WINO_SPLIT8(gr + 2 * (pairs - 4), ev + pairs - 4, od + pairs - 4);
          l = pairs;
        }
#endif
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

/* The kernel transforms below, for kernels [lo, hi) (each kernel alone, so
 * dt__par_range may cut them over the intra-op threads). */
typedef struct dt__wino_kjob {
  const dt__conv_geom *q;
  const float *src;
  float *dst;
} dt__wino_kjob;
#define DT__WINO_K_PAR_MIN 256 /* kernels below which one thread is faster */

/* u[xi][o][c] = (G w[o][c] G^T)[xi] for kernels [lo, hi) of w [O, C, 5, 5],
 * DT__WINO_KL kernels at a time: the lanes of fixed-length loops that the
 * compiler vectorises (the kernels' 25 weights gathered lane by lane first;
 * u is contiguous along the kernels). Each lane gets the operations of one
 * kernel alone, in a fixed order; lanes past hi compute zeros, unstored. */
#define DT__WINO_KL 8
static void dt__wino_kernels_range(void *arg, int64_t lo, int64_t hi) {
  const dt__wino_kjob *kj = (const dt__wino_kjob *)arg;
  const float *w = kj->src;
  float *u = kj->dst;
  int64_t oc = kj->q->o * kj->q->c;
  for (int64_t k0 = lo; k0 < hi; k0 += DT__WINO_KL) {
    int nl = (int)DT__MIN((int64_t)DT__WINO_KL, hi - k0);
    float g[25][DT__WINO_KL], t[6][5][DT__WINO_KL], acc[DT__WINO_KL];
    for (int e = 0; e < 25; e++)
      for (int l = 0; l < DT__WINO_KL; l++) g[e][l] = l < nl ? w[(k0 + l) * 25 + e] : 0.0f;
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        for (int l = 0; l < DT__WINO_KL; l++) acc[l] = 0.0f;
        for (int i = 0; i < 5; i++)
          for (int l = 0; l < DT__WINO_KL; l++) acc[l] += dt__wino_g[a][i] * g[i * 5 + j][l];
        for (int l = 0; l < DT__WINO_KL; l++) t[a][j][l] = acc[l];
      }
    for (int a = 0; a < 6; a++)
      for (int b = 0; b < 6; b++) {
        for (int l = 0; l < DT__WINO_KL; l++) acc[l] = 0.0f;
        for (int j = 0; j < 5; j++)
          for (int l = 0; l < DT__WINO_KL; l++) acc[l] += t[a][j][l] * dt__wino_g[b][j];
        memcpy(u + (a * 6 + b) * oc + k0, acc, (size_t)nl * sizeof(float));
      }
  }
}

static void dt__wino_kernels(const dt__conv_geom *q, const float *w, float *u) {
  dt__wino_kjob j = {q, w, u};
  dt__par_range(q->o * q->c, 16, DT__WINO_K_PAR_MIN, dt__wino_kernels_range, &j);
}

/* The adjoint: gw[o][c] += G^T du[.][o][c] G, kernels [lo, hi), in lanes
 * as above. */
static void dt__wino_kernels_adjoint_range(void *arg, int64_t lo, int64_t hi) {
  const dt__wino_kjob *kj = (const dt__wino_kjob *)arg;
  const float *du = kj->src;
  float *gw = kj->dst;
  int64_t oc = kj->q->o * kj->q->c;
  for (int64_t k0 = lo; k0 < hi; k0 += DT__WINO_KL) {
    int nl = (int)DT__MIN((int64_t)DT__WINO_KL, hi - k0);
    float d[36][DT__WINO_KL], t[6][5][DT__WINO_KL], acc[DT__WINO_KL];
    for (int xi = 0; xi < 36; xi++) {
      memset(d[xi], 0, sizeof d[xi]);
      memcpy(d[xi], du + xi * oc + k0, (size_t)nl * sizeof(float));
    }
    for (int a = 0; a < 6; a++)
      for (int j = 0; j < 5; j++) {
        for (int l = 0; l < DT__WINO_KL; l++) acc[l] = 0.0f;
        for (int b = 0; b < 6; b++)
          for (int l = 0; l < DT__WINO_KL; l++) acc[l] += d[a * 6 + b][l] * dt__wino_g[b][j];
        for (int l = 0; l < DT__WINO_KL; l++) t[a][j][l] = acc[l];
      }
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 5; j++) {
        for (int l = 0; l < DT__WINO_KL; l++) acc[l] = 0.0f;
        for (int a = 0; a < 6; a++)
          for (int l = 0; l < DT__WINO_KL; l++) acc[l] += dt__wino_g[a][i] * t[a][j][l];
        for (int l = 0; l < nl; l++) gw[(k0 + l) * 25 + i * 5 + j] += acc[l];
      }
  }
}

static void dt__wino_kernels_adjoint(const dt__conv_geom *q, const float *du, float *gw) {
  dt__wino_kjob j = {q, du, gw};
  dt__par_range(q->o * q->c, 16, DT__WINO_K_PAR_MIN, dt__wino_kernels_adjoint_range, &j);
}

/* The steps of a group of images, each split over the intra-op threads by
 * planes (transforms) or by xi (GEMMs): every part writes its own planes or
 * matrices, each computed exactly as on one thread, so results do not
 * depend on the number of threads. */
enum { DT__WINO_IN, DT__WINO_MUL, DT__WINO_OUT, DT__WINO_OUT_ADJ, DT__WINO_MUL_DU, DT__WINO_MUL_DV, DT__WINO_IN_ADJ };
typedef struct dt__wino_job {
  const dt__conv_geom *q;
  const dt__wino *z;
  int step, relu;
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
                     jb->b ? jb->b[i] : 0.0f, jb->relu, scr);
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
#ifdef DT__WINO_AVX2
__attribute__((target("avx2"))) static void dt__wino_part_avx2(void *arg, int part, int nparts) {
  dt__wino_part_body(arg, part, nparts);
}
#endif

static void dt__wino_run(dt__wino_job *jb, int step, int parts) {
  jb->step = step;
#ifdef DT__WINO_AVX2
  if (dt__simd_level() >= DT__SIMD_AVX2) { /* the GEMM's path: DTRAIN_ISA=portable runs the plain copy */
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

DTRAIN_PRIVATE void dt__wino_forward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *b,
                             int relu, float *y) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  dt__arena_pos scratch = dt__arena_mark(g); /* U, V, M and the per-thread scratch: this call's only */
  float *u = dt__arena_floats(g, 36 * q->o * q->c);
  int parts = dt__wino_setup(g, &jb, q, &z, 1, 0);
  if (!parts || g->err != DTRAIN_OK) return;
  dt__wino_kernels(q, w, u);
  jb.u = u;
  jb.x = x;
  jb.b = b;
  jb.relu = relu;
  jb.y = y;
  for (int64_t n0 = 0; n0 < q->n; n0 += z.nb) {
    dt__wino_group(&jb, n0);
    dt__wino_run(&jb, DT__WINO_IN, parts);
    dt__wino_run(&jb, DT__WINO_MUL, parts);
    dt__wino_run(&jb, DT__WINO_OUT, parts);
  }
  dt__arena_release(g, scratch);
}

/* gy: the output gradient; m holds dM. */
DTRAIN_PRIVATE void dt__wino_backward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *gy,
                              float *gx, float *gw) {
  dt__wino z;
  dt__wino_job jb;
  dt__wino_geometry(q, &z);
  int64_t oc = q->o * q->c;
  dt__arena_pos scratch = dt__arena_mark(g); /* everything below is this call's only (backward recomputes V) */
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
  dt__arena_release(g, scratch);
}

#undef DT__WINO_L
#undef DT__WINO_K_PAR_MIN
#undef DT__WINO_KL
#ifdef DT__WINO_SSE
#  undef DT__WINO_SSE
#  undef DT__WINO_SPLIT8
#  undef DT__WINO_MERGE8
#endif
#undef DT__WINO_COLS
#undef DT__WINO_INLINE
#undef DT__WV_LD
#undef DT__WV_ST
#undef DT__WV_ADD
#undef DT__WV_SUB
#undef DT__WV_MUL
#undef DT__WV_KEEP
#undef DT__WV_NEG
#ifdef DT__WINO_AVX2
#  undef DT__WINO_AVX2
#endif
