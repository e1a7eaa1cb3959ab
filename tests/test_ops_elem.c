/* Elementwise ops: values, broadcasting, gradients against finite differences, errors. */
#include "harness.h"

typedef struct { int op; float s; } elem_ctx;

static dt_tensor *f_binary(dt_graph *g, dt_tensor **in, void *ctx) {
  switch (((elem_ctx *)ctx)->op) {
    case 0: return dt_add(g, in[0], in[1]);
    case 1: return dt_sub(g, in[0], in[1]);
    case 2: return dt_mul(g, in[0], in[1]);
    default: return dt_div(g, in[0], in[1]);
  }
}

static void test_binary_broadcast_grads(void) {
  /* (a shape, b shape) pairs covering equal, trailing, leading, middle, scalar and two-sided broadcasts */
  static const int64_t sa[][4] = {{3, 4}, {2, 3, 4}, {2, 3, 4}, {4, 1, 5}, {3, 4}, {3, 1}};
  static const int nda[] = {2, 3, 3, 3, 2, 2};
  static const int64_t sb[][4] = {{3, 4}, {4}, {3, 1}, {1, 6, 1}, {1}, {1, 5}};
  static const int ndb[] = {2, 1, 2, 3, 1, 2};
  float a[200], b[200];
  for (int op = 0; op < 4; op++) {
    for (int c = 0; c < 6; c++) {
      int64_t na = 1, nb = 1;
      for (int d = 0; d < nda[c]; d++) na *= sa[c][d];
      for (int d = 0; d < ndb[c]; d++) nb *= sb[c][d];
      th_fill(a, na, -2, 2);
      if (op == 3) th_fill_away0(b, nb, -2, 2, 0.5f); else th_fill(b, nb, -2, 2);
      th_input ins[2] = {th_in(a, nda[c], sa[c], 1), th_in(b, ndb[c], sb[c], 1)};
      elem_ctx ctx = {op, 0};
      int bad = th_gradcheck("binary", f_binary, &ctx, ins, 2);
      CHECK_MSG(bad == 0, "op %d case %d: %d mismatches", op, c, bad);
    }
  }
}

static void test_binary_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float av[6] = {1, 2, 3, 4, 5, 6}, bv[3] = {10, 20, 30};
  int64_t s23[2] = {2, 3}, s3[1] = {3}, s21[2] = {2, 1};
  dt_tensor *a = dt_tensor_from(g, 2, s23, av), *b = dt_tensor_from(g, 1, s3, bv);
  dt_tensor *y = dt_add(g, a, b);
  CHECK(y && y->ndim == 2 && y->shape[0] == 2 && y->shape[1] == 3);
  if (y) { CHECK(y->data[0] == 11 && y->data[5] == 36); }
  float cv[2] = {2, 4};
  dt_tensor *c = dt_tensor_from(g, 2, s21, cv);
  dt_tensor *z = dt_div(g, a, c);
  CHECK(z && z->data[2] == 1.5f && z->data[3] == 1.0f);
  dt_tensor *w = dt_mul(g, c, b); /* [2,1] * [3] -> [2,3] */
  CHECK(w && w->shape[0] == 2 && w->shape[1] == 3 && w->data[4] == 80);
  dt_graph_destroy(g);
}

/* Every op of DT__MAP_LIST (dt_maps.h), through th_map_ops: an op added to
 * the list is gradchecked here without an edit. */
static dt_tensor *f_map(dt_graph *g, dt_tensor **in, void *ctx) {
  return th_map_apply(g, (const th_map_op *)ctx, in[0]);
}

static void test_unary_grads(void) {
  int n;
  const th_map_op *ops = th_map_ops(&n);
  float x[2 * 3 * 5];
  int64_t shape[3] = {2, 3, 5};
  CHECK(n >= 13);
  for (int op = 0; op < n; op++) {
    th_map_fill(&ops[op], x, 30);
    th_input in = th_in(x, 3, shape, 1);
    int bad = th_gradcheck(ops[op].name, f_map, (void *)&ops[op], &in, 1);
    CHECK_MSG(bad == 0, "%s: %d mismatches", ops[op].name, bad);
  }
}

