/* ===========================================================================
 * dt_checkpoint.c -- training checkpoints as safetensors: atomic save,
 * validated load
 * ===========================================================================
 * Sections: a JSON writer, optimizer state names, save, load. Reading the
 * file and its index is dt_safetensors.c's part.
 *
 * Load never changes the model until everything is checked: the whole file is
 * read into memory (the scratch copy), parsed and validated against the model,
 * and only then are the floats decoded into the params, the optimizer state
 * and the RNGs (a step that cannot fail).
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_optim_internal.h"
#include "dt_json.h"
#include "dt_safetensors.h"
#include "dt_file.h"

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#endif

#ifndef DTRAIN_NO_STDIO

#define DT__IO_HEX_RNG 64 /* hex digits of a 4 x 64-bit RNG state */

/* ---- JSON writer: a growable byte buffer -------------------------------------------- */

DTRAIN_PRIVATE void dt__io_buf_put(dt__io_buf *b, const void *s, size_t n) {
  if (b->nomem) return;
  if (b->len + n + 1 > b->cap) {
    size_t ncap = b->cap ? b->cap : 256;
    while (ncap < b->len + n + 1) ncap *= 2;
    char *np = (char *)dt__realloc(b->p, b->cap, ncap);
    if (!np) {
      b->nomem = 1;
      return;
    }
    b->p = np;
    b->cap = ncap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

DTRAIN_PRIVATE void dt__io_buf_str(dt__io_buf *b, const char *s) { dt__io_buf_put(b, s, strlen(s)); }

DTRAIN_PRIVATE void dt__io_buf_u64(dt__io_buf *b, uint64_t v) {
  char tmp[24];
  snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  dt__io_buf_str(b, tmp);
}

/* Quoted JSON string; s must be valid UTF-8 (checked by the caller). */
DTRAIN_PRIVATE void dt__io_buf_jstr(dt__io_buf *b, const char *s) {
  static const char hex[] = "0123456789abcdef";
  dt__io_buf_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[7];
    switch (*p) {
      case '"': dt__io_buf_put(b, "\\\"", 2); break;
      case '\\': dt__io_buf_put(b, "\\\\", 2); break;
      case '\n': dt__io_buf_put(b, "\\n", 2); break;
      case '\r': dt__io_buf_put(b, "\\r", 2); break;
      case '\t': dt__io_buf_put(b, "\\t", 2); break;
      default:
        if (*p < 0x20) {
          esc[0] = '\\'; esc[1] = 'u'; esc[2] = '0'; esc[3] = '0';
          esc[4] = hex[*p >> 4]; esc[5] = hex[*p & 15]; esc[6] = '\0';
          dt__io_buf_put(b, esc, 6);
        } else {
          dt__io_buf_put(b, p, 1);
        }
    }
  }
  dt__io_buf_put(b, "\"", 1);
}

DTRAIN_PRIVATE void dt__io_buf_free(dt__io_buf *b) {
  dt__free(b->p, b->cap);
  b->p = NULL;
  b->len = b->cap = 0;
}

DTRAIN_PRIVATE int dt__io_valid_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      i++;
      continue;
    }
    size_t bad;
    int len = dt__json_utf8(p + i, n - i, &bad);
    if (len <= 0) return 0;
    i += (size_t)len;
  }
  return 1;
}

/* ---- optimizer slots --------------------------------------------------------------------- */

/* The optimizers' names come from their table (dt_optim.c, asked through
 * dt_optim_internal.h), so a new optimizer needs no case here. */
static const char *dt__io_kind_name(dt_optim_kind k) {
  const char *n = dt__optim_kind_name(k);
  return n ? n : "unknown";
}

/* PyTorch's name of state slot s of an optimizer of this kind. */
static const char *dt__io_slot_name(dt_optim_kind k, int s) {
  const char *n = dt__optim_slot_name(k, s);
  return n ? n : "unknown";
}

/* The slot name of some optimizer that s[0, len) spells, or NULL. */
static const char *dt__io_known_slot(const char *s, size_t len) {
  for (int k = 0; dt__optim_kind_name((dt_optim_kind)k); k++)
    for (int i = 0; i < 2; i++) {
      const char *n = dt__optim_slot_name((dt_optim_kind)k, i);
      if (n && strlen(n) == len && strncmp(s, n, len) == 0) return n;
    }
  return NULL;
}

