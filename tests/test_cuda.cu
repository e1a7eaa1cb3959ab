/* tests/test_cuda.cu -- CPU <-> GPU parity of the CUDA backend (dtrain_cuda.h).
 *
 * The checks of tests/cuda_parity.h (every op with a device path forward and
 * backward, MLP training steps with SGD/Adam/AdamW, clean errors for what has
 * no kernel) run against a real GPU, plus the CUDA-only error paths (out of
 * memory, a bad device index). Built with nvcc by `make test` where nvcc
 * exists; on a machine without a GPU (or driver) it prints
 * "test_cuda: no CUDA device (...), skipping" and an all-zero summary. */
/* dtrain itself comes from build/dtrain.o (the C compiler); this file holds
 * only the CUDA backend, the way users are meant to split it. */
#define DTRAIN_CUDA_IMPLEMENTATION
#include "dtrain_cuda.h"
#include "cuda_parity.h"

/* An arena block larger than any GPU: DTRAIN_ERR_NOMEM naming cudaMalloc and
 * the byte count; the graph stays usable after a reset. */
static void test_out_of_memory(void) {
  dt_graph_desc gd;
  memset(&gd, 0, sizeof gd);
  gd.device = cp_dev;
  gd.arena_bytes = (size_t)1 << 50;
  dt_graph *g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (!g) return;
  CHECK(dt_tensor_new1(g, 4) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NOMEM);
  CHECK(strstr(dt_graph_message(g), "cudaMalloc of 1125899906842624 bytes") != NULL);
  dt_graph_destroy(g);
}

static void test_bad_index(void) {
  int n = dt_cuda_device_count();
  CHECK(dt_cuda_device_create(n) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  CHECK(dt_cuda_device_create(-1) == NULL);
}

int main(void) {
  dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG); /* the expected failure below is not an error */
  int n = dt_cuda_device_count();
  if (n <= 0) {
    printf("test_cuda: no CUDA device (%s), skipping\n", n < 0 ? dt_last_error() : "cudaGetDeviceCount: 0 devices");
    return th_summary("test_cuda");
  }
  cp_dev = dt_cuda_device_create(0);
  if (!cp_dev) {
    printf("test_cuda: dt_cuda_device_create(0) failed: %s\n", dt_last_error());
    th_failed++;
    return th_summary("test_cuda");
  }
  cp_run_all();
  TH_RUN(test_out_of_memory);
  TH_RUN(test_bad_index);
  printf("test_cuda: %d floats compared between the CPU ops and %s\n", cp_compared, cp_dev->name);
  dt_cuda_device_destroy(cp_dev);
  return th_summary("test_cuda");
}
