/* ===========================================================================
 * dt_gemm.c -- single-precision GEMM
 * ===========================================================================
 * C = alpha * op(A) @ op(B) + beta * C, row-major, op(X) = X or X^T.
 *
 * The classic Goto/BLIS structure:
 *
 *   for jc in n by NC:                      columns of C and B
 *     for pc in k by KC:                    the shared dimension
 *       pack op(B)[pc.., jc..] -> bp        KC x NC, NR-wide slivers
 *       for ic in m by MC:                  rows of C and A
 *         pack op(A)[ic.., pc..] -> ap      MC x KC, MR-tall slivers
 *         for jr, ir: micro-kernel          one MR x NR tile of C
 *
 * Packing copies each block into the order the micro-kernel reads it
 * (contiguous, zero-padded to whole tiles), so the transpose flags and the
 * leading dimensions only matter in the packing routines. Partial tiles at
 * the edges run the kernel into a small local tile and copy its valid part
 * (the AVX2 path has a 4-row kernel for the 4-row edge of 64-row batches).
 * Products A @ B^T with few columns (n < 32), or with few rows and a long
 * k (m <= 32 and k >= 256, m <= 64 and k >= 512: a linear layer's forward on
 * a training batch, where packing the weights costs as much as the product;
 * measured on AVX2 Xeon and EPYC) skip packing on the AVX2 path: a
 * dot-product kernel (dt_gemm_dot.c); on the AVX-512 path only the
 * few-column products do (see dt_sgemm). With 16 or 32 rows (or 64 and
 * big weights) and beta 0, both x86 paths instead run such a product
 * flipped, as (B @ A^T)^T (dt__gemm_flipped: the weights read once,
 * unpacked).
 * When A has few rows (at most 2 MC: the batch of a training step) and B is
 * wider than NC, the loops run pc -> jc instead, so that A is packed once per
 * k block rather than once per B panel.
 * The panels are one buffer from a scratch slot, allocated on a thread's
 * first call and kept (dt_base.c), or, when none can be had (a user's
 * allocator, all slots busy, no memory), an automatic array (320 KiB of
 * stack; 32 KiB more under a flipped product) with narrower B panels: a
 * call allocates nothing after the first, may run on any thread, and gets
 * the same bits either way.
 * On the x86 paths, products with n <= 256 (8 or 16 B slivers) do not pack
 * A: the kernel reads it where it lies, 6 rows at a stride (a packed A
 * would be read only n/NR times; the Winograd products' n = 32, once or
 * twice); only a last sliver shorter than 6 is packed. Likewise B, when A
 * has at most 64 rows and B is untransposed (its rows of 16 or 32 floats
 * read at their stride, unless the stride is a multiple of 256 bytes: rows
 * in few L1 sets); only a last sliver narrower than NR is packed. The same
 * FMAs in the same order: the same bits.
 * dt__sgemm_epi (dt_linear, dt_linear_relu) runs the same product with an
 * epilogue on each tile of C while it is in L1: a row of bias copied into
 * the tile before its first k block (which then adds to it), ReLU after its
 * last; the same bits as the separate passes.
 *
 * Kernels ("paths"), picked once per process at run time:
 *   avx512    x86-64 with GCC or clang on CPUs with AVX-512F: a 6x32
 *             micro-kernel (dt_gemm_avx512.c), packed by the x86 routines
 *             of dt_gemm_avx2.c (32-wide B slivers), and its own
 *             dot-product kernel.
 *   avx2+fma  x86-64 with GCC or clang: a 6x16 micro-kernel and packing
 *             routines in intrinsics (dt_gemm_avx2.c), compiled for
 *             AVX2+FMA with a function attribute, so a plain -O2 build uses
 *             them on CPUs that have them (checked with
 *             __builtin_cpu_supports).
 *   neon      aarch64: an 8x12 micro-kernel in NEON intrinsics
 *             (dt_gemm_neon.c).
 *   portable  plain C that gcc and clang vectorise with whatever the build
 *             targets (6x8 with SSE, 6x16 with -mavx); the fallback, and the
 *             only path under DTRAIN_NO_SIMD.
 * The environment variable DTRAIN_ISA=portable|avx2|avx512|neon, or
 * dt_sgemm_use_isa(), forces a path the CPU has (tests compare them all);
 * DTRAIN_GEMM=portable, or dt_sgemm_use_portable(1), the portable one.
 *
 * Determinism: the path is fixed once chosen, the blocking depends only on
 * (m, n, k) and the path, and every element of C is summed in the same
 * order on every call: over k in KC blocks, each block in increasing p.
 * Different paths round differently (FMA or not), so results agree across
 * paths only to rounding.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#ifdef DTRAIN_USE_CBLAS
#include <cblas.h>
#endif

#ifdef DT__X86_SIMD
#  define DT__GEMM_X86 1
#  include <immintrin.h> /* the AVX2 kernel and x86 packing are in dt_gemm_avx2.c */
#endif
#ifdef DT__NEON_GEMM /* dt_ops_internal.h; the kernel is in dt_gemm_neon.c */
#  define DT__GEMM_NEON 1
#endif

/* Path ids. */
#define DT__GEMM_PORTABLE 0
#define DT__GEMM_PATH_AVX2 1
#define DT__GEMM_PATH_NEON 2
#define DT__GEMM_PATH_AVX512 3
#define DT__GEMM_PATH_BF16 4 /* only under dt_set_matmul_precision(DTRAIN_MATMUL_BF16) */
#define DT__GEMM_NPATHS 5

/* Portable register tile. MR x NR is 12 vector accumulators, whether a
 * vector holds 4 floats (SSE, NEON) or 8 (AVX). */
#define DT__GEMM_MR 6
#if defined(__AVX__)
#  define DT__GEMM_NR 16
#else
#  define DT__GEMM_NR 8
#endif

/* Cache blocking shared by all paths: a B sliver (KC x NR) stays in L1, the
 * packed A block (MC x KC) and the B panel (KC x NC) in L2. MC is a multiple
 * of every path's MR (6, 8) and NC of every NR (8, 12, 16, 32). The panels
 * live in a scratch slot (dt_base.c: 0.9 MiB, kept between calls), or, when
 * none can be had, on the stack with B panels of NC_STACK columns; only the
 * order of the loops differs, not a bit of any result (KC alone decides
 * the sums). On a Zen 5 core, one thread, sgemm n=512-2048: KC 128 with NC
 * 384 on the stack gave 215-237 GFLOP/s (AVX-512) and 119-125 (AVX2); KC 256
 * with NC 768, 239-253 and 121-128. (KC 256 with NC 384 was no better than
 * KC 128; NC 192 on the stack costs the CNN's conv and fc products 10-15%.) */
