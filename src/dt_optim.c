/* ===========================================================================
 * dt_optim.c -- SGD, Adam, AdamW, RMSprop; learning-rate schedules; clipping
 * ===========================================================================
 * The update rules follow PyTorch's single-tensor implementations (torch.optim,
 * foreach=False) operation by operation, in float, with the per-step scalars
 * (bias corrections, lr * weight decay) computed in double like Python does.
 *
 * State slots (dt_optim_state):
 *   SGD      slot 0: momentum buffer (only when momentum > 0)
 *   Adam(W)  slot 0: first moment m, slot 1: second moment v
 *   RMSprop  slot 0: square average v, slot 1: momentum buffer (momentum > 0)
 * Every slot has the params' layout, so a range [begin,end) of the flat
 * buffers uses the same range of each slot.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_memory.h"
#include "dt_device.h"
#include "dt_optim_math.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_optim_internal.h"

/* The Adam update in SIMD: the same float operations in the same order as
 * the shared formula dt__optim_adam_at (dt_optim_math.h; no FMA), so the
 * results are the same bit for bit, and sqrt/div do not go through libm.
 * A change to the formula must be made here too: tests/test_optim.c
 * compares the two bit for bit. SSE is baseline on x86-64; an AVX version
 * (8 floats, twice as fast) and an AVX-512 one (16: the divides and square
 * roots bound this loop, and a 512-bit core does twice the lanes per
 * instruction) are picked at run time with GCC or clang, at the GEMM's
 * instruction set (dt__simd_level: DTRAIN_ISA forces one). */
#if !defined(DTRAIN_NO_SIMD) && defined(__SSE2__)
#  define DT__OPTIM_SSE 1
#  include <emmintrin.h>
#  if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#    define DT__OPTIM_AVX 1
#    include <immintrin.h>
#  endif
#endif

struct dt_optim {
  dt_optim_desc desc;   /* filled: zero fields replaced by their defaults */
  dt_params *params;
  size_t size;          /* dt_params_size() at creation */
  int64_t steps;        /* completed steps */
  int nslots;
  float *state[2];      /* nslots buffers of `size` floats */
  /* device state (dt_optim_step_graph on a device graph) */
  dt_device *dev;
  float *dstate[2];
  float *dscratch;      /* one float: the sum of squares for clipping */
  unsigned host_mirror; /* bit s: dt_optim_state(s) handed out the host copy of a
                           device slot; it goes back up before the next device step */
};

/* An optimizer: its row of dt__optim_rules (below, after the update functions). */
typedef struct dt__optim_rule {
  dt_optim_kind kind;
  const char *name;              /* "adamw": checkpoints (dt__optim_kind_name) */
  const char *slot_names[2];     /* PyTorch's names of the state slots */
  float default_lr;              /* for desc.lr == 0 */
  int slots;                     /* state slots it always has ... */
  int momentum_slot;             /* ... plus one when momentum > 0 (1) or not (0) */
  /* Updates n elements: p (data), g (grad), s0/s1 (the state slots, NULL
   * beyond nslots) already offset to the range; wd is the weight decay of
   * this parameter (0 where decay is off). */
  void (*update)(const dt_optim *o, float lr, float wd, float *p, const float *g, float *s0, float *s1, size_t n);
  /* Optional: d = the update of x minus x (the same floats as update on a
   * copy of x, then the difference), x left as it is; NULL: done that way. */
  void (*delta)(const dt_optim *o, float lr, float wd, const float *x, float *d, const float *g, float *s0, float *s1,
                size_t n);
  dt_kernel kernel;              /* the device kernel (0: none) ... */
  void (*kernel_args)(const dt_optim *o, float lr, float wd, dt_kernel_args *a); /* ... and its scalars */
} dt__optim_rule;
/* The row for kind; NULL for a kind without one. */
static const dt__optim_rule *dt__optim_rule_of(dt_optim_kind kind);
static int dt__optim_nslots(const dt__optim_rule *rule, const dt_optim_desc *d);

/* ---- learning-rate schedules ------------------------------------------------------ */

DTRAIN_API float dt_schedule_lr(const dt_schedule *s, float lr, int64_t step) {
  if (!s) return lr;
  if (step < 0) step = 0;
  if (s->warmup_steps > 0 && step < s->warmup_steps)
    return (float)((double)lr * (double)(step + 1) / (double)s->warmup_steps);
  int64_t t = step - (s->warmup_steps > 0 ? s->warmup_steps : 0);
  switch (s->kind) {
    case DTRAIN_SCHED_STEP: {
      if (s->step_size <= 0) return lr;
      double gamma = s->gamma != 0.0f ? (double)s->gamma : 0.1;
      return (float)((double)lr * pow(gamma, (double)(t / s->step_size)));
    }
    case DTRAIN_SCHED_COSINE: {
      double lo = (double)s->min_lr;
      if (s->total_steps <= 0 || t >= s->total_steps) return s->min_lr;
      double c = cos(3.14159265358979323846 * (double)t / (double)s->total_steps);
      return (float)(lo + ((double)lr - lo) * (1.0 + c) * 0.5);
    }
    case DTRAIN_SCHED_CONSTANT:
    default: return lr;
  }
}

/* ---- gradient clipping -------------------------------------------------------------- */

