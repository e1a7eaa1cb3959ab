/* torch_dump.c -- writes a model's weights, a batch, and dtrain's loss and
 * gradients, for tests/torch_parity.py to recompute with PyTorch.
 *
 *   torch_dump mlp|cnn OUTDIR
 *   torch_dump optim OUTDIR
 *
 * Files (raw little-endian float32 / int32): <name>.weight etc. per parameter
 * (PyTorch layout), x.f32, y.i32, loss.f32, grad.<param>.f32, and index.txt
 * listing "param <name> <dims...>".
 *
 * The mlp run also writes every elementwise map of DT__MAP_LIST (dt_maps.h):
 * for each, map.<name>.{x,go,y,gx}.f32 (input, output gradient, dtrain's
 * output and input gradient) and a line "map <name> <scalar> <count>" in
 * maps.txt, so that an op added to the list is compared with PyTorch
 * without an edit here (torch_parity.py needs its torch expression).
 * The maps' inputs include NaN and Inf, and special.txt lists ops whose
 * NaN / Inf rules are their own (dump_special below).
 *
 * The optim run writes optim.txt: for each optimizer setting (dump_optim
 * below) a "config" line, the start values "p0", and for each of its steps
 * the gradient "g" given and the values "p" after dt_optim_step, as text
 * (%.9g: each float exactly), for torch.optim to repeat. */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <string.h>

static int write_le(const char *dir, const char *name, const void *data, size_t n4) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) return 1;
  const unsigned char *b = (const unsigned char *)data;
  for (size_t i = 0; i < n4; i++) {
    uint32_t u;
    memcpy(&u, b + 4 * i, 4);
    unsigned char le[4] = {(unsigned char)u, (unsigned char)(u >> 8), (unsigned char)(u >> 16), (unsigned char)(u >> 24)};
    fwrite(le, 1, 4, f);
  }
  return fclose(f) != 0;
}

/* DIR/NAME opened for writing text; NULL (the reason on stderr) if it cannot be. */
static FILE *open_out(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  if (!f) perror(path);
  return f;
}

/* The ops of DT__MAP_LIST: name, function, domain (as in tests/harness.h). */
typedef struct map_op {
  const char *name;
  dt_tensor *(*unary)(dt_graph *g, dt_tensor *x);
  dt_tensor *(*scalar)(dt_graph *g, dt_tensor *x, float s);
  int domain;
} map_op;
#define MAP_FNS_UNARY(name) dt_##name, NULL
#define MAP_FNS_SCALAR(name) NULL, dt_##name
#define MAP_ROW(name, NAME, args, domain) {#name, MAP_FNS_##args(name), DT__MAP_DOMAIN_##domain},
static const map_op map_ops[] = {DT__MAP_LIST(MAP_ROW)};

/* Each map on n inputs (positive where the op has a domain, else in [-3, 3]
 * at least 0.05 from 0), backward from a random output gradient. */
