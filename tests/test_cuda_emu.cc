/* tests/test_cuda_emu.cc -- the CUDA backend's kernels without a GPU.
 *
 * dtrain_cuda.h writes every kernel's math as a function of the element
 * index shared by the __global__ kernels and a host emulation
 * (DTRAIN_CUDA_HOST_EMULATION): a dt_device whose memory is host memory and
 * whose kernels run those same functions in loops. This test plugs it into
 * dt_graph_options.device, so the core's whole device path (device arena,
 * transfers, device twins of the ops, device backward, the optimizers'
 * device update) runs with the CUDA kernel bodies, and compares every op,
 * forward and backward, and a few MLP training steps against the CPU ops.
 * It also checks the row-major -> cuBLAS column-major GEMM mapping against
 * dt_sgemm. Built with the C++ compiler (no nvcc needed); the real-GPU
 * version of the same checks is tests/test_cuda.cu. */
#define DTRAIN_IMPLEMENTATION
#define DTRAIN_CUDA_HOST_EMULATION
#include "dtrain_cuda.h"
#include "cuda_parity.h"

/* Every transpose combination and beta 0/1 through dt__cu_gemm_map and the
 * column-major reference, against dt_sgemm. */
static void test_gemm_mapping(void) {
  const int64_t m = 5, n = 3, k = 4;
  float a[20], b[12], c0[15], c1[15], ref[15];
  th_fill(a, 20, -1, 1);
  th_fill(b, 12, -1, 1);
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++)
      for (int beta = 0; beta < 2; beta++) {
        th_fill(c0, 15, -1, 1);
        memcpy(c1, c0, sizeof c0);
        memcpy(ref, c0, sizeof c0);
        dt_sgemm(ta, tb, m, n, k, 1.0f, a, ta ? m : k, b, tb ? k : n, (float)beta, ref, n);
        dt_kernel_args ka;
        memset(&ka, 0, sizeof ka);
        ka.p[0] = c1;
        ka.p[1] = a;
        ka.p[2] = b;
        ka.n[0] = m;
        ka.n[1] = n;
        ka.n[2] = k;
        ka.n[3] = ta | (tb << 1);
        ka.f[0] = 1.0f;
        ka.f[1] = (float)beta;
        CHECK(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka) == DTRAIN_OK);
        for (int i = 0; i < 15; i++) CHECK_NEAR(c1[i], ref[i], 1e-5);
      }
}

/* The batched form (n4 products at strides n5/n6/n7, B shared when n6 = 0),
 * every transpose combination, against dt_sgemm product by product. */
static void test_gemm_batched(void) {
  const int64_t m = 3, n = 5, k = 4, nb = 3;
  float a[3 * 12], b[3 * 20], c[3 * 15], ref[3 * 15];
  th_fill(a, 36, -1, 1);
  th_fill(b, 60, -1, 1);
  for (int shared = 0; shared < 2; shared++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        th_fill(c, 45, -1, 1);
        memcpy(ref, c, sizeof c);
        int64_t sb = shared ? 0 : k * n;
        for (int64_t i = 0; i < nb; i++)
          dt_sgemm(ta, tb, m, n, k, 1.0f, a + i * m * k, ta ? m : k, b + i * sb, tb ? k : n, 1.0f, ref + i * m * n, n);
        dt_kernel_args ka;
        memset(&ka, 0, sizeof ka);
        ka.p[0] = c;
        ka.p[1] = a;
        ka.p[2] = b;
        ka.n[0] = m;
        ka.n[1] = n;
        ka.n[2] = k;
        ka.n[3] = ta | (tb << 1);
        ka.n[4] = nb;
        ka.n[5] = m * k;
        ka.n[6] = sb;
        ka.n[7] = m * n;
        ka.f[0] = 1.0f;
        ka.f[1] = 1.0f;
        CHECK(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka) == DTRAIN_OK);
        for (int i = 0; i < 45; i++) CHECK_NEAR(c[i], ref[i], 1e-5);
      }
}

/* What cuBLAS would refuse or leave undefined is refused by the shared
 * dispatch, so the emulation cannot pass it: products of one strided batch
 * writing overlapping outputs (concurrent on a GPU, sequential here), and a
 * leading dimension below its operand's rows. An empty C or k = 0 is fine. */