/* The list's ids are the dt_map_fn values, in order, with the domain maps after. */
static void test_map_list(void) {
  int n;
  const th_map_op *ops = th_map_ops(&n);
  CHECK(n == DTRAIN_MAP_DOMAIN_POS && DTRAIN_MAP_COUNT == n + 2);
  CHECK(strcmp(ops[DTRAIN_MAP_GELU].name, "gelu") == 0 && strcmp(ops[DTRAIN_MAP_SQRT].name, "sqrt") == 0);
  CHECK(ops[DTRAIN_MAP_LOG].domain == DT__MAP_DOMAIN_POS && ops[DTRAIN_MAP_SQRT].domain == DT__MAP_DOMAIN_NONNEG);
  CHECK(ops[DTRAIN_MAP_LEAKY_RELU].scalar == dt_leaky_relu && ops[DTRAIN_MAP_RELU].unary == dt_relu);
}

static void test_unary_values(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  float v[4] = {-100.0f, -1.0f, 0.0f, 100.0f};
  int64_t s[1] = {4};
  dt_tensor *x = dt_tensor_from(g, 1, s, v);
  dt_tensor *sg = dt_sigmoid(g, x);
  CHECK(sg && sg->data[0] >= 0.0f && sg->data[0] < 1e-30f && sg->data[3] == 1.0f && sg->data[2] == 0.5f);
  dt_tensor *r = dt_relu(g, x);
  CHECK(r && r->data[0] == 0.0f && r->data[3] == 100.0f);
  dt_tensor *lr = dt_leaky_relu(g, x, 0.01f);
  CHECK(lr && fabsf(lr->data[1] + 0.01f) < 1e-7f);
  dt_tensor *ge = dt_gelu(g, x);
  CHECK(ge && fabsf(ge->data[1] - (-0.158808f)) < 1e-4f && ge->data[3] == 100.0f);
  dt_graph_destroy(g);
}

static void test_errors(void) {
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s23[2] = {2, 3}, s4[1] = {4};
  dt_tensor *a = dt_tensor_new(g, 2, s23), *b = dt_tensor_new(g, 1, s4);
  /* shape mismatch: clear code and message, sticky */
  CHECK(dt_add(g, a, b) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE);
  CHECK(strstr(dt_graph_message(g), "dt_add: shapes [2,3] and [4] cannot broadcast") != NULL);
  CHECK(strstr(dt_last_error(), "cannot broadcast") != NULL);
  CHECK(dt_relu(g, a) == NULL); /* later ops are no-ops */
  CHECK(dt_graph_error(g) == DTRAIN_ERR_SHAPE);
  CHECK(dt_backward(g, a) == DTRAIN_ERR_SHAPE);
  dt_graph_reset(g);
  CHECK(dt_graph_error(g) == DTRAIN_OK);
  /* NULL argument */
  a = dt_tensor_new(g, 2, s23);
  CHECK(dt_mul(g, a, NULL) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NULL_ARG);
  CHECK(strstr(dt_graph_message(g), "dt_mul: tensor argument 2 is NULL") != NULL);
  dt_graph_reset(g);
  /* NULL graph */
  CHECK(dt_add(NULL, a, a) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_NULL_ARG);
  /* zero-size tensor */
  int64_t s0[2] = {0, 3};
  CHECK(dt_tensor_new(g, 2, s0) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_EMPTY);
  CHECK(strstr(dt_graph_message(g), "dimension 0 is 0") != NULL);
  dt_graph_reset(g);
  /* domain errors */
  float neg[2] = {1.0f, -1.0f};
  int64_t s2[1] = {2};
  dt_tensor *n = dt_tensor_from(g, 1, s2, neg);
  CHECK(dt_log(g, n) == NULL && dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG);
  CHECK(strstr(dt_graph_message(g), "dt_log: input element 1") != NULL);
  dt_graph_reset(g);
  /* NaN input with numeric checks on */
  dt_graph_destroy(g);
  dt_graph_options d;
  memset(&d, 0, sizeof d);
  d.check_numerics = 1;
  g = dt_graph_create(NULL, &d);
  float nanv[2] = {1.0f, NAN};
  n = dt_tensor_from(g, 1, s2, nanv);
  CHECK(dt_exp(g, n) == NULL && dt_graph_error(g) == DTRAIN_ERR_NONFINITE);
  CHECK(strstr(dt_graph_message(g), "NaN at element 1") != NULL);
  dt_graph_reset(g);
  /* NaN loss is refused by backward even without numeric checks */
  dt_graph_destroy(g);
  g = dt_graph_create(NULL, NULL);
  int64_t s1[1] = {1};
  dt_tensor *l = dt_tensor_from(g, 1, s1, nanv + 1);
  dt_tensor_set_requires_grad(l, 1);
  dt_tensor *l2 = dt_mul_scalar(g, l, 2.0f);
  if (l2) { CHECK(dt_backward(g, l2) == DTRAIN_ERR_NONFINITE); }
  dt_graph_destroy(g);
}

