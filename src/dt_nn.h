/* ===========================================================================
 * dt_nn.h -- layers: parameter indices plus a forward function
 * ===========================================================================
 * A layer struct holds parameter indices, not pointers, so the same model
 * struct serves every replica: forward looks the parameters up in the graph
 * it runs on (dt_param), which is bound to that replica's buffers.
 * Parameters are named "<name>.weight", "<name>.bias", ... (PyTorch names).
 */
#ifndef DTRAIN_NN_H
#define DTRAIN_NN_H

#include "dt_ops.h"
#include "dt_params.h"

DTRAIN_EXTERN_C_BEGIN

/* y = x W^T + b; W [out,in] (Glorot uniform), b [out] (zeros). */
typedef struct dt_nn_linear { int w, b; int64_t in, out; } dt_nn_linear;
DTRAIN_API dt_result dt_nn_linear_init(dt_nn_linear *l, dt_params *p, const char *name,
                                       int64_t in, int64_t out, int bias);
/* x [..., in] -> [..., out] */
DTRAIN_API dt_tensor *dt_nn_linear_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x);
/* relu(dt_nn_linear_forward(l, x)), fused: dt_linear_relu */
DTRAIN_API dt_tensor *dt_nn_linear_relu_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x);

/* W [out,in,k,k] (He uniform), b [out]. */
typedef struct dt_nn_conv2d { int w, b; int in, out, kernel, stride, padding; } dt_nn_conv2d;
DTRAIN_API dt_result dt_nn_conv2d_init(dt_nn_conv2d *l, dt_params *p, const char *name, int in, int out,
                                       int kernel, int stride, int padding, int bias);
DTRAIN_API dt_tensor *dt_nn_conv2d_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x);
/* relu(dt_nn_conv2d_forward(l, x)), fused: dt_conv2d_relu */
DTRAIN_API dt_tensor *dt_nn_conv2d_relu_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x);

/* table [vocab, dim] ~ N(0,1). */
typedef struct dt_nn_embedding { int w; int64_t vocab, dim; } dt_nn_embedding;
DTRAIN_API dt_result dt_nn_embedding_init(dt_nn_embedding *l, dt_params *p, const char *name,
                                          int64_t vocab, int64_t dim);
DTRAIN_API dt_tensor *dt_nn_embedding_forward(dt_graph *g, const dt_nn_embedding *l,
                                              const int32_t *ids, int64_t n);

/* gamma [dim] = 1, beta [dim] = 0. */
typedef struct dt_nn_layer_norm { int gamma, beta; int64_t dim; float eps; } dt_nn_layer_norm;
DTRAIN_API dt_result dt_nn_layer_norm_init(dt_nn_layer_norm *l, dt_params *p, const char *name, int64_t dim);
DTRAIN_API dt_tensor *dt_nn_layer_norm_forward(dt_graph *g, const dt_nn_layer_norm *l, dt_tensor *x);

/* gamma, beta [C]; buffers running_mean (0), running_var (1). */
typedef struct dt_nn_batch_norm { int gamma, beta, mean, var; int64_t channels; float momentum, eps; } dt_nn_batch_norm;
DTRAIN_API dt_result dt_nn_batch_norm_init(dt_nn_batch_norm *l, dt_params *p, const char *name, int64_t channels);
DTRAIN_API dt_tensor *dt_nn_batch_norm_forward(dt_graph *g, const dt_nn_batch_norm *l, dt_tensor *x);

/* LSTM cell (PyTorch gate order i, f, g, o): weight_ih [4H,in], weight_hh [4H,H],
 * bias [4H] (forget-gate bias 1). h, c: [N,H] (NULL means zeros). */
typedef struct dt_nn_lstm_cell { int w_ih, w_hh, b; int64_t in, hidden; } dt_nn_lstm_cell;
DTRAIN_API dt_result dt_nn_lstm_cell_init(dt_nn_lstm_cell *l, dt_params *p, const char *name,
                                          int64_t in, int64_t hidden);
DTRAIN_API dt_result dt_nn_lstm_cell_forward(dt_graph *g, const dt_nn_lstm_cell *l, dt_tensor *x,
                                             dt_tensor *h, dt_tensor *c, dt_tensor **h_out, dt_tensor **c_out);

/* GRU cell (PyTorch equations, gate order r, z, n): weight_ih [3H,in],
 * weight_hh [3H,H], bias_ih [3H], bias_hh [3H]. */
typedef struct dt_nn_gru_cell { int w_ih, w_hh, b_ih, b_hh; int64_t in, hidden; } dt_nn_gru_cell;
DTRAIN_API dt_result dt_nn_gru_cell_init(dt_nn_gru_cell *l, dt_params *p, const char *name,
                                         int64_t in, int64_t hidden);
DTRAIN_API dt_tensor *dt_nn_gru_cell_forward(dt_graph *g, const dt_nn_gru_cell *l, dt_tensor *x, dt_tensor *h);

/* Causal multi-head self-attention, composed from ops: x [B,T,C] -> [B,T,C].
 * qkv: linear C -> 3C, proj: linear C -> C; heads must divide C. */
typedef struct dt_nn_attention { dt_nn_linear qkv, proj; int64_t dim; int heads; } dt_nn_attention;
DTRAIN_API dt_result dt_nn_attention_init(dt_nn_attention *l, dt_params *p, const char *name,
                                          int64_t dim, int heads);
DTRAIN_API dt_tensor *dt_nn_attention_forward(dt_graph *g, const dt_nn_attention *l, dt_tensor *x);

DTRAIN_EXTERN_C_END

#endif /* DTRAIN_NN_H */