#define DT__GEMM_KC 256
#define DT__GEMM_MC 96
#define DT__GEMM_NC 768
#define DT__GEMM_NC_STACK 192
/* floats for the panels with an A block of ma rows and B panels of nc
 * columns: + one more B sliver's worth (see the jc loop), alignment, and
 * slack after A (see pack_a) */
#define DT__GEMM_BUF_A(ma, nc) (DT__GEMM_KC * ((ma) + (nc) + DT__GEMM_NR_MAX) + 48)
#define DT__GEMM_BUF(nc) DT__GEMM_BUF_A(DT__GEMM_MC, nc)
/* Products with more rows than 2 MC and wider than one B panel pack all of
 * A's rows at once per k block (dt__gemm_blocked) when they fit in this
 * many (1 MiB of A at KC 256: more, measured at n = 2048, packed no faster
 * than it was read back): A is then packed once, not once per panel. */
#define DT__GEMM_WHOLE_A_MAX 1024
#define DT__GEMM_TILE_MAX (6 * 32) /* largest MR x NR of any path */
#define DT__GEMM_NR_MAX 32         /* largest NR of any path */

/* Loop hints for the portable micro-kernel, so that the accumulator tile
 * stays in vector registers. gcc needs the loops over the rows of the tile
 * fully unrolled (DT__GEMM_UNROLL); clang unrolls and vectorises those loops
 * best on its own, but when it also unrolls the loop over k (as it does when
 * tuning for some CPUs, e.g. -march=znver3) the tile falls back to memory
 * and speed drops by 2.5x, hence DT__GEMM_KLOOP. */
#if defined(__clang__)
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP _Pragma("clang loop unroll(disable)")
#elif defined(__GNUC__) && __GNUC__ >= 8
#  define DT__GEMM_UNROLL _Pragma("GCC unroll 16")
#  define DT__GEMM_KLOOP
#else
#  define DT__GEMM_UNROLL
#  define DT__GEMM_KLOOP
#endif

#if DT__GEMM_MC % 24 != 0 || DT__GEMM_NC % 96 != 0 || DT__GEMM_NC_STACK % 96 != 0
#  error "dt_gemm.c: MC must be a multiple of 6 and 8, NC of 8, 12, 16 and 32"
#endif

/* One path: its tile, micro-kernel and packing routines.
 *   kernel   C[r][j] = alpha * sum_p ap[p*mr + r] * bp[p*nr + j] + beta * C[r][j]
 *            over a whole mr x nr tile; C is not read when beta == 0.
 *   pack_a   rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) into mr-tall
 *            slivers: ap[s*mr*kc + p*mr + r] = op(A)[i0+s*mr+r][p0+p], zero
 *            past mc.
 *   pack_b   rows [p0, p0+kc) x cols [j0, j0+nc) of op(B) into nr-wide
 *            slivers: bp[s*nr*kc + p*nr + j] = op(B)[p0+p][j0+s*nr+j], zero
 *            past nc. */
typedef void (*dt__gemm_kernel_fn)(int64_t kc, const float *ap, const float *bp, float alpha, float beta, float *c,
                                   int64_t ldc);
typedef void (*dt__gemm_pack_fn)(int trans, const float *x, int64_t ld, int64_t r0, int64_t c0, int64_t rows,
                                 int64_t cols, float *dst);
typedef struct dt__gemm_path {
  int mr, nr;
  dt__gemm_kernel_fn kernel;
  dt__gemm_kernel_fn kernel4; /* the first 4 rows of a tile into C, or NULL */
  dt__gemm_pack_fn pack_a, pack_b;
  const char *name;
} dt__gemm_path;

/* ---- portable packing (dt_gemm_pack.c) and kernel ------------------------------------- */

static void dt__gemm_pack_a_c(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc, int64_t kc,
                              float *ap) {
  dt__gemm_pack_a_n(DT__GEMM_MR, trans, a, lda, i0, p0, mc, kc, ap);
}

static void dt__gemm_pack_b_c(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc, int64_t nc,
                              float *bp) {
  dt__gemm_pack_b_n(DT__GEMM_NR, trans, b, ldb, p0, j0, kc, nc, bp);
}

/* The portable micro-kernel: the accumulator tile is a local array that
 * gcc and clang keep in vector registers. Accumulates in increasing p. */
static void dt__gemm_micro_c(int64_t kc, const float *DT__RESTRICT ap, const float *DT__RESTRICT bp, float alpha,
                             float beta, float *DT__RESTRICT c, int64_t ldc) {
  float acc[DT__GEMM_MR][DT__GEMM_NR];
  DT__GEMM_UNROLL
  for (int r = 0; r < DT__GEMM_MR; r++)
    for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] = 0.0f;
  DT__GEMM_KLOOP
  for (int64_t p = 0; p < kc; p++) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++) {
      float av = ap[r];
      for (int j = 0; j < DT__GEMM_NR; j++) acc[r][j] += av * bp[j];
    }
    ap += DT__GEMM_MR;
    bp += DT__GEMM_NR;
  }
  if (beta == 0.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j];
  } else if (beta == 1.0f) {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] += alpha * acc[r][j];
  } else {
    DT__GEMM_UNROLL
    for (int r = 0; r < DT__GEMM_MR; r++)
      for (int j = 0; j < DT__GEMM_NR; j++) c[r * ldc + j] = alpha * acc[r][j] + beta * c[r * ldc + j];
  }
}

/* ---- NEON (aarch64): the 8x12 micro-kernel is in dt_gemm_neon.c ----------------------------- */
#ifdef DT__GEMM_NEON
static void dt__gemm_pack_a_neon(int trans, const float *a, int64_t lda, int64_t i0, int64_t p0, int64_t mc,
                                 int64_t kc, float *ap) {
  dt__gemm_pack_a_n(8, trans, a, lda, i0, p0, mc, kc, ap);
}