DTRAIN_API float dt_clip_grad_norm(float *grad, size_t n, float max_norm) {
  if (!grad && n > 0) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_clip_grad_norm: grad is NULL");
    return -1.0f;
  }
  if (!(max_norm > 0.0f)) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_clip_grad_norm: max_norm %g must be > 0", (double)max_norm);
    return -1.0f;
  }
  double norm = dt_l2_norm(grad, n);
  float coef = isfinite(norm) ? dt__clip_scale(norm, max_norm) : 1.0f;
  if (coef != 1.0f)
    for (size_t i = 0; i < n; i++) grad[i] *= coef;
  return (float)norm;
}

/* ---- create / destroy ------------------------------------------------------------------ */

static int dt__optim_bad01(float x) { return !(x >= 0.0f && x < 1.0f); }

/* Checks the schedule; returns DTRAIN_OK or records an error. */
static dt_result dt__optim_check_schedule(const dt_schedule *s) {
  const char *fn = "dt_optim_create";
  if (s->warmup_steps < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: schedule warmup_steps %lld < 0", fn, (long long)s->warmup_steps);
  switch (s->kind) {
    case DTRAIN_SCHED_CONSTANT: return DTRAIN_OK;
    case DTRAIN_SCHED_STEP:
      if (s->step_size <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: step schedule needs step_size >= 1 (got %lld)", fn,
                         (long long)s->step_size);
      if (!(s->gamma >= 0.0f))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: step schedule gamma %g < 0", fn, (double)s->gamma);
      return DTRAIN_OK;
    case DTRAIN_SCHED_COSINE:
      if (s->total_steps <= 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: cosine schedule needs total_steps >= 1 (got %lld)", fn,
                         (long long)s->total_steps);
      if (!(s->min_lr >= 0.0f))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: cosine schedule min_lr %g < 0", fn, (double)s->min_lr);
      return DTRAIN_OK;
    default: return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown schedule kind %d", fn, (int)s->kind);
  }
}

/* Fills defaults into d and validates it. */
static dt_result dt__optim_fill(dt_optim_desc *d) {
  const char *fn = "dt_optim_create";
  const dt__optim_rule *rule = dt__optim_rule_of(d->kind);
  if (!rule) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown optimizer kind %d", fn, (int)d->kind);
  if (!(d->lr >= 0.0f) || !isfinite(d->lr))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: lr %g must be finite and >= 0", fn, (double)d->lr);
  if (!(d->momentum >= 0.0f) || !isfinite(d->momentum))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: momentum %g must be finite and >= 0", fn, (double)d->momentum);
  if (d->nesterov && d->kind != DTRAIN_OPTIM_SGD)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: nesterov applies to SGD only", fn);
  if (d->nesterov && d->momentum == 0.0f)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: nesterov needs momentum > 0", fn);
  if (!(d->weight_decay >= 0.0f) || !isfinite(d->weight_decay))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: weight_decay %g must be finite and >= 0", fn,
                     (double)d->weight_decay);
  if (dt__optim_bad01(d->beta1) || dt__optim_bad01(d->beta2))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: betas (%g, %g) must lie in [0, 1)", fn, (double)d->beta1,
                     (double)d->beta2);
  if (!(d->eps >= 0.0f) || !isfinite(d->eps))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: eps %g must be finite and >= 0", fn, (double)d->eps);
  if (dt__optim_bad01(d->alpha))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: alpha %g must lie in [0, 1)", fn, (double)d->alpha);
  if (!(d->clip_norm >= 0.0f))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: clip_norm %g must be >= 0 (0: no clipping)", fn,
                     (double)d->clip_norm);
  dt_result r = dt__optim_check_schedule(&d->schedule);
  if (r != DTRAIN_OK) return r;
  if (d->lr == 0.0f) d->lr = rule->default_lr;
  if (d->beta1 == 0.0f) d->beta1 = 0.9f;
  if (d->beta2 == 0.0f) d->beta2 = 0.999f;
  if (d->eps == 0.0f) d->eps = 1e-8f;
  if (d->alpha == 0.0f) d->alpha = 0.99f;
  if (d->schedule.kind == DTRAIN_SCHED_STEP && d->schedule.gamma == 0.0f) d->schedule.gamma = 0.1f;
  return DTRAIN_OK;
}

DTRAIN_API dt_optim_options dt_optim_defaults(dt_optim_kind kind) {
  dt_optim_options o;
  memset(&o, 0, sizeof o);
  o.kind = kind;
  return o;
}

DTRAIN_API dt_optim *dt_optim_create(dt_params *p, const dt_optim_desc *desc) {
  if (!p || !desc) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_create: %s is NULL", !p ? "params" : "desc");
    return NULL;
  }
  dt_optim_desc d = *desc;
  if (dt__optim_fill(&d) != DTRAIN_OK) return NULL;
  size_t n = dt_params_size(p), bytes;
  if (!dt__mul_size(n, sizeof(float), &bytes)) {
    dt__error(DTRAIN_ERR_OVERFLOW, "dt_optim_create: state of %zu floats is too large", n);
    return NULL;
  }
  dt_optim *o = (dt_optim *)dt__calloc(sizeof *o);
  if (!o) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_optim_create: out of memory");
    return NULL;
  }
  o->desc = d;
  o->params = p;
  o->size = n;
  o->nslots = dt__optim_nslots(dt__optim_rule_of(d.kind), &d);
  for (int s = 0; s < o->nslots; s++) {
    o->state[s] = (float *)dt__calloc(bytes);
    if (!o->state[s]) {
      dt__error(DTRAIN_ERR_NOMEM, "dt_optim_create: out of memory for %d state buffers of %zu floats", o->nslots, n);
      dt_optim_destroy(o);
      return NULL;
    }
  }
  return o;
}

