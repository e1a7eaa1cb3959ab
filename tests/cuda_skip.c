/* tests/cuda_skip.c -- stands in for build/tests/test_cuda (or
 * test_cuda_emu) where it cannot be built (no nvcc, a cross or sanitizer
 * build; no C++ compiler): reports the whole program as one skipped item
 * with its reason, in the lines tools/run_tests.sh reads ("skip NAME: why",
 * then the summary), so that the closing line counts it as skipped, not as
 * passed. CUDA_SKIP_NAME and CUDA_SKIP_REASON come from the Makefile. */
#include <stdio.h>
#ifndef CUDA_SKIP_NAME
#  define CUDA_SKIP_NAME "test_cuda"
#endif
#ifndef CUDA_SKIP_REASON
#  define CUDA_SKIP_REASON "not built"
#endif
int main(void) {
  printf("skip %s: %s\n", CUDA_SKIP_NAME, CUDA_SKIP_REASON);
  printf("%s: 0 passed, 0 failed, 1 skipped\n", CUDA_SKIP_NAME);
  return 0;
}
