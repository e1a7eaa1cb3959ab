/* tests/cuda_emu_backend.cc -- dt_cuda_device_create() etc. backed by the
 * host emulation of dtrain_cuda.h (one device, named "cuda-emu"), so that a
 * program written for the CUDA backend runs its whole device path on a
 * machine without a GPU. Linked into build/examples/02_fashion_mnist_emu,
 * which tests/example_checks.sh compares with the CPU run. Test use only. */
#define DTRAIN_CUDA_HOST_EMULATION
#include "dtrain_cuda.h"

DTRAIN_API int dt_cuda_device_count(void) { return 1; }

DTRAIN_API dt_device *dt_cuda_device_create(int index) {
  if (index != 0) {
    dt_device_error(DTRAIN_ERR_INVALID_ARG, "dt_cuda_device_create: the host emulation has one device (0)");
    return NULL;
  }
  return dt_cuda_emu_device();
}

DTRAIN_API void dt_cuda_device_destroy(dt_device *d) { (void)d; }