DTRAIN_API void dt_optim_destroy(dt_optim *o) {
  if (!o) return;
  for (int s = 0; s < 2; s++) dt__free(o->state[s], o->size * sizeof(float));
  if (o->dev) {
    for (int s = 0; s < 2; s++)
      if (o->dstate[s]) o->dev->free(o->dev, o->dstate[s], o->size * sizeof(float));
    if (o->dscratch) o->dev->free(o->dev, o->dscratch, sizeof(float));
  }
  dt__free(o, sizeof *o);
}

/* ---- update kernels ------------------------------------------------------------------
 * Each updates n elements: p (data), g (grad), s0/s1 (state) already offset to
 * the range. wd is the weight decay of this parameter (0 where decay is off).
 * The math of one element is dt_optim_math.h's, shared with the CUDA kernels. */

/* The per-step scalars of each optimizer (dt_optim_math.h), computed once
 * here for the CPU loops and for the device kernels' arguments alike. */
static dt__optim_sgd_k dt__optim_sgd_scalars(const dt_optim *o, float lr, float wd) {
  dt__optim_sgd_k k;
  k.lr = lr;
  k.wd = wd;
  k.mom = o->desc.momentum;
  k.nesterov = o->desc.nesterov;
  return k;
}

/* The two bias corrections of step t, 1 - b1^t and 1 - b2^t, kept for the
 * thread's last (b1, b2, t): an update runs the kernel once a parameter, and
 * an async push once a block of each (a push of the MLP made 230 pow calls,
 * 1% of an async replica's step). The same pow calls, so the same values. */
static void dt__optim_adam_bc(double b1, double b2, double t, double *bc1, double *bc2) {
  static DT__TLS double last[5]; /* b1, b2, t, bc1, bc2; t = 0 never asked */
  if (!(last[2] == t && last[0] == b1 && last[1] == b2)) {
    last[0] = b1;
    last[1] = b2;
    last[2] = t;
    last[3] = 1.0 - pow(b1, t);
    last[4] = 1.0 - pow(b2, t);
  }
  *bc1 = last[3];
  *bc2 = last[4];
}

/* Python's arithmetic: the bias corrections and lr * wd in double. */
static dt__optim_adam_k dt__optim_adam_scalars(const dt_optim *o, float lr, float wd, int decoupled) {
  const double b1 = (double)o->desc.beta1, b2 = (double)o->desc.beta2;
  const double t = (double)(o->steps + 1);
  double bc1, bc2;
  dt__optim_adam_bc(b1, b2, t, &bc1, &bc2);
  dt__optim_adam_k k;
  k.step_size = (float)((double)lr / bc1);
  k.wd = wd;
  k.bc2_sqrt = (float)sqrt(bc2);
  k.eps = o->desc.eps;
  k.w1 = (float)(1.0 - b1);
  k.w2 = (float)(1.0 - b2);
  k.beta2 = o->desc.beta2;
  k.shrink = (float)(1.0 - (double)lr * (double)wd); /* AdamW */
  k.decoupled = decoupled;
  return k;
}

static dt__optim_rmsprop_k dt__optim_rmsprop_scalars(const dt_optim *o, float lr, float wd) {
  dt__optim_rmsprop_k k;
  k.lr = lr;
  k.wd = wd;
  k.alpha = o->desc.alpha;
  k.w = (float)(1.0 - (double)o->desc.alpha);
  k.mom = o->desc.momentum;
  k.eps = o->desc.eps;
  return k;
}

static void dt__optim_sgd(const dt_optim *o, float lr, float wd, float *DT__RESTRICT p,
                          const float *DT__RESTRICT g, float *DT__RESTRICT buf, float *unused, size_t n) {
  (void)unused;
  const dt__optim_sgd_k k = dt__optim_sgd_scalars(o, lr, wd);
  for (size_t i = 0; i < n; i++) dt__optim_sgd_at(k, p, g, buf, i);
}

#ifdef DT__OPTIM_SSE
/* Elements [0, n - n%4) of the Adam update: dt__optim_adam_at four at a
 * time, operation by operation; returns how many it did. */
static size_t dt__optim_adam_sse(float w1, float w2, float fb2, float eps, float bc2_sqrt, float step_size, float wd,
                                 int decoupled, float shrink, float *p, const float *DT__RESTRICT g,
                                 float *DT__RESTRICT m, float *DT__RESTRICT v, size_t n, const float *x, int delta) {
  const __m128 vw1 = _mm_set1_ps(w1), vw2 = _mm_set1_ps(w2), vb2 = _mm_set1_ps(fb2), veps = _mm_set1_ps(eps);
  const __m128 vbc2 = _mm_set1_ps(bc2_sqrt), vstep = _mm_set1_ps(step_size), vwd = _mm_set1_ps(wd);
  const __m128 vshrink = _mm_set1_ps(shrink);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128 d = _mm_loadu_ps(g + i), xv = _mm_loadu_ps(x + i), mv = _mm_loadu_ps(m + i), vv = _mm_loadu_ps(v + i);
    __m128 pv = xv;
    if (wd != 0.0f) {
      if (decoupled) pv = _mm_mul_ps(pv, vshrink);
      else d = _mm_add_ps(d, _mm_mul_ps(vwd, pv));
    }
    mv = _mm_add_ps(mv, _mm_mul_ps(vw1, _mm_sub_ps(d, mv)));
    vv = _mm_add_ps(_mm_mul_ps(vv, vb2), _mm_mul_ps(_mm_mul_ps(vw2, d), d));
    __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vv), vbc2), veps);
    pv = _mm_sub_ps(pv, _mm_mul_ps(vstep, _mm_div_ps(mv, denom)));
    _mm_storeu_ps(m + i, mv);
    _mm_storeu_ps(v + i, vv);
    _mm_storeu_ps(p + i, delta ? _mm_sub_ps(pv, xv) : pv);
  }
  return i;
}
#endif

