/* ===========================================================================
 * dt_ops_pool.c -- max and average pooling, NCHW
 * ===========================================================================
 * No padding; Ho = (H - k)/s + 1. iaux: kernel, stride. Max pooling routes
 * the gradient to the first maximum of each window; a NaN wins, and of
 * several NaNs the last one takes the gradient (PyTorch's rule: its scan
 * takes every NaN it meets).
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__POOL_SSE 1
#  include <emmintrin.h>
#endif
#if defined(DT__POOL_SSE) && defined(DT__X86_SIMD) /* dt_ops_internal.h: AVX2 picked at run time */
#  define DT__POOL_AVX2 1
#  include <immintrin.h>
#endif

/* Checks the arguments (dt__begin included); 0 when g has failed. */
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
#ifdef DT__POOL_SSE
static __m128 dt__pool_max4(__m128 best, __m128 v) {
  __m128 take = _mm_or_ps(_mm_cmpgt_ps(v, best), _mm_and_ps(_mm_cmpunord_ps(v, v), _mm_cmpord_ps(best, best)));
  return _mm_or_ps(_mm_and_ps(take, v), _mm_andnot_ps(take, best));
}

/* 2x2 windows, stride 2: 4 outputs from 2 x 8 inputs (rows r0, r1 at the
 * windows' first column). */
static void dt__pool2_fwd4(const float *r0, const float *r1, float *yo) {
  __m128 a0 = _mm_loadu_ps(r0), a1 = _mm_loadu_ps(r0 + 4);
  __m128 b0 = _mm_loadu_ps(r1), b1 = _mm_loadu_ps(r1 + 4);
  __m128 best = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
  best = dt__pool_max4(best, _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
  best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)));
  best = dt__pool_max4(best, _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm_storeu_ps(yo, best);
}

/* The backward of 4 such windows: g0, g1 (x's gradient rows) += go at each
 * window's winner, in the lanes of keep (all ones, or the windows not done
 * yet when the last 4 of a row overlap the ones before). */
static void dt__pool2_bwd4(const float *r0, const float *r1, float *g0, float *g1, const float *yd, const float *go,
                           __m128 keep) {
  __m128 best = _mm_loadu_ps(yd), gv = _mm_and_ps(keep, _mm_loadu_ps(go));
  __m128 bnan = _mm_cmpunord_ps(best, best);
  __m128 a0 = _mm_loadu_ps(r0), a1 = _mm_loadu_ps(r0 + 4);
  __m128 b0 = _mm_loadu_ps(r1), b1 = _mm_loadu_ps(r1 + 4);
  __m128 v[4], e[4];
  v[0] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
  v[1] = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
  v[2] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
  v[3] = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
  __m128 taken = _mm_setzero_ps(), taken_nan = _mm_setzero_ps();
  for (int t = 0; t < 4; t++) { /* a NaN never compares equal: only the lanes with a number */
    __m128 eq = _mm_andnot_ps(taken, _mm_cmpeq_ps(v[t], best)); /* the first match only */
    taken = _mm_or_ps(taken, eq);
    e[t] = eq;
  }
  for (int t = 3; t >= 0; t--) { /* the lanes whose output is NaN: the last NaN */
    __m128 isn = _mm_andnot_ps(taken_nan, _mm_and_ps(bnan, _mm_cmpunord_ps(v[t], v[t])));
    taken_nan = _mm_or_ps(taken_nan, isn);
    e[t] = _mm_and_ps(_mm_or_ps(e[t], isn), gv);
  }
  _mm_storeu_ps(g0, _mm_add_ps(_mm_loadu_ps(g0), _mm_unpacklo_ps(e[0], e[1])));
  _mm_storeu_ps(g0 + 4, _mm_add_ps(_mm_loadu_ps(g0 + 4), _mm_unpackhi_ps(e[0], e[1])));
  _mm_storeu_ps(g1, _mm_add_ps(_mm_loadu_ps(g1), _mm_unpacklo_ps(e[2], e[3])));
  _mm_storeu_ps(g1 + 4, _mm_add_ps(_mm_loadu_ps(g1 + 4), _mm_unpackhi_ps(e[2], e[3])));
}
#endif