static void dt__gemm_pack_b_neon(int trans, const float *b, int64_t ldb, int64_t p0, int64_t j0, int64_t kc,
                                 int64_t nc, float *bp) {
  dt__gemm_pack_b_n(12, trans, b, ldb, p0, j0, kc, nc, bp);
}
#endif /* DT__GEMM_NEON */

/* ---- path selection ----------------------------------------------------------------------- */

static const dt__gemm_path dt__gemm_paths[DT__GEMM_NPATHS] = {
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#ifdef DT__GEMM_X86
    {6, 16, dt__gemm_micro_avx2, dt__gemm_micro4_avx2, dt__gemm_pack_a_avx2, dt__gemm_pack_b_avx2, "avx2+fma"},
#else
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#endif
#ifdef DT__GEMM_NEON
    {8, 12, dt__gemm_micro_neon, NULL, dt__gemm_pack_a_neon, dt__gemm_pack_b_neon, "neon"},
#else
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#endif
#ifdef DT__GEMM_X86
    {6, 32, dt__gemm_micro_avx512, dt__gemm_micro4_avx512, dt__gemm_pack_a_avx2, dt__gemm_pack_b_avx512, "avx512"},
    {6, 32, dt__gemm_micro_bf16, NULL, dt__gemm_pack_a_bf16, dt__gemm_pack_b_bf16, "avx512-bf16"},
#else
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
    {DT__GEMM_MR, DT__GEMM_NR, dt__gemm_micro_c, NULL, dt__gemm_pack_a_c, dt__gemm_pack_b_c, "portable"},
#endif
};

/* 1 when this build and CPU have path id (DT__GEMM_*). */
static int dt__gemm_has_path(int id) {
  switch (id) {
    case DT__GEMM_PORTABLE: return 1;
#if defined(DT__GEMM_X86)
    case DT__GEMM_PATH_AVX2: return dt__cpu_avx2();
    case DT__GEMM_PATH_AVX512: return dt__cpu_avx512();
    case DT__GEMM_PATH_BF16: return dt__cpu_bf16();
#elif defined(DT__GEMM_NEON)
    case DT__GEMM_PATH_NEON: return 1;
#endif
    default: return 0;
  }
}

/* Path id of an ISA name (DTRAIN_ISA, dt_sgemm_use_isa); -1: not a name. */
static int dt__gemm_isa_id(const char *isa) {
  static const char *const names[DT__GEMM_NPATHS] = {"portable", "avx2", "neon", "avx512", NULL};
  for (int i = 0; i < DT__GEMM_NPATHS; i++)
    if (names[i] && strcmp(isa, names[i]) == 0) return i;
  return -1;
}

/* The best path this build and CPU have (ignoring any override). */
static int dt__gemm_best_path(void) {
#if defined(DT__GEMM_X86)
  if (dt__gemm_has_path(DT__GEMM_PATH_AVX512)) return DT__GEMM_PATH_AVX512;
  return dt__cpu_avx2() ? DT__GEMM_PATH_AVX2 : DT__GEMM_PORTABLE;
#elif defined(DT__GEMM_NEON)
  return DT__GEMM_PATH_NEON;
#else
  return DT__GEMM_PORTABLE;
#endif
}

/* The chosen path, +1 (0: not chosen yet), and the override (-1: none yet
 * read, 0: best, else a path id + 1). Each is a plain int written with the same
 * value by whichever thread gets there first, through atomic builtins where
 * the compiler has them so that concurrent first calls are race-free. */
static int dt__gemm_chosen = 0;
static int dt__gemm_override = -1;
static int dt__gemm_bf16_on = 0; /* dt_set_matmul_precision */

#if defined(__GNUC__) || defined(__clang__)
#  define DT__GEMM_LOAD(v) __atomic_load_n(&(v), __ATOMIC_ACQUIRE)
#  define DT__GEMM_STORE(v, x) __atomic_store_n(&(v), (x), __ATOMIC_RELEASE)
#else
#  define DT__GEMM_LOAD(v) (v)
#  define DT__GEMM_STORE(v, x) ((v) = (x))
#endif

static int dt__gemm_path_id(void) {
  int c = DT__GEMM_LOAD(dt__gemm_chosen);
  if (c > 0) return c - 1;
  int ov = DT__GEMM_LOAD(dt__gemm_override);
  if (ov < 0) {
    const char *e = getenv("DTRAIN_GEMM"), *isa = getenv("DTRAIN_ISA");
    int id = isa && *isa && strcmp(isa, "best") != 0 ? dt__gemm_isa_id(isa) : -2;
    if (id == -1 || (id >= 0 && !dt__gemm_has_path(id))) {
      dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_UNSUPPORTED,
              "DTRAIN_ISA=%s: %s; using the best path this CPU has", isa,
              id == -1 ? "not portable, avx2, avx512 or neon" : "this build or CPU does not have it");
      id = -2;
    }
    ov = (e && strcmp(e, "portable") == 0) ? DT__GEMM_PORTABLE + 1 : id >= 0 ? id + 1 : 0;
    DT__GEMM_STORE(dt__gemm_override, ov);
  }
  c = ov ? ov - 1 : dt__gemm_best_path();
  DT__GEMM_STORE(dt__gemm_chosen, c + 1);
  return c;
}

DTRAIN_API int dt_sgemm_use_portable(int on) {
  (void)dt__gemm_path_id(); /* reads DTRAIN_GEMM and DTRAIN_ISA once */
  int prev = DT__GEMM_LOAD(dt__gemm_override);
  DT__GEMM_STORE(dt__gemm_override, on ? DT__GEMM_PORTABLE + 1 : 0);
  DT__GEMM_STORE(dt__gemm_chosen, 0);
  return prev == DT__GEMM_PORTABLE + 1;
}

DTRAIN_API dt_result dt_sgemm_use_isa(const char *isa) {
  if (!isa) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_sgemm_use_isa: isa is NULL");
  int id = strcmp(isa, "best") == 0 ? -2 : dt__gemm_isa_id(isa);
  if (id == -1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_sgemm_use_isa: \"%.32s\" is not best, portable, avx2, avx512 or neon",
                     isa);
  if (id >= 0 && !dt__gemm_has_path(id))
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_sgemm_use_isa: this build or CPU has no %s path", isa);
  (void)dt__gemm_path_id(); /* the environment is read once, before the choice */
  DT__GEMM_STORE(dt__gemm_override, id >= 0 ? id + 1 : 0);
  DT__GEMM_STORE(dt__gemm_chosen, 0);
  return DTRAIN_OK;
}