#ifdef DT__OPTIM_AVX
/* The same as dt__optim_adam_sse, 8 elements at a time. */
__attribute__((target("avx"))) static size_t dt__optim_adam_avx(float w1, float w2, float fb2, float eps,
                                                                float bc2_sqrt, float step_size, float wd,
                                                                int decoupled, float shrink, float *p,
                                                                const float *DT__RESTRICT g, float *DT__RESTRICT m,
                                                                float *DT__RESTRICT v, size_t n, const float *x,
                                                                int delta) {
  const __m256 vw1 = _mm256_set1_ps(w1), vw2 = _mm256_set1_ps(w2), vb2 = _mm256_set1_ps(fb2);
  const __m256 veps = _mm256_set1_ps(eps), vbc2 = _mm256_set1_ps(bc2_sqrt), vstep = _mm256_set1_ps(step_size);
  const __m256 vwd = _mm256_set1_ps(wd), vshrink = _mm256_set1_ps(shrink);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 d = _mm256_loadu_ps(g + i), xv = _mm256_loadu_ps(x + i), pv = xv;
    __m256 mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    if (wd != 0.0f) {
      if (decoupled) pv = _mm256_mul_ps(pv, vshrink);
      else d = _mm256_add_ps(d, _mm256_mul_ps(vwd, pv));
    }
    mv = _mm256_add_ps(mv, _mm256_mul_ps(vw1, _mm256_sub_ps(d, mv)));
    vv = _mm256_add_ps(_mm256_mul_ps(vv, vb2), _mm256_mul_ps(_mm256_mul_ps(vw2, d), d));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), vbc2), veps);
    pv = _mm256_sub_ps(pv, _mm256_mul_ps(vstep, _mm256_div_ps(mv, denom)));
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    _mm256_storeu_ps(p + i, delta ? _mm256_sub_ps(pv, xv) : pv);
  }
  return i;
}
#endif

#ifdef DT__OPTIM_AVX
/* The same as dt__optim_adam_sse, 16 elements at a time. */
__attribute__((target("avx512f"))) static size_t dt__optim_adam_avx512(float w1, float w2, float fb2, float eps,
                                                                       float bc2_sqrt, float step_size, float wd,
                                                                       int decoupled, float shrink, float *p,
                                                                       const float *DT__RESTRICT g,
                                                                       float *DT__RESTRICT m, float *DT__RESTRICT v,
                                                                       size_t n, const float *x, int delta) {
  const __m512 vw1 = _mm512_set1_ps(w1), vw2 = _mm512_set1_ps(w2), vb2 = _mm512_set1_ps(fb2);
  const __m512 veps = _mm512_set1_ps(eps), vbc2 = _mm512_set1_ps(bc2_sqrt), vstep = _mm512_set1_ps(step_size);
  const __m512 vwd = _mm512_set1_ps(wd), vshrink = _mm512_set1_ps(shrink);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 d = _mm512_loadu_ps(g + i), xv = _mm512_loadu_ps(x + i), pv = xv;
    __m512 mv = _mm512_loadu_ps(m + i), vv = _mm512_loadu_ps(v + i);
    if (wd != 0.0f) {
      if (decoupled) pv = _mm512_mul_ps(pv, vshrink);
      else d = _mm512_add_ps(d, _mm512_mul_ps(vwd, pv));
    }
    mv = _mm512_add_ps(mv, _mm512_mul_ps(vw1, _mm512_sub_ps(d, mv)));
    vv = _mm512_add_ps(_mm512_mul_ps(vv, vb2), _mm512_mul_ps(_mm512_mul_ps(vw2, d), d));
    /* maskz: gcc 12 warns (maybe-uninitialized, C++) on the plain sqrt's undefined source */
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps((__mmask16)0xFFFF, vv), vbc2), veps);
    pv = _mm512_sub_ps(pv, _mm512_mul_ps(vstep, _mm512_div_ps(mv, denom)));
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
    _mm512_storeu_ps(p + i, delta ? _mm512_sub_ps(pv, xv) : pv);
  }
  return i;
}
#endif

/* p = the update of p (x == p), or, with delta, p = the update of x minus x
 * (x and p apart: dt__optim_delta_span). */