static void test_tensors_from_other_graph(void) {
  dt_graph *g1 = dt_graph_create(NULL, NULL), *g2 = dt_graph_create(NULL, NULL);
  dt_tensor *a = dt_tensor_new1(g1, 3), *b = dt_tensor_new1(g2, 3);
  CHECK(dt_add(g1, a, b) == NULL);
  CHECK(strstr(dt_graph_message(g1), "belongs to another graph") != NULL);
  dt_graph_destroy(g1);
  dt_graph_destroy(g2);
}

/* NaN and Inf go through the activations as in PyTorch (issue 17): relu
 * keeps a NaN (it used to give 0, hiding a divergence until the parameters
 * were NaN) and passes the output gradient at a NaN input (torch's
 * threshold_backward); leaky relu likewise. 9 elements: the SIMD loop and
 * its scalar tail both see the special values. */
static void test_nonfinite_propagation(void) {
  float x[9] = {NAN, INFINITY, -INFINITY, 1.0f, -1.0f, -0.0f, 2.0f, NAN, -INFINITY};
  float go[9] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  int64_t s9[1] = {9};
  for (int op = 0; op < 2; op++) {
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *t = dt_tensor_from(g, 1, s9, x);
    dt_tensor_set_requires_grad(t, 1);
    dt_tensor *y = op == 0 ? dt_relu(g, t) : dt_leaky_relu(g, t, 0.25f);
    float yv[9], gv[9];
    CHECK(y != NULL && dt_backward_grad(g, y, go) == DTRAIN_OK);
    CHECK(dt_tensor_to_host(y, yv) == DTRAIN_OK && dt_tensor_grad_to_host(t, gv) == DTRAIN_OK);
    float k = op == 0 ? 0.0f : 0.25f;
    for (int i = 0; i < 9; i++) {
      if (x[i] != x[i]) {
        CHECK_MSG(yv[i] != yv[i], "op %d: element %d: NaN in, %g out", op, i, (double)yv[i]);
        CHECK_MSG(gv[i] == (op == 0 ? 0.5f : 0.125f), "op %d: element %d: gradient %g at NaN", op, i, (double)gv[i]);
      } else {
        float want = x[i] > 0.0f ? x[i] : k * x[i];
        if (op == 0 && !(x[i] > 0.0f)) want = 0.0f;
        CHECK_MSG(yv[i] == want, "op %d: element %d: %g -> %g, want %g", op, i, (double)x[i], (double)yv[i],
                  (double)want);
        CHECK_MSG(gv[i] == (x[i] > 0.0f ? 0.5f : 0.5f * k), "op %d: element %d: gradient %g", op, i, (double)gv[i]);
      }
    }
    if (op == 0) CHECK_MSG(!signbit(yv[5]), "relu(-0) is %g, want +0", (double)yv[5]);
    dt_graph_destroy(g);
  }
}

/* log, sqrt and non-integer powers on NaN and Inf (issue 17): a NaN passes
 * through as in PyTorch (NaN out, NaN gradient) instead of being refused,
 * +Inf gives PyTorch's value and gradient; a number below the domain, -Inf
 * included, is still refused, and is named even after a NaN. pow(x, 0) has
 * PyTorch's zero gradient everywhere (it was NaN at x = 0 and at NaN). The
 * wanted values are torch 1.13's, go = 0.5. */