DTRAIN_API const char *dt_sgemm_kernel(void) {
#ifdef DTRAIN_USE_CBLAS
  return "cblas";
#else
  if (DT__GEMM_LOAD(dt__gemm_bf16_on)) return dt__gemm_paths[DT__GEMM_PATH_BF16].name;
  return dt__gemm_paths[dt__gemm_path_id()].name;
#endif
}

/* The vector width the other kernels (the optimizer, the Winograd
 * transforms) use: that of the GEMM's path, so DTRAIN_ISA and
 * dt_sgemm_use_isa choose one instruction set for the whole step. */
DTRAIN_PRIVATE int dt__simd_level(void) {
  switch (dt__gemm_path_id()) {
    case DT__GEMM_PATH_AVX512: return DT__SIMD_AVX512; /* the bf16 switch is not a path id here */
    case DT__GEMM_PATH_AVX2: return DT__SIMD_AVX2;
    default: return DT__SIMD_BASE;
  }
}

DTRAIN_API dt_result dt_set_matmul_precision(dt_matmul_precision precision) {
  if (precision != DTRAIN_MATMUL_FP32 && precision != DTRAIN_MATMUL_BF16)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_set_matmul_precision: %d is not DTRAIN_MATMUL_FP32 or _BF16",
                     (int)precision);
  if (precision == DTRAIN_MATMUL_BF16) {
#ifdef DTRAIN_USE_CBLAS
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "bf16 matrix products: this build uses BLAS (DTRAIN_USE_CBLAS), float only");
#else
    if (!dt__gemm_has_path(DT__GEMM_PATH_BF16))
      return dt__error(DTRAIN_ERR_UNSUPPORTED,
                       "bf16 matrix products need an x86-64 CPU with AVX512_BF16 and AVX512BW (AMD Zen 4 and later, "
                       "Intel Cooper Lake, Sapphire Rapids and later) and a GCC or clang build with SIMD; "
                       "this CPU or build has not");
#endif
  }
  DT__GEMM_STORE(dt__gemm_bf16_on, precision == DTRAIN_MATMUL_BF16);
  return DTRAIN_OK;
}

DTRAIN_API dt_matmul_precision dt_get_matmul_precision(void) {
  return DT__GEMM_LOAD(dt__gemm_bf16_on) ? DTRAIN_MATMUL_BF16 : DTRAIN_MATMUL_FP32;
}

/* ---- driver ------------------------------------------------------------------------------- */

/* C = beta * C over m x n (C not read when beta == 0): the k == 0 or
 * alpha == 0 case, where op(A) @ op(B) contributes nothing. */
static void dt__gemm_scale(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    float *ci = c + i * ldc;
    if (beta == 0.0f)
      for (int64_t j = 0; j < n; j++) ci[j] = 0.0f;
    else if (beta != 1.0f)
      for (int64_t j = 0; j < n; j++) ci[j] *= beta;
  }
}

/* The epilogue (dt__sgemm_epi): the bias into C before the product, which
 * then adds to it (beta 1): rows of bias [n], or rbias[i] along row i. */
static void dt__gemm_bias_rows(const float *bias, const float *rbias, int64_t m, int64_t n, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++) {
    float *row = c + i * ldc;
    if (bias) {
      memcpy(row, bias, (size_t)n * sizeof(float));
      continue;
    }
    /* a row of one value, four at a time (one vector store; the plain loop
     * stayed scalar, reloading rbias[i] in case C overlaps it: 1.8% of the
     * CNN's step, which fills every conv output tile this way) */
    const float v = rbias[i];
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      row[j] = v;
      row[j + 1] = v;
      row[j + 2] = v;
      row[j + 3] = v;
    }
    for (; j < n; j++) row[j] = v;
  }
}

#ifdef DT__GEMM_X86
/* The strided tile of the path (rows 6 or 4; see dt__gemm_macro). */
static void dt__gemm_strided(const dt__gemm_path *pa, int rows, int64_t kc, const float *as, int64_t ars, int64_t aks,
                             const float *bs, int64_t bks, float alpha, float beta, float *c, int64_t ldc) {
  if (pa->nr == 32) dt__gemm_micro_avx512_ua(rows, kc, as, ars, aks, bs, bks, alpha, beta, c, ldc);
  else dt__gemm_micro_avx2_ua(rows, kc, as, ars, aks, bs, bks, alpha, beta, c, ldc);
}
#endif

/* An operand read where it lies instead of packed: op(A)[i][p] at
 * a[i * rs + p * ks], op(B)[p][j] at a[p * ks + j] (rs unused). */
typedef struct dt__gemm_ua {
  const float *a;
  int64_t rs, ks;
} dt__gemm_ua;

/* A partial tile (mr < MR or nr < NR): run the kernel into a local tile,
 * then apply it to the valid mr x nr corner of C. A at strides ars and aks
 * (packed: 1 and MR), B at bks (packed: NR); strided only on x86. */
static void dt__gemm_edge(const dt__gemm_path *pa, int64_t kc, const float *as, int64_t ars, int64_t aks,
                          const float *bs, int64_t bks, float alpha, float beta, float *c, int64_t ldc, int64_t mr,
                          int64_t nr) {
  float t[DT__GEMM_TILE_MAX];
  int rows = mr <= 4 && pa->kernel4 ? 4 : 6; /* (a tile of 4 rows: 2/3 of the work) */
#ifdef DT__GEMM_X86
  if (pa->kernel == dt__gemm_micro_avx512 && nr <= 16) /* half the width (the bf16 path has its own kernel) */
    dt__gemm_edge16_avx512(rows, kc, as, ars, aks, bs, bks, t, pa->nr);
  else if (ars != 1 || aks != pa->mr || bks != pa->nr)
    dt__gemm_strided(pa, rows, kc, as, ars, aks, bs, bks, 1.0f, 0.0f, t, pa->nr);
  else
#endif
  if (rows == 4)
    pa->kernel4(kc, as, bs, 1.0f, 0.0f, t, pa->nr);
  else
    pa->kernel(kc, as, bs, 1.0f, 0.0f, t, pa->nr);
  (void)ars, (void)aks, (void)bks; /* (strided only on x86) */
  for (int64_t r = 0; r < mr; r++) {
    float *cr = c + r * ldc;
    const float *tr = t + r * pa->nr;
    if (beta == 0.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j];
    else if (beta == 1.0f)
      for (int64_t j = 0; j < nr; j++) cr[j] += alpha * tr[j];
    else
      for (int64_t j = 0; j < nr; j++) cr[j] = alpha * tr[j] + beta * cr[j];
  }
}