static int dump_maps(const char *dir) {
  enum { N = 256 };
  float x[N], go[N], y[N], gx[N];
  char name[256];
  FILE *idx = open_out(dir, "maps.txt");
  if (!idx) return 1;
  dt_rng r;
  dt_rng_seed(&r, 11);
  int bad = 0;
  for (size_t k = 0; k < sizeof map_ops / sizeof map_ops[0] && !bad; k++) {
    const map_op *m = &map_ops[k];
    float s = m->unary ? 0.0f : m->domain == DT__MAP_DOMAIN_POW ? 1.7f : 0.75f; /* 0: the op takes none */
    for (int i = 0; i < N; i++) {
      float u = dt_rng_uniform(&r);
      if (m->domain != DT__MAP_DOMAIN_ANY) x[i] = 0.3f + 2.7f * u;
      else x[i] = (u < 0.5f ? -1.0f : 1.0f) * (0.05f + 2.95f * (u < 0.5f ? 2.0f * u : 2.0f * u - 1.0f));
      go[i] = dt_rng_uniform(&r) - 0.5f;
    }
    /* NaN and Inf, as PyTorch propagates them (issue 17): every map sees
     * NaN and +Inf at the start (the SIMD loops) and at the end (the scalar
     * tails); the maps defined on all floats also -Inf. -Inf and the other
     * numbers below a domain (log, sqrt, non-integer powers) are refused
     * instead: see tests/test_ops_elem.c. sqrt also sees 0 (gradient +-Inf
     * by the sign of the output gradient, as in torch). */
    x[0] = NAN;
    x[3] = INFINITY;
    x[N - 1] = NAN;
    x[N - 3] = INFINITY;
    if (m->domain == DT__MAP_DOMAIN_ANY) {
      x[1] = -INFINITY;
      x[N - 2] = -INFINITY;
    }
    if (m->domain == DT__MAP_DOMAIN_NONNEG) x[2] = 0.0f;
    dt_graph *g = dt_graph_create(NULL, NULL);
    int64_t shape[1] = {N};
    dt_tensor *t = dt_tensor_from(g, 1, shape, x);
    dt_tensor_set_requires_grad(t, 1);
    dt_tensor *o = m->unary ? m->unary(g, t) : m->scalar(g, t, s);
    if (!o || dt_backward_grad(g, o, go) != DTRAIN_OK || dt_tensor_to_host(o, y) != DTRAIN_OK ||
        dt_tensor_grad_to_host(t, gx) != DTRAIN_OK) {
      fprintf(stderr, "torch_dump: map %s: %s\n", m->name, dt_graph_message(g));
      bad = 1;
    }
    dt_graph_destroy(g);
    fprintf(idx, "map %s %.9g %d\n", m->name, (double)s, N);
    const char *part[4] = {"x", "go", "y", "gx"};
    const float *data[4] = {x, go, y, gx};
    for (int p = 0; p < 4 && !bad; p++) {
      snprintf(name, sizeof name, "map.%s.%s.f32", m->name, part[p]);
      bad |= write_le(dir, name, data[p], N);
    }
  }
  return (fclose(idx) != 0) | bad;
}

/* Ops whose NaN / Inf rules are not a map's (softmax, losses, pooling,
 * reductions), on inputs holding NaN, +Inf and -Inf: for each,
 * special.<name>.{x,go,y,gx}.f32 and a line "special <name> <ndim> <dims>"
 * in special.txt (torch_parity.py recomputes them by name). Backward runs
 * from an explicit output gradient, so a NaN loss is not refused. */
static const int32_t special_labels[4] = {0, 1, 3, 2};
static dt_tensor *special_op(dt_graph *g, int k, dt_tensor *x, dt_tensor *t) {
  switch (k) {
    case 0: return dt_softmax(g, x, 1);
    case 1: return dt_log_softmax(g, x, 1);
    case 2: return dt_cross_entropy(g, x, special_labels);
    case 3: return dt_cross_entropy(g, x, special_labels);
    case 4: return dt_mse(g, x, t);
    case 5: return dt_max_pool2d(g, x, 2, 2);
    case 6: return dt_avg_pool2d(g, x, 2, 2);
    case 7: return dt_sum(g, x);
    case 8: return dt_mean_axis(g, x, 1, 0);
    case 9: return dt_max_pool2d(g, x, 3, 1);
    case 10: return dt_pow_scalar(g, x, 0.0f); /* integer powers: no domain, so -Inf and 0 too */
    case 11: return dt_pow_scalar(g, x, 2.0f);
    default: return dt_pow_scalar(g, x, -1.0f);
  }
}

