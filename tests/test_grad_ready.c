/* tests/test_grad_ready.c -- backward's "gradient ready" calls (the base of
 * communication that overlaps backward): on a model with a linear layer, a
 * weight shared by two layers, a layer norm, an embedding, a concat of five
 * inputs whose fifth is a parameter, and an unused parameter, each used
 * parameter is announced exactly once, at a moment when its gradient already
 * equals the final one (snapshots taken in the call), latest layers first;
 * the unused one never; no calls once the hook is cleared; and the gradients
 * are bitwise those of a backward without the hook. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "harness.h"

#define B 3

typedef struct probe {
  dt_params *P;
  int calls[16];
  int order[32];
  int n;
  float *snap; /* the whole gradient buffer's copy per call: the param's own range is compared */
} probe;

static void on_ready(void *user, int p) {
  probe *pr = (probe *)user;
  if (p < 0 || p >= 16) return;
  pr->calls[p]++;
  if (pr->n < 32) pr->order[pr->n] = p;
  dt_param_info info;
  if (dt_params_info(pr->P, p, &info) == DTRAIN_OK)
    memcpy(pr->snap + info.offset, dt_params_grad(pr->P) + info.offset, info.size * sizeof(float));
  pr->n++;
}

enum { W1, B1, WS, GAMMA, BETA, EMB, CATP, UNUSED, OUT, NPARAM };

static dt_params *make_params(void) {
  dt_params *P = dt_params_create(3);
  int64_t w1[2] = {8, 6}, b1[1] = {8}, ws[2] = {8, 8}, g1[1] = {8}, emb[2] = {10, 8}, cat[2] = {B, 2}, un[1] = {5},
          out[2] = {8 * 4 + 2, 1};
  dt_params_add(P, "w1", 2, w1, dt_init_normal(0, 0.5f));
  dt_params_add(P, "b1", 1, b1, dt_init_normal(0, 0.1f));
  dt_params_add(P, "shared", 2, ws, dt_init_normal(0, 0.4f));
  dt_params_add(P, "gamma", 1, g1, dt_init_normal(1, 0.1f));
  dt_params_add(P, "beta", 1, g1, dt_init_normal(0, 0.1f));
  dt_params_add(P, "emb", 2, emb, dt_init_normal(0, 0.5f));
  dt_params_add(P, "catp", 2, cat, dt_init_normal(0, 0.5f));
  dt_params_add(P, "unused", 1, un, dt_init_normal(0, 1));
  dt_params_add(P, "out", 2, out, dt_init_normal(0, 0.3f));
  return P;
}

/* The loss: x -> linear -> tanh -> (shared) -> tanh -> (shared again) -> layer
 * norm; beside it an embedding; concat [h1, h2, h3, e, catp] -> out. */
static dt_tensor *forward(dt_graph *g) {
  static const float xv[B * 6] = {0.1f, -0.2f, 0.3f, 0.5f, -0.7f, 0.2f, 1.0f, 0.0f, -1.0f,
                                  0.4f, 0.4f, -0.3f, 0.2f, 0.8f, -0.5f, 0.1f, 0.9f, -0.6f};
  static const int32_t ids[B] = {1, 7, 3};
  int64_t xs[2] = {B, 6};
  dt_tensor *x = dt_tensor_from(g, 2, xs, xv);
  dt_tensor *h1 = dt_tanh(g, dt_linear(g, x, dt_param(g, W1), dt_param(g, B1)));
  dt_tensor *h2 = dt_tanh(g, dt_matmul(g, h1, dt_param(g, WS)));
  dt_tensor *h3 = dt_layer_norm(g, dt_matmul(g, h2, dt_param(g, WS)), dt_param(g, GAMMA), dt_param(g, BETA), 1e-5f);
  dt_tensor *e = dt_embedding(g, dt_param(g, EMB), ids, B);
  dt_tensor *parts[5] = {h1, h2, h3, e, dt_param(g, CATP)};
  dt_tensor *cat = dt_concat(g, parts, 5, 1);
  dt_tensor *y = dt_tanh(g, dt_matmul(g, cat, dt_param(g, OUT)));
  return dt_sum(g, dt_mul(g, y, y));
}

static void run(dt_params *P, dt_graph *g, probe *pr, int hook) {
  dt_params_zero_grad(P);
  dt_graph_reset(g);
  dt__graph_on_grad_ready(g, hook ? on_ready : NULL, pr);
  dt_tensor *L = forward(g);
  CHECK_MSG(L != NULL && dt_backward(g, L) == DTRAIN_OK, "%s", dt_graph_message(g));
}