/* One packed A block (mc x kc) times one packed B panel (kc x nc) into C:
 * the loops over the tiles, B slivers outside (one stays in L1 while the
 * A slivers stream past it). bias (the panel's first column's) or rbias
 * (the block's first row's), on the first k block with beta 1, goes into
 * each tile before its product, relu
 * (on the last k block) over it after, while the tile is in L1. ua / ub
 * (x86): A / B read where they lie (dt__gemm_run); then only a last A
 * sliver shorter than MR is packed (at ap) and only a last B sliver
 * narrower than NR (at bp), both by dt__gemm_run. */
static void dt__gemm_macro(const dt__gemm_path *pa, int64_t mc, int64_t nc, int64_t kc, float alpha,
                           const float *ap, const float *bp, float beta, float *c, int64_t ldc, const float *bias,
                           const float *rbias, int relu, const dt__gemm_ua *ua, const dt__gemm_ua *ub) {
  const int64_t MR = pa->mr, NR = pa->nr, nfull = ub ? nc - nc % NR : nc;
  for (int64_t jr = 0; jr < nc; jr += NR) {
    int64_t nr = DT__MIN(NR, nc - jr), bks = ub && jr < nfull ? ub->ks : NR;
    const float *bs = !ub ? bp + jr * kc : jr < nfull ? ub->a + jr : bp;
    for (int64_t ir = 0; ir < mc; ir += MR) {
      int64_t mr = DT__MIN(MR, mc - ir), ars = 1, aks = MR;
      const float *as = ua ? ap : ap + ir * kc; /* (with ua, ap holds only the short sliver) */
      if (ua && (mr == MR || (mr == 4 && nr == NR))) as = ua->a + ir * ua->rs, ars = ua->rs, aks = ua->ks;
      float *cs = c + ir * ldc + jr;
      if (bias || rbias) dt__gemm_bias_rows(bias ? bias + jr : NULL, rbias ? rbias + ir : NULL, mr, nr, cs, ldc);
#ifdef DT__GEMM_X86
      if ((ua || ub) && nr == NR && (mr == MR || mr == 4))
        dt__gemm_strided(pa, (int)mr, kc, as, ars, aks, bs, bks, alpha, beta, cs, ldc);
      else
#endif
      if (mr == MR && nr == NR && !ua && !ub)
        pa->kernel(kc, as, bs, alpha, beta, cs, ldc);
      else if (mr == 4 && nr == NR && pa->kernel4 && !ua && !ub)
        pa->kernel4(kc, as, bs, alpha, beta, cs, ldc);
      else
        dt__gemm_edge(pa, kc, as, ars, aks, bs, bks, alpha, beta, cs, ldc, mr, nr);
      if (relu) dt__relu_rows(cs, mr, nr, ldc);
    }
  }
}

/* The blocked product on one thread (m, n, k > 0, alpha != 0), with the
 * epilogue ep (or NULL) on the tiles, its panels in buf
 * (DT__GEMM_BUF_A(arows, ncap) floats): an A block of MC x KC and a B panel
 * of KC x ncap, or, when A has few rows (up to 2 MC) and B is wider than
 * ncap, all of A's rows and a B panel as wide as the rest allows, or, when
 * arows is more than MC (all of A's rows rounded up to MR, from
 * dt__gemm_run: more than 2 MC rows and B wider than a panel), all of them
 * and full panels, the products of MC rows at a time (in the last two ways
 * A is packed once per k block instead of once per B panel). */
