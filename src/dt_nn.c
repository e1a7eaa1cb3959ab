/* ===========================================================================
 * dt_nn.c -- layers composed from the ops
 * ===========================================================================
 * Each layer is a struct of parameter indices plus an init and a forward
 * function. Init adds the parameters to a dt_params (names "<name>.weight",
 * ...); forward looks them up on the graph it runs on, so one model struct
 * serves every replica.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_nn.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"

/* "<name>.<suffix>" into buf; error if it does not fit. */
static dt_result dt__nn_name(char *buf, size_t cap, const char *fn, const char *name, const char *suffix) {
  if (!name) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: name is NULL", fn);
  int k = snprintf(buf, cap, "%s.%s", name, suffix);
  if (k < 0 || (size_t)k >= cap) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: name '%s' is too long", fn, name);
  return DTRAIN_OK;
}

/* Adds "<name>.<suffix>" and returns its index (negative dt_result on error). */
static int dt__nn_add(dt_params *p, const char *fn, const char *name, const char *suffix, int ndim,
                      const int64_t *shape, dt_init init, int trainable) {
  char full[160];
  dt_result r = dt__nn_name(full, sizeof full, fn, name, suffix);
  if (r != DTRAIN_OK) return r;
  return trainable ? dt_params_add(p, full, ndim, shape, init) : dt_params_add_buffer(p, full, ndim, shape, init);
}

#define DT__NN_TRY(idx_expr, dst)  \
  do {                             \
    int r_ = (idx_expr);           \
    if (r_ < 0) return (dt_result)r_; \
    (dst) = r_;                    \
  } while (0)

/* ---- linear ------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_linear_init(dt_nn_linear *l, dt_params *p, const char *name,
                                       int64_t in, int64_t out, int bias) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_linear_init: NULL argument");
  if (in <= 0 || out <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_linear_init('%s'): in=%lld out=%lld (must be >= 1)",
                     name ? name : "", (long long)in, (long long)out);
  int64_t ws[2], bs[1];
  ws[0] = out; ws[1] = in; bs[0] = out;
  l->in = in;
  l->out = out;
  l->b = -1;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_linear_init", name, "weight", 2, ws, dt_init_glorot_uniform(), 1), l->w);
  if (bias) DT__NN_TRY(dt__nn_add(p, "dt_nn_linear_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_linear_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_linear_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_linear_forward: layer is NULL");
  return dt_linear(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL);
}

DTRAIN_API dt_tensor *dt_nn_linear_relu_forward(dt_graph *g, const dt_nn_linear *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_linear_relu_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_linear_relu_forward: layer is NULL");
  return dt_linear_relu(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL);
}

/* ---- conv2d ---------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_conv2d_init(dt_nn_conv2d *l, dt_params *p, const char *name, int in, int out,
                                       int kernel, int stride, int padding, int bias) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_conv2d_init: NULL argument");
  if (in <= 0 || out <= 0 || kernel <= 0 || stride <= 0 || padding < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG,
                     "dt_nn_conv2d_init('%s'): in=%d out=%d kernel=%d stride=%d padding=%d out of range",
                     name ? name : "", in, out, kernel, stride, padding);
  int64_t ws[4], bs[1];
  ws[0] = out; ws[1] = in; ws[2] = kernel; ws[3] = kernel; bs[0] = out;
  l->in = in;
  l->out = out;
  l->kernel = kernel;
  l->stride = stride;
  l->padding = padding;
  l->b = -1;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_conv2d_init", name, "weight", 4, ws, dt_init_he_uniform(), 1), l->w);
  if (bias) DT__NN_TRY(dt__nn_add(p, "dt_nn_conv2d_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_conv2d_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_conv2d_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_conv2d_forward: layer is NULL");
  return dt_conv2d(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL, l->stride, l->padding);
}

DTRAIN_API dt_tensor *dt_nn_conv2d_relu_forward(dt_graph *g, const dt_nn_conv2d *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_conv2d_relu_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_conv2d_relu_forward: layer is NULL");
  return dt_conv2d_relu(g, x, dt_param(g, l->w), l->b >= 0 ? dt_param(g, l->b) : NULL, l->stride, l->padding);
}

/* ---- embedding ---------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_embedding_init(dt_nn_embedding *l, dt_params *p, const char *name,
                                          int64_t vocab, int64_t dim) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_embedding_init: NULL argument");
  if (vocab <= 0 || dim <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_embedding_init('%s'): vocab=%lld dim=%lld (must be >= 1)",
                     name ? name : "", (long long)vocab, (long long)dim);
  int64_t s[2];
  s[0] = vocab; s[1] = dim;
  l->vocab = vocab;
  l->dim = dim;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_embedding_init", name, "weight", 2, s, dt_init_normal(0.0f, 1.0f), 1), l->w);
  dt_params_set_decay(p, l->w, 0);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_embedding_forward(dt_graph *g, const dt_nn_embedding *l, const int32_t *ids, int64_t n) {
  if (!dt__begin(g, "dt_nn_embedding_forward", 0)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_embedding_forward: layer is NULL");
  return dt_embedding(g, dt_param(g, l->w), ids, n);
}

/* ---- layer norm ------------------------------------------------------------------------------ */