static void test_ready(void) {
  dt_params *P = make_params();
  dt_graph *g = dt_graph_create(P, NULL);
  size_t n = dt_params_size(P);
  probe pr;
  memset(&pr, 0, sizeof pr);
  pr.P = P;
  pr.snap = (float *)calloc(n, sizeof(float));
  float *plain = (float *)malloc(n * sizeof(float));
  run(P, g, &pr, 0);
  CHECK(pr.n == 0);
  memcpy(plain, dt_params_grad(P), n * sizeof(float));
  for (int rep = 0; rep < 2; rep++) { /* twice: the schedule is rebuilt from each step's tape */
    memset(&pr.calls, 0, sizeof pr.calls);
    pr.n = 0;
    for (size_t i = 0; i < n; i++) pr.snap[i] = NAN;
    run(P, g, &pr, 1);
    CHECK(memcmp(plain, dt_params_grad(P), n * sizeof(float)) == 0);
    for (int p = 0; p < NPARAM; p++) CHECK_MSG(pr.calls[p] == (p == UNUSED ? 0 : 1), "param %d: %d calls", p, pr.calls[p]);
    CHECK(pr.n == NPARAM - 1);
    /* at its call each gradient was already final */
    for (int p = 0; p < NPARAM; p++) {
      if (p == UNUSED) continue;
      dt_param_info info;
      CHECK(dt_params_info(P, p, &info) == DTRAIN_OK);
      int same = memcmp(pr.snap + info.offset, plain + info.offset, info.size * sizeof(float)) == 0;
      double mag = dt_l2_norm(plain + info.offset, info.size);
      CHECK_MSG(same, "param %d (%s): gradient changed after its ready call", p, info.name);
      CHECK_MSG(mag > 0.0, "param %d: zero gradient: the check would mean nothing", p);
    }
    /* latest first: out before the concat's parameter, the shared weight
     * after its second use's layer norm, w1 and b1 last */
    int pos[NPARAM];
    for (int i = 0; i < pr.n && i < 32; i++) pos[pr.order[i]] = i;
    CHECK(pos[OUT] == 0);
    CHECK(pos[GAMMA] < pos[WS] && pos[BETA] < pos[WS]);
    CHECK(pos[WS] < pos[W1] && pos[WS] < pos[B1]);
    CHECK(pos[CATP] < pos[WS] && pos[EMB] < pos[W1]);
  }
  /* cleared: no calls */
  memset(&pr.calls, 0, sizeof pr.calls);
  pr.n = 0;
  run(P, g, &pr, 0);
  CHECK(pr.n == 0);
  free(pr.snap);
  free(plain);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

/* A model that used its shared weight in the earliest layer too: the weight
 * is announced only at the very end, with the first layer. */
static void test_shared_first(void) {
  dt_params *P = dt_params_create(5);
  int64_t w[2] = {4, 4};
  dt_params_add(P, "a", 2, w, dt_init_normal(0, 0.5f));
  dt_params_add(P, "b", 2, w, dt_init_normal(0, 0.5f));
  dt_graph *g = dt_graph_create(P, NULL);
  probe pr;
  memset(&pr, 0, sizeof pr);
  pr.P = P;
  pr.snap = (float *)calloc(dt_params_size(P), sizeof(float));
  static const float xv[8] = {1, 2, 3, 4, -1, 0.5f, 0.25f, 2};
  int64_t xs[2] = {2, 4};
  dt_params_zero_grad(P);
  dt__graph_on_grad_ready(g, on_ready, &pr);
  dt_tensor *x = dt_tensor_from(g, 2, xs, xv);
  dt_tensor *h = dt_tanh(g, dt_matmul(g, x, dt_param(g, 0)));  /* a, first */
  h = dt_tanh(g, dt_matmul(g, h, dt_param(g, 1)));             /* b */
  h = dt_tanh(g, dt_matmul(g, h, dt_param(g, 0)));             /* a again */
  CHECK(dt_backward(g, dt_sum(g, h)) == DTRAIN_OK);
  CHECK(pr.n == 2 && pr.order[0] == 1 && pr.order[1] == 0);
  CHECK(memcmp(pr.snap, dt_params_grad(P), dt_params_size(P) * sizeof(float)) == 0);
  free(pr.snap);
  dt_graph_destroy(g);
  dt_params_destroy(P);
}

int main(void) {
  TH_RUN(test_ready);
  TH_RUN(test_shared_first);
  return th_summary("grad_ready");
}
