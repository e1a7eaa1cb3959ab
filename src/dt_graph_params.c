/* ===========================================================================
 * dt_graph_params.c -- a graph and its params: dt_graph_create, the
 * dt_param views, the device copy of the params
 * ===========================================================================
 * Params layer. The graph itself (arena, tape, tensors: dt_tensor.c) knows
 * its params only as a pointer; whatever reads the params' layout or
 * buffers lives here, so that the tensor layer never calls up into
 * dt_params. On a device graph (dt_device.h) the graph holds its own device
 * copy of the params' flat data and grad buffers (g->dparam_*), made by
 * dt_graph_create and freed with the graph's device arena (dt_tensor.c).
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

/* The device copy of the params: two device buffers of dt_params_size
 * floats, the data uploaded and the gradient zeroed. Nothing without params. */
static dt_result dt__gparams_device_copy(dt_graph *g) {
  dt_device *d = g->device;
  size_t n = dt_params_size(g->params), bytes;
  if (n == 0) return DTRAIN_OK;
  if (!dt__mul_size(n, sizeof(float), &bytes))
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_graph_create: params too large");
  void *pd = NULL, *pg = NULL;
  dt_result r = d->alloc(d, bytes, &pd);
  if (r == DTRAIN_OK) r = d->alloc(d, bytes, &pg);
  if (r != DTRAIN_OK) {
    if (pd) d->free(d, pd, bytes);
    return dt__error(r, "dt_graph_create: device copy of the params (%zu bytes): %s", bytes, dt_last_error());
  }
  g->dparam_data = (float *)pd;
  g->dparam_grad = (float *)pg;
  g->dparam_n = n;
  return dt_graph_params_upload(g);
}

DTRAIN_API dt_graph *dt_graph_create(dt_params *params, const dt_graph_desc *desc) {
  dt__trace_env(); /* DTRAIN_TRACE: the first graph starts the run's trace */
  dt_graph *g = dt__graph_new(desc); /* checks the device's function table first */
  if (!g) return NULL;
  g->params = params;
  if (g->device && dt__gparams_device_copy(g) != DTRAIN_OK) {
    dt_graph_destroy(g);
    return NULL;
  }
  return g;
}

DTRAIN_API dt_tensor *dt_param(dt_graph *g, int index) {
  if (!dt__begin(g, "dt_param", 0)) return NULL;
  if (!g->params) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_STATE, "dt_param: graph was created without params");
  int count = dt_params_count(g->params);
  if (index < 0 || index >= count)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_INDEX, "dt_param: index %d out of range (params has %d)", index, count);
  if (g->npviews < count) {
    /* Parameters were added since the views were built: grow (setup only). */
    size_t bytes = (size_t)count * sizeof(dt_tensor);
    dt_tensor *nv = (dt_tensor *)dt__realloc(g->pviews, g->pviews_bytes, bytes);
    if (!nv) return (dt_tensor *)dt__fail(g, DTRAIN_ERR_NOMEM, "dt_param: out of memory");
    g->pviews = nv;
    g->pviews_bytes = bytes;
    g->npviews = count;
  }
  size_t off;
  int ndim, trainable;
  const int64_t *shape;
  dt__params_view(g->params, index, &off, &ndim, &shape, &trainable);
  float *data = g->bound_own ? dt_params_data(g->params) : g->bound_data;
  float *grad = g->bound_own ? dt_params_grad(g->params) : g->bound_grad;
  if (g->device && g->bound_own && dt_params_size(g->params) != g->dparam_n)
    return (dt_tensor *)dt__fail(g, DTRAIN_ERR_STATE,
                                 "dt_param: params grew since the graph was created on device %s; create it after "
                                 "adding every parameter", g->device->name);
  if (g->device && g->bound_own) { /* the graph's device copy of the params */
    data = g->dparam_data;
    grad = g->dparam_grad;
  }
  dt_tensor *t = &g->pviews[index];
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  dt__header_init(t, g, ndim, shape, n);
  t->data = data + off;
  t->grad = (grad && trainable) ? grad + off : NULL;
  t->flags = DTRAIN_TENSOR_PARAM | (t->grad ? DTRAIN_TENSOR_REQUIRES_GRAD : 0);
  t->op = "param";
  t->param_index = index;
  return t;
}