DTRAIN_API dt_result dt_nn_layer_norm_init(dt_nn_layer_norm *l, dt_params *p, const char *name, int64_t dim) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_layer_norm_init: NULL argument");
  if (dim <= 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_layer_norm_init('%s'): dim=%lld", name ? name : "", (long long)dim);
  int64_t s[1];
  s[0] = dim;
  l->dim = dim;
  l->eps = 1e-5f;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_layer_norm_init", name, "weight", 1, s, dt_init_constant(1.0f), 1), l->gamma);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_layer_norm_init", name, "bias", 1, s, dt_init_zeros(), 1), l->beta);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_layer_norm_forward(dt_graph *g, const dt_nn_layer_norm *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_layer_norm_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_layer_norm_forward: layer is NULL");
  return dt_layer_norm(g, x, dt_param(g, l->gamma), dt_param(g, l->beta), l->eps);
}

/* ---- batch norm ------------------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_batch_norm_init(dt_nn_batch_norm *l, dt_params *p, const char *name, int64_t channels) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_batch_norm_init: NULL argument");
  if (channels <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_batch_norm_init('%s'): channels=%lld", name ? name : "", (long long)channels);
  int64_t s[1];
  s[0] = channels;
  l->channels = channels;
  l->momentum = 0.1f;
  l->eps = 1e-5f;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "weight", 1, s, dt_init_constant(1.0f), 1), l->gamma);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "bias", 1, s, dt_init_zeros(), 1), l->beta);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "running_mean", 1, s, dt_init_zeros(), 0), l->mean);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_batch_norm_init", name, "running_var", 1, s, dt_init_constant(1.0f), 0), l->var);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_batch_norm_forward(dt_graph *g, const dt_nn_batch_norm *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_batch_norm_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_batch_norm_forward: layer is NULL");
  return dt_batch_norm(g, x, dt_param(g, l->gamma), dt_param(g, l->beta), dt_param(g, l->mean),
                       dt_param(g, l->var), l->momentum, l->eps);
}

/* ---- recurrent cells ------------------------------------------------------------------------------
 * Weights ~ U(-1/sqrt(H), 1/sqrt(H)) as in PyTorch. */

/* The two weight matrices shared by both cells: weight_ih [gates*H, in] and
 * weight_hh [gates*H, H]; fills bshape with [gates*H] for the biases. */