/* "optim.<slot>.<param>": returns the param part and the slot's name (one
 * that some optimizer has), or NULL when name is not of that form. */
DTRAIN_PRIVATE const char *dt__io_split_optim(const char *name, const char **slot) {
  if (strncmp(name, "optim.", 6) != 0) return NULL;
  const char *s = name + 6, *dot = strchr(s, '.');
  if (!dot) return NULL;
  *slot = dt__io_known_slot(s, (size_t)(dot - s));
  return *slot ? dot + 1 : NULL;
}

/* The optimizer's state must cover the params' layout (it was created for
 * them): dt_optim_update on the empty range [n, n) checks exactly that. */
static dt_result dt__io_check_optim(const dt__io_ctx *ctx, dt_optim *o, dt_params *p) {
  size_t n = dt_params_size(p);
  if (!o || dt_optim_update(o, NULL, NULL, n, n) == DTRAIN_OK) return DTRAIN_OK;
  return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "the optimizer was not created for these params (%zu floats)", n);
}

/* ---- save ---------------------------------------------------------------------------------- */

static void dt__io_hex_rng(char *out, const uint64_t s[4]) {
  for (int i = 0; i < 4; i++) snprintf(out + 16 * i, 17, "%016llx", (unsigned long long)s[i]);
}

/* Streams the tensors' bytes (little-endian) to f, or into the hasher when f is NULL. */
static int dt__io_stream_data(FILE *f, dt__io_hasher *h, const dt__io_out *outs, int nout) {
  unsigned char stage[16384];
  const size_t per = sizeof stage / 4;
  for (int t = 0; t < nout; t++) {
    for (size_t i = 0; i < outs[t].n; i += per) {
      size_t k = DT__MIN(per, outs[t].n - i);
      dt__put_f32le(stage, outs[t].src + i, k);
      if (f) {
        if (fwrite(stage, 1, 4 * k, f) != 4 * k) return 0;
      } else {
        dt__io_hash(h, stage, 4 * k);
      }
    }
  }
  return 1;
}

/* Write [len][header][data] through the shared atomic writer (dt_file.h):
 * a temporary file created exclusively next to path, fsynced, renamed over
 * path, the directory fsynced. */
static dt_result dt__io_write_atomic(const dt__io_ctx *ctx, const dt__io_buf *header, const dt__io_out *outs,
                                     int nout) {
  dt__file_out fo;
  unsigned char len8[8];
  dt_result r = dt__file_create(&fo, ctx->path);
  if (r != DTRAIN_OK) return dt__io_err(ctx, r, "%s", fo.msg);
  dt__put_le64(len8, (uint64_t)header->len);
  if (fwrite(len8, 1, 8, fo.f) != 8 || fwrite(header->p, 1, header->len, fo.f) != header->len ||
      !dt__io_stream_data(fo.f, NULL, outs, nout)) {
    int saved = errno;
    r = dt__io_err(ctx, DTRAIN_ERR_IO, "write to '%s' failed: %s", fo.tmp, strerror(saved));
    dt__file_abort(&fo);
    return r;
  }
  r = dt__file_commit(&fo);
  return r == DTRAIN_OK ? r : dt__io_err(ctx, r, "%s", fo.msg);
}

/* Shortest of %.6g / %.9g that reads back as the same float. */
static void dt__io_fmt_float(char *buf, size_t cap, float v) {
  snprintf(buf, cap, "%.6g", (double)v);
  if ((float)strtod(buf, NULL) != v) snprintf(buf, cap, "%.9g", (double)v);
}