DTRAIN_API float *dt_graph_param_data(dt_graph *g) {
  if (!g) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_param_data: graph is NULL");
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_data;
  return g->device ? g->dparam_data : dt_params_data(g->params);
}

DTRAIN_API float *dt_graph_param_grad(dt_graph *g) {
  if (!g) dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_param_grad: graph is NULL");
  if (!g || !g->params) return NULL;
  if (!g->bound_own) return g->bound_grad;
  return g->device ? g->dparam_grad : dt_params_grad(g->params);
}

DTRAIN_API dt_result dt_graph_params_upload(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_upload: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_upload: params changed size since the graph was created");
  size_t bytes = g->dparam_n * sizeof(float);
  dt_result r = d->copy(d, g->dparam_data, dt_params_data(g->params), bytes, DTRAIN_COPY_H2D);
  if (r == DTRAIN_OK) r = d->zero(d, g->dparam_grad, bytes);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_upload: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_params_download(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_params_download: graph is NULL");
  if (!g->device || g->dparam_n == 0) return DTRAIN_OK;
  dt_device *d = g->device;
  if (dt_params_size(g->params) != g->dparam_n)
    return dt__error(DTRAIN_ERR_STATE, "dt_graph_params_download: params changed size since the graph was created");
  dt_result r = d->copy(d, dt_params_data(g->params), g->dparam_data, g->dparam_n * sizeof(float), DTRAIN_COPY_D2H);
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_params_download: device %s: %s", d->name, dt_last_error());
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_graph_zero_grad(dt_graph *g) {
  if (!g) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_graph_zero_grad: graph is NULL");
  float *grad = dt_graph_param_grad(g);
  size_t n = dt_params_size(g->params);
  g->ngstale = 0;
  if (!grad || n == 0) return DTRAIN_OK;
  if (!g->device) {
    memset(grad, 0, n * sizeof(float));
    return DTRAIN_OK;
  }
  dt_result r = g->device->zero(g->device, grad, n * sizeof(float));
  if (r != DTRAIN_OK) return dt__error(r, "dt_graph_zero_grad: device %s: %s", g->device->name, dt_last_error());
  return DTRAIN_OK;
}

/* ---- the gradient zeroed lazily (see dt_params_internal.h) ---------------------------------- */

/* Parameter i's range in the flat buffer; 0 past the last. */
static int dt__gparams_range(const dt_graph *g, int i, size_t *b, size_t *e, int *trainable) {
  int decay;
  return dt__params_range(g->params, i, b, e, trainable, &decay);
}

DTRAIN_PRIVATE dt_result dt__graph_grad_defer(dt_graph *g) {
  float *grad = g->device ? NULL : dt_graph_param_grad(g);
  int count = g->params ? dt_params_count(g->params) : 0;
  if (!grad || count <= 0) return dt_graph_zero_grad(g);
  if (count > g->gstale_cap) {
    uint8_t *ns = (uint8_t *)dt__realloc(g->gstale, (size_t)g->gstale_cap, (size_t)count);
    if (!ns) return dt_graph_zero_grad(g); /* no marks: zeroed now, as before */
    g->gstale = ns;
    g->gstale_cap = count;
  }
  size_t pos = 0, b, e;
  int tr;
  for (int i = 0; dt__gparams_range(g, i, &b, &e, &tr); i++) {
    if (b > pos) memset(grad + pos, 0, (b - pos) * sizeof(float)); /* padding */
    g->gstale[i] = (uint8_t)(tr ? 1 : 0);
    if (!tr && e > b) memset(grad + b, 0, (e - b) * sizeof(float));
    pos = e;
  }
  size_t n = dt_params_size(g->params);
  if (n > pos) memset(grad + pos, 0, (n - pos) * sizeof(float));
  g->ngstale = count;
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__graph_grad_settle(dt_graph *g) {
  if (g->ngstale <= 0) return;
  float *grad = dt_graph_param_grad(g);
  size_t b, e;
  int tr;
  for (int i = 0; i < g->ngstale && dt__gparams_range(g, i, &b, &e, &tr); i++)
    if (g->gstale[i] && e > b) memset(grad + b, 0, (e - b) * sizeof(float));
  g->ngstale = 0;
}
