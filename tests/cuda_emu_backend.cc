/* tests/cuda_emu_backend.cc -- dt_cuda_device_create() etc. backed by the
 * host emulation of dtrain_cuda.h, so that a program written for the CUDA
 * backend runs its whole device path on a machine without a GPU. Linked
 * into build/examples/02_fashion_mnist_emu, which tests/example_checks.sh
 * compares with the CPU run. One device ("cuda-emu") unless the environment
 * variable DTRAIN_CUDA_EMU_DEVICES says how many (1..64; then each is a
 * device of its own named "cuda-emu:<index>", for multi-device runs).
 * The devices are guarded (dt_cuda_emu_guard): their memory cannot be
 * touched from the host, as on a GPU, so a host read of device memory in
 * the program or the library crashes here instead of passing. Test use only. */
#define DTRAIN_CUDA_HOST_EMULATION
#include "dtrain_cuda.h"
#include <stdlib.h>

DTRAIN_API int dt_cuda_device_count(void) {
  const char *e = getenv("DTRAIN_CUDA_EMU_DEVICES");
  int n = e ? atoi(e) : 1;
  return n < 1 ? 1 : n > 64 ? 64 : n;
}

DTRAIN_API dt_device *dt_cuda_device_create(int index) {
  int n = dt_cuda_device_count();
  if (index < 0 || index >= n) {
    char msg[128];
    snprintf(msg, sizeof msg, "dt_cuda_device_create: device %d out of range (%d emulated devices)", index, n);
    dt_device_error(DTRAIN_ERR_INVALID_ARG, msg);
    return NULL;
  }
  dt_device *d = dt_cuda_emu_device_create(index);
  if (d && !getenv("DTRAIN_CUDA_EMU_DEVICES"))
    snprintf(((dt__cu_emu_dev *)d->impl)->name, sizeof ((dt__cu_emu_dev *)d->impl)->name, "cuda-emu");
  return dt_cuda_emu_guard(d);
}

DTRAIN_API void dt_cuda_device_destroy(dt_device *d) { dt_cuda_emu_device_free(d); }
