/* Reductions and shape ops: values against naive references, gradients against
 * finite differences on random shapes, reshape aliasing, gradient flow through
 * chains, and every error path. */
#include "harness.h"

/* ---- helpers ------------------------------------------------------------------ */

static int64_t numel(const int64_t *s, int nd) {
  int64_t n = 1;
  for (int d = 0; d < nd; d++) n *= s[d];
  return n;
}

static void unravel(int64_t flat, const int64_t *s, int nd, int64_t *idx) {
  for (int d = nd - 1; d >= 0; d--) {
    idx[d] = flat % s[d];
    flat /= s[d];
  }
}

static int64_t ravel(const int64_t *idx, const int64_t *s, int nd) {
  int64_t f = 0;
  for (int d = 0; d < nd; d++) f = f * s[d] + idx[d];
  return f;
}

/* Random shape of rank nd: first dim (the batch) in [2,4], the rest in [1,4]. */
static void rand_shape(int nd, int64_t *s) {
  for (int d = 0; d < nd; d++) s[d] = (d == 0 ? 2 : 1) + (int64_t)(th_rand() * (d == 0 ? 3 : 4));
}

static int same_shape_as(const dt_tensor *t, const int64_t *s, int nd) {
  if (!t || t->ndim != nd) return 0;
  for (int d = 0; d < nd; d++)
    if (t->shape[d] != s[d]) return 0;
  return 1;
}

/* The graph must hold `code` with `needle` in its message. */
#define CHECK_GERR(g, code, needle)                                                                  \
  do {                                                                                             \
    CHECK_MSG(dt_graph_error(g) == (code), "got %s, expected %s", dt_result_name(dt_graph_error(g)), \
              dt_result_name(code));                                                               \
    CHECK_MSG(strstr(dt_graph_message(g), (needle)) != NULL, "message '%s' lacks '%s'",            \
              dt_graph_message(g), (needle));                                                      \
  } while (0)

/* ---- reductions: values ---------------------------------------------------------- */

static void test_sum_mean_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[3] = {2, 3, 4};
  float v[24];
  th_fill(v, 24, -3, 3);
  double ref = 0;
  for (int i = 0; i < 24; i++) ref += v[i];
  dt_tensor *x = dt_tensor_from(g, 3, s, v);
  dt_tensor *y = dt_sum(g, x), *m = dt_mean(g, x);
  CHECK(y && y->ndim == 0 && y->size == 1);
  CHECK(m && m->ndim == 0 && m->size == 1);
  if (y && m) {
    CHECK_NEAR(y->data[0], ref, 1e-5);
    CHECK_NEAR(m->data[0], ref / 24, 1e-6);
  }
  /* a scalar input */
  dt_tensor *sc = dt_scalar(g, 2.5f);
  dt_tensor *ss = dt_sum(g, sc), *sm = dt_mean(g, sc);
  CHECK(ss && sm && ss->data[0] == 2.5f && sm->data[0] == 2.5f);
  /* accuracy: a float accumulator would stall at 2^24 */
  float big[1001];
  big[0] = 16777216.0f;
  for (int i = 1; i < 1001; i++) big[i] = 1.0f;
  int64_t sb = 1001;
  dt_tensor *b = dt_tensor_from(g, 1, &sb, big);
  dt_tensor *bs = dt_sum(g, b), *ba = dt_sum_axis(g, b, 0, 0);
  CHECK(bs && bs->data[0] == 16778216.0f);
  CHECK(ba && ba->ndim == 0 && ba->data[0] == 16778216.0f);
  dt_graph_destroy(g);
}

/* Naive sum over `ax` of x (shape s, rank nd) into out (the reduced layout). */
static void naive_sum_axis(const float *x, const int64_t *s, int nd, int ax, double *out) {
  int64_t rs[DTRAIN_MAX_DIMS], idx[DTRAIN_MAX_DIMS];
  for (int d = 0; d < nd; d++) rs[d] = d == ax ? 1 : s[d];
  int64_t n = numel(s, nd), no = numel(rs, nd);
  for (int64_t i = 0; i < no; i++) out[i] = 0;
  for (int64_t i = 0; i < n; i++) {
    unravel(i, s, nd, idx);
    idx[ax] = 0;
    out[ravel(idx, rs, nd)] += x[i];
  }
}

