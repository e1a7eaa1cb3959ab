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
/* The private wire helpers (dt__frame_pack, dt__put_f32le, ...) are static
 * in the amalgamation and visible here because the implementation is. */
#include <stdio.h>
#include <string.h>

/* Usage: portable_run [save FILE] [load FILE]: after training, save the
 * state as a checkpoint, and/or load another run's checkpoint into a fresh
 * model of the same layout and print its checksum (lines of kind "info":
 * cross_compare.sh compares them with the writer's train.checksum). */

static void exact_u64(const char *k, uint64_t v) { printf("%s exact %016llx\n", k, (unsigned long long)v); }
static void flt(const char *k, double v) { printf("%s float %.9g\n", k, v); }

/* ---- wire frames: the bytes written must be the same on every architecture,
 * and every architecture must decode another's frames to the same values. */
#define WIRE_JOB 0x0123456789ABCDEFull
static const float wire_floats[6] = {1.5f, -2.25f, 3e-8f, 1e30f, -0.0f, 0.1f};

/* A digest of the values the frames carry, from the source values. */
static uint64_t wire_digest_values(const uint32_t *fields, size_t nf, const float *f, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < nf; i++) h = (h ^ fields[i]) * 1099511628211ULL;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &f[i], 4);
    h = (h ^ u) * 1099511628211ULL;
  }
  return h;
}

/* Two frames: a control frame carrying a hello-like record of u32/u64 fields,
 * a data frame carrying floats. Returns the bytes used. */
static size_t wire_write(unsigned char *buf) {
  unsigned char rec[24];
  dt__put_le32(rec, 1u);
  dt__put_le32(rec + 4, 7u);
  dt__put_le64(rec + 8, 0xFEDCBA9876543210ull);
  dt__put_le32(rec + 16, 0x80000001u);
  dt__put_le32(rec + 20, 42u);
  dt__frame_pack(buf, 0x01, WIRE_JOB, 0x10003u, 0, rec, sizeof rec);
  memcpy(buf + DT__NET_HDR, rec, sizeof rec);
  size_t off = DT__NET_HDR + sizeof rec;
  unsigned char f[6 * 4];
  dt__put_f32le(f, wire_floats, 6);
  dt__frame_pack(buf + off, 0x41, WIRE_JOB, 2u, 1, f, sizeof f);
  memcpy(buf + off + DT__NET_HDR, f, sizeof f);
  return off + DT__NET_HDR + sizeof f;
}

static uint64_t wire_expected(void) {
  uint32_t fields[] = {0x01, 0x10003u, 0, 24, 1u, 7u, 0x76543210u, 0xFEDCBA98u, 0x80000001u, 42u,
                       0x41, 2u, 1, 24};
  return wire_digest_values(fields, sizeof fields / sizeof fields[0], wire_floats, 6);
}

/* Decode what wire_write wrote (on any architecture); 0 on any error. */
static uint64_t wire_read(const unsigned char *buf, size_t n) {
  uint32_t fields[14];
  float f[6];
  dt__frame fr;
  char why[128];
  if (n < 2 * DT__NET_HDR + 48) return 0;
  if (dt__frame_unpack(buf, WIRE_JOB, 4096, &fr, why, sizeof why) != DTRAIN_OK || fr.length != 24 ||
      !dt__frame_payload_ok(buf, &fr, buf + DT__NET_HDR))
    return 0;
  const unsigned char *rec = buf + DT__NET_HDR;
  uint64_t u64 = dt__get_le64(rec + 8);
  uint32_t a[] = {fr.type, fr.sender, (uint32_t)fr.seq, fr.length, dt__get_le32(rec), dt__get_le32(rec + 4),
                  (uint32_t)u64, (uint32_t)(u64 >> 32), dt__get_le32(rec + 16), dt__get_le32(rec + 20)};
  memcpy(fields, a, sizeof a);
  const unsigned char *b = buf + DT__NET_HDR + 24;
  if (dt__frame_unpack(b, WIRE_JOB, 4096, &fr, why, sizeof why) != DTRAIN_OK || fr.length != 24 ||
      !dt__frame_payload_ok(b, &fr, b + DT__NET_HDR))
    return 0;
  fields[10] = fr.type;
  fields[11] = fr.sender;
  fields[12] = (uint32_t)fr.seq;
  fields[13] = fr.length;
  dt__get_f32le(f, b + DT__NET_HDR, 6);
  return wire_digest_values(fields, 14, f, 6);
}

static dt_params *make_model(dt_nn_conv2d *conv, dt_nn_linear *fc1, dt_nn_linear *fc2) {
  dt_params *P = dt_params_create(7);
  dt_nn_conv2d_init(conv, P, "conv", 1, 4, 3, 1, 1, 1);
  dt_nn_linear_init(fc1, P, "fc1", 4 * 4 * 4, 16, 1);
  dt_nn_linear_init(fc2, P, "fc2", 16, 3, 1);
  return P;
}

int main(int argc, char **argv) {
  const char *save = NULL, *load = NULL, *wsave = NULL, *wload = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "save")) save = argv[i + 1];
    else if (!strcmp(argv[i], "load")) load = argv[i + 1];
    else if (!strcmp(argv[i], "wsave")) wsave = argv[i + 1];
    else if (!strcmp(argv[i], "wload")) wload = argv[i + 1];
  }
  {
    unsigned char wb[256];
    size_t wn = wire_write(wb);
    exact_u64("wire.bytes", dt__crc32c(0, wb, wn));
    exact_u64("wire.decoded_here", wire_read(wb, wn) == wire_expected());
    printf("wire.digest info %016llx\n", (unsigned long long)wire_expected());
    if (wsave) {
      FILE *f = fopen(wsave, "wb");
      if (!f || fwrite(wb, 1, wn, f) != wn) { printf("error cannot write %s\n", wsave); return 1; }
      fclose(f);
    }
    if (wload) {
      unsigned char rb[256];
      FILE *f = fopen(wload, "rb");
      size_t rn = f ? fread(rb, 1, sizeof rb, f) : 0;
      if (f) fclose(f);
      printf("wireload.digest info %016llx\n", (unsigned long long)wire_read(rb, rn));
    }
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
  dt_optim_options od;
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