static void test_gemm_refused(void) {
  float a[24], b[24], c[24];
  th_fill(a, 24, -1, 1);
  th_fill(b, 24, -1, 1);
  th_fill(c, 24, -1, 1);
  dt_kernel_args ka;
  memset(&ka, 0, sizeof ka);
  ka.p[0] = c;
  ka.p[1] = a;
  ka.p[2] = b;
  ka.n[0] = 2; /* m */
  ka.n[1] = 3; /* n */
  ka.n[2] = 2; /* k */
  ka.n[4] = 2; /* two products */
  ka.n[5] = 4;
  ka.n[6] = 6;
  ka.n[7] = 0; /* both into the same C: a race on the GPU */
  ka.f[0] = 1.0f;
  ka.f[1] = 1.0f;
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka), DTRAIN_ERR_INVALID_ARG, "overlapping outputs");
  ka.n[7] = 5; /* C_1 starts inside C_0 (6 floats) */
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka), DTRAIN_ERR_INVALID_ARG, "overlapping outputs");
  float before = c[0];
  ka.n[7] = 6; /* adjacent: fine */
  CHECK(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka) == DTRAIN_OK);
  CHECK(c[0] != before);
  ka.n[2] = -1;
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka), DTRAIN_ERR_INVALID_ARG, "negative dimension");
  /* k = 0: C = beta C (no operand read), leading dimensions clamped to 1 */
  ka.n[2] = 0;
  ka.n[4] = 0;
  ka.f[1] = 0.5f;
  for (int i = 0; i < 6; i++) c[i] = 2.0f;
  CHECK(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka) == DTRAIN_OK);
  for (int i = 0; i < 6; i++) CHECK_NEAR(c[i], 1.0f, 0.0);
  /* an empty C: nothing done, nothing refused */
  ka.n[0] = 0;
  ka.n[4] = 2;
  ka.n[7] = 0;
  CHECK(cp_dev->run(cp_dev, DTRAIN_K_GEMM, &ka) == DTRAIN_OK);
}

/* Every op of the library has a device path today; an op that had none
 * (a name not in the list) would be refused by dt__begin. */
static void test_device_op_list(void) {
  static const char *const ops[] = {"dt_permute", "dt_concat", "dt_slice", "dt_split", "dt_bmm", "dt_causal_mask",
                                    "dt_batch_norm", "dt_nn_attention_forward", "dt_nn_lstm_cell_forward",
                                    "dt_nn_gru_cell_forward", "dt_nn_batch_norm_forward"};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) CHECK_MSG(dt__dev_op_ok(ops[i]), "%s", ops[i]);
  CHECK(!dt__dev_op_ok("dt_no_such_op"));
  CHECK(!dt__dev_op_ok("dt_permut"));
}

/* An unknown kernel id is refused, not ignored. */
static void test_unknown_kernel(void) {
  dt_kernel_args ka;
  memset(&ka, 0, sizeof ka);
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_COUNT, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
  ka.n[1] = DTRAIN_MAP_COUNT; /* a map function the backend does not know */
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_MAP, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
  ka.n[1] = -1;
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_MAP, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
  ka.n[1] = DTRAIN_MAP_DOMAIN_POS; /* the domain maps have no backward */
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_MAP_BWD, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
  ka.n[1] = DTRAIN_MAP_SQRT;
  CHECK(cp_dev->run(cp_dev, DTRAIN_K_MAP_BWD, &ka) == DTRAIN_OK);
  memset(&ka, 0, sizeof ka);
  ka.n[1] = 7; /* a permute of more dims than the kernel holds */
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_PERMUTE, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
}

/* A device that fails on demand: a kernel, or allocations above a size. The
 * core must turn each failure into the graph's error, with the op's name,
 * the device's name and the device's message, and NOMEM for memory. */
static int fail_kernel = -1;
static size_t fail_alloc_above = (size_t)-1;
static dt_result failing_run(dt_device *d, dt_kernel k, const dt_kernel_args *a) {
  if ((int)k == fail_kernel) return dt_device_error(DTRAIN_ERR_IO, "injected kernel failure");
  return dt_cuda_emu_device()->run(d, k, a);
}
static dt_result failing_alloc(dt_device *d, size_t bytes, void **out) {
  if (bytes > fail_alloc_above) {
    char msg[96];
    snprintf(msg, sizeof msg, "alloc of %zu bytes: out of memory", bytes);
    return dt_device_error(DTRAIN_ERR_NOMEM, msg);
  }
  return dt_cuda_emu_device()->alloc(d, bytes, out);
}