static void dt__optim_adam_run(const dt_optim *o, float lr, float wd, int decoupled, float *p,
                               const float *DT__RESTRICT g, float *DT__RESTRICT m, float *DT__RESTRICT v, size_t n,
                               const float *x, int delta) {
  const dt__optim_adam_k k = dt__optim_adam_scalars(o, lr, wd, decoupled);
  size_t i = 0;
#ifdef DT__OPTIM_AVX
  int level = dt__simd_level();
  if (level >= DT__SIMD_AVX512)
    i = dt__optim_adam_avx512(k.w1, k.w2, k.beta2, k.eps, k.bc2_sqrt, k.step_size, wd, decoupled, k.shrink, p, g, m,
                              v, n, x, delta);
  if (level >= DT__SIMD_AVX2 && n - i >= 8) /* the AVX2 path, or the AVX-512 path's last 8-15 */
    i += dt__optim_adam_avx(k.w1, k.w2, k.beta2, k.eps, k.bc2_sqrt, k.step_size, wd, decoupled, k.shrink, p + i,
                            g + i, m + i, v + i, n - i, x + i, delta);
#endif
#ifdef DT__OPTIM_SSE
  if (i == 0)
    i = dt__optim_adam_sse(k.w1, k.w2, k.beta2, k.eps, k.bc2_sqrt, k.step_size, wd, decoupled, k.shrink, p, g, m, v,
                           n, x, delta);
#endif
  for (; i < n; i++) { /* the tail, or all without SIMD */
    if (delta) p[i] = x[i];
    dt__optim_adam_at(k, p, g, m, v, i);
    if (delta) p[i] = p[i] - x[i];
  }
}

/* Intra-op threads (dt_set_threads): a large buffer is cut into runs of
 * whole 64-float blocks, one per thread. Each element's update depends on
 * that element only, so the result is the one-thread result bit for bit. */
#define DT__OPTIM_PAR_MIN ((size_t)1 << 16) /* floats below which one thread is faster */

typedef struct dt__optim_adam_job {
  const dt_optim *o;
  float lr, wd;
  int decoupled;
  float *p, *m, *v;
  const float *g;
} dt__optim_adam_job;

static void dt__optim_adam_range(void *arg, int64_t lo, int64_t hi) {
  const dt__optim_adam_job *j = (const dt__optim_adam_job *)arg;
  dt__optim_adam_run(j->o, j->lr, j->wd, j->decoupled, j->p + lo, j->g + lo, j->m + lo, j->v + lo, (size_t)(hi - lo),
                     j->p + lo, 0);
}

static void dt__optim_adam(const dt_optim *o, float lr, float wd, int decoupled, float *p, const float *g, float *m,
                           float *v, size_t n) {
  dt__optim_adam_job j;
  j.o = o;
  j.lr = lr;
  j.wd = wd;
  j.decoupled = decoupled;
  j.p = p;
  j.g = g;
  j.m = m;
  j.v = v;
  dt__par_range((int64_t)n, 64, (int64_t)DT__OPTIM_PAR_MIN, dt__optim_adam_range, &j);
}
#undef DT__OPTIM_PAR_MIN

static void dt__optim_rmsprop(const dt_optim *o, float lr, float wd, float *DT__RESTRICT p,
                              const float *DT__RESTRICT g, float *DT__RESTRICT sq, float *DT__RESTRICT buf,
                              size_t n) {
  const dt__optim_rmsprop_k k = dt__optim_rmsprop_scalars(o, lr, wd);
  for (size_t i = 0; i < n; i++) dt__optim_rmsprop_at(k, p, g, sq, buf, i);
}

static void dt__optim_adam_l2(const dt_optim *o, float lr, float wd, float *p, const float *g, float *m, float *v,
                              size_t n) {
  dt__optim_adam(o, lr, wd, 0, p, g, m, v, n);
}

static void dt__optim_adamw(const dt_optim *o, float lr, float wd, float *p, const float *g, float *m, float *v,
                            size_t n) {
  dt__optim_adam(o, lr, wd, 1, p, g, m, v, n);
}

static void dt__optim_adam_l2_delta(const dt_optim *o, float lr, float wd, const float *x, float *d, const float *g,
                                    float *m, float *v, size_t n) {
  dt__optim_adam_run(o, lr, wd, 0, d, g, m, v, n, x, 1);
}

static void dt__optim_adamw_delta(const dt_optim *o, float lr, float wd, const float *x, float *d, const float *g,
                                  float *m, float *v, size_t n) {
  dt__optim_adam_run(o, lr, wd, 1, d, g, m, v, n, x, 1);
}

/* ---- device kernels' arguments (dt_kernel in dt_device.h): the scalars the host update uses, packed ---- */

static void dt__optim_sgd_args(const dt_optim *o, float lr, float wd, dt_kernel_args *a) {
  dt__optim_sgd_pack(dt__optim_sgd_scalars(o, lr, wd), a->f, &a->n[1]);
}

static void dt__optim_adam_args(const dt_optim *o, float lr, float wd, dt_kernel_args *a) {
  dt__optim_adam_pack(dt__optim_adam_scalars(o, lr, wd, o->desc.kind == DTRAIN_OPTIM_ADAMW), a->f, &a->n[1]);
}

static void dt__optim_rmsprop_args(const dt_optim *o, float lr, float wd, dt_kernel_args *a) {
  dt__optim_rmsprop_pack(dt__optim_rmsprop_scalars(o, lr, wd), a->f);
}

/* ---- the optimizers: one row each -------------------------------------------------------
 * What differs between the optimizers is in their rows; every other function
 * of this file serves them all. A new optimizer is its dt_optim_kind
 * (dt_optim.h), its per-element formula (dt_optim_math.h, shared with the
 * CUDA kernel), its update function and its row here (see CONTRIBUTING.md);
 * a device kernel is optional (without one, dt_optim_step_graph on a device
 * graph fails with DTRAIN_ERR_UNSUPPORTED). */
