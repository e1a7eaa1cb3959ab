/* tests/cuda_skip.c -- stands in for build/tests/test_cuda (or
 * test_cuda_emu) where it cannot be built (no nvcc, a cross or sanitizer
 * build; no C++ compiler): prints why, and the summary line the test runner
 * expects. CUDA_SKIP_NAME and CUDA_SKIP_REASON come from the Makefile. */
#include <stdio.h>
#ifndef CUDA_SKIP_NAME
#  define CUDA_SKIP_NAME "test_cuda"
#endif
#ifndef CUDA_SKIP_REASON
#  define CUDA_SKIP_REASON "not built"
#endif
int main(void) {
  printf("%s: %s, skipping\n", CUDA_SKIP_NAME, CUDA_SKIP_REASON);
  printf("%s: 0 passed, 0 failed\n", CUDA_SKIP_NAME);
  return 0;
}