static void dt__gemm_blocked(const dt__gemm_path *pa, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                             float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                             float *c, int64_t ldc, const dt__gemm_epi *ep, float *buf, int64_t ncap, int64_t arows) {
  const int64_t MR = pa->mr, NR = pa->nr;
  float *ap = buf + ((16 - ((uintptr_t)buf / sizeof(float)) % 16) % 16); /* 64-byte aligned */
  int64_t mcb = DT__GEMM_MC, ncb = ncap;
  int few_rows = n > ncap && m <= 2 * DT__GEMM_MC;
  int whole_a = arows > DT__GEMM_MC; /* dt__gemm_run gives room for all of A only where it pays */
  if (few_rows) {
    mcb = (m + MR - 1) / MR * MR;
    ncb = (DT__GEMM_MC + ncap - mcb) / NR * NR;
  }
  float *bp = ap + (whole_a ? arows : mcb) * DT__GEMM_KC + 16;
  const float *bias = ep ? ep->bias : NULL, *rbias = ep ? ep->row_bias : NULL;
  int relu = ep && ep->relu;
  /* Few B slivers: a packed A would be read only a few times, so the kernel
   * reads it where it lies (the same FMAs, the same bits; see the top). */
  /* Likewise B (untransposed, rows of p contiguous in j) for few rows of A,
   * unless its rows lie a multiple of 256 bytes apart: they would then
   * share a few L1 sets. */
  int unpacked_a = 0, unpacked_b = 0;
#ifdef DT__GEMM_X86
  int x86 = pa == &dt__gemm_paths[DT__GEMM_PATH_AVX512] || pa == &dt__gemm_paths[DT__GEMM_PATH_AVX2];
  unpacked_a = x86 && n <= 256;
  unpacked_b = x86 && !trans_b && m <= 64 && ldb % 64 != 0;
#endif

  /* The order of the loops does not change any result: every element of C
   * is summed over the same k blocks in the same order. */
  if (few_rows || whole_a) { /* all of A packed once per k block, then B panels in turn against MC rows at a
                               * time (few rows: all of them at once) */
    int64_t mstep = whole_a ? DT__GEMM_MC : m;
    for (int64_t pc = 0; pc < k; pc += DT__GEMM_KC) {
      int64_t kc = DT__MIN(DT__GEMM_KC, k - pc);
      float beta_blk = pc == 0 && !bias && !rbias ? beta : 1.0f;
      pa->pack_a(trans_a, a, lda, 0, pc, m, kc, ap);
      for (int64_t jc = 0, nc; jc < n; jc += nc) {
        nc = n - jc <= ncb + NR ? n - jc : ncb; /* as below: a last sliver joins the last panel */
        pa->pack_b(trans_b, b, ldb, pc, jc, kc, nc, bp);
        for (int64_t ic = 0; ic < m; ic += mstep)
          dt__gemm_macro(pa, DT__MIN(mstep, m - ic), nc, kc, alpha, ap + ic * kc, bp, beta_blk, c + ic * ldc + jc,
                         ldc, pc == 0 && bias ? bias + jc : NULL, pc == 0 && rbias ? rbias + ic : NULL,
                         relu && pc + kc >= k, NULL, NULL);
      }
    }
    return;
  }
  for (int64_t jc = 0, nc; jc < n; jc += nc) {
    /* A last panel of at most one sliver joins this one: A is packed once
     * per panel, so a 196-wide B would pack all of A twice for 4 columns. */
    nc = n - jc <= ncb + NR ? n - jc : ncb;
    for (int64_t pc = 0; pc < k; pc += DT__GEMM_KC) {
      int64_t kc = DT__MIN(DT__GEMM_KC, k - pc);
      float beta_blk = pc == 0 && !bias && !rbias ? beta : 1.0f; /* later k blocks add to C */
      dt__gemm_ua ub = {b + pc * ldb + jc, 0, ldb};
      if (!unpacked_b) pa->pack_b(trans_b, b, ldb, pc, jc, kc, nc, bp);
      else if (nc % NR) pa->pack_b(trans_b, b, ldb, pc, jc + nc - nc % NR, kc, nc % NR, bp); /* the narrow sliver */
      for (int64_t ic = 0; ic < m; ic += mcb) {
        int64_t mc = DT__MIN(mcb, m - ic);
        dt__gemm_ua u = {trans_a ? a + pc * lda + ic : a + ic * lda + pc, trans_a ? 1 : lda, trans_a ? lda : 1};
        if (!unpacked_a) pa->pack_a(trans_a, a, lda, ic, pc, mc, kc, ap);
        else if (mc % MR && (mc % MR != 4 || nc % NR)) /* the short sliver, where a tile needs it packed */
          pa->pack_a(trans_a, a, lda, ic + mc - mc % MR, pc, mc % MR, kc, ap);
        dt__gemm_macro(pa, mc, nc, kc, alpha, ap, bp, beta_blk, c + ic * ldc + jc, ldc,
                       pc == 0 && bias ? bias + jc : NULL, pc == 0 && rbias ? rbias + ic : NULL, relu && pc + kc >= k,
                       unpacked_a ? &u : NULL, unpacked_b ? &ub : NULL);
      }
    }
  }
}

/* The panels on the stack (320 KiB: dtrain's threads get 2 MiB), for when
 * no scratch slot can be had; kept out of line so that the usual way does
 * not reserve them. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
static void dt__gemm_run_stack(const dt__gemm_path *pa, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                               float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                               float *c, int64_t ldc, const dt__gemm_epi *ep) {
  float buf[DT__GEMM_BUF(DT__GEMM_NC_STACK)];
  dt__gemm_blocked(pa, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ep, buf, DT__GEMM_NC_STACK,
                   DT__GEMM_MC);
}

static void dt__gemm_run(const dt__gemm_path *pa, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                         int64_t ldc, const dt__gemm_epi *ep) {
  int slot;
  /* more than 2 MC rows and wider than a panel: room for all of A's rows (see dt__gemm_blocked) */
  int64_t arows = (m + pa->mr - 1) / pa->mr * pa->mr;
  if (m <= 2 * DT__GEMM_MC || n <= DT__GEMM_NC + pa->nr || arows > DT__GEMM_WHOLE_A_MAX) arows = DT__GEMM_MC;
  float *buf = (float *)dt__scratch_claim((size_t)DT__GEMM_BUF_A(arows, DT__GEMM_NC) * sizeof(float), &slot);
  if (!buf && arows > DT__GEMM_MC) { /* no memory for that: the usual panels */
    arows = DT__GEMM_MC;
    buf = (float *)dt__scratch_claim(DT__GEMM_BUF(DT__GEMM_NC) * sizeof(float), &slot);
  }
  if (!buf) {
    dt__gemm_run_stack(pa, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ep);
    return;
  }
  dt__gemm_blocked(pa, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ep, buf, DT__GEMM_NC, arows);
  dt__scratch_release(slot);
}

/* ---- intra-op threads ---------------------------------------------------------------------
 * C is cut into blocks of whole tiles, along the rows when op(A) has more
 * row tiles than op(B) has column tiles (but A @ B^T with at least 4 column
 * tiles a thread: see dt_sgemm), else along the columns, and each
 * thread runs the one-thread product on its block. The cuts fall on
 * multiples of MR (rows) or NR (columns) from 0, so each tile of C is the
 * same tile (full, 4-row or edge) with the same k blocks as in the whole
 * product: every element is computed by exactly one thread, bit for bit as
 * with one thread. */
#define DT__GEMM_PAR_MIN ((double)(1 << 20)) /* multiply-adds below which one thread is faster */