#ifdef DT__POOL_AVX2
/* The same 2x2 windows 8 at a time (AVX2): the even and odd columns of 16
 * inputs come out of the in-lane shuffles as windows 0 1 4 5 | 2 3 6 7, so
 * the outputs and gradients are loaded and stored through the one
 * permutation that swaps the middle 64-bit pairs; the unpacks then give the
 * inputs' own order back. Each lane has the SSE block's operations: the same
 * bits. Both return the windows done, a multiple of 8. */
#  define DT__POOL_SWAP(v) _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8))
__attribute__((target("avx2"))) static __m256 dt__pool_max8(__m256 best, __m256 v) {
  __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                             _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q)));
  return _mm256_or_ps(_mm256_and_ps(take, v), _mm256_andnot_ps(take, best));
}

__attribute__((target("avx2"))) static int64_t dt__pool2_fwd_row_avx2(const float *r0, const float *r1, float *yo,
                                                                      int64_t wo) {
  int64_t ow = 0;
  for (; ow + 8 <= wo; ow += 8) {
    __m256 a0 = _mm256_loadu_ps(r0 + 2 * ow), a1 = _mm256_loadu_ps(r0 + 2 * ow + 8);
    __m256 b0 = _mm256_loadu_ps(r1 + 2 * ow), b1 = _mm256_loadu_ps(r1 + 2 * ow + 8);
    __m256 best = _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
    best = dt__pool_max8(best, _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
    best = dt__pool_max8(best, _mm256_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)));
    best = dt__pool_max8(best, _mm256_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(yo + ow, DT__POOL_SWAP(best));
  }
  return ow;
}

__attribute__((target("avx2"))) static int64_t dt__pool2_bwd_row_avx2(const float *r0, const float *r1, float *g0,
                                                                      float *g1, const float *yd, const float *go,
                                                                      int64_t wo) {
  int64_t ow = 0;
  for (; ow + 8 <= wo; ow += 8) {
    __m256 best = DT__POOL_SWAP(_mm256_loadu_ps(yd + ow)), gv = DT__POOL_SWAP(_mm256_loadu_ps(go + ow));
    __m256 bnan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    __m256 a0 = _mm256_loadu_ps(r0 + 2 * ow), a1 = _mm256_loadu_ps(r0 + 2 * ow + 8);
    __m256 b0 = _mm256_loadu_ps(r1 + 2 * ow), b1 = _mm256_loadu_ps(r1 + 2 * ow + 8);
    __m256 v[4], e[4];
    v[0] = _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
    v[1] = _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
    v[2] = _mm256_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
    v[3] = _mm256_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
    __m256 taken = _mm256_setzero_ps(), taken_nan = _mm256_setzero_ps();
    for (int t = 0; t < 4; t++) {
      __m256 eq = _mm256_andnot_ps(taken, _mm256_cmp_ps(v[t], best, _CMP_EQ_OQ));
      taken = _mm256_or_ps(taken, eq);
      e[t] = eq;
    }
    for (int t = 3; t >= 0; t--) {
      __m256 isn = _mm256_andnot_ps(taken_nan, _mm256_and_ps(bnan, _mm256_cmp_ps(v[t], v[t], _CMP_UNORD_Q)));
      taken_nan = _mm256_or_ps(taken_nan, isn);
      e[t] = _mm256_and_ps(_mm256_or_ps(e[t], isn), gv);
    }
    float *p0 = g0 + 2 * ow, *p1 = g1 + 2 * ow;
    _mm256_storeu_ps(p0, _mm256_add_ps(_mm256_loadu_ps(p0), _mm256_unpacklo_ps(e[0], e[1])));
    _mm256_storeu_ps(p0 + 8, _mm256_add_ps(_mm256_loadu_ps(p0 + 8), _mm256_unpackhi_ps(e[0], e[1])));
    _mm256_storeu_ps(p1, _mm256_add_ps(_mm256_loadu_ps(p1), _mm256_unpacklo_ps(e[2], e[3])));
    _mm256_storeu_ps(p1 + 8, _mm256_add_ps(_mm256_loadu_ps(p1 + 8), _mm256_unpackhi_ps(e[2], e[3])));
  }
  return ow;
}
#  undef DT__POOL_SWAP
#endif

