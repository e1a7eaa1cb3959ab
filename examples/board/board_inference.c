/* board_inference.c -- predict with a trained MLP on a small board: the
 * weights compiled in as C source, no file system, no threads, no malloc.
 *
 * The model is a header made from a checkpoint by dt_checkpoint_export_c
 * (prefix "model"):
 *
 *   build/examples/02_fashion_mnist --epochs 3 --checkpoint mlp.ckpt
 *   tools/dtrain-ckpt export-c mlp.ckpt -o build/board/model.h
 *   cc -O2 -Ibuild/board -I. examples/board/board_inference.c -lm -o board_inference
 *   arm-linux-gnueabihf-gcc -O2 -static ... (the same, for a 32-bit ARM board)
 *
 * The weights are const arrays (flash, .rodata); the only RAM dtrain uses is
 * the fixed buffer below (DTRAIN_NO_MALLOC: nothing else can be allocated),
 * and the program reports how much of it the forward pass needed at most.
 * The library is built without threads, stdio, sockets, data loaders or
 * dt_fit: what a microcontroller build keeps. The program itself reads
 * images from its standard input (the board's serial line, say): raw bytes,
 * one per pixel (the body of an IDX file), scaled to [0, 1] as in training,
 * and writes each image's predicted class on a line. The model must be an
 * MLP of "NAME.weight" [out, in] / "NAME.bias" [out] pairs with ReLU between
 * them (examples/02_fashion_mnist --model mlp is one).
 *
 *   zcat t10k-images-idx3-ubyte.gz | tail -c +17 | ./board_inference > predictions.txt
 *
 * Exit status: 0, 1 when the model or the memory does not fit (said why), 2
 * for input that is not whole images.
 */
#ifndef DTRAIN_NO_THREADS
#  define DTRAIN_NO_THREADS
#endif
#ifndef DTRAIN_NO_STDIO
#  define DTRAIN_NO_STDIO
#endif
#ifndef DTRAIN_NO_MALLOC
#  define DTRAIN_NO_MALLOC
#endif
#ifndef DTRAIN_NO_DIST
#  define DTRAIN_NO_DIST
#endif
#ifndef DTRAIN_NO_DATA
#  define DTRAIN_NO_DATA
#endif
#ifndef DTRAIN_NO_FIT
#  define DTRAIN_NO_FIT
#endif
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#ifndef BOARD_MODEL
#  define BOARD_MODEL "model.h" /* dt_checkpoint_export_c(..., "model") */
#endif
#include BOARD_MODEL

#include <stdio.h>
#include <string.h>

#ifndef BOARD_MEMORY
#  define BOARD_MEMORY (16 * 1024) /* the fixed buffer: all the RAM dtrain gets */
#endif
#define MAX_LAYERS 16
#define MAX_WIDTH 4096

static unsigned char memory[BOARD_MEMORY];

typedef struct layer {
  const model_tensor *w, *b;
} layer;

/* The model's layers: "X.weight" [out, in] then "X.bias" [out], each layer's
 * in the last one's out. 0 with a message when the table is not such an MLP. */
static int layers_of(layer *L, int *nl, int64_t *in, int64_t *out) {
  *nl = 0;
  for (int i = 0; i + 1 < MODEL_TENSORS && *nl < MAX_LAYERS; i += 2) {
    const model_tensor *w = &model_tensors[i], *b = &model_tensors[i + 1];
    if (w->ndim != 2 || b->ndim != 1 || b->shape[0] != w->shape[0] || w->shape[0] > MAX_WIDTH ||
        (*nl > 0 && w->shape[1] != L[*nl - 1].w->shape[0])) {
      fprintf(stderr, "board_inference: tensors '%s' and '%s' are not a linear layer following the last\n", w->name,
              b->name);
      return 0;
    }
    L[*nl].w = w;
    L[*nl].b = b;
    (*nl)++;
  }
  if (*nl == 0 || 2 * *nl != MODEL_TENSORS) {
    fprintf(stderr, "board_inference: the model is not an MLP of weight/bias pairs (%d tensors)\n", MODEL_TENSORS);
    return 0;
  }
  *in = L[0].w->shape[1];
  *out = L[*nl - 1].w->shape[0];
  return 1;
}

int main(void) {
  layer L[MAX_LAYERS];
  int nl;
  int64_t in, out;
  if (!layers_of(L, &nl, &in, &out)) return 1;
  if (in > MAX_WIDTH) {
    fprintf(stderr, "board_inference: %lld inputs: at most %d\n", (long long)in, MAX_WIDTH);
    return 1;
  }
  if (dt_use_fixed_memory(memory, sizeof memory) != DTRAIN_OK) {
    fprintf(stderr, "board_inference: %s\n", dt_last_error());
    return 1;
  }
  dt_params *P = dt_params_create(0); /* empty: the weights are the const arrays */
  dt_graph_options go;
  memset(&go, 0, sizeof go);
  go.arena_bytes = 8 * 1024; /* one image's activations and tape */
  dt_graph *g = P ? dt_graph_create(P, &go) : NULL;
  if (!g) {
    fprintf(stderr, "board_inference: %s (BOARD_MEMORY %d bytes)\n", dt_last_error(), BOARD_MEMORY);
    return 1;
  }
  dt_graph_set_grad_enabled(g, 0);
  static unsigned char pixels[MAX_WIDTH];
  static float x[MAX_WIDTH];
  long images = 0;
  size_t got;
  while ((got = fread(pixels, 1, (size_t)in, stdin)) == (size_t)in) {
    for (int64_t k = 0; k < in; k++) x[k] = (float)pixels[k] / 255.0f;
    dt_graph_reset(g);
    const int64_t xs[2] = {1, in};
    dt_tensor *h = dt_tensor_wrap(g, 2, xs, x);
    for (int l = 0; l < nl && h; l++) {
      /* the const weights wrapped in place (never written: no gradient) */
      dt_tensor *w = dt_tensor_wrap(g, 2, L[l].w->shape, (float *)(uintptr_t)L[l].w->data);
      dt_tensor *b = dt_tensor_wrap(g, 1, L[l].b->shape, (float *)(uintptr_t)L[l].b->data);
      h = dt_linear(g, h, w, b);
      if (l + 1 < nl) h = dt_relu(g, h);
    }
    int32_t cls;
    if (!h || dt_argmax_rows(h->data, 1, out, &cls) != DTRAIN_OK) {
      fprintf(stderr, "board_inference: image %ld: %s\n", images, dt_last_error());
      return 1;
    }
    printf("%d\n", (int)cls);
    images++;
  }
  if (got != 0) {
    fprintf(stderr, "board_inference: %zu bytes after image %ld: not a whole image of %lld pixels\n", got, images,
            (long long)in);
    return 2;
  }
  fprintf(stderr, "board_inference: %ld images, %d layers (%lld inputs, %lld classes); dtrain's memory: %zu of %d "
          "bytes at most\n", images, nl, (long long)in, (long long)out, dt_fixed_memory_peak(), BOARD_MEMORY);
  dt_graph_destroy(g);
  dt_params_destroy(P);
  return 0;
}
