/* examples/cuda_backend.cu -- the CUDA backend as its own object (nvcc), for
 * build/examples/02_fashion_mnist_cuda: the example (a C file compiled with
 * -DFMNIST_CUDA, holding DTRAIN_IMPLEMENTATION) links with this. */
#define DTRAIN_CUDA_IMPLEMENTATION
#include "dtrain_cuda.h"