static void test_sum_axis_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float x[600];
  double ref[600];
  for (int nd = 1; nd <= 4; nd++) {
    for (int trial = 0; trial < 3; trial++) {
      int64_t s[4];
      rand_shape(nd, s);
      if (trial == 2 && nd > 1) { /* axis 0 then has inner = 300: more than one accumulation block */
        s[0] = 2;
        s[nd - 1] = 1;
        s[nd - 1] = 300 / numel(s + 1, nd - 1);
      }
      int64_t n = numel(s, nd);
      th_fill(x, n, -2, 2);
      for (int ax = -nd; ax < nd; ax++) {
        int a = ax < 0 ? ax + nd : ax;
        naive_sum_axis(x, s, nd, a, ref);
        for (int keep = 0; keep <= 1; keep++) {
          for (int mean = 0; mean <= 1; mean++) {
            dt_graph_reset(g);
            dt_tensor *t = dt_tensor_from(g, nd, s, x);
            dt_tensor *y = mean ? dt_mean_axis(g, t, ax, keep) : dt_sum_axis(g, t, ax, keep);
            CHECK_MSG(y != NULL, "%s", dt_graph_message(g));
            if (!y) continue;
            int64_t es[4];
            int en = 0;
            for (int d = 0; d < nd; d++) {
              if (d != a) es[en++] = s[d];
              else if (keep) es[en++] = 1;
            }
            CHECK_MSG(same_shape_as(y, es, en), "nd %d axis %d keep %d", nd, ax, keep);
            int64_t no = n / s[a], bad = 0;
            for (int64_t i = 0; i < no && i < y->size; i++) {
              double r = mean ? ref[i] / (double)s[a] : ref[i];
              if (fabs(y->data[i] - r) > 1e-5) bad++;
            }
            CHECK_MSG(bad == 0, "nd %d axis %d keep %d mean %d: %lld wrong", nd, ax, keep, mean, (long long)bad);
          }
        }
      }
    }
  }
  dt_graph_destroy(g);
}

/* ---- reductions: gradients ------------------------------------------------------- */

typedef struct { int op, axis, keep; } red_ctx;

static dt_tensor *f_reduce(dt_graph *g, dt_tensor **in, void *ctx) {
  red_ctx *c = (red_ctx *)ctx;
  switch (c->op) {
    case 0: return dt_sum(g, in[0]);
    case 1: return dt_mean(g, in[0]);
    case 2: return dt_sum_axis(g, in[0], c->axis, c->keep);
    default: return dt_mean_axis(g, in[0], c->axis, c->keep);
  }
}

static void test_reduce_grads(void) {
  float x[256];
  for (int nd = 1; nd <= 4; nd++) {
    int64_t s[4];
    rand_shape(nd, s);
    th_fill(x, numel(s, nd), -2, 2);
    for (int op = 0; op < 2; op++) {
      red_ctx c = {op, 0, 0};
      th_input in = th_in(x, nd, s, 1);
      int bad = th_gradcheck(op ? "mean" : "sum", f_reduce, &c, &in, 1);
      CHECK_MSG(bad == 0, "op %d nd %d: %d mismatches", op, nd, bad);
    }
    for (int ax = -nd; ax < nd; ax++) {
      for (int keep = 0; keep <= 1; keep++) {
        for (int op = 2; op < 4; op++) {
          red_ctx c = {op, ax, keep};
          th_input in = th_in(x, nd, s, 1);
          int bad = th_gradcheck(op == 2 ? "sum_axis" : "mean_axis", f_reduce, &c, &in, 1);
          CHECK_MSG(bad == 0, "op %d nd %d axis %d keep %d: %d mismatches", op, nd, ax, keep, bad);
        }
      }
    }
  }
}

/* Exact backward values: d sum = 1, d mean = 1/n, accumulated (+=) over two uses. */
static void test_reduce_backward_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[2] = {3, 4};
  float v[12];
  th_fill(v, 12, -1, 1);
  dt_tensor *x = dt_tensor_from(g, 2, s, v);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *a = dt_sum(g, x), *b = dt_mean_axis(g, x, -1, 1); /* b: [3,1] */
  dt_tensor *l = dt_add(g, a, dt_sum(g, b));
  CHECK(l != NULL && dt_backward(g, l) == DTRAIN_OK);
  CHECK(x->grad != NULL);
  if (x->grad)
    for (int i = 0; i < 12; i++) CHECK_NEAR(x->grad[i], 1.25, 1e-6);
  dt_graph_destroy(g);
}

/* ---- reshape, reshape2, flatten ---------------------------------------------------- */