/* Optimizer settings as a JSON object (a metadata string). */
static void dt__io_optim_json(dt__io_buf *b, const dt_optim_desc *d, int nslots) {
  static const char *const sched[3] = {"constant", "step", "cosine"};
  const char *names[9] = {"lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "alpha", "clip_norm", "min_lr"};
  float vals[9];
  char tmp[96];
  vals[0] = d->lr; vals[1] = d->momentum; vals[2] = d->weight_decay; vals[3] = d->beta1; vals[4] = d->beta2;
  vals[5] = d->eps; vals[6] = d->alpha; vals[7] = d->clip_norm; vals[8] = d->schedule.min_lr;
  snprintf(tmp, sizeof tmp, "{\"kind\":\"%s\",\"slots\":%d,\"nesterov\":%d", dt__io_kind_name(d->kind), nslots,
           d->nesterov);
  dt__io_buf_str(b, tmp);
  for (int i = 0; i < 8; i++) {
    char num[32];
    dt__io_fmt_float(num, sizeof num, vals[i]);
    snprintf(tmp, sizeof tmp, ",\"%s\":%s", names[i], num);
    dt__io_buf_str(b, tmp);
  }
  {
    int k = (int)d->schedule.kind;
    char g[32], lo[32];
    dt__io_fmt_float(g, sizeof g, d->schedule.gamma);
    dt__io_fmt_float(lo, sizeof lo, vals[8]);
    snprintf(tmp, sizeof tmp, ",\"schedule\":{\"kind\":\"%s\",\"warmup_steps\":%lld,",
             k >= 0 && k < 3 ? sched[k] : "unknown", (long long)d->schedule.warmup_steps);
    dt__io_buf_str(b, tmp);
    snprintf(tmp, sizeof tmp, "\"step_size\":%lld,\"gamma\":%s,", (long long)d->schedule.step_size, g);
    dt__io_buf_str(b, tmp);
    snprintf(tmp, sizeof tmp, "\"total_steps\":%lld,\"min_lr\":%s}}", (long long)d->schedule.total_steps, lo);
    dt__io_buf_str(b, tmp);
  }
}

/* Writes a safetensors file at ctx->path atomically (dt_safetensors.h). */
DTRAIN_PRIVATE dt_result dt__io_write_file(const dt__io_ctx *ctx, dt__io_out *outs, int nout, const char *names,
                                           const char **mk, const char **mv, int nm) {
  dt__io_buf header;
  dt_checkpoint view;
  const char **onames = NULL;
  int *order = NULL;
  dt_result r = DTRAIN_OK;
  uint64_t off = 0;
  memset(&header, 0, sizeof header);
  memset(&view, 0, sizeof view);
  for (int t = 0; t < nout; t++) {
    outs[t].begin = off;
    off += (uint64_t)outs[t].n * 4u;
    outs[t].end = off;
  }
  /* Checksum over the canonical index (a dt_checkpoint view) and the data. */
  onames = (const char **)dt__alloc((size_t)(nout > 0 ? nout : 1) * sizeof(char *));
  view.entries = (dt__io_entry *)dt__calloc((size_t)(nout > 0 ? nout : 1) * sizeof(dt__io_entry));
  if (!onames || !view.entries) {
    r = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int t = 0; t < nout; t++) {
    dt__io_entry *e = &view.entries[t];
    onames[t] = e->name = names + outs[t].name_off;
    e->dtype = "F32";
    e->dsize = 4;
    e->ndim = outs[t].ndim;
    memcpy(e->shape, outs[t].shape, sizeof e->shape);
    e->begin = outs[t].begin;
    e->end = outs[t].end;
  }
  view.nentries = nout;
  view.by_name = dt__io_sorted_index(onames, nout);
  view.mkeys = mk;
  view.mvals = mv;
  view.nmeta = nm;
  order = dt__io_sorted_index(mk, nm);
  if (!view.by_name || !order) {
    r = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  {
    /* The checksum a reader computes (dt__io_checksum), with the data
     * streamed from memory; mk has no "checksum" key yet. */
    dt__io_hasher h;
    char sum[17];
    dt__io_hash_init(&h);
    dt__io_hash_index(&h, &view, order);
    dt__io_stream_data(NULL, &h, outs, nout);
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)dt__io_hash_final(&h));

    /* Header JSON. */
    dt__io_buf_str(&header, "{\"__metadata__\":{");
    for (int k = 0; k < nm; k++) {
      dt__io_buf_jstr(&header, mk[k]);
      dt__io_buf_str(&header, ":");
      dt__io_buf_jstr(&header, mv[k]);
      dt__io_buf_str(&header, ",");
    }
    dt__io_buf_str(&header, "\"checksum\":");
    dt__io_buf_jstr(&header, sum);
    dt__io_buf_str(&header, "}");
  }
  for (int t = 0; t < nout; t++) {
    dt__io_buf_str(&header, ",");
    dt__io_buf_jstr(&header, names + outs[t].name_off);
    dt__io_buf_str(&header, ":{\"dtype\":\"F32\",\"shape\":[");
    for (int d = 0; d < outs[t].ndim; d++) {
      if (d) dt__io_buf_str(&header, ",");
      dt__io_buf_u64(&header, (uint64_t)outs[t].shape[d]);
    }
    dt__io_buf_str(&header, "],\"data_offsets\":[");
    dt__io_buf_u64(&header, outs[t].begin);
    dt__io_buf_str(&header, ",");
    dt__io_buf_u64(&header, outs[t].end);
    dt__io_buf_str(&header, "]}");
  }
  dt__io_buf_str(&header, "}");
  /* Pad so that the data starts 8-byte aligned; a buffer that could not grow
   * (nomem) keeps its length, so the loop must stop on that too. */
  while (!header.nomem && (8 + header.len) % 8 != 0) dt__io_buf_str(&header, " ");
  if (header.nomem) {
    r = dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for the header");
    goto done;
  }
  if (header.len > (size_t)DTRAIN_CHECKPOINT_MAX_HEADER) {
    r = dt__io_err(ctx, DTRAIN_ERR_OVERFLOW, "header of %zu bytes exceeds the limit", header.len);
    goto done;
  }
  r = dt__io_write_atomic(ctx, &header, outs, nout);

done:
  dt__free(view.entries, (size_t)(nout > 0 ? nout : 1) * sizeof(dt__io_entry));
  dt__free(view.by_name, (size_t)(nout > 0 ? nout : 1) * sizeof(int));
  dt__free(order, (size_t)(nm > 0 ? nm : 1) * sizeof(int));
  dt__free((void *)onames, (size_t)(nout > 0 ? nout : 1) * sizeof(char *));
  dt__io_buf_free(&header);
  return r;
}

