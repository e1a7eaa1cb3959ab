/* tests/cuda_skip.c -- stands in for build/tests/test_cuda where it cannot be
 * built (no nvcc, a cross or sanitizer build): prints why, and the summary
 * line the test runner expects. CUDA_SKIP_REASON comes from the Makefile. */
#include <stdio.h>
#ifndef CUDA_SKIP_REASON
#  define CUDA_SKIP_REASON "not built"
#endif
int main(void) {
  printf("test_cuda: %s, skipping\n", CUDA_SKIP_REASON);
  printf("test_cuda: 0 passed, 0 failed\n");
  return 0;
}