static void test_reshape_alias_and_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[3] = {2, 3, 4};
  float v[24];
  for (int i = 0; i < 24; i++) v[i] = (float)i;
  dt_tensor *x = dt_tensor_from(g, 3, s, v);
  int64_t ns[2] = {-1, 6};
  dt_tensor *y = dt_reshape(g, x, 2, ns);
  CHECK(y && y->ndim == 2 && y->shape[0] == 4 && y->shape[1] == 6 && y->size == 24);
  CHECK(y && y->data == x->data);
  CHECK(y && (y->flags & DTRAIN_TENSOR_VIEW));
  int64_t ns2[4] = {2, 2, -1, 3};
  dt_tensor *z = dt_reshape(g, y, 4, ns2);
  CHECK(z && z->shape[2] == 2 && z->data == x->data);
  dt_tensor *r2 = dt_reshape2(g, x, 8, -1);
  CHECK(r2 && r2->ndim == 2 && r2->shape[0] == 8 && r2->shape[1] == 3 && r2->data == x->data);
  dt_tensor *f = dt_flatten(g, x);
  CHECK(f && f->ndim == 2 && f->shape[0] == 2 && f->shape[1] == 12 && f->data == x->data);
  int64_t s1 = 5;
  dt_tensor *x1 = dt_tensor_new(g, 1, &s1);
  dt_tensor *f1 = dt_flatten(g, x1);
  CHECK(f1 && f1->ndim == 2 && f1->shape[0] == 5 && f1->shape[1] == 1);
  /* to and from a scalar */
  int64_t one = 1;
  dt_tensor *o = dt_tensor_from(g, 1, &one, v + 7);
  dt_tensor *sc = dt_reshape(g, o, 0, NULL);
  CHECK(sc && sc->ndim == 0 && sc->size == 1 && sc->data[0] == 7.0f);
  int64_t m1 = -1;
  dt_tensor *back = dt_reshape(g, sc, 1, &m1);
  CHECK(back && back->ndim == 1 && back->shape[0] == 1);
  /* writes through the view are seen by the input (same memory) */
  if (y) y->data[5] = 100.0f;
  CHECK(x->data[5] == 100.0f);
  /* no input needs a gradient: nothing on the tape */
  CHECK(y && !(y->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  dt_graph_destroy(g);
}

typedef struct { int op; int nd; int64_t shape[4]; } rs_ctx;

static dt_tensor *f_reshape(dt_graph *g, dt_tensor **in, void *ctx) {
  rs_ctx *c = (rs_ctx *)ctx;
  switch (c->op) {
    case 0: return dt_reshape(g, in[0], c->nd, c->shape);
    case 1: return dt_reshape2(g, in[0], c->shape[0], c->shape[1]);
    case 2: return dt_flatten(g, in[0]);
    default: { /* x + reshape(reshape(x)): the two paths must add up */
      dt_tensor *y = dt_reshape(g, in[0], c->nd, c->shape);
      int64_t sh[DTRAIN_MAX_DIMS];
      for (int d = 0; d < in[0]->ndim; d++) sh[d] = in[0]->shape[d];
      return dt_mul(g, in[0], dt_reshape(g, dt_mul_scalar(g, y, 3.0f), in[0]->ndim, sh));
    }
  }
}

static void test_reshape_grads(void) {
  float x[256];
  for (int nd = 1; nd <= 4; nd++) {
    int64_t s[4];
    rand_shape(nd, s);
    int64_t n = numel(s, nd);
    th_fill(x, n, -2, 2);
    th_input in = th_in(x, nd, s, 1);
    rs_ctx c;
    memset(&c, 0, sizeof c);
    c.op = 0; c.nd = 2; c.shape[0] = -1; c.shape[1] = s[0];
    CHECK(th_gradcheck("reshape", f_reshape, &c, &in, 1) == 0);
    c.nd = 3; c.shape[0] = 1; c.shape[1] = n; c.shape[2] = 1;
    CHECK(th_gradcheck("reshape3", f_reshape, &c, &in, 1) == 0);
    c.op = 1; c.shape[0] = s[0]; c.shape[1] = -1;
    CHECK(th_gradcheck("reshape2", f_reshape, &c, &in, 1) == 0);
    c.op = 2;
    CHECK(th_gradcheck("flatten", f_reshape, &c, &in, 1) == 0);
    c.op = 3; c.nd = 1; c.shape[0] = -1;
    CHECK(th_gradcheck("reshape_chain", f_reshape, &c, &in, 1) == 0);
  }
}

/* Backward of a reshape accumulates: grad of x from two reshaped uses is 2. */
static void test_reshape_backward_accumulates(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s[2] = {2, 3};
  dt_tensor *x = dt_tensor_new(g, 2, s);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *a = dt_reshape2(g, x, 3, 2), *b = dt_flatten(g, x);
  dt_tensor *l = dt_add(g, dt_sum(g, a), dt_sum(g, b));
  CHECK(a && (a->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  CHECK(l && dt_backward(g, l) == DTRAIN_OK);
  CHECK(x->grad != NULL && a->grad != NULL && a->grad != x->grad);
  if (x->grad)
    for (int i = 0; i < 6; i++) CHECK(x->grad[i] == 2.0f);
  dt_graph_destroy(g);
}

/* ---- transpose and permute ------------------------------------------------------------ */

static void test_transpose_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  static const int64_t shapes[][4] = {{2, 3}, {3, 40, 35}, {2, 3, 4, 5}};
  static const int nds[] = {2, 3, 4};
  static float v[3 * 40 * 35];
  for (int c = 0; c < 3; c++) {
    int nd = nds[c];
    const int64_t *s = shapes[c];
    int64_t n = numel(s, nd), m = s[nd - 2], k = s[nd - 1];
    for (int64_t i = 0; i < n; i++) v[i] = (float)i;
    dt_graph_reset(g);
    dt_tensor *x = dt_tensor_from(g, nd, s, v);
    dt_tensor *y = dt_transpose(g, x);
    CHECK(y && y->ndim == nd && y->shape[nd - 2] == k && y->shape[nd - 1] == m && y->data != x->data);
    if (!y) continue;
    int64_t bad = 0;
    for (int64_t b = 0; b < n / (m * k); b++)
      for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++)
          if (y->data[b * m * k + j * m + i] != v[b * m * k + i * k + j]) bad++;
    CHECK_MSG(bad == 0, "case %d: %lld wrong", c, (long long)bad);
  }
  dt_graph_destroy(g);
}

static void test_permute_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float v[256];
  for (int nd = 1; nd <= 4; nd++) {
    for (int trial = 0; trial < 4; trial++) {
      int64_t s[4], idx[4], oidx[4], os[4];
      int perm[4];
      rand_shape(nd, s);
      for (int d = 0; d < nd; d++) perm[d] = d;
      for (int d = nd - 1; d > 0; d--) { /* Fisher-Yates */
        int j = (int)(th_rand() * (d + 1));
        int t = perm[d]; perm[d] = perm[j]; perm[j] = t;
      }
      int qperm[4];
      for (int d = 0; d < nd; d++) qperm[d] = trial & 1 ? perm[d] - nd : perm[d]; /* negative form */
      int64_t n = numel(s, nd);
      th_fill(v, n, -1, 1);
      dt_graph_reset(g);
      dt_tensor *x = dt_tensor_from(g, nd, s, v);
      dt_tensor *y = dt_permute(g, x, qperm);
      for (int d = 0; d < nd; d++) os[d] = s[perm[d]];
      CHECK_MSG(same_shape_as(y, os, nd), "%s", dt_graph_message(g));
      if (!y) continue;
      int64_t bad = 0;
      for (int64_t i = 0; i < n; i++) {
        unravel(i, os, nd, oidx);
        for (int d = 0; d < nd; d++) idx[perm[d]] = oidx[d];
        if (y->data[i] != v[ravel(idx, s, nd)]) bad++;
      }
      CHECK_MSG(bad == 0, "nd %d trial %d: %lld wrong", nd, trial, (long long)bad);
    }
  }
  /* permute of a scalar is a copy */
  dt_graph_reset(g);
  dt_tensor *sc = dt_scalar(g, 4.0f);
  dt_tensor *ps = dt_permute(g, sc, NULL);
  CHECK(ps && ps->ndim == 0 && ps->data[0] == 4.0f && ps->data != sc->data);
  dt_graph_destroy(g);
}