static const dt__optim_rule dt__optim_rules[] = {
  {DTRAIN_OPTIM_SGD, "sgd", {"momentum_buffer", NULL}, 0.01f, 0, 1, dt__optim_sgd, NULL, DTRAIN_K_SGD,
   dt__optim_sgd_args},
  {DTRAIN_OPTIM_ADAM, "adam", {"exp_avg", "exp_avg_sq"}, 0.001f, 2, 0, dt__optim_adam_l2, dt__optim_adam_l2_delta,
   DTRAIN_K_ADAM, dt__optim_adam_args},
  {DTRAIN_OPTIM_ADAMW, "adamw", {"exp_avg", "exp_avg_sq"}, 0.001f, 2, 0, dt__optim_adamw, dt__optim_adamw_delta,
   DTRAIN_K_ADAM, dt__optim_adam_args},
  {DTRAIN_OPTIM_RMSPROP, "rmsprop", {"square_avg", "momentum_buffer"}, 0.001f, 1, 1, dt__optim_rmsprop, NULL,
   DTRAIN_K_RMSPROP, dt__optim_rmsprop_args},
};

static const dt__optim_rule *dt__optim_rule_of(dt_optim_kind kind) {
  for (size_t i = 0; i < sizeof dt__optim_rules / sizeof dt__optim_rules[0]; i++)
    if (dt__optim_rules[i].kind == kind) return &dt__optim_rules[i];
  return NULL;
}

static int dt__optim_nslots(const dt__optim_rule *rule, const dt_optim_desc *d) {
  return rule->slots + (rule->momentum_slot && d->momentum > 0.0f ? 1 : 0);
}

DTRAIN_PRIVATE const char *dt__optim_kind_name(dt_optim_kind kind) {
  const dt__optim_rule *rule = dt__optim_rule_of(kind);
  return rule ? rule->name : NULL;
}

DTRAIN_PRIVATE const char *dt__optim_slot_name(dt_optim_kind kind, int slot) {
  const dt__optim_rule *rule = dt__optim_rule_of(kind);
  return rule && slot >= 0 && slot < 2 ? rule->slot_names[slot] : NULL;
}

/* ---- steps ---------------------------------------------------------------------------- */

static dt_result dt__optim_check_layout(const dt_optim *o, const char *fn) {
  size_t now = dt_params_size(o->params);
  if (now != o->size)
    return dt__error(DTRAIN_ERR_STATE, "%s: params changed size since dt_optim_create (%zu -> %zu floats)", fn,
                     o->size, now);
  return DTRAIN_OK;
}

/* The update of the trainable ranges within [begin, end): in place on data
 * (x NULL), or as differences into data from the values x (see
 * dt__optim_delta_span). data[0], x[0] and g[0] are element begin; the
 * state is indexed as the params. No checks, no FP mode. */
static void dt__optim_ranges(dt_optim *o, const dt__optim_rule *rule, const float *x, float *data, const float *g,
                             size_t begin, size_t end) {
  const float lr = dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps);
  size_t b, e;
  int trainable, decay;
  for (int i = dt__params_first_after(o->params, begin); dt__params_range(o->params, i, &b, &e, &trainable, &decay);
       i++) {
    if (b >= end) break;
    if (!trainable) continue;
    size_t lo = DT__MAX(b, begin), hi = DT__MIN(e, end), n = hi - lo;
    if (lo >= hi) continue;
    float wd = decay ? o->desc.weight_decay : 0.0f;
    float *s0 = o->nslots > 0 ? o->state[0] + lo : NULL;
    float *s1 = o->nslots > 1 ? o->state[1] + lo : NULL;
    float *di = data + (lo - begin);
    const float *gi = g + (lo - begin);
    if (!x) {
      rule->update(o, lr, wd, di, gi, s0, s1, n);
      continue;
    }
    const float *xi = x + (lo - begin);
    if (rule->delta) {
      rule->delta(o, lr, wd, xi, di, gi, s0, s1, n);
    } else {
      memcpy(di, xi, n * sizeof(float));
      rule->update(o, lr, wd, di, gi, s0, s1, n);
      for (size_t j = 0; j < n; j++) di[j] = di[j] - xi[j];
    }
  }
}

/* dt_optim_update's and dt__optim_update_from's common part: g is the
 * gradient as the params index it (from 0), or at element begin (from_begin). */