/* Backward finds the winner again instead of keeping an index per output
 * from the forward pass: the first element of the window equal to the
 * output is the element the forward pass picked, since the maximum is the
 * first occurrence of its value; when the output is NaN, the last NaN of
 * the window (in row-major order) takes the gradient, as in PyTorch. */
/* Max pooling over the planes [p0, p1) (an image's channel each): the
 * forward pass (gx NULL: y = the window maxima) or the backward one (gx
 * += the gradient at each window's winner). Planes are independent, so
 * dt__pool_max splits them over the intra-op threads with the same result. */
typedef struct dt__pool_job {
  const float *x, *yd, *go;
  float *y, *gx;
  int64_t planes, h, w, ho, wo, k, s;
  int zero_gx; /* backward: gx holds nothing yet, each plane is zeroed just before its pass */
} dt__pool_job;

static void dt__pool_max_bwd_planes(const dt__pool_job *jb, int64_t p0, int64_t p1) {
  int64_t k = jb->k, s = jb->s, h = jb->h, w = jb->w, ho = jb->ho, wo = jb->wo;
  const float *go = jb->go, *yd = jb->yd;
#ifdef DT__POOL_AVX2
  const int avx2 = dt__simd_level() >= DT__SIMD_AVX2;
#endif
  for (int64_t pl = p0; pl < p1; pl++) {
    const float *xp = jb->x + pl * h * w;
    float *gp = jb->gx + pl * h * w;
    if (jb->zero_gx) memset(gp, 0, (size_t)(h * w) * sizeof(float)); /* in L1, not a pass over all of gx */
    for (int64_t oh = 0; oh < ho; oh++) {
      int64_t ow = 0;
#ifdef DT__POOL_SSE
      if (k == 2 && s == 2 && wo >= 4) { /* masks of the winners, no branches; no scalar tail */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
        float *g0 = gp + 2 * oh * w, *g1 = g0 + w;
        const float *yr = yd + (pl * ho + oh) * wo, *gr = go + (pl * ho + oh) * wo;
        const __m128 all = _mm_castsi128_ps(_mm_set1_epi32(-1));
#  ifdef DT__POOL_AVX2
        if (avx2) ow = dt__pool2_bwd_row_avx2(r0, r1, g0, g1, yr, gr, wo);
#  endif
        for (; ow + 4 <= wo; ow += 4)
          dt__pool2_bwd4(r0 + 2 * ow, r1 + 2 * ow, g0 + 2 * ow, g1 + 2 * ow, yr + ow, gr + ow, all);
        if (ow < wo) { /* the last 4 windows, lanes of the ones before masked off */
          int64_t o4 = wo - 4;
          int done = (int)(ow - o4); /* 1..3: keep the lanes l >= done */
          __m128 keep = _mm_castsi128_ps(_mm_cmpgt_epi32(_mm_set_epi32(3, 2, 1, 0), _mm_set1_epi32(done - 1)));
          dt__pool2_bwd4(r0 + 2 * o4, r1 + 2 * o4, g0 + 2 * o4, g1 + 2 * o4, yr + o4, gr + o4, keep);
          ow = wo;
        }
      }
#endif
      for (; ow < wo; ow++) {
        int64_t o = (pl * ho + oh) * wo + ow, at = oh * s * w + ow * s, t0 = at;
        float best = yd[o];
        if (best != best) { /* the last NaN: a forward scan, the last match stays */
          for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < k; j++)
              if (xp[t0 + i * w + j] != xp[t0 + i * w + j]) at = t0 + i * w + j;
        } else {
          /* Scan backwards so that the first match is the one that stays;
           * no early exit, so the compiler can use conditional moves. */
          for (int64_t i = k - 1; i >= 0; i--) {
            for (int64_t j = k - 1; j >= 0; j--) {
              int64_t t = t0 + i * w + j;
              if (xp[t] == best) at = t;
            }
          }
        }
        gp[at] += go[o];
      }
    }
  }
}

