/* ===========================================================================
 * dt_ops_conv.h -- what the convolution files share (private)
 * ===========================================================================
 * dt_ops_conv.c (im2col + GEMM, and dt_conv2d itself) picks Winograd for
 * 5x5 kernels (dt__wino_use) and calls dt_ops_wino.c for them; both read the
 * geometry of the convolution from one dt__conv_geom, filled by
 * dt_ops_conv.c. Listed as an impl file: nothing here is public.
 */
#ifndef DTRAIN_OPS_CONV_H
#define DTRAIN_OPS_CONV_H

#include "dt_internal.h"

/* Geometry of one convolution, from the tensors and the saved parameters. */
typedef struct dt__conv_geom {
  int64_t n, c, h, w;      /* input */
  int64_t o, kh, kw;       /* weight */
  int64_t ho, wo;          /* output */
  int64_t s, p;            /* stride, padding */
  int64_t k, pp, nb;       /* K = c*kh*kw, P = ho*wo, images per GEMM */
  int direct;              /* 1x1, stride 1, padding 0, nb == 1: col is x */
} dt__conv_geom;

/* Winograd F(2x2, 5x5) (dt_ops_wino.c): 5x5 kernels, stride 1, at least 8
 * channels in and out. The forward writes y [N,O,Ho,Wo] (plus the bias b
 * when not NULL, then ReLU with relu); the backward adds to gx and gw (either NULL: not wanted)
 * from the output gradient gy. Scratch comes from g's arena; an arena
 * failure is left on g. */
DTRAIN_PRIVATE int dt__wino_use(const dt__conv_geom *q);
DTRAIN_PRIVATE void dt__wino_forward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w, const float *b,
                                     int relu, float *y);
DTRAIN_PRIVATE void dt__wino_backward(dt_graph *g, const dt__conv_geom *q, const float *x, const float *w,
                                      const float *gy, float *gx, float *gw);

#endif /* DTRAIN_OPS_CONV_H */