#define DT__IO_NMETA 14

DTRAIN_PRIVATE dt_result dt__io_save(const char *path, const dt_train_state *st, const char *fn, const char *const *xk,
                                     const char *const *xv, int nx) {
  dt__io_ctx ctx;
  ctx.fn = fn;
  ctx.path = path ? path : "(null)";
  if (!path || !st || !st->params)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !path ? "path" : !st ? "state" : "params");
  if (nx < 0 || nx > DT__IO_MAX_EXTRA) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d extra metadata", fn, nx);
  dt_params *p = st->params;
  dt_optim *o = st->optim;
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  const dt_optim_desc *od = o ? dt_optim_get_options(o) : NULL;
  float *data = dt_params_data(p);
  dt__io_buf names, optjson;
  dt__io_out *outs = NULL;
  size_t outs_cap = 0;
  int nout = 0, ntrain = 0;
  dt_result r = DTRAIN_OK;
  const char *mk[DT__IO_NMETA + DT__IO_MAX_EXTRA], *mv[DT__IO_NMETA + DT__IO_MAX_EXTRA];
  char vbuf[DT__IO_NMETA][72];
  char prng[DT__IO_HEX_RNG + 1], grng[DT__IO_HEX_RNG + 1];
  int nm = 0;
  memset(&names, 0, sizeof names);
  memset(&optjson, 0, sizeof optjson);

  r = dt__io_check_optim(&ctx, o, p);
  if (r != DTRAIN_OK) goto done;
  if (st->config && !dt__io_valid_utf8(st->config)) {
    r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "config is not valid UTF-8");
    goto done;
  }
  if (st->step < 0 || st->epoch < 0 || st->data_epoch < 0 || st->data_index < 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "step, epoch and data position must be >= 0");
    goto done;
  }
  for (int i = 0; i < np; i++) {
    dt_param_info info;
    dt_params_info(p, i, &info);
    if (info.trainable) ntrain++;
  }
  outs_cap = (size_t)np + (size_t)nslots * (size_t)ntrain;
  outs = (dt__io_out *)dt__calloc((outs_cap > 0 ? outs_cap : 1) * sizeof(dt__io_out));
  if (!outs) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  /* A device run: the device's params and optimizer state come to the host
   * first (dt_optim_state copies a device slot to its host copy). */
  if (st->graph && st->graph->device && st->graph->params == p) {
    r = dt_graph_params_download(st->graph);
    if (r != DTRAIN_OK) {
      r = dt__io_err(&ctx, r, "%s", dt_last_error());
      goto done;
    }
  }
  for (int s = 0; s < nslots; s++) {
    if (!dt_optim_state(o, s)) {
      r = dt__io_err(&ctx, dt_last_result(), "%s", dt_last_error());
      goto done;
    }
  }
  /* Tensors: parameters and buffers, then optimizer slots. */
  for (int s = -1; s < nslots; s++) {
    const float *base = s < 0 ? data : dt_optim_state(o, s);
    for (int i = 0; i < np; i++) {
      dt_param_info info;
      dt_params_info(p, i, &info);
      if (s >= 0 && !info.trainable) continue;
      dt__io_out *t = &outs[nout++];
      t->name_off = names.len;
      if (s < 0) {
        if (!dt__io_valid_utf8(info.name) || strcmp(info.name, "__metadata__") == 0) {
          r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "parameter name '%s' cannot be a safetensors name", info.name);
          goto done;
        }
      } else {
        dt__io_buf_str(&names, "optim.");
        dt__io_buf_str(&names, dt__io_slot_name(od->kind, s));
        dt__io_buf_str(&names, ".");
      }
      dt__io_buf_put(&names, info.name, strlen(info.name) + 1);
      t->src = base + info.offset;
      t->n = info.size;
      t->ndim = info.ndim;
      memcpy(t->shape, info.shape, sizeof t->shape);
    }
  }
  if (names.nomem) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  /* A parameter must not be named like another one's optimizer state. */
  for (int t = np; t < nout; t++)
    if (dt_params_find(p, names.p + outs[t].name_off) >= 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "parameter name '%s' collides with optimizer state",
                     names.p + outs[t].name_off);
      goto done;
    }

  /* Metadata. */
  {
    dt_rng *pr = dt_params_rng(p);
    uint64_t gs[4];
    mk[nm] = "format"; mv[nm++] = "dtrain";
    snprintf(vbuf[nm], sizeof vbuf[nm], "%d", DTRAIN_CHECKPOINT_VERSION);
    mk[nm] = "format_version"; mv[nm] = vbuf[nm]; nm++;
    mk[nm] = "dtrain_version"; mv[nm++] = DTRAIN_VERSION_STRING;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)(o ? dt_optim_steps(o) : st->step));
    mk[nm] = "step"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->epoch);
    mk[nm] = "epoch"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->data_epoch);
    mk[nm] = "data_epoch"; mv[nm] = vbuf[nm]; nm++;
    snprintf(vbuf[nm], sizeof vbuf[nm], "%lld", (long long)st->data_index);
    mk[nm] = "data_index"; mv[nm] = vbuf[nm]; nm++;
    dt__io_hex_rng(prng, pr->s);
    mk[nm] = "params_rng"; mv[nm++] = prng;
    if (st->graph) {
      dt_graph_rng_state(st->graph, gs);
      dt__io_hex_rng(grng, gs);
      mk[nm] = "graph_rng"; mv[nm++] = grng;
    }
    if (o) {
      dt__io_optim_json(&optjson, od, nslots);
      if (optjson.nomem) {
        r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
        goto done;
      }
      mk[nm] = "optimizer"; mv[nm++] = optjson.p;
    }
    snprintf(vbuf[nm], sizeof vbuf[nm], "%016llx", (unsigned long long)dt_params_layout_hash(p));
    mk[nm] = "layout_hash"; mv[nm] = vbuf[nm]; nm++;
    mk[nm] = "config"; mv[nm++] = st->config ? st->config : "";
    for (int k = 0; k < nx; k++) {
      mk[nm] = xk[k]; mv[nm++] = xv[k];
    }
  }

  r = dt__io_write_file(&ctx, outs, nout, names.p, mk, mv, nm);