typedef struct { int op; int perm[4]; } perm_ctx;

static dt_tensor *f_perm(dt_graph *g, dt_tensor **in, void *ctx) {
  perm_ctx *c = (perm_ctx *)ctx;
  return c->op ? dt_permute(g, in[0], c->perm) : dt_transpose(g, in[0]);
}

static void test_transpose_permute_grads(void) {
  float x[256];
  for (int nd = 1; nd <= 4; nd++) {
    int64_t s[4];
    rand_shape(nd, s);
    th_fill(x, numel(s, nd), -2, 2);
    th_input in = th_in(x, nd, s, 1);
    perm_ctx c;
    memset(&c, 0, sizeof c);
    if (nd >= 2) CHECK_MSG(th_gradcheck("transpose", f_perm, &c, &in, 1) == 0, "nd %d", nd);
    c.op = 1;
    for (int d = 0; d < nd; d++) c.perm[d] = nd - 1 - d; /* reverse */
    CHECK_MSG(th_gradcheck("permute_rev", f_perm, &c, &in, 1) == 0, "nd %d", nd);
    for (int d = 0; d < nd; d++) c.perm[d] = (d + 1) % nd - (d % 2 ? nd : 0); /* rotate, some negative */
    CHECK_MSG(th_gradcheck("permute_rot", f_perm, &c, &in, 1) == 0, "nd %d", nd);
  }
}

/* ---- concat ------------------------------------------------------------------------ */

static void test_concat_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  static float v[5][256];
  for (int nd = 1; nd <= 4; nd++) {
    for (int ax = -nd; ax < nd; ax++) {
      int a = ax < 0 ? ax + nd : ax;
      int n = 1 + (int)(th_rand() * 5); /* 1..5 inputs */
      int64_t base[4], s[5][4], os[4];
      rand_shape(nd, base);
      dt_graph_reset(g);
      dt_tensor *xs[5];
      int64_t cat = 0, offs[6];
      for (int j = 0; j < n; j++) {
        memcpy(s[j], base, sizeof base);
        s[j][a] = 1 + (int64_t)(th_rand() * 3);
        offs[j] = cat;
        cat += s[j][a];
        th_fill(v[j], numel(s[j], nd), -1, 1);
        xs[j] = dt_tensor_from(g, nd, s[j], v[j]);
      }
      offs[n] = cat;
      dt_tensor *y = dt_concat(g, xs, n, ax);
      memcpy(os, base, sizeof base);
      os[a] = cat;
      CHECK_MSG(same_shape_as(y, os, nd), "%s", dt_graph_message(g));
      if (!y) continue;
      int64_t bad = 0, idx[4];
      for (int64_t i = 0; i < y->size; i++) {
        unravel(i, os, nd, idx);
        int j = 0;
        while (idx[a] >= offs[j + 1]) j++;
        idx[a] -= offs[j];
        if (y->data[i] != v[j][ravel(idx, s[j], nd)]) bad++;
      }
      CHECK_MSG(bad == 0, "nd %d axis %d n %d: %lld wrong", nd, ax, n, (long long)bad);
    }
  }
  dt_graph_destroy(g);
}