typedef void (*dt__gemm_dot_fn)(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                                const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

typedef struct dt__gemm_job {
  const dt__gemm_path *pa;
  dt__gemm_dot_fn dot; /* the unpacked dot-product kernel, or NULL: packed */
  int trans_a, trans_b, by_rows;
  int64_t m, n, k, lda, ldb, ldc, tiles;
  float alpha, beta;
  const float *a, *b;
  float *c;
  const dt__gemm_epi *ep;
} dt__gemm_job;

static void dt__gemm_part(void *arg, int part, int nparts) {
  const dt__gemm_job *j = (const dt__gemm_job *)arg;
  int64_t t0 = j->tiles * part / nparts, t1 = j->tiles * (part + 1) / nparts;
  if (t0 >= t1) return;
  dt__gemm_epi ep = {NULL, 0, NULL}; /* the bias from this block's first row or column */
  if (j->ep) ep = *j->ep;
  if (j->dot || j->by_rows) {
    int64_t i0 = j->dot ? t0 * 3 : t0 * j->pa->mr, i1 = DT__MIN(j->m, j->dot ? t1 * 3 : t1 * j->pa->mr);
    float *c = j->c + i0 * j->ldc;
    if (ep.row_bias) ep.row_bias += i0;
    if (!j->dot) {
      const float *a = j->trans_a ? j->a + i0 : j->a + i0 * j->lda;
      dt__gemm_run(j->pa, j->trans_a, j->trans_b, i1 - i0, j->n, j->k, j->alpha, a, j->lda, j->b, j->ldb, j->beta, c,
                   j->ldc, j->ep ? &ep : NULL);
      return;
    } /* the dot kernel: blocks of 3 rows; the epilogue over them, before and after */
    int bias = ep.bias || ep.row_bias;
    if (bias) dt__gemm_bias_rows(ep.bias, ep.row_bias, i1 - i0, j->n, c, j->ldc);
    j->dot(i1 - i0, j->n, j->k, j->alpha, j->a + i0 * j->lda, j->lda, j->b, j->ldb, bias ? 1.0f : j->beta, c, j->ldc);
    if (ep.relu) dt__relu_rows(c, i1 - i0, j->n, j->ldc);
  } else {
    int64_t c0 = t0 * j->pa->nr, c1 = DT__MIN(j->n, t1 * j->pa->nr);
    const float *b = j->trans_b ? j->b + c0 * j->ldb : j->b + c0;
    if (ep.bias) ep.bias += c0;
    dt__gemm_run(j->pa, j->trans_a, j->trans_b, j->m, c1 - c0, j->k, j->alpha, j->a, j->lda, b, j->ldb, j->beta,
                 j->c + c0, j->ldc, j->ep ? &ep : NULL);
  }
}

/* A @ B^T with few rows and many columns (a linear layer's
 * forward on a small batch or a replica's shard of one: A the inputs, B the
 * weights) runs as (B @ A^T)^T, in blocks of B's rows: the weights become
 * the product's A, which the x86 kernels read where it lies (n <= 256: see
 * the top of this file), and the inputs its B, packed once a block; each
 * block's result goes through a small tile on the stack into C's columns
 * (intra-op threads: each a run of whole tiles of B's rows).
 * The weights are then neither packed nor read more than once, and the
 * tiles run over 6 rows of B (32 rows of A leave an edge tile of 2). Only
 * for 16 or 32 rows, and 64 with weights of at least 2^20 floats and
 * k >= 1024 (too big for the caches: packing them read them from memory and
 * wrote them again): the inputs then fill whole 16- or 32-float slivers (24,
 * 40 or 48 rows were slower flipped; 64 rows with small weights, 5-15%
 * slower: 64 x 1024 x 256 342 -> 361 us). Every element is
 * the same FMAs in the same k order (a product of two floats does not care
 * which is A): the same bits. One thread, Zen 4 EPYC, cold caches:
 * 32 x 256 x 784 (x @ W^T) AVX-512 157 -> 123 us, AVX2 (its dot kernel)
 * 140 -> 125; 32 x 512 x 512 236 -> 169, 200 -> 166; 16 x 256 x 784
 * 89 -> 78, 77 -> 64; 32 x 1024 x 3136 (a CNN's fc1, its weights cold:
 * packing them cost the most) 3171 -> 1940; 64 x 1024 x 3136 5309 -> 4083
 * (AVX2 5173 -> 4286; two threads 2813 -> 2078); 64 x 4096 x 1024
 * 7247 -> 6490. */
#define DT__GEMM_FLIP_BUF 8192 /* floats of the transposed block: 32 KiB of stack */
static int dt__gemm_flip_ok(int path, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float beta) {
#ifdef DT__GEMM_X86
  return (path == DT__GEMM_PATH_AVX512 || path == DT__GEMM_PATH_AVX2) && !trans_a && trans_b && beta == 0.0f &&
         (((m == 16 || m == 32) && n >= 64 && k >= 128) ||
          (m == 64 && k >= 1024 && (double)n * (double)k >= (double)(1 << 20)));
#else
  (void)path, (void)trans_a, (void)trans_b, (void)m, (void)n, (void)k, (void)beta;
  return 0;
#endif
}

typedef struct dt__gemm_flip_job {
  const dt__gemm_path *pa;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha;
  const float *a, *b;
  float *c;
  const dt__gemm_epi *ep;
} dt__gemm_flip_job;

/* Columns [j0, j1) of C: blocks of whole tiles of B's rows. */
static void dt__gemm_flip_cols(const dt__gemm_flip_job *f, int64_t j0, int64_t j1) {
  float t[DT__GEMM_FLIP_BUF];
  int64_t m = f->m, rows = DT__GEMM_FLIP_BUF / m / f->pa->mr * f->pa->mr; /* of B a block: columns of C */
  for (; j0 < j1; j0 += rows) {
    int64_t nb = DT__MIN(rows, j1 - j0);
    dt__gemm_epi e = {NULL, 0, NULL}; /* C's column bias is the block's row bias, and the other way */
    if (f->ep) {
      e.relu = f->ep->relu;
      e.row_bias = f->ep->bias ? f->ep->bias + j0 : NULL;
      e.bias = f->ep->row_bias;
    }
    dt__gemm_run(f->pa, 0, 1, nb, m, f->k, f->alpha, f->b + j0 * f->ldb, f->ldb, f->a, f->lda, 0.0f, t, m,
                 f->ep ? &e : NULL);
    for (int64_t i = 0; i < m; i++) {
      float *ci = f->c + i * f->ldc + j0;
      for (int64_t j = 0; j < nb; j++) ci[j] = t[j * m + i];
    }
  }
}

/* Intra-op threads: each takes a run of whole tiles of B's rows. */
static void dt__gemm_flip_part(void *arg, int part, int nparts) {
  const dt__gemm_flip_job *f = (const dt__gemm_flip_job *)arg;
  int64_t tiles = (f->n + f->pa->mr - 1) / f->pa->mr;
  int64_t j0 = tiles * part / nparts * f->pa->mr, j1 = DT__MIN(f->n, tiles * (part + 1) / nparts * f->pa->mr);
  if (j0 < j1) dt__gemm_flip_cols(f, j0, j1);
}

static void dt__gemm_flipped(const dt__gemm_path *pa, int threads, int64_t m, int64_t n, int64_t k, float alpha,
                             const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc,
                             const dt__gemm_epi *ep) {
  dt__gemm_flip_job f = {pa, m, n, k, lda, ldb, ldc, alpha, a, b, c, ep};
  int parts = (int)DT__MIN((int64_t)threads, (n + pa->mr - 1) / pa->mr);
  if (parts > 1)
    dt__par_run(parts, dt__gemm_flip_part, &f);
  else
    dt__gemm_flip_cols(&f, 0, n);
}

/* dt_sgemm with the epilogue ep (or NULL). */
static void dt__sgemm_do(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc,
                         const dt__gemm_epi *ep) {
  if (m <= 0 || n <= 0) return;
  /* A and B are read only when k > 0 (and alpha != 0 for this kernel; BLAS
   * may still read them): refuse NULL ones, as a C that is NULL, before any
   * work. void: the reason goes to dt_last_error(). */
  if (!c || (k > 0 && (!a || !b))) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_sgemm: %s is NULL", !c ? "C" : !a ? "A" : "B");
    return;
  }
#ifdef DTRAIN_USE_CBLAS
  /* BLAS, like this kernel, never reads C when beta == 0. Sizes beyond int
   * (not reachable with the arena's limits) fall through to the C kernel. */
  if (m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX) {
    if (ep && (ep->bias || ep->row_bias)) {
      dt__gemm_bias_rows(ep->bias, ep->row_bias, m, n, c, ldc);
      beta = 1.0f;
    }
    if (k <= 0)
      dt__gemm_scale(m, n, beta, c, ldc);
    else
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)m,
                  (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
    if (ep && ep->relu) dt__relu_rows(c, m, n, ldc);
    return;
  }
#endif
  if (k <= 0 || alpha == 0.0f) {
    int bias = ep && (ep->bias || ep->row_bias);
    if (bias) dt__gemm_bias_rows(ep->bias, ep->row_bias, m, n, c, ldc);
    dt__gemm_scale(m, n, bias ? 1.0f : beta, c, ldc);
    if (ep && ep->relu) dt__relu_rows(c, m, n, ldc);
    return;
  }
  int path = DT__GEMM_LOAD(dt__gemm_bf16_on) ? DT__GEMM_PATH_BF16 : dt__gemm_path_id();
  const dt__gemm_path *pa = &dt__gemm_paths[path];
  /* A @ B^T with few columns, or with few rows and a long k (a layer's
   * forward on a small batch: packing B, the weights, would cost as much as
   * the product): the unpacked dot-product kernel. On the AVX-512 path only
   * with few columns: there the dot products are bound by reading A from L2
   * (64x256x784 on a Zen 5 EPYC: 102 GFLOP/s, packed 153). */
  dt__gemm_dot_fn dot = NULL;
#ifdef DT__GEMM_X86
  if (!trans_a && trans_b && k >= 16) {
    if (path == DT__GEMM_PATH_AVX2 && (n < 32 || (m <= 32 && k >= 256) || (m <= 64 && k >= 512)))
      dot = dt__gemm_dot_avx2;
    else if (path == DT__GEMM_PATH_AVX512 && n < 32)
      dot = dt__gemm_dot_avx512;
  }
#endif
  int threads = (double)m * (double)n * (double)k >= DT__GEMM_PAR_MIN ? dt__par_threads() : 1;
  if (dt__gemm_flip_ok(path, trans_a, trans_b, m, n, k, beta)) {
    dt__gemm_flipped(pa, threads, m, n, k, alpha, a, lda, b, ldb, c, ldc, ep);
    return;
  }
  if (threads > 1 || dot) {
    dt__gemm_job j;
    int64_t tiles_m = (m + pa->mr - 1) / pa->mr, tiles_n = (n + pa->nr - 1) / pa->nr;
    j.pa = pa;
    j.trans_a = trans_a;
    j.trans_b = trans_b;
    j.dot = dot;
    /* A @ B^T with B's rows to spare (a linear layer's forward: B the weights) is cut along the
     * columns: each thread packs and reads only its share of the weights, which it then also
     * updates in the optimizer's split of the same rows (2 threads, Zen 5: MLP batch 64
     * 291-294k -> 325-328k samples/s, batch 256 388-392k -> 403-404k) */
    j.by_rows = dot != NULL || (tiles_m > tiles_n && !(trans_b && !trans_a && tiles_n >= 4 * threads));
    j.tiles = dot != NULL ? (m + 2) / 3 : j.by_rows ? tiles_m : tiles_n;
    j.m = m;
    j.n = n;
    j.k = k;
    j.lda = lda;
    j.ldb = ldb;
    j.ldc = ldc;
    j.alpha = alpha;
    j.beta = beta;
    j.a = a;
    j.b = b;
    j.c = c;
    j.ep = ep;
    int parts = (int)DT__MIN((int64_t)threads, j.tiles);
    if (parts > 1) {
      dt__par_run(parts, dt__gemm_part, &j);
      return;
    }
    if (dot) {
      dt__gemm_part(&j, 0, 1);
      return;
    }
  }
  dt__gemm_run(pa, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ep);
}