done:
  dt__free(outs, (outs_cap > 0 ? outs_cap : 1) * sizeof(dt__io_out));
  dt__io_buf_free(&names);
  dt__io_buf_free(&optjson);
  return r;
}

static dt_result dt__checkpoint_save(const char *path, const dt_train_state *st);

DTRAIN_API dt_result dt_checkpoint_save(const char *path, const dt_train_state *st) {
  int64_t t0 = dt__prof_t0();
  dt_result r = dt__checkpoint_save(path, st);
  dt__prof_add("dt_checkpoint_save", DTRAIN_PROFILE_CHECKPOINT, t0);
  return r;
}

static dt_result dt__checkpoint_save(const char *path, const dt_train_state *st) {
  return dt__io_save(path, st, "dt_checkpoint_save", NULL, NULL, 0);
}

/* ---- load ------------------------------------------------------------------------------------ */

DTRAIN_PRIVATE int dt__io_parse_i64(const char *s, int64_t *out) {
  int64_t v = 0;
  if (!*s) return 0;
  for (const char *q = s; *q; q++) {
    if (*q < '0' || *q > '9') return 0;
    if (v > (INT64_MAX - (*q - '0')) / 10) return 0;
    v = v * 10 + (*q - '0');
  }
  if (s[0] == '0' && s[1]) return 0;
  *out = v;
  return 1;
}