static int dump_special(const char *dir) {
  static const char *names[] = {"softmax", "log_softmax", "xent", "xent_neginf", "mse",
                                "max_pool", "avg_pool", "sum", "mean_axis", "max_pool_k3",
                                "pow0", "pow2", "pow_neg1"};
  enum { NS = sizeof names / sizeof names[0], CAP = 96 };
  float x[CAP], t[CAP], go[CAP], y[CAP], gx[CAP];
  char name[256];
  FILE *idx = open_out(dir, "special.txt");
  if (!idx) return 1;
  dt_rng r;
  dt_rng_seed(&r, 13);
  int bad = 0;
  for (int k = 0; k < NS && !bad; k++) {
    int64_t sh[4] = {4, 5, 1, 1};
    int nd = 2;
    if (k == 4) sh[0] = 20, sh[1] = 1, nd = 1;
    if (k == 5 || k == 6 || k == 9) sh[0] = 1, sh[1] = 3, sh[2] = 4, sh[3] = 8, nd = 4;
    int64_t n = sh[0] * sh[1] * sh[2] * sh[3];
    for (int64_t i = 0; i < n; i++) {
      x[i] = 4.0f * dt_rng_uniform(&r) - 2.0f;
      t[i] = dt_rng_uniform(&r);
      go[i] = dt_rng_uniform(&r) - 0.5f;
    }
    if (k < 4) { /* rows: a NaN, a +Inf, a -Inf (at the label for xent_neginf's row 2), finite */
      if (k != 3) x[2] = NAN, x[5] = INFINITY;
      x[13] = -INFINITY;
      x[11] = -INFINITY;
    } else if (k == 4) {
      x[1] = NAN, x[7] = INFINITY, x[12] = -INFINITY, t[12] = -INFINITY;
    } else if ((k >= 5 && k <= 6) || k == 9) { /* NaN, two NaNs, Inf, all -Inf windows; SIMD and tail */
      x[1] = NAN, x[8 + 2] = INFINITY, x[4] = -INFINITY, x[5] = -INFINITY, x[12] = -INFINITY, x[13] = -INFINITY;
      x[33] = NAN, x[41] = NAN, x[62] = INFINITY, x[63] = NAN, x[70] = -INFINITY;
    } else {
      x[3] = INFINITY, x[9] = -INFINITY, x[17] = NAN;
      if (k >= 10) x[5] = 0.0f, x[6] = -0.0f; /* x^0 has gradient 0 there (not 0 * 0^-1) */
    }
    dt_graph *g = dt_graph_create(NULL, NULL);
    dt_tensor *xt = dt_tensor_from(g, nd, sh, x), *tt = dt_tensor_from(g, nd, sh, t);
    dt_tensor_set_requires_grad(xt, 1);
    dt_tensor *o = special_op(g, k, xt, tt);
    for (int64_t i = 0; i < n; i++) gx[i] = 0.0f;
    int64_t ny = o ? o->size : 0;
    if (!o || ny > CAP || dt_backward_grad(g, o, go) != DTRAIN_OK || dt_tensor_to_host(o, y) != DTRAIN_OK ||
        dt_tensor_grad_to_host(xt, gx) != DTRAIN_OK) {
      fprintf(stderr, "torch_dump: special %s: %s\n", names[k], dt_graph_message(g));
      bad = 1;
    }
    dt_graph_destroy(g);
    fprintf(idx, "special %s %d", names[k], nd);
    for (int d = 0; d < nd; d++) fprintf(idx, " %lld", (long long)sh[d]);
    fprintf(idx, "\n");
    const char *part[5] = {"x", "t", "go", "y", "gx"};
    const float *data[5] = {x, t, go, y, gx};
    const size_t len[5] = {(size_t)n, (size_t)n, (size_t)ny, (size_t)ny, (size_t)n};
    for (int p = 0; p < 5 && !bad; p++) {
      snprintf(name, sizeof name, "special.%s.%s.f32", names[k], part[p]);
      bad |= write_le(dir, name, data[p], len[p]);
    }
  }
  return (fclose(idx) != 0) | bad;
}

/* Every optimizer kind and its options on a weight (5x7, weight decay
 * applies: dtrain's default for ndim >= 2) and a bias (7, no decay): STEPS
 * steps of the same gradients (a few exact zeros among them). */
typedef struct optim_cfg {
  const char *name;
  dt_optim_kind kind;
  float lr, momentum, wd, beta1, beta2, eps, alpha;
  int nesterov;
} optim_cfg;

static void put_floats(FILE *f, const char *tag, int step, const float *v, size_t n) {
  fprintf(f, "%s %d", tag, step);
  for (size_t i = 0; i < n; i++) fprintf(f, " %.9g", (double)v[i]);
  fprintf(f, "\n");
}