DTRAIN_API void dt_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  dt__sgemm_do(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, NULL);
}

DTRAIN_PRIVATE void dt__sgemm_epi(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                                  int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc,
                                  const dt__gemm_epi *ep) {
  dt__sgemm_do(trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc, ep);
}

#undef DT__GEMM_MR
#undef DT__GEMM_NR
#undef DT__GEMM_KC
#undef DT__GEMM_MC
#undef DT__GEMM_NC
#undef DT__GEMM_NC_STACK
#undef DT__GEMM_TILE_MAX
#undef DT__GEMM_NR_MAX
#undef DT__GEMM_PAR_MIN
#undef DT__GEMM_BUF
#undef DT__GEMM_UNROLL
#undef DT__GEMM_KLOOP
#undef DT__GEMM_PORTABLE
#undef DT__GEMM_PATH_AVX2
#undef DT__GEMM_PATH_NEON
#undef DT__GEMM_PATH_AVX512
#undef DT__GEMM_PATH_BF16
#undef DT__GEMM_NPATHS
#undef DT__GEMM_LOAD
#undef DT__GEMM_STORE
#ifdef DT__GEMM_X86
#  undef DT__GEMM_X86
#endif
#ifdef DT__GEMM_NEON
#  undef DT__GEMM_NEON
#endif