static int dt__io_parse_rng(const char *s, uint64_t out[4]) {
  char part[17];
  if (strlen(s) != DT__IO_HEX_RNG) return 0;
  for (int i = 0; i < 4; i++) {
    memcpy(part, s + 16 * i, 16);
    part[16] = '\0';
    if (!dt__io_parse_hex64(part, &out[i])) return 0;
  }
  return 1;
}

/* Checks that the entries fit the model. entry_of[i]: entry of parameter i.
 * With optim: every trainable parameter has each slot of its kind (slot_of[s][i]). */
static dt_result dt__io_match(const dt_checkpoint *c, const dt__io_ctx *ctx, dt_params *p, dt_optim *o,
                              int *entry_of, int *slot_entry) {
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  const dt_optim_desc *od = o ? dt_optim_get_options(o) : NULL;
  char s1[96], s2[96];
  for (int i = 0; i < np; i++) {
    dt_param_info info;
    dt_params_info(p, i, &info);
    for (int s = -1; s < nslots; s++) {
      char name[192];
      if (s >= 0 && !info.trainable) continue;
      if (s < 0) snprintf(name, sizeof name, "%s", info.name);
      else snprintf(name, sizeof name, "optim.%s.%s", dt__io_slot_name(od->kind, s), info.name);
      int e = dt__io_find(c, name);
      if (e < 0)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "%s '%s' is missing from the checkpoint",
                          s < 0 ? "parameter" : "optimizer state", name);
      const dt__io_entry *en = &c->entries[e];
      int same = en->ndim == info.ndim;
      for (int d = 0; same && d < info.ndim; d++) same = en->shape[d] == info.shape[d];
      if (!same)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' has shape %s in the checkpoint but %s in the model",
                          name, dt__shape_text(en->ndim, en->shape, s1, sizeof s1),
                          dt__shape_text(info.ndim, info.shape, s2, sizeof s2));
      if (s < 0) entry_of[i] = e;
      else slot_entry[(size_t)s * (size_t)np + (size_t)i] = e;
    }
  }
  /* Every tensor known: a parameter, or optimizer state of a trainable
   * parameter (of this optimizer's kind when one is given). */
  for (int e = 0; e < c->nentries; e++) {
    const char *name = c->entries[e].name;
    const char *slot = NULL;
    int pi;
    if (dt_params_find(p, name) >= 0) continue;
    const char *pname = dt__io_split_optim(name, &slot);
    if (!pname || (pi = dt_params_find(p, pname)) < 0)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "unknown tensor '%s' (not a parameter of this model)", name);
    if (o) {
      int ok = 0;
      for (int s = 0; s < nslots; s++) ok |= strcmp(slot, dt__io_slot_name(od->kind, s)) == 0;
      if (!ok)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' is state of another optimizer (this one is %s with %d slots)",
                          name, dt__io_kind_name(od->kind), nslots);
    }
  }
  return DTRAIN_OK;
}