typedef struct { int axis, n; } cat_ctx;

static dt_tensor *f_concat(dt_graph *g, dt_tensor **in, void *ctx) {
  cat_ctx *c = (cat_ctx *)ctx;
  return dt_concat(g, in, c->n, c->axis);
}

static void test_concat_grads(void) {
  static float v[4][256];
  for (int nd = 1; nd <= 4; nd++) {
    for (int ax = -nd; ax < nd; ax++) {
      int a = ax < 0 ? ax + nd : ax;
      for (int n = 1; n <= 4; n++) {
        int64_t base[4], s[4][4];
        rand_shape(nd, base);
        th_input ins[4];
        for (int j = 0; j < n; j++) {
          memcpy(s[j], base, sizeof base);
          s[j][a] = 1 + (int64_t)(th_rand() * 3);
          th_fill(v[j], numel(s[j], nd), -2, 2);
          ins[j] = th_in(v[j], nd, s[j], 1);
        }
        cat_ctx c = {ax, n};
        int bad = th_gradcheck("concat", f_concat, &c, ins, n);
        CHECK_MSG(bad == 0, "nd %d axis %d n %d: %d mismatches", nd, ax, n, bad);
        if (n == 4) {
          /* only the 4th input needs a gradient: concat must still reach the tape */
          for (int j = 0; j < 3; j++) ins[j].grad = 0;
          bad = th_gradcheck("concat_last_only", f_concat, &c, ins, n);
          CHECK_MSG(bad == 0, "last only: nd %d axis %d: %d mismatches", nd, ax, bad);
        }
      }
    }
  }
}

