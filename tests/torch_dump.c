/* torch_dump.c -- writes a model's weights, a batch, and dtrain's loss and
 * gradients, for tests/torch_parity.py to recompute with PyTorch.
 *
 *   torch_dump mlp|cnn OUTDIR
 *
 * Files (raw little-endian float32 / int32): <name>.weight etc. per parameter
 * (PyTorch layout), x.f32, y.i32, loss.f32, grad.<param>.f32, and index.txt
 * listing "param <name> <dims...>".
 *
 * The mlp run also writes every elementwise map of DT__MAP_LIST (dt_maps.h):
 * for each, map.<name>.{x,go,y,gx}.f32 (input, output gradient, dtrain's
 * output and input gradient) and a line "map <name> <scalar> <count>" in
 * maps.txt, so that an op added to the list is compared with PyTorch
 * without an edit here (torch_parity.py needs its torch expression). */
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
  char path[512], name[256];
  snprintf(path, sizeof path, "%s/maps.txt", dir);
  FILE *idx = fopen(path, "w");
  if (!idx) {
    perror(path);
    return 1;
  }
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

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "mlp") && strcmp(argv[1], "cnn"))) {
    fprintf(stderr, "usage: torch_dump mlp|cnn OUTDIR\n");
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
  char path[512];
  snprintf(path, sizeof path, "%s/index.txt", dir);
  FILE *idx = fopen(path, "w");
  if (!idx) {
    perror(path);
    return 1;
  }
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
  if (!cnn) bad |= dump_maps(dir);
  return bad;
}