static dt_result dt__optim_update_at(dt_optim *o, float *data, const float *g, int from_begin, size_t begin,
                                     size_t end) {
  if (!o) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_update: optimizer is NULL");
  dt_result r = dt__optim_check_layout(o, "dt_optim_update");
  if (r != DTRAIN_OK) return r;
  if (begin > end || end > o->size)
    return dt__error(DTRAIN_ERR_INDEX, "dt_optim_update: range [%zu,%zu) outside [0,%zu)", begin, end, o->size);
  if (begin == end) return DTRAIN_OK;
  if (!data || !g)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_update: %s is NULL", !data ? "data" : "grad");
  const dt__optim_rule *rule = dt__optim_rule_of(o->desc.kind);
  if (!rule)
    return dt__error(DTRAIN_ERR_INTERNAL, "dt_optim_update: unknown optimizer kind %d", (int)o->desc.kind);
  int64_t t0 = dt__prof_t0();
  unsigned long fp = dt__fp_enter(); /* subnormal moments: dt_set_flush_denormals */
  dt__optim_ranges(o, rule, NULL, data + begin, from_begin ? g : g + begin, begin, end);
  dt__fp_leave(fp);
  dt__prof_add("dt_optim_update", DTRAIN_PROFILE_UPDATE, t0);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_update(dt_optim *o, float *data, const float *grad, size_t begin, size_t end) {
  return dt__optim_update_at(o, data, grad, 0, begin, end);
}

DTRAIN_PRIVATE dt_result dt__optim_update_from(dt_optim *o, float *data, const float *g, size_t begin, size_t end) {
  return dt__optim_update_at(o, data, g, 1, begin, end);
}

DTRAIN_PRIVATE int dt__optim_delta_span(dt_optim *o, const float *x, float *d, const float *grad, size_t begin,
                                        size_t end) {
  const dt__optim_rule *rule = dt__optim_rule_of(o->desc.kind);
  if (!rule || !x || begin > end || end > o->size) return 0;
  int64_t t0 = dt__prof_t0();
  dt__optim_ranges(o, rule, x, d, grad + begin, begin, end);
  dt__prof_add_table("dt_optim_update", DTRAIN_PROFILE_UPDATE, t0); /* per block: on the timeline, the push's span */
  return 1;
}

DTRAIN_PRIVATE int dt__optim_step_span(dt_optim *o, float *x, const float *grad, size_t begin, size_t end) {
  const dt__optim_rule *rule = dt__optim_rule_of(o->desc.kind);
  if (!rule || !x || begin > end || end > o->size) return 0;
  int64_t t0 = dt__prof_t0();
  dt__optim_ranges(o, rule, NULL, x, grad + begin, begin, end);
  dt__prof_add_table("dt_optim_update", DTRAIN_PROFILE_UPDATE, t0); /* per block, as dt__optim_delta_span's */
  return 1;
}

/* Clip (if set), update and advance over data/grad with the params' layout. */
static dt_result dt__optim_step_host(dt_optim *o, float *data, float *grad, const char *fn) {
  dt_result r = dt__optim_check_layout(o, fn);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  int trainable, decay;
  if (o->desc.clip_norm > 0.0f) {
    /* Global norm over the trainable ranges only, summed in double in index order. */
    double ss = 0.0;
    for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++)
      for (size_t j = b; trainable && j < e; j++) ss += (double)grad[j] * (double)grad[j];
    double norm = sqrt(ss);
    if (!isfinite(norm))
      return dt__error(DTRAIN_ERR_NONFINITE, "%s: gradient norm is %s; no update made", fn,
                       isnan(norm) ? "NaN" : "Inf");
    float coef = dt__clip_scale(norm, o->desc.clip_norm);
    if (coef != 1.0f) {
      for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++)
        for (size_t j = b; trainable && j < e; j++) grad[j] *= coef;
    }
  }
  r = dt_optim_update(o, data, grad, 0, o->size);
  if (r != DTRAIN_OK) return r;
  dt_optim_advance(o);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_step(dt_optim *o) {
  if (!o) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_step: optimizer is NULL");
  return dt__optim_step_host(o, dt_params_data(o->params), dt_params_grad(o->params), "dt_optim_step");
}

/* ---- on a device --------------------------------------------------------------------- */

static dt_result dt__optim_dev_run(dt_optim *o, dt_kernel k, const dt_kernel_args *a) {
  dt_result r = o->dev->run(o->dev, k, a);
  if (r != DTRAIN_OK)
    return dt__error(r, "dt_optim_step_graph: device %s: %s", o->dev->name, dt_last_error());
  return DTRAIN_OK;
}

static dt_result dt__optim_dev_state(dt_optim *o, dt_device *d) {
  const char *fn = "dt_optim_step_graph";
  if (o->dev && o->dev != d)
    return dt__error(DTRAIN_ERR_STATE, "%s: the optimizer's state lives on device %s, not %s", fn, o->dev->name,
                     d->name);
  size_t bytes = o->size * sizeof(float);
  dt_result r = DTRAIN_OK;
  if (o->dev) { /* the host copies dt_optim_state handed out (a checkpoint saved or loaded) go back up */
    for (int s = 0; r == DTRAIN_OK && s < o->nslots; s++)
      if (o->host_mirror & (1u << s)) r = d->copy(d, o->dstate[s], o->state[s], bytes, DTRAIN_COPY_H2D);
    if (r != DTRAIN_OK) return dt__error(r, "%s: optimizer state to device %s: %s", fn, d->name, dt_last_error());
    o->host_mirror = 0;
    return DTRAIN_OK;
  }
  /* First step on a device: the state starts as the host state (zeros, or
   * what a checkpoint loaded through dt_optim_state). */
  o->dev = d;
  void *p = NULL;
  r = d->alloc(d, sizeof(float), &p);
  o->dscratch = (float *)p;
  for (int s = 0; r == DTRAIN_OK && s < o->nslots; s++) {
    p = NULL;
    r = d->alloc(d, bytes, &p);
    o->dstate[s] = (float *)p;
    if (r == DTRAIN_OK) r = d->copy(d, p, o->state[s], bytes, DTRAIN_COPY_H2D);
  }
  if (r != DTRAIN_OK) return dt__error(r, "%s: optimizer state on device %s: %s", fn, d->name, dt_last_error());
  o->host_mirror = 0;
  return DTRAIN_OK;
}