static int dump_optim(const char *dir) {
  enum { STEPS = 6, NW = 35, NB = 7 };
  static const optim_cfg cfgs[] = {
    {"sgd", DTRAIN_OPTIM_SGD, 0.1f, 0, 0, 0, 0, 0, 0, 0},
    {"sgd_momentum_wd", DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0.01f, 0, 0, 0, 0, 0},
    {"sgd_nesterov", DTRAIN_OPTIM_SGD, 0.05f, 0.9f, 0, 0, 0, 0, 0, 1},
    {"adam", DTRAIN_OPTIM_ADAM, 0.01f, 0, 0, 0.9f, 0.999f, 1e-8f, 0, 0},
    {"adam_wd_betas", DTRAIN_OPTIM_ADAM, 0.02f, 0, 0.05f, 0.8f, 0.99f, 1e-6f, 0, 0},
    {"adamw", DTRAIN_OPTIM_ADAMW, 0.01f, 0, 0.1f, 0.9f, 0.999f, 1e-8f, 0, 0},
    {"rmsprop", DTRAIN_OPTIM_RMSPROP, 0.01f, 0, 0, 0, 0, 1e-8f, 0.99f, 0},
    {"rmsprop_momentum_wd", DTRAIN_OPTIM_RMSPROP, 0.005f, 0.9f, 0.02f, 0, 0, 1e-6f, 0.9f, 0},
  };
  FILE *f = open_out(dir, "optim.txt");
  if (!f) return 1;
  int bad = 0;
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
    const optim_cfg *k = &cfgs[c];
    dt_params *P = dt_params_create(11);
    int64_t ws[2] = {5, 7}, bs[1] = {NB};
    int iw = dt_params_add(P, "w", 2, ws, dt_init_zeros()), ib = dt_params_add(P, "b", 1, bs, dt_init_zeros());
    dt_param_info wi, bi;
    dt_params_info(P, iw, &wi);
    dt_params_info(P, ib, &bi);
    float *d = dt_params_data(P), *g = dt_params_grad(P), v[NW + NB];
    dt_rng r;
    dt_rng_seed(&r, 100 + (uint64_t)c);
    for (int i = 0; i < NW; i++) d[wi.offset + (size_t)i] = dt_rng_uniform(&r) * 2.0f - 1.0f;
    for (int i = 0; i < NB; i++) d[bi.offset + (size_t)i] = 0.2f * (dt_rng_uniform(&r) - 0.5f);
    dt_optim_options od = dt_optim_defaults(k->kind);
    od.lr = k->lr;
    od.momentum = k->momentum;
    od.nesterov = k->nesterov;
    od.weight_decay = k->wd;
    if (k->kind == DTRAIN_OPTIM_ADAM || k->kind == DTRAIN_OPTIM_ADAMW) {
      od.beta1 = k->beta1;
      od.beta2 = k->beta2;
    }
    if (k->kind != DTRAIN_OPTIM_SGD) od.eps = k->eps;
    if (k->kind == DTRAIN_OPTIM_RMSPROP) od.alpha = k->alpha;
    dt_optim *o = dt_optim_create(P, &od);
    if (!o) {
      fprintf(stderr, "torch_dump: %s: %s\n", k->name, dt_last_error());
      bad = 1;
      dt_params_destroy(P);
      continue;
    }
    fprintf(f, "config %s %d %.9g %.9g %d %.9g %.9g %.9g %.9g %.9g\n", k->name, (int)k->kind, (double)k->lr,
            (double)k->momentum, k->nesterov, (double)k->wd, (double)od.beta1, (double)od.beta2, (double)od.eps,
            (double)od.alpha);
    memcpy(v, d + wi.offset, NW * sizeof(float));
    memcpy(v + NW, d + bi.offset, NB * sizeof(float));
    put_floats(f, "p0", 0, v, NW + NB);
    for (int t = 1; t <= STEPS; t++) {
      for (int i = 0; i < NW + NB; i++) v[i] = (i + t) % 9 == 0 ? 0.0f : (dt_rng_uniform(&r) - 0.5f) * (float)t;
      memcpy(g + wi.offset, v, NW * sizeof(float));
      memcpy(g + bi.offset, v + NW, NB * sizeof(float));
      put_floats(f, "g", t, v, NW + NB);
      if (dt_optim_step(o) != DTRAIN_OK) {
        fprintf(stderr, "torch_dump: %s step %d: %s\n", k->name, t, dt_last_error());
        bad = 1;
        break;
      }
      memcpy(v, d + wi.offset, NW * sizeof(float));
      memcpy(v + NW, d + bi.offset, NB * sizeof(float));
      put_floats(f, "p", t, v, NW + NB);
    }
    dt_optim_destroy(o);
    dt_params_destroy(P);
  }
  return (fclose(f) != 0) | bad;
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "optim")) return dump_optim(argv[2]);
  if (argc != 3 || (strcmp(argv[1], "mlp") && strcmp(argv[1], "cnn"))) {
    fprintf(stderr, "usage: torch_dump mlp|cnn|optim OUTDIR\n");
    return 2;
  }
  int cnn = !strcmp(argv[1], "cnn");
  const char *dir = argv[2];
  enum { B = 16 };
  dt_params *P = dt_params_create(2024);
  dt_nn_linear fc1, fc2, fc3;
  dt_nn_conv2d c1, c2;
  if (cnn) {
    dt_nn_conv2d_init(&c1, P, "conv1", 1, 32, 5, 1, 2, 1);
    dt_nn_conv2d_init(&c2, P, "conv2", 32, 64, 5, 1, 2, 1);
    dt_nn_linear_init(&fc1, P, "fc1", 64 * 7 * 7, 1024, 1);
    dt_nn_linear_init(&fc2, P, "fc2", 1024, 10, 1);
  } else {
    dt_nn_linear_init(&fc1, P, "fc1", 784, 256, 1);
    dt_nn_linear_init(&fc2, P, "fc2", 256, 128, 1);
    dt_nn_linear_init(&fc3, P, "fc3", 128, 10, 1);
  }
  /* Non-zero biases, so their gradients and uses are really compared. */
  dt_rng r;
  dt_rng_seed(&r, 5);
  for (int i = 0; i < dt_params_count(P); i++) {
    dt_param_info in;
    dt_params_info(P, i, &in);
    if (in.ndim == 1)
      for (size_t k = 0; k < in.size; k++) dt_params_data(P)[in.offset + k] = 0.1f * (dt_rng_uniform(&r) - 0.5f);
  }
  static float x[B * 784];
  int32_t y[B];
  for (int i = 0; i < B * 784; i++) x[i] = dt_rng_uniform(&r);
  for (int i = 0; i < B; i++) y[i] = (int32_t)dt_rng_below(&r, 10);
  dt_graph *g = dt_graph_create(P, NULL);
  dt_tensor *h;
  if (cnn) {
    int64_t xs[4] = {B, 1, 28, 28};
    h = dt_tensor_from(g, 4, xs, x);
    h = dt_max_pool2d(g, dt_relu(g, dt_nn_conv2d_forward(g, &c1, h)), 2, 2);
    h = dt_max_pool2d(g, dt_relu(g, dt_nn_conv2d_forward(g, &c2, h)), 2, 2);
    h = dt_relu(g, dt_nn_linear_forward(g, &fc1, dt_flatten(g, h)));
    h = dt_nn_linear_forward(g, &fc2, h);
  } else {
    int64_t xs[2] = {B, 784};
    h = dt_tensor_from(g, 2, xs, x);
    h = dt_relu(g, dt_nn_linear_forward(g, &fc1, h));
    h = dt_relu(g, dt_nn_linear_forward(g, &fc2, h));
    h = dt_nn_linear_forward(g, &fc3, h);
  }
  dt_tensor *loss = dt_cross_entropy(g, h, y);
  dt_params_zero_grad(P);
  if (dt_backward(g, loss) != DTRAIN_OK) {
    fprintf(stderr, "torch_dump: %s\n", dt_graph_message(g));
    return 1;
  }
  FILE *idx = open_out(dir, "index.txt");
  if (!idx) return 1;
  int bad = 0;
  fprintf(idx, "model %s\nbatch %d\n", cnn ? "cnn" : "mlp", B);
  for (int i = 0; i < dt_params_count(P); i++) {
    dt_param_info in;
    dt_params_info(P, i, &in);
    char name[256];
    fprintf(idx, "param %s", in.name);
    for (int d = 0; d < in.ndim; d++) fprintf(idx, " %lld", (long long)in.shape[d]);
    fprintf(idx, "\n");
    snprintf(name, sizeof name, "%s.f32", in.name);
    bad |= write_le(dir, name, dt_params_data(P) + in.offset, in.size);
    snprintf(name, sizeof name, "grad.%s.f32", in.name);
    bad |= write_le(dir, name, dt_params_grad(P) + in.offset, in.size);
  }
  bad |= fclose(idx) != 0;
  bad |= write_le(dir, "x.f32", x, (size_t)B * 784);
  bad |= write_le(dir, "y.i32", y, B);
  float lv = dt_item(loss);
  bad |= write_le(dir, "loss.f32", &lv, 1);
  dt_graph_destroy(g);
  dt_params_destroy(P);
  if (!cnn) bad |= dump_maps(dir) | dump_special(dir);
  return bad;
}