static dt_result dt__nn_rnn_weights(dt_params *p, const char *fn, const char *name, int64_t in, int64_t hidden,
                                    int gates, int *w_ih, int *w_hh, int64_t *bshape) {
  if (!p) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: NULL argument", fn);
  if (in <= 0 || hidden <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s('%s'): in=%lld hidden=%lld (must be >= 1)", fn, name ? name : "",
                     (long long)in, (long long)hidden);
  float k = 1.0f / sqrtf((float)hidden);
  int64_t wi[2], wh[2];
  wi[0] = gates * hidden; wi[1] = in;
  wh[0] = gates * hidden; wh[1] = hidden;
  bshape[0] = gates * hidden;
  DT__NN_TRY(dt__nn_add(p, fn, name, "weight_ih", 2, wi, dt_init_uniform(-k, k), 1), *w_ih);
  DT__NN_TRY(dt__nn_add(p, fn, name, "weight_hh", 2, wh, dt_init_uniform(-k, k), 1), *w_hh);
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_lstm_cell_init(dt_nn_lstm_cell *l, dt_params *p, const char *name,
                                          int64_t in, int64_t hidden) {
  int64_t bs[1];
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_lstm_cell_init: NULL argument");
  dt_result r = dt__nn_rnn_weights(p, "dt_nn_lstm_cell_init", name, in, hidden, 4, &l->w_ih, &l->w_hh, bs);
  if (r != DTRAIN_OK) return r;
  l->in = in;
  l->hidden = hidden;
  DT__NN_TRY(dt__nn_add(p, "dt_nn_lstm_cell_init", name, "bias", 1, bs, dt_init_zeros(), 1), l->b);
  /* Forget-gate bias 1: remember by default early in training. */
  dt_param_info info;
  dt_params_info(p, l->b, &info);
  float *b = dt_params_data(p) + info.offset;
  for (int64_t i = hidden; i < 2 * hidden; i++) b[i] = 1.0f;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_lstm_cell_forward(dt_graph *g, const dt_nn_lstm_cell *l, dt_tensor *x, dt_tensor *h,
                                             dt_tensor *c, dt_tensor **h_out, dt_tensor **c_out) {
  if (h_out) *h_out = NULL;
  if (c_out) *c_out = NULL;
  if (!dt__begin(g, "dt_nn_lstm_cell_forward", 1, x)) return g ? g->err : DTRAIN_ERR_NULL_ARG;
  if (!l || !h_out || !c_out) {
    dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_lstm_cell_forward: layer or output pointer is NULL");
    return g->err;
  }
  dt_tensor *gates = dt_linear(g, x, dt_param(g, l->w_ih), dt_param(g, l->b));
  if (h) gates = dt_add(g, gates, dt_linear(g, h, dt_param(g, l->w_hh), NULL));
  dt_tensor *parts[4] = {NULL, NULL, NULL, NULL};
  if (dt_split(g, gates, -1, 4, parts) != DTRAIN_OK) return g->err;
  dt_tensor *ig = dt_sigmoid(g, parts[0]);
  dt_tensor *fg = dt_sigmoid(g, parts[1]);
  dt_tensor *gg = dt_tanh(g, parts[2]);
  dt_tensor *og = dt_sigmoid(g, parts[3]);
  dt_tensor *cn = dt_mul(g, ig, gg);
  if (c) cn = dt_add(g, dt_mul(g, fg, c), cn);
  dt_tensor *hn = dt_mul(g, og, dt_tanh(g, cn));
  if (g->err != DTRAIN_OK) return g->err;
  *h_out = hn;
  *c_out = cn;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_nn_gru_cell_init(dt_nn_gru_cell *l, dt_params *p, const char *name,
                                         int64_t in, int64_t hidden) {
  int64_t bs[1];
  if (!l) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_gru_cell_init: NULL argument");
  dt_result r = dt__nn_rnn_weights(p, "dt_nn_gru_cell_init", name, in, hidden, 3, &l->w_ih, &l->w_hh, bs);
  if (r != DTRAIN_OK) return r;
  l->in = in;
  l->hidden = hidden;
  float k = 1.0f / sqrtf((float)hidden);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_gru_cell_init", name, "bias_ih", 1, bs, dt_init_uniform(-k, k), 1), l->b_ih);
  DT__NN_TRY(dt__nn_add(p, "dt_nn_gru_cell_init", name, "bias_hh", 1, bs, dt_init_uniform(-k, k), 1), l->b_hh);
  return DTRAIN_OK;
}

DTRAIN_API dt_tensor *dt_nn_gru_cell_forward(dt_graph *g, const dt_nn_gru_cell *l, dt_tensor *x, dt_tensor *h) {
  if (!dt__begin(g, "dt_nn_gru_cell_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_gru_cell_forward: layer is NULL");
  if (!h) h = dt_tensor_new2(g, x->shape[0], l->hidden); /* zero state */
  dt_tensor *gi = dt_linear(g, x, dt_param(g, l->w_ih), dt_param(g, l->b_ih));
  dt_tensor *gh = dt_linear(g, h, dt_param(g, l->w_hh), dt_param(g, l->b_hh));
  dt_tensor *pi[3] = {NULL, NULL, NULL}, *ph[3] = {NULL, NULL, NULL};
  if (dt_split(g, gi, -1, 3, pi) != DTRAIN_OK || dt_split(g, gh, -1, 3, ph) != DTRAIN_OK) return NULL;
  dt_tensor *r = dt_sigmoid(g, dt_add(g, pi[0], ph[0]));
  dt_tensor *z = dt_sigmoid(g, dt_add(g, pi[1], ph[1]));
  dt_tensor *n = dt_tanh(g, dt_add(g, pi[2], dt_mul(g, r, ph[2])));
  /* h' = (1 - z) * n + z * h = n + z * (h - n) */
  return dt_add(g, n, dt_mul(g, z, dt_sub(g, h, n)));
}

/* ---- causal self-attention ---------------------------------------------------------------------- */

DTRAIN_API dt_result dt_nn_attention_init(dt_nn_attention *l, dt_params *p, const char *name, int64_t dim, int heads) {
  if (!l || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_nn_attention_init: NULL argument");
  if (dim <= 0 || heads <= 0 || dim % heads != 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_nn_attention_init('%s'): dim=%lld must be a positive multiple of heads=%d",
                     name ? name : "", (long long)dim, heads);
  char sub[160];
  dt_result r;
  l->dim = dim;
  l->heads = heads;
  if ((r = dt__nn_name(sub, sizeof sub, "dt_nn_attention_init", name, "qkv")) != DTRAIN_OK) return r;
  if ((r = dt_nn_linear_init(&l->qkv, p, sub, dim, 3 * dim, 1)) != DTRAIN_OK) return r;
  if ((r = dt__nn_name(sub, sizeof sub, "dt_nn_attention_init", name, "proj")) != DTRAIN_OK) return r;
  return dt_nn_linear_init(&l->proj, p, sub, dim, dim, 1);
}

DTRAIN_API dt_tensor *dt_nn_attention_forward(dt_graph *g, const dt_nn_attention *l, dt_tensor *x) {
  if (!dt__begin(g, "dt_nn_attention_forward", 1, x)) return NULL;
  if (!l) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NULL_ARG, "dt_nn_attention_forward: layer is NULL");
  if (x->ndim != 3 || x->shape[2] != l->dim) {
    char sb[96];
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_SHAPE, "dt_nn_attention_forward: input %s, expected [B,T,%lld]",
                                 dt_shape_str(x, sb, sizeof sb), (long long)l->dim);
  }
  int64_t B = x->shape[0], T = x->shape[1], C = l->dim, H = l->heads, D = C / H;
  static const int to_heads[4] = {0, 2, 1, 3}; /* [B,T,H,D] <-> [B,H,T,D] */
  int64_t s4[4], s3[3];
  s4[0] = B; s4[1] = T; s4[2] = H; s4[3] = D;
  s3[0] = B; s3[1] = T; s3[2] = C;
  dt_tensor *qkv = dt_nn_linear_forward(g, &l->qkv, x); /* [B,T,3C] */
  dt_tensor *p[3] = {NULL, NULL, NULL};
  if (dt_split(g, qkv, 2, 3, p) != DTRAIN_OK) return NULL;
  dt_tensor *q = dt_permute(g, dt_reshape(g, p[0], 4, s4), to_heads);
  dt_tensor *k = dt_permute(g, dt_reshape(g, p[1], 4, s4), to_heads);
  dt_tensor *v = dt_permute(g, dt_reshape(g, p[2], 4, s4), to_heads);
  dt_tensor *att = dt_mul_scalar(g, dt_bmm(g, q, k, 1), 1.0f / sqrtf((float)D)); /* [B,H,T,T] */
  att = dt_softmax(g, dt_causal_mask(g, att), -1);
  dt_tensor *y = dt_bmm(g, att, v, 0);                                            /* [B,H,T,D] */
  y = dt_reshape(g, dt_permute(g, y, to_heads), 3, s3);
  return dt_nn_linear_forward(g, &l->proj, y);
}

#undef DT__NN_TRY