static dt_result dt__optim_step_device(dt_optim *o, dt_device *d, float *data, float *grad) {
  const char *fn = "dt_optim_step_graph";
  dt_result r = dt__optim_check_layout(o, fn);
  if (r != DTRAIN_OK) return r;
  const dt__optim_rule *rule = dt__optim_rule_of(o->desc.kind);
  if (!rule || !rule->kernel)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: this optimizer kind (%d) has no kernel on device %s", fn,
                     (int)o->desc.kind, d->name);
  r = dt__optim_dev_state(o, d);
  if (r != DTRAIN_OK) return r;
  size_t b, e;
  int trainable, decay;
  dt_kernel_args a;
  if (o->desc.clip_norm > 0.0f) {
    double ss = 0.0;
    for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
      if (!trainable || b == e) continue;
      float part;
      memset(&a, 0, sizeof a);
      a.p[0] = o->dscratch;
      a.p[1] = grad + b;
      a.n[0] = (int64_t)(e - b);
      if ((r = dt__optim_dev_run(o, DTRAIN_K_SUMSQ, &a)) != DTRAIN_OK) return r;
      if ((r = d->copy(d, &part, o->dscratch, sizeof part, DTRAIN_COPY_D2H)) != DTRAIN_OK)
        return dt__error(r, "%s: device %s: %s", fn, d->name, dt_last_error());
      ss += (double)part;
    }
    double norm = sqrt(ss);
    if (!isfinite(norm))
      return dt__error(DTRAIN_ERR_NONFINITE, "%s: gradient norm is %s; no update made", fn,
                       isnan(norm) ? "NaN" : "Inf");
    float coef = dt__clip_scale(norm, o->desc.clip_norm);
    if (coef != 1.0f) {
      for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
        if (!trainable || b == e) continue;
        memset(&a, 0, sizeof a);
        a.p[0] = grad + b;
        a.n[0] = (int64_t)(e - b);
        a.f[0] = coef;
        if ((r = dt__optim_dev_run(o, DTRAIN_K_SCALE, &a)) != DTRAIN_OK) return r;
      }
    }
  }
  const float lr = dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps);
  for (int i = 0; dt__params_range(o->params, i, &b, &e, &trainable, &decay); i++) {
    if (!trainable || b == e) continue;
    float wd = decay ? o->desc.weight_decay : 0.0f;
    memset(&a, 0, sizeof a);
    a.p[0] = data + b;
    a.p[1] = grad + b;
    a.p[2] = o->nslots > 0 ? o->dstate[0] + b : NULL;
    a.p[3] = o->nslots > 1 ? o->dstate[1] + b : NULL;
    a.n[0] = (int64_t)(e - b);
    rule->kernel_args(o, lr, wd, &a);
    r = dt__optim_dev_run(o, rule->kernel, &a);
    if (r != DTRAIN_OK) return r;
  }
  dt_optim_advance(o);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_optim_step_graph(dt_optim *o, dt_graph *g) {
  const char *fn = "dt_optim_step_graph";
  if (!o || !g) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !o ? "optimizer" : "graph");
  if (g->params != o->params)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: the graph is bound to other params than the optimizer", fn);
  float *data = dt_graph_param_data(g), *grad = dt_graph_param_grad(g);
  if (!data || !grad) return dt__error(DTRAIN_ERR_STATE, "%s: the graph has no parameter gradient buffer", fn);
  if (g->device) return dt__optim_step_device(o, g->device, data, grad);
  return dt__optim_step_host(o, data, grad, fn);
}

DTRAIN_API void dt_optim_advance(dt_optim *o) {
  if (o) o->steps++;
}

/* ---- accessors ------------------------------------------------------------------------- */

DTRAIN_API int64_t dt_optim_steps(const dt_optim *o) { return o ? o->steps : 0; }

DTRAIN_API void dt_optim_set_steps(dt_optim *o, int64_t steps) {
  if (!o) return;
  if (steps < 0) {
    dt__error(DTRAIN_ERR_INVALID_ARG, "dt_optim_set_steps: steps %lld < 0", (long long)steps);
    return;
  }
  o->steps = steps;
}

DTRAIN_API float dt_optim_lr(const dt_optim *o) {
  if (!o) dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_lr: optimizer is NULL");
  return o ? dt_schedule_lr(&o->desc.schedule, o->desc.lr, o->steps) : 0.0f;
}

DTRAIN_API const dt_optim_options *dt_optim_get_options(const dt_optim *o) {
  if (!o) dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_get_options: optimizer is NULL");
  return o ? &o->desc : NULL;
}
/* Deprecated name, removed in the next release. */
DTRAIN_API const dt_optim_options *dt_optim_get_desc(const dt_optim *o) { return dt_optim_get_options(o); }

DTRAIN_API int dt_optim_state_slots(const dt_optim *o) { return o ? o->nslots : 0; }

DTRAIN_API float *dt_optim_state(dt_optim *o, int slot) {
  if (!o) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_optim_state: optimizer is NULL");
    return NULL;
  }
  if (slot < 0 || slot >= o->nslots) {
    dt__error(DTRAIN_ERR_INDEX, "dt_optim_state: slot %d out of range (%d slots)", slot, o->nslots);
    return NULL;
  }
  if (o->dev && !(o->host_mirror & (1u << slot))) { /* the state lives on a device: bring it to the host copy */
    dt_result r = o->dev->copy(o->dev, o->state[slot], o->dstate[slot], o->size * sizeof(float), DTRAIN_COPY_D2H);
    if (r != DTRAIN_OK) {
      dt__error(r, "dt_optim_state: slot %d from device %s: %s", slot, o->dev->name, dt_last_error());
      return NULL;
    }
    o->host_mirror |= 1u << slot;
  }
  return o->state[slot];
}

#ifdef DT__OPTIM_SSE
#  undef DT__OPTIM_SSE
#endif
#ifdef DT__OPTIM_AVX
#  undef DT__OPTIM_AVX
#endif