static void test_domain_nonfinite(void) {
  float x[4] = {NAN, INFINITY, 4.0f, NAN};
  float go[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  int64_t s4[1] = {4};
  /* y and dL/dx at +Inf and at 4 for log, sqrt, x^1.5, x^0 */
  const float want[4][4] = {{INFINITY, 0.0f, 1.3862944f, 0.125f},
                            {INFINITY, 0.0f, 2.0f, 0.125f},
                            {INFINITY, INFINITY, 8.0f, 1.5f},
                            {1.0f, 0.0f, 1.0f, 0.0f}};
  for (int op = 0; op < 4; op++) {
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *t = dt_tensor_from(g, 1, s4, x);
    dt_tensor_set_requires_grad(t, 1);
    dt_tensor *y = op == 0 ? dt_log(g, t) : op == 1 ? dt_sqrt(g, t) : dt_pow_scalar(g, t, op == 2 ? 1.5f : 0.0f);
    float yv[4] = {0}, gv[4] = {0};
    CHECK_MSG(y != NULL && dt_backward_grad(g, y, go) == DTRAIN_OK, "op %d: %s", op, dt_graph_message(g));
    CHECK(y && dt_tensor_to_host(y, yv) == DTRAIN_OK && dt_tensor_grad_to_host(t, gv) == DTRAIN_OK);
    for (int i = 0; i < 4; i += 3) {
      if (op == 3) CHECK_MSG(yv[i] == 1.0f && gv[i] == 0.0f, "pow 0 at NaN: %g, gradient %g", (double)yv[i], (double)gv[i]);
      else CHECK_MSG(yv[i] != yv[i] && gv[i] != gv[i], "op %d: NaN in, %g out, gradient %g", op, (double)yv[i], (double)gv[i]);
    }
    CHECK_MSG(yv[1] == want[op][0] && gv[1] == want[op][1], "op %d: +Inf in, %g out, gradient %g", op, (double)yv[1],
              (double)gv[1]);
    CHECK_MSG(fabsf(yv[2] - want[op][2]) <= 1e-6f && fabsf(gv[2] - want[op][3]) <= 1e-6f, "op %d: 4 in, %g, gradient %g",
              op, (double)yv[2], (double)gv[2]);
    dt_graph_destroy(g);
  }
  /* pow(0, 0) = 1 with gradient 0 (PyTorch), not 0 * 0^-1 = NaN */
  dt_graph *g = dt_graph_create(NULL, NULL);
  int64_t s1[1] = {1};
  float zero = 0.0f, gz = 0.0f, yz = 0.0f;
  dt_tensor *z = dt_tensor_from(g, 1, s1, &zero);
  dt_tensor_set_requires_grad(z, 1);
  dt_tensor *pz = dt_pow_scalar(g, z, 0.0f);
  CHECK(pz && dt_backward_grad(g, pz, go) == DTRAIN_OK && dt_tensor_to_host(pz, &yz) == DTRAIN_OK &&
        dt_tensor_grad_to_host(z, &gz) == DTRAIN_OK);
  CHECK_MSG(yz == 1.0f && gz == 0.0f, "pow(0, 0) = %g, gradient %g", (double)yz, (double)gz);
  dt_graph_destroy(g);
  /* still refused: below the domain (-Inf too), zero for log and x^1.5;
   * a NaN before the bad element is skipped, the bad one named */
  static const struct { int op; float bad; } refused[] = {
    {0, -1.0f}, {0, 0.0f}, {0, -INFINITY}, {1, -0.25f}, {1, -INFINITY}, {2, 0.0f}, {2, -2.0f}, {2, -INFINITY}};
  for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++) {
    g = dt_graph_create(NULL, NULL);
    float xb[4] = {NAN, 1.0f, refused[k].bad, NAN};
    dt_tensor *t = dt_tensor_from(g, 1, s4, xb);
    int op = refused[k].op;
    dt_tensor *y = op == 0 ? dt_log(g, t) : op == 1 ? dt_sqrt(g, t) : dt_pow_scalar(g, t, 1.5f);
    CHECK_MSG(y == NULL && dt_graph_error(g) == DTRAIN_ERR_INVALID_ARG, "case %zu: %g accepted", k, (double)refused[k].bad);
    CHECK_MSG(strstr(dt_graph_message(g), "input element 2 ") != NULL, "case %zu: %s", k, dt_graph_message(g));
    dt_graph_destroy(g);
  }
}

int main(void) {
  TH_RUN(test_binary_values);
  TH_RUN(test_binary_broadcast_grads);
  TH_RUN(test_unary_values);
  TH_RUN(test_unary_grads);
  TH_RUN(test_map_list);
  TH_RUN(test_errors);
  TH_RUN(test_nonfinite_propagation);
  TH_RUN(test_domain_nonfinite);
  TH_RUN(test_tensors_from_other_graph);
  return th_summary("ops_elem");
}
