/* portable_run.c -- prints numbers that must agree on every architecture.
 *
 * tests/cross_compare.sh runs it natively and under qemu (aarch64, armhf,
 * big-endian s390x) and compares: RNG draws and initial parameter checksums
 * bit for bit (integer arithmetic, little-endian checksum), training results
 * within float tolerance (compilers may contract or order float math
 * differently per target). Output lines: "<key> <kind> <value>", kind is
 * "exact" or "float". */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include <stdio.h>
#include <string.h>

/* Usage: portable_run [save FILE] [load FILE]: after training, save the
 * state as a checkpoint, and/or load another run's checkpoint into a fresh
 * model of the same layout and print its checksum (lines of kind "info":
 * cross_compare.sh compares them with the writer's train.checksum). */

static void exact_u64(const char *k, uint64_t v) { printf("%s exact %016llx\n", k, (unsigned long long)v); }
static void flt(const char *k, double v) { printf("%s float %.9g\n", k, v); }

static dt_params *make_model(dt_nn_conv2d *conv, dt_nn_linear *fc1, dt_nn_linear *fc2) {
  dt_params *P = dt_params_create(7);
  dt_nn_conv2d_init(conv, P, "conv", 1, 4, 3, 1, 1, 1);
  dt_nn_linear_init(fc1, P, "fc1", 4 * 4 * 4, 16, 1);
  dt_nn_linear_init(fc2, P, "fc2", 16, 3, 1);
  return P;
}

int main(int argc, char **argv) {
  const char *save = NULL, *load = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "save")) save = argv[i + 1];
    else if (!strcmp(argv[i], "load")) load = argv[i + 1];
  }
  dt_rng r;
  dt_rng_seed(&r, 42);
  for (int i = 0; i < 4; i++) {
    char k[32];
    snprintf(k, sizeof k, "rng.u64.%d", i);
    exact_u64(k, dt_rng_u64(&r));
  }
  for (int i = 0; i < 4; i++) {
    char k[32];
    float u = dt_rng_uniform(&r);
    uint32_t bits;
    memcpy(&bits, &u, 4);
    snprintf(k, sizeof k, "rng.uniform.%d", i);
    exact_u64(k, bits);
  }
  for (int i = 0; i < 4; i++) {
    char k[32];
    snprintf(k, sizeof k, "rng.normal.%d", i);
    flt(k, dt_rng_normal(&r));
  }

  /* A small CNN + MLP head, deterministic data, 30 Adam steps. */
  dt_nn_conv2d conv;
  dt_nn_linear fc1, fc2;
  dt_params *P = make_model(&conv, &fc1, &fc2);
  exact_u64("init.layout", dt_params_layout_hash(P));
  exact_u64("init.checksum.uniform_layers", dt_params_checksum(P));
  dt_optim_desc od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.01f;
  dt_optim *opt = dt_optim_create(P, &od);
  dt_graph *g = dt_graph_create(P, NULL);
  float x[8 * 64];
  int32_t y[8];
  for (int i = 0; i < 8 * 64; i++) x[i] = (float)((i * 7919) % 97) / 97.0f - 0.5f;
  for (int i = 0; i < 8; i++) y[i] = i % 3;
  int64_t xs[4] = {8, 1, 8, 8};
  float loss = 0;
  for (int s = 0; s < 30; s++) {
    dt_graph_reset(g);
    dt_params_zero_grad(P);
    dt_tensor *h = dt_relu(g, dt_nn_conv2d_forward(g, &conv, dt_tensor_from(g, 4, xs, x)));
    h = dt_max_pool2d(g, h, 2, 2);
    h = dt_tanh(g, dt_nn_linear_forward(g, &fc1, dt_flatten(g, h)));
    dt_tensor *L = dt_cross_entropy(g, dt_nn_linear_forward(g, &fc2, h), y);
    if (dt_backward(g, L) != DTRAIN_OK) {
      printf("error %s\n", dt_graph_message(g));
      return 1;
    }
    dt_optim_step(opt);
    loss = dt_item(L);
    if (s == 0) flt("train.loss.first", loss);
  }
  flt("train.loss.last", loss);
  const float *d = dt_params_data(P);
  for (int i = 0; i < 6; i++) {
    char k[32];
    snprintf(k, sizeof k, "train.param.%d", i * 97);
    flt(k, d[i * 97]);
  }
  flt("train.param.l2", dt_l2_norm(d, dt_params_size(P)));
  printf("train.checksum info %016llx\n", (unsigned long long)dt_params_checksum(P));
  if (save) {
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = P;
    st.optim = opt;
    st.graph = g;
    st.step = 30;
    if (dt_checkpoint_save(save, &st) != DTRAIN_OK) {
      printf("error %s\n", dt_last_error());
      return 1;
    }
  }
  if (load) {
    dt_nn_conv2d c2;
    dt_nn_linear f1, f2;
    dt_params *Q = make_model(&c2, &f1, &f2);
    dt_optim *qo = dt_optim_create(Q, &od);
    dt_graph *qg = dt_graph_create(Q, NULL);
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = Q;
    st.optim = qo;
    st.graph = qg;
    if (dt_checkpoint_load(load, &st) != DTRAIN_OK) {
      printf("error %s\n", dt_last_error());
      return 1;
    }
    printf("load.checksum info %016llx\n", (unsigned long long)dt_params_checksum(Q));
    printf("load.step info %lld\n", (long long)st.step);
    dt_graph_destroy(qg);
    dt_optim_destroy(qo);
    dt_params_destroy(Q);
  }
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  return 0;
}
