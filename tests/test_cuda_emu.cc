/* tests/test_cuda_emu.cc -- the CUDA backend's kernels without a GPU.
 *
 * dtrain_cuda.h writes every kernel's math as a function of the element
 * index shared by the __global__ kernels and a host emulation
 * (DTRAIN_CUDA_HOST_EMULATION): a dt_device whose memory is host memory and
 * whose kernels run those same functions in loops. This test plugs it into
 * dt_graph_desc.device, so the core's whole device path (device arena,
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

/* An unknown kernel id is refused, not ignored. */
static void test_unknown_kernel(void) {
  dt_kernel_args ka;
  memset(&ka, 0, sizeof ka);
  CHECK_ERR(cp_dev->run(cp_dev, DTRAIN_K_COUNT, &ka), DTRAIN_ERR_UNSUPPORTED, "no implementation");
}

int main(void) {
  cp_dev = dt_cuda_emu_device();
  cp_run_all();
  TH_RUN(test_gemm_mapping);
  TH_RUN(test_unknown_kernel);
  printf("test_cuda_emu: %d floats compared between the CPU ops and the emulated CUDA kernels\n", cp_compared);
  return th_summary("test_cuda_emu");
}