static dt_result dt__io_load(const char *path, const char *fn, dt_train_state *st, dt_params *p, int full) {
  dt__io_ctx ctx;
  ctx.fn = fn;
  ctx.path = path ? path : "(null)";
  if (!path || !p) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !path ? "path" : "params");
  dt_result r;
  dt_checkpoint *c = dt__io_open(&ctx, 1, &r);
  if (!c) return r;
  dt_optim *o = full ? st->optim : NULL;
  const int np = dt_params_count(p);
  const int nslots = o ? dt_optim_state_slots(o) : 0;
  size_t nent = (size_t)(np > 0 ? np : 1), nslot_ent = (size_t)(nslots > 0 ? nslots : 1) * nent;
  int *entry_of = (int *)dt__calloc(nent * sizeof(int));
  int *slot_entry = (int *)dt__calloc(nslot_ent * sizeof(int));
  int64_t step = 0, epoch = 0, data_epoch = 0, data_index = 0;
  uint64_t prng[4], grng[4];
  if (!entry_of || !slot_entry) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  r = dt__io_check_optim(&ctx, o, p);
  if (r != DTRAIN_OK) goto done;
  if (full) {
    static const char *const ints[4] = {"step", "epoch", "data_epoch", "data_index"};
    int64_t *dst[4];
    const char *v;
    dst[0] = &step; dst[1] = &epoch; dst[2] = &data_epoch; dst[3] = &data_index;
    if (!c->is_dtrain) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT,
                     "not a dtrain checkpoint (metadata 'format' is not \"dtrain\"); dt_checkpoint_load_weights reads weights only");
      goto done;
    }
    v = dt__io_meta_get(c, "format_version");
    if (!v || strcmp(v, "1") != 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "unsupported format_version '%s' (this build reads 1)", v ? v : "(none)");
      goto done;
    }
    for (int k = 0; k < 4; k++) {
      v = dt__io_meta_get(c, ints[k]);
      if (!v || !dt__io_parse_i64(v, dst[k])) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata '%s' is %s", ints[k], v ? "not a non-negative integer" : "missing");
        goto done;
      }
    }
    v = dt__io_meta_get(c, "params_rng");
    if (!v || !dt__io_parse_rng(v, prng)) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'params_rng' is %s", v ? "not 64 hex digits" : "missing");
      goto done;
    }
    if (st->graph) {
      v = dt__io_meta_get(c, "graph_rng");
      if (!v) {
        r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint has no graph RNG state (saved without a graph); load with graph = NULL");
        goto done;
      }
      if (!dt__io_parse_rng(v, grng)) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'graph_rng' is not 64 hex digits");
        goto done;
      }
    }
    v = dt__io_meta_get(c, "layout_hash");
    {
      uint64_t lh;
      if (!v || !dt__io_parse_hex64(v, &lh)) {
        r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'layout_hash' is %s", v ? "not 16 hex digits" : "missing");
        goto done;
      }
      if (lh != dt_params_layout_hash(p)) {
        /* Name the first difference when there is one. */
        r = dt__io_match(c, &ctx, p, NULL, entry_of, slot_entry);
        if (r == DTRAIN_OK)
          r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH,
                         "layout hash %s differs from the model's %016llx (parameter order or buffers differ)", v,
                         (unsigned long long)dt_params_layout_hash(p));
        goto done;
      }
    }
    if (o) {
      const char *kind = dt__io_kind_name(dt_optim_get_options(o)->kind);
      dt__json oj;
      int ok = 0;
      v = dt__io_meta_get(c, "optimizer");
      if (!v) {
        r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint has no optimizer state (saved without one); load with optim = NULL");
        goto done;
      }
      if (dt__json_parse(&oj, v, strlen(v), DT__IO_JSON_DEPTH, 0) && oj.v[0].type == DT__JSON_OBJ) {
        for (int32_t k = oj.v[0].child; k >= 0; k = oj.v[oj.v[k].next].next) {
          int32_t val = oj.v[k].next;
          if (strcmp(dt__json_str(&oj, k), "kind") == 0 && oj.v[val].type == DT__JSON_STR) {
            ok = 1;
            if (strcmp(dt__json_str(&oj, val), kind) != 0) ok = 2;
            if (ok == 2)
              r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "the checkpoint holds %s optimizer state; this optimizer is %s",
                             dt__json_str(&oj, val), kind);
          }
        }
      }
      if (oj.nomem) r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory reading metadata 'optimizer'");
      dt__json_free(&oj);
      if (ok == 0 && r == DTRAIN_OK) r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'optimizer' is not a JSON object with a \"kind\"");
      if (r != DTRAIN_OK) goto done;
    }
  }
  r = dt__io_match(c, &ctx, p, o, entry_of, slot_entry);
  if (r != DTRAIN_OK) goto done;
  /* An optimizer stepped on a device: its host copies, fetched now (the one
   * step that can fail), are what the commit overwrites; the next
   * dt_optim_step_graph takes them back to the device. */
  for (int s = 0; s < nslots; s++) {
    if (!dt_optim_state(o, s)) {
      r = dt__io_err(&ctx, dt_last_result(), "%s", dt_last_error());
      goto done;
    }
  }

  /* Commit: nothing below can fail (but the upload to a device graph after it). */
  {
    float *data = dt_params_data(p);
    for (int i = 0; i < np; i++) {
      dt_param_info info;
      dt_params_info(p, i, &info);
      dt__get_f32le(data + info.offset, c->data + c->entries[entry_of[i]].begin, info.size);
    }
    for (int s = 0; s < nslots; s++) {
      float *buf = dt_optim_state(o, s);
      memset(buf, 0, dt_params_size(p) * sizeof(float));
      for (int i = 0; i < np; i++) {
        dt_param_info info;
        dt_params_info(p, i, &info);
        if (!info.trainable) continue;
        int e = slot_entry[(size_t)s * (size_t)np + (size_t)i];
        dt__get_f32le(buf + info.offset, c->data + c->entries[e].begin, info.size);
      }
    }
    if (full) {
      if (o) dt_optim_set_steps(o, step);
      memcpy(dt_params_rng(p)->s, prng, sizeof prng);
      if (st->graph) dt_graph_set_rng_state(st->graph, grng);
      st->step = step;
      st->epoch = epoch;
      st->data_epoch = data_epoch;
      st->data_index = data_index;
    }
  }
  /* A device graph on these params gets the loaded values (its gradient zeroed). */
  if (full && st->graph && st->graph->device && st->graph->params == p) {
    r = dt_graph_params_upload(st->graph);
    if (r != DTRAIN_OK) r = dt__io_err(&ctx, r, "the params were loaded on the host: %s", dt_last_error());
  }