static void test_device_errors(void) {
  dt_device dev = *dt_cuda_emu_device();
  dev.name = "cuda-fail";
  dev.run = failing_run;
  dev.alloc = failing_alloc;
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = &dev;
  gd.arena_bytes = 4096;
  dt_graph *g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (!g) return;
  fail_kernel = DTRAIN_K_RELU;
  dt_tensor *x = dt_tensor_new2(g, 4, 4);
  CHECK(x != NULL);
  CHECK(dt_relu(g, x) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_IO);
  CHECK_MSG(strstr(dt_graph_message(g), "dt_relu: device cuda-fail: injected kernel failure") != NULL, "%s",
            dt_graph_message(g));
  fail_kernel = -1;
  dt_graph_reset(g);
  fail_alloc_above = 1 << 20;
  CHECK(dt_tensor_new2(g, 1024, 1024) == NULL); /* 4 MiB block */
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NOMEM);
  CHECK_MSG(strstr(dt_graph_message(g), "alloc of 4194304 bytes") != NULL, "%s", dt_graph_message(g));
  dt_graph_reset(g);
  CHECK(dt_tensor_new2(g, 16, 16) != NULL); /* still usable */
  /* a failure in backward stops it with the same kind of message */
  dt_tensor *a = dt_tensor_new2(g, 4, 4);
  dt_tensor_set_requires_grad(a, 1);
  dt_tensor *l = dt_sum(g, dt_tanh(g, a));
  fail_kernel = DTRAIN_K_TANH_BWD;
  CHECK(dt_backward(g, l) == DTRAIN_ERR_IO);
  CHECK(strstr(dt_graph_message(g), "injected kernel failure") != NULL);
  fail_kernel = -1;
  fail_alloc_above = (size_t)-1;
  dt_graph_destroy(g);
  /* params that do not fit on the device: dt_graph_create fails cleanly */
  dt_params *p = dt_params_create(1);
  int64_t s[2] = {512, 512};
  dt_params_add(p, "w", 2, s, dt_init_zeros());
  fail_alloc_above = 4096;
  CHECK(dt_graph_create(p, &gd) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_NOMEM);
  CHECK(strstr(dt_last_error(), "1048576 bytes") != NULL);
  fail_alloc_above = (size_t)-1;
  dt_params_destroy(p);
  /* arena_bytes sizes the device arena on a device graph: a block too large
   * for the device fails there, naming the device allocation (the host arena,
   * which holds only tensor headers, does not try the same size: on a GPU
   * that made test_cuda's out-of-memory check fail on the host first). */
  gd.arena_bytes = (size_t)1 << 36;
  fail_alloc_above = (size_t)1 << 30;
  g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (g) {
    CHECK(dt_tensor_new1(g, 4) == NULL);
    CHECK(dt_graph_error(g) == DTRAIN_ERR_NOMEM);
    CHECK_MSG(strstr(dt_graph_message(g), "alloc of 68719476736 bytes: out of memory") != NULL, "%s",
              dt_graph_message(g));
    dt_graph_destroy(g);
  }
  fail_alloc_above = (size_t)-1;
}

int main(void) {
  cp_dev = dt_cuda_emu_device();
  cp_run_all();
  /* The same parity checks on the guarded emulation: device memory the
   * host cannot touch, as on a GPU (a host read of device memory in the
   * core would crash here). */
  dt_device *guarded = dt_cuda_emu_guarded_device_create(0);
  CHECK(guarded != NULL);
  if (guarded) {
    cp_dev = guarded;
    cp_run_all();
    cp_dev = dt_cuda_emu_device();
    dt_cuda_emu_device_free(guarded);
  }
  TH_RUN(test_gemm_mapping);
  TH_RUN(test_gemm_batched);
  TH_RUN(test_gemm_refused);
  TH_RUN(test_device_op_list);
  TH_RUN(test_unknown_kernel);
  TH_RUN(test_device_errors);
  printf("test_cuda_emu: %d floats compared between the CPU ops and the emulated CUDA kernels\n", cp_compared);
  return th_summary("test_cuda_emu");
}