/* More inputs than src[] holds: every input gets its own slice of the seed. */
static void test_concat_many_backward(void) {
  enum { N = 7 };
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *xs[N];
  for (int j = 0; j < N; j++) {
    xs[j] = dt_tensor_new2(g, 2, j + 1);
    if (j == 5 || j == 6) dt_tensor_set_requires_grad(xs[j], 1); /* none of the first three */
  }
  dt_tensor *y = dt_concat(g, xs, N, 1); /* [2, 28] */
  CHECK(y && y->shape[0] == 2 && y->shape[1] == 28);
  CHECK(y && (y->flags & DTRAIN_TENSOR_REQUIRES_GRAD) && y->aux != NULL);
  float seed[56];
  for (int i = 0; i < 56; i++) seed[i] = (float)i;
  CHECK(y && dt_backward_grad(g, y, seed) == DTRAIN_OK);
  for (int j = 0; j < N; j++) {
    if (j != 5 && j != 6) {
      CHECK(xs[j]->grad == NULL);
      continue;
    }
    CHECK(xs[j]->grad != NULL);
    if (!xs[j]->grad) continue;
    int64_t off = (int64_t)j * (j + 1) / 2, bad = 0;
    for (int r = 0; r < 2; r++)
      for (int c = 0; c <= j; c++)
        if (xs[j]->grad[r * (j + 1) + c] != seed[r * 28 + off + c]) bad++;
    CHECK_MSG(bad == 0, "input %d: %lld wrong", j, (long long)bad);
  }
  dt_graph_destroy(g);

  /* the same tensor twice accumulates; no input needing grad keeps it off the tape */
  g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new2(g, 2, 2);
  dt_tensor *p = dt_tensor_new2(g, 2, 2);
  dt_tensor_set_requires_grad(x, 1);
  dt_tensor *two[5] = {p, p, p, x, x};
  dt_tensor *z = dt_concat(g, two, 5, 0);
  dt_tensor *nog[2] = {p, p};
  dt_tensor *w = dt_concat(g, nog, 2, 0);
  CHECK(w && !(w->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  CHECK(z && dt_backward(g, dt_sum(g, z)) == DTRAIN_OK);
  CHECK(x->grad && x->grad[0] == 2.0f && x->grad[3] == 2.0f);
  CHECK(p->grad == NULL);
  dt_graph_destroy(g);

  /* no-grad mode: nothing recorded */
  g = dt_graph_create(NULL, NULL);
  x = dt_tensor_new2(g, 2, 2);
  dt_tensor_set_requires_grad(x, 1);
  dt_graph_set_grad_enabled(g, 0);
  dt_tensor *one[1] = {x};
  dt_tensor *u = dt_concat(g, one, 1, -1);
  CHECK(u && !(u->flags & DTRAIN_TENSOR_REQUIRES_GRAD));
  dt_graph_destroy(g);
}

/* ---- slice and split ---------------------------------------------------------------- */

static void test_slice_split_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float v[256];
  for (int nd = 1; nd <= 4; nd++) {
    int64_t s[4], os[4], idx[4];
    rand_shape(nd, s);
    s[nd - 1] = 4;
    int64_t n = numel(s, nd);
    for (int64_t i = 0; i < n; i++) v[i] = (float)i;
    for (int ax = -nd; ax < nd; ax++) {
      int a = ax < 0 ? ax + nd : ax;
      int64_t dim = s[a], start = (int64_t)(th_rand() * (double)dim);
      int64_t len = 1 + (int64_t)(th_rand() * (double)(dim - start));
      dt_graph_reset(g);
      dt_tensor *x = dt_tensor_from(g, nd, s, v);
      dt_tensor *y = dt_slice(g, x, ax, start, len);
      memcpy(os, s, sizeof s);
      os[a] = len;
      CHECK_MSG(same_shape_as(y, os, nd), "%s", dt_graph_message(g));
      if (!y) continue;
      int64_t bad = 0;
      for (int64_t i = 0; i < y->size; i++) {
        unravel(i, os, nd, idx);
        idx[a] += start;
        if (y->data[i] != v[ravel(idx, s, nd)]) bad++;
      }
      CHECK_MSG(bad == 0, "slice nd %d axis %d: %lld wrong", nd, ax, (long long)bad);
    }
    /* split the last dim (4) in 2 and check it against slices */
    dt_graph_reset(g);
    dt_tensor *x = dt_tensor_from(g, nd, s, v);
    dt_tensor *parts[2] = {NULL, NULL};
    CHECK(dt_split(g, x, -1, 2, parts) == DTRAIN_OK);
    CHECK(parts[0] && parts[1]);
    if (!parts[0] || !parts[1]) continue;
    CHECK(parts[0]->shape[nd - 1] == 2 && parts[1]->size == n / 2);
    int64_t bad = 0;
    for (int64_t r = 0; r < n / 4; r++)
      for (int c = 0; c < 2; c++)
        if (parts[0]->data[r * 2 + c] != v[r * 4 + c] || parts[1]->data[r * 2 + c] != v[r * 4 + 2 + c]) bad++;
    CHECK_MSG(bad == 0, "split nd %d: %lld wrong", nd, (long long)bad);
  }
  dt_graph_destroy(g);
}

typedef struct { int op, axis; int64_t start, len; int n; } sl_ctx;

static dt_tensor *f_slice(dt_graph *g, dt_tensor **in, void *ctx) {
  sl_ctx *c = (sl_ctx *)ctx;
  switch (c->op) {
    case 0: return dt_slice(g, in[0], c->axis, c->start, c->len);
    case 1: { /* split into n parts and join them back in reverse order */
      dt_tensor *p[4], *r[4];
      if (dt_split(g, in[0], c->axis, c->n, p) != DTRAIN_OK) return NULL;
      for (int i = 0; i < c->n; i++) r[i] = p[c->n - 1 - i];
      return dt_concat(g, r, c->n, c->axis);
    }
    default: { /* slice then concat: [start:start+len] twice, then everything before start */
      dt_tensor *p[3];
      p[0] = dt_slice(g, in[0], c->axis, c->start, c->len);
      p[1] = dt_mul(g, p[0], p[0]);
      p[2] = c->start > 0 ? dt_slice(g, in[0], c->axis, 0, c->start) : p[0];
      return dt_concat(g, p, 3, c->axis);
    }
  }
}

static void test_slice_split_grads(void) {
  float x[256];
  for (int nd = 1; nd <= 4; nd++) {
    int64_t s[4];
    rand_shape(nd, s);
    s[nd - 1] = 4;
    if (nd > 1) s[0] = 2 + (int64_t)(th_rand() * 2) * 2; /* 2 or 4: divisible by 2 */
    th_fill(x, numel(s, nd), -2, 2);
    th_input in = th_in(x, nd, s, 1);
    for (int ax = -nd; ax < nd; ax++) {
      int a = ax < 0 ? ax + nd : ax;
      int64_t dim = s[a];
      sl_ctx c = {0, ax, dim > 1 ? 1 : 0, dim > 2 ? dim - 2 : 1, 0};
      CHECK_MSG(th_gradcheck("slice", f_slice, &c, &in, 1) == 0, "nd %d axis %d", nd, ax);
      c.op = 2;
      CHECK_MSG(th_gradcheck("slice_concat", f_slice, &c, &in, 1) == 0, "nd %d axis %d", nd, ax);
      if (dim % 2 == 0) {
        c.op = 1;
        c.n = 2;
        CHECK_MSG(th_gradcheck("split_concat", f_slice, &c, &in, 1) == 0, "nd %d axis %d", nd, ax);
      }
      c.op = 1;
      c.n = 1;
      CHECK_MSG(th_gradcheck("split1", f_slice, &c, &in, 1) == 0, "nd %d axis %d", nd, ax);
    }
  }
  /* split in 4 along the last dim */
  int64_t s2[2] = {3, 8};
  th_fill(x, 24, -2, 2);
  th_input in = th_in(x, 2, s2, 1);
  sl_ctx c = {1, 1, 0, 0, 4};
  CHECK(th_gradcheck("split4", f_slice, &c, &in, 1) == 0);
}

/* ---- errors --------------------------------------------------------------------------- */

static void test_err_null_inputs(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  CHECK(dt_sum(g, NULL) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_sum: tensor argument 1 is NULL");
  dt_graph_reset(g);
  CHECK(dt_mean_axis(g, NULL, 0, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_mean_axis: tensor argument 1 is NULL");
  dt_graph_reset(g);
  CHECK(dt_reshape2(g, NULL, 1, 1) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_reshape2: tensor argument 1 is NULL");
  dt_graph_reset(g);
  CHECK(dt_transpose(g, NULL) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_transpose");
  dt_graph_reset(g);
  CHECK(dt_slice(g, NULL, 0, 0, 1) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_slice");
  dt_graph_reset(g);
  /* NULL graph */
  dt_tensor *x = dt_tensor_new2(g, 2, 2);
  CHECK(dt_flatten(NULL, x) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_sum(NULL, x) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  dt_tensor *o[2] = {x, x};
  CHECK(dt_split(NULL, x, 0, 2, o) == DTRAIN_ERR_NULL_ARG && o[0] == NULL && o[1] == NULL);
  CHECK(dt_concat(NULL, o, 2, 0) == NULL && dt_last_result() == DTRAIN_ERR_NULL_ARG);
  dt_graph_destroy(g);
}

static void test_err_reduce_bad_axis(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new3(g, 2, 3, 4);
  CHECK(dt_sum_axis(g, x, 3, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_sum_axis: axis 3 out of range for [2,3,4]");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  CHECK(dt_mean_axis(g, x, -4, 1) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_mean_axis: axis -4 out of range");
  dt_graph_reset(g);
  dt_tensor *s = dt_scalar(g, 1.0f);
  CHECK(dt_sum_axis(g, s, 0, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "rank 0");
  /* sticky: later ops do nothing */
  CHECK(dt_sum(g, s) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "rank 0");
  dt_graph_destroy(g);
}

static void test_err_reshape_count(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new3(g, 2, 3, 4);
  int64_t s[2] = {5, 5};
  CHECK(dt_reshape(g, x, 2, s) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "dt_reshape: cannot reshape [2,3,4] (24 elements) into [5,5]");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int64_t s2[2] = {-1, 5}; /* 24 not divisible by 5 */
  CHECK(dt_reshape(g, x, 2, s2) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "into [-1,5]");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  CHECK(dt_reshape2(g, x, 4, 7) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "dt_reshape2: cannot reshape");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 40, 1}; /* product overflows: still a mismatch */
  CHECK(dt_reshape(g, x, 3, huge) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "cannot reshape");
  dt_graph_destroy(g);
}

static void test_err_reshape_two_infer(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new3(g, 2, 3, 4);
  int64_t s[3] = {-1, 2, -1};
  CHECK(dt_reshape(g, x, 3, s) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "more than one -1 (dims 0 and 2)");
  dt_graph_destroy(g);
}

static void test_err_reshape_bad_dims(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new3(g, 2, 3, 4);
  int64_t s[2] = {24, -2};
  CHECK(dt_reshape(g, x, 2, s) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "dimension 1 is -2");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int64_t z[2] = {0, 24};
  CHECK(dt_reshape(g, x, 2, z) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_EMPTY, "dimension 0 is 0");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  CHECK(dt_reshape(g, x, 2, NULL) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_reshape: shape is NULL");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int64_t seven[7] = {1, 1, 1, 2, 3, 4, 1};
  CHECK(dt_reshape(g, x, 7, seven) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_RANK, "dt_reshape: 7 dimensions");
  dt_graph_reset(g);
  dt_tensor *sc = dt_scalar(g, 1.0f);
  CHECK(dt_flatten(g, sc) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_RANK, "dt_flatten: input is a scalar");
  dt_graph_destroy(g);
}

static void test_err_transpose_rank(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new1(g, 5);
  CHECK(dt_transpose(g, x) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_RANK, "dt_transpose: input [5] has rank 1");
  dt_graph_destroy(g);
}

static void test_err_bad_perm(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new3(g, 2, 3, 4);
  int dup[3] = {0, 2, 2};
  CHECK(dt_permute(g, x, dup) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "dt_permute: perm {0,2,2} is not a permutation of the 3 dims of [2,3,4]");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int out[3] = {0, 1, 3};
  CHECK(dt_permute(g, x, out) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "perm {0,1,3}");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  int negdup[3] = {-1, 2, 0}; /* -1 is 2 */
  CHECK(dt_permute(g, x, negdup) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "not a permutation");
  dt_graph_reset(g);
  x = dt_tensor_new3(g, 2, 3, 4);
  CHECK(dt_permute(g, x, NULL) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_permute: perm is NULL");
  dt_graph_destroy(g);
}

static void test_err_concat_mismatch(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *xs[3];
  xs[0] = dt_tensor_new2(g, 2, 3);
  xs[1] = dt_tensor_new2(g, 2, 5);
  xs[2] = dt_tensor_new2(g, 3, 3);
  CHECK(dt_concat(g, xs, 3, 1) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "dt_concat: xs[2] is [3,3] but xs[0] is [2,3] (all dims but axis 1 must agree)");
  dt_graph_reset(g);
  xs[0] = dt_tensor_new2(g, 2, 3);
  xs[1] = dt_tensor_new3(g, 2, 3, 1);
  CHECK(dt_concat(g, xs, 2, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_RANK, "xs[1] is [2,3,1]");
  dt_graph_destroy(g);
}

static void test_err_concat_args(void) {
  dt_graph *g = dt_graph_create(NULL, NULL), *g2 = dt_graph_create(NULL, NULL);
  dt_tensor *xs[3];
  xs[0] = dt_tensor_new2(g, 2, 3);
  xs[1] = NULL;
  CHECK(dt_concat(g, xs, 2, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs[1] is NULL");
  dt_graph_reset(g);
  CHECK(dt_concat(g, NULL, 2, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_concat: xs is NULL");
  dt_graph_reset(g);
  xs[0] = dt_tensor_new2(g, 2, 3);
  CHECK(dt_concat(g, xs, 0, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: n is 0");
  dt_graph_reset(g);
  xs[0] = dt_tensor_new2(g, 2, 3);
  xs[1] = dt_tensor_new2(g, 2, 3);
  CHECK(dt_concat(g, xs, 2, 2) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_concat: axis 2 out of range for [2,3]");
  dt_graph_reset(g);
  xs[0] = dt_tensor_new2(g, 2, 3);
  xs[1] = dt_tensor_new2(g2, 2, 3);
  CHECK(dt_concat(g, xs, 2, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "dt_concat: xs[1] belongs to another graph");
  dt_graph_destroy(g);
  dt_graph_destroy(g2);
}

static void test_err_slice_range(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new2(g, 2, 5);
  CHECK(dt_slice(g, x, 1, 3, 3) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_slice: start 3, len 3 out of bounds for axis 1 (size 5) of [2,5]");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 5);
  CHECK(dt_slice(g, x, -1, -1, 2) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "start -1");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 5);
  CHECK(dt_slice(g, x, 0, 0, 0) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "len 0");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 5);
  CHECK(dt_slice(g, x, 0, 1, INT64_MAX) == NULL); /* start + len would overflow */
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "out of bounds");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 5);
  CHECK(dt_slice(g, x, 2, 0, 1) == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_slice: axis 2 out of range");
  dt_graph_destroy(g);
}

static void test_err_split(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  dt_tensor *x = dt_tensor_new2(g, 2, 5);
  dt_tensor *o[3] = {x, x, x};
  CHECK(dt_split(g, x, 1, 3, o) == DTRAIN_ERR_SHAPE);
  CHECK(o[0] == NULL && o[1] == NULL && o[2] == NULL);
  CHECK_GERR(g, DTRAIN_ERR_SHAPE, "dt_split: axis 1 of [2,5] (size 5) does not split into 3 equal parts");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 6);
  CHECK(dt_split(g, x, 0, 0, o) == DTRAIN_ERR_INVALID_ARG);
  CHECK_GERR(g, DTRAIN_ERR_INVALID_ARG, "dt_split: n is 0");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 6);
  CHECK(dt_split(g, x, 0, 2, NULL) == DTRAIN_ERR_NULL_ARG);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_split: outs is NULL");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 6);
  o[0] = o[1] = x;
  CHECK(dt_split(g, x, -3, 2, o) == DTRAIN_ERR_INDEX && o[0] == NULL && o[1] == NULL);
  CHECK_GERR(g, DTRAIN_ERR_INDEX, "dt_split: axis -3 out of range");
  dt_graph_reset(g);
  x = dt_tensor_new2(g, 2, 6);
  o[0] = o[1] = x;
  CHECK(dt_split(g, NULL, 0, 2, o) == DTRAIN_ERR_NULL_ARG && o[0] == NULL && o[1] == NULL);
  CHECK_GERR(g, DTRAIN_ERR_NULL_ARG, "dt_split: tensor argument 1 is NULL");
  /* on a failed graph: the sticky error comes back, outs are NULL */
  o[0] = o[1] = x;
  CHECK(dt_split(g, x, 1, 2, o) == DTRAIN_ERR_NULL_ARG && o[0] == NULL && o[1] == NULL);
  dt_graph_destroy(g);
}

int main(void) {
  th_seed(42);
  TH_RUN(test_sum_mean_values);
  TH_RUN(test_sum_axis_values);
  TH_RUN(test_reduce_grads);
  TH_RUN(test_reduce_backward_values);
  TH_RUN(test_reshape_alias_and_values);
  TH_RUN(test_reshape_grads);
  TH_RUN(test_reshape_backward_accumulates);
  TH_RUN(test_transpose_values);
  TH_RUN(test_permute_values);
  TH_RUN(test_transpose_permute_grads);
  TH_RUN(test_concat_values);
  TH_RUN(test_concat_grads);
  TH_RUN(test_concat_many_backward);
  TH_RUN(test_slice_split_values);
  TH_RUN(test_slice_split_grads);
  TH_RUN(test_err_null_inputs);
  TH_RUN(test_err_reduce_bad_axis);
  TH_RUN(test_err_reshape_count);
  TH_RUN(test_err_reshape_two_infer);
  TH_RUN(test_err_reshape_bad_dims);
  TH_RUN(test_err_transpose_rank);
  TH_RUN(test_err_bad_perm);
  TH_RUN(test_err_concat_mismatch);
  TH_RUN(test_err_concat_args);
  TH_RUN(test_err_slice_range);
  TH_RUN(test_err_split);
  return th_summary("ops_shape");
}