done:
  dt__free(entry_of, nent * sizeof(int));
  dt__free(slot_entry, nslot_ent * sizeof(int));
  dt_checkpoint_close(c);
  return r;
}

DTRAIN_API dt_result dt_checkpoint_load(const char *path, dt_train_state *st) {
  if (!st) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_load: state is NULL");
  return dt__io_load(path, "dt_checkpoint_load", st, st->params, 1);
}

DTRAIN_API dt_result dt_checkpoint_load_weights(const char *path, dt_params *p) {
  return dt__io_load(path, "dt_checkpoint_load_weights", NULL, p, 0);
}

#undef DT__IO_HEX_RNG
#undef DT__IO_NMETA

#else /* DTRAIN_NO_STDIO: no file I/O, every entry point says so */

static dt_result dt__checkpoint_unsupported(const char *fn) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO (no file I/O)", fn);
}

DTRAIN_API dt_result dt_checkpoint_save(const char *path, const dt_train_state *st) {
  (void)path; (void)st;
  return dt__checkpoint_unsupported("dt_checkpoint_save");
}
DTRAIN_API dt_result dt_checkpoint_load(const char *path, dt_train_state *st) {
  (void)path; (void)st;
  return dt__checkpoint_unsupported("dt_checkpoint_load");
}
DTRAIN_API dt_result dt_checkpoint_load_weights(const char *path, dt_params *p) {
  (void)path; (void)p;
  return dt__checkpoint_unsupported("dt_checkpoint_load_weights");
}
#endif /* DTRAIN_NO_STDIO */