static void dt__pool_max_fwd_planes(const dt__pool_job *jb, int64_t p0, int64_t p1) {
  int64_t k = jb->k, s = jb->s, h = jb->h, w = jb->w, ho = jb->ho, wo = jb->wo;
#ifdef DT__POOL_AVX2
  const int avx2 = dt__simd_level() >= DT__SIMD_AVX2;
#endif
  for (int64_t pl = p0; pl < p1; pl++) {
    const float *xp = jb->x + pl * h * w;
    for (int64_t oh = 0; oh < ho; oh++) {
      float *yo = jb->y + (pl * ho + oh) * wo;
      int64_t ow = 0;
#ifdef DT__POOL_SSE
      if (k == 2 && s == 2 && wo >= 4) { /* the common 2x2 pooling; the last 4 windows may overlap the ones before */
        const float *r0 = xp + 2 * oh * w, *r1 = r0 + w;
#  ifdef DT__POOL_AVX2
        if (avx2) ow = dt__pool2_fwd_row_avx2(r0, r1, yo, wo);
#  endif
        for (; ow + 4 <= wo; ow += 4) dt__pool2_fwd4(r0 + 2 * ow, r1 + 2 * ow, yo + ow);
        if (ow < wo) dt__pool2_fwd4(r0 + 2 * (wo - 4), r1 + 2 * (wo - 4), yo + wo - 4);
        ow = wo;
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
}

static void dt__pool_max_part(void *arg, int part, int nparts) {
  const dt__pool_job *jb = (const dt__pool_job *)arg;
  int64_t p0 = jb->planes * part / nparts, p1 = jb->planes * (part + 1) / nparts;
  if (jb->gx) dt__pool_max_bwd_planes(jb, p0, p1);
  else dt__pool_max_fwd_planes(jb, p0, p1);
}

#define DT__POOL_PAR_MIN ((int64_t)1 << 15) /* window inputs below which one thread is faster */

/* Runs the job over all planes, split over the intra-op threads when it is large. */
static void dt__pool_max(dt__pool_job *jb) {
  int t = dt__par_threads();
  if (t > 1 && jb->planes >= 2 && jb->planes * jb->ho * jb->wo * jb->k * jb->k >= DT__POOL_PAR_MIN)
    dt__par_run((int)DT__MIN((int64_t)t, jb->planes), dt__pool_max_part, jb);
  else
    dt__pool_max_part(jb, 0, 1);
}

static dt__pool_job dt__pool_job_of(dt_tensor *x, dt_tensor *y, int64_t k, int64_t s) {
  dt__pool_job jb;
  memset(&jb, 0, sizeof jb);
  jb.x = x->data;
  jb.y = y->data;
  jb.planes = y->shape[0] * y->shape[1];
  jb.h = x->shape[2];
  jb.w = x->shape[3];
  jb.ho = y->shape[2];
  jb.wo = y->shape[3];
  jb.k = k;
  jb.s = s;
  return jb;
}

static void dt__pool_max_backward(dt_graph *g, dt_tensor *y) {
  dt_tensor *x = y->src[0];
  int fresh = 0; /* x's gradient not yet written: zeroed plane by plane below, not all at once here */
  float *gx = dt__grad_first(g, x, &fresh);
  if (!gx) return;
  dt__pool_job jb = dt__pool_job_of(x, y, y->iaux[0], y->iaux[1]);
  jb.yd = y->data;
  jb.go = y->grad;
  jb.gx = gx;
  jb.zero_gx = fresh;
  dt__pool_max(&jb);
}

DTRAIN_API dt_tensor *dt_max_pool2d(dt_graph *g, dt_tensor *x, int kernel, int stride) {
  static const char *op = "dt_max_pool2d";
  if (!dt__pool_check(g, op, x, kernel, stride)) return NULL;
  if (g->device) return dt__dev_pool(g, x, kernel, stride, 1, op);
  dt_tensor *y = dt__pool_new(g, op, x, kernel, stride);
  if (!y) return NULL;
  dt__pool_job jb = dt__pool_job_of(x, y, kernel, stride);
  dt__pool_max(&jb);
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

#ifdef DT__POOL_SSE
#  undef DT__POOL_SSE
#endif
#undef DT__POOL_PAR_MIN
