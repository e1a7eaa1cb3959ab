/* ===========================================================================
 * dt_parallel_ckpt.c -- model-parallel checkpoints: a part per pipeline
 * stage or tensor-parallel shard, gathered into one full checkpoint, split
 * again for any layout (dt_io.h)
 * ===========================================================================
 * Sections: the metadata ("part", "split", "buffers", "gathered"), save_part,
 * gather, split. Parts and full files are ordinary checkpoints: reading goes
 * through dt_safetensors.c (every byte checked), writing through
 * dt__io_write_file (atomic, checksummed). The shard arithmetic is
 * dt_tensor_parallel.c's (dt_tp_shard_* / dt_tp_unshard_*).
 */
#include "dt_internal.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_io.h"
#include "dt_tensor_parallel.h"
#include "dt_params_internal.h"
#include "dt_json.h"
#include "dt_safetensors.h"

#ifndef DTRAIN_NO_STDIO

#define DT__PT_MAX 65536 /* most stages, shards and parts */
#define DT__PT_SLOTS 4   /* most optimizer slots */

static const char *const dt__pt_kinds[4] = {"none", "rows", "cols", "qkv"};

/* ---- metadata -------------------------------------------------------------------------- */

/* One opened file and its parsed layout metadata. */
typedef struct dt__pt_file {
  dt_checkpoint *c;
  const char *path;
  int stage, stages, shard, shards;
  dt__json split, buffers, gathered; /* nv == 0 when absent */
} dt__pt_file;

static void dt__pt_file_free(dt__pt_file *f) {
  dt_checkpoint_close(f->c);
  dt__json_free(&f->split);
  dt__json_free(&f->buffers);
  dt__json_free(&f->gathered);
  memset(f, 0, sizeof *f);
}

/* Member `key` of object 0 of j: its value id, or -1. */
static int32_t dt__pt_member(const dt__json *j, const char *key) {
  if (j->nv == 0 || j->v[0].type != DT__JSON_OBJ) return -1;
  for (int32_t k = j->v[0].child; k >= 0; k = j->v[j->v[k].next].next)
    if (dt__json_eq(j, k, key)) return j->v[k].next;
  return -1;
}

/* Parses metadata `key` of f (absent: j stays empty) as JSON of type want
 * whose members (object) or elements (array) are all of type elem (0: any). */
static dt_result dt__pt_parse(const dt__io_ctx *ctx, const dt_checkpoint *c, const char *key, int want, int elem,
                              dt__json *j) {
  const char *text = dt__io_meta_get(c, key);
  memset(j, 0, sizeof *j);
  if (!text) return DTRAIN_OK;
  if (!dt__json_parse(j, text, strlen(text), 8, 0))
    return dt__io_err(ctx, j->nomem ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_FORMAT, "metadata '%s': %s", key, j->err);
  if (j->v[0].type != want) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata '%s' is not a JSON %s", key,
                                              want == DT__JSON_OBJ ? "object" : "array");
  for (int32_t k = j->v[0].child; elem && k >= 0; k = j->v[k].next) {
    int32_t v = want == DT__JSON_OBJ ? j->v[k].next : k;
    if (j->v[v].type != elem) return dt__io_err(ctx, DTRAIN_ERR_FORMAT, "metadata '%s': an entry of the wrong type", key);
    if (want == DT__JSON_OBJ) k = v;
  }
  return DTRAIN_OK;
}

/* How parameter `name` is cut in f's "split" (DTRAIN_SPLIT_*), or -1 for an unknown kind. */
static int dt__pt_kind_in(const dt__json *split, const char *name) {
  int32_t v = dt__pt_member(split, name);
  if (v < 0) return DTRAIN_SPLIT_NONE;
  for (int k = 1; k < 4; k++)
    if (dt__json_eq(split, v, dt__pt_kinds[k])) return k;
  return -1;
}

static int dt__pt_in_array(const dt__json *a, const char *name) {
  for (int32_t k = a->nv ? a->v[0].child : -1; k >= 0; k = a->v[k].next)
    if (dt__json_eq(a, k, name)) return 1;
  return 0;
}

/* Integer member key of j's object in [lo, hi]. */
static int dt__pt_int(const dt__json *j, const char *key, int lo, int hi, int *out) {
  uint64_t u;
  int32_t v = dt__pt_member(j, key);
  if (v < 0 || !dt__json_uint(j, v, &u) || u < (uint64_t)lo || u > (uint64_t)hi) return 0;
  *out = (int)u;
  return 1;
}

/* Opens path and reads its layout metadata; a part (need_part 1) must have
 * a valid "part", a full file (0) must not. */
static dt_result dt__pt_open(const char *fn, const char *path, int need_part, dt__pt_file *f) {
  dt__io_ctx ctx;
  dt_result r = DTRAIN_OK;
  dt__json part;
  memset(f, 0, sizeof *f);
  memset(&part, 0, sizeof part);
  ctx.fn = fn;
  ctx.path = path;
  f->path = path;
  f->c = dt__io_open(&ctx, 1, &r);
  if (!f->c) return r;
  if (!f->c->is_dtrain) return dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "not a dtrain checkpoint (metadata 'format')");
  if ((r = dt__pt_parse(&ctx, f->c, "split", DT__JSON_OBJ, DT__JSON_STR, &f->split)) != DTRAIN_OK ||
      (r = dt__pt_parse(&ctx, f->c, "buffers", DT__JSON_ARR, DT__JSON_STR, &f->buffers)) != DTRAIN_OK ||
      (r = dt__pt_parse(&ctx, f->c, "gathered", DT__JSON_OBJ, 0, &f->gathered)) != DTRAIN_OK ||
      (r = dt__pt_parse(&ctx, f->c, "part", DT__JSON_OBJ, DT__JSON_NUM, &part)) != DTRAIN_OK)
    goto done;
  for (int32_t k = f->split.nv ? f->split.v[0].child : -1; k >= 0; k = f->split.v[f->split.v[k].next].next)
    if (dt__pt_kind_in(&f->split, dt__json_str(&f->split, k)) < 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'split': '%s' has an unknown kind", dt__json_str(&f->split, k));
      goto done;
    }
  if (need_part && part.nv == 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "not a checkpoint part (no metadata 'part': dt_checkpoint_save_part)");
  } else if (!need_part && part.nv != 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "is a checkpoint part, not a full checkpoint (gather the parts first)");
  } else if (need_part && (!dt__pt_int(&part, "stages", 1, DT__PT_MAX, &f->stages) ||
                           !dt__pt_int(&part, "shards", 1, DT__PT_MAX, &f->shards) ||
                           !dt__pt_int(&part, "stage", 0, f->stages - 1, &f->stage) ||
                           !dt__pt_int(&part, "shard", 0, f->shards - 1, &f->shard))) {
    r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "metadata 'part' needs stage < stages and shard < shards");
  }
done:
  dt__json_free(&part);
  return r;
}

/* Whether entry e of c is optimizer state ("optim.<slot>.<a parameter of c>"). */
static const char *dt__pt_optim_of(const dt_checkpoint *c, int e, const char **slot) {
  const char *p = dt__io_split_optim(c->entries[e].name, slot);
  return p && dt__io_find(c, p) >= 0 ? p : NULL;
}

/* The metadata values every writer here copies from a source file. */
/* The metadata every part carries: SAME must agree across the parts (parts
 * of one run and step); FIRST is taken from part 0 (each stage's RNGs, the
 * config, may differ). */
enum { DT__PT_SAME = 0, DT__PT_FIRST = 1 };
static const struct {
  const char *key;
  int how;
} dt__pt_copied[] = {{"step", DT__PT_SAME},       {"epoch", DT__PT_SAME},      {"data_epoch", DT__PT_SAME},
                     {"data_index", DT__PT_SAME}, {"params_rng", DT__PT_FIRST}, {"graph_rng", DT__PT_FIRST},
                     {"optimizer", DT__PT_SAME},  {"config", DT__PT_FIRST}};
#define DT__PT_NCOPY ((int)(sizeof dt__pt_copied / sizeof dt__pt_copied[0]))
#define DT__PT_NMETA 16
#define DT__PT_STR2(x) #x
#define DT__PT_STR(x) DT__PT_STR2(x)

/* Common metadata into mk/mv: the format, the copied values of src (rng:
 * override params_rng / graph_rng when non-NULL), the layout hash. */
static int dt__pt_meta(const dt_checkpoint *src, const char *prng, const char *grng, char *hashbuf, uint64_t hash,
                       const char **mk, const char **mv) {
  int nm = 0;
  mk[nm] = "format"; mv[nm++] = "dtrain";
  mk[nm] = "format_version"; mv[nm++] = DT__PT_STR(DTRAIN_CHECKPOINT_VERSION);
  mk[nm] = "dtrain_version"; mv[nm++] = DTRAIN_VERSION_STRING;
  for (int i = 0; i < DT__PT_NCOPY; i++) {
    const char *key = dt__pt_copied[i].key, *v = dt__io_meta_get(src, key);
    if (prng && !strcmp(key, "params_rng")) v = prng;
    if (grng && !strcmp(key, "graph_rng")) v = *grng ? grng : NULL;
    if (!v) continue;
    mk[nm] = key; mv[nm++] = v;
  }
  snprintf(hashbuf, 17, "%016llx", (unsigned long long)hash);
  mk[nm] = "layout_hash"; mv[nm++] = hashbuf;
  return nm;
}

/* ---- save_part ------------------------------------------------------------------------- */

static dt_result dt__checkpoint_save_part(const char *path, const dt_train_state *st, const dt_part *part);

DTRAIN_API dt_result dt_checkpoint_save_part(const char *path, const dt_train_state *st, const dt_part *part) {
  int64_t t0 = dt__prof_t0();
  dt_result r = dt__checkpoint_save_part(path, st, part);
  dt__prof_add("dt_checkpoint_save_part", DTRAIN_PROFILE_CHECKPOINT, t0);
  return r;
}

static dt_result dt__checkpoint_save_part(const char *path, const dt_train_state *st, const dt_part *part) {
  const char *fn = "dt_checkpoint_save_part";
  if (!path || !st || !st->params || !part)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s is NULL", fn, !path ? "path" : !st ? "state" : !part ? "part" : "params");
  dt_params *p = st->params;
  const int P = part->stages > 1 ? part->stages : 1, T = part->shards > 1 ? part->shards : 1;
  if (P > DT__PT_MAX || T > DT__PT_MAX || part->stage < 0 || part->stage >= P || part->shard < 0 ||
      part->shard >= T || part->nsplit < 0 || (part->nsplit > 0 && (!part->split_names || !part->split_kinds)))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: '%s': part is stage %d of %d, shard %d of %d, %d splits", fn, path,
                     part->stage, part->stages, part->shard, part->shards, part->nsplit);
  for (int i = 0; i < part->nsplit; i++) {
    const char *nm = part->split_names[i];
    int k = part->split_kinds[i];
    if (!nm || dt_params_find(p, nm) < 0)
      return dt__error(DTRAIN_ERR_MISMATCH, "%s: '%s': split parameter '%s' is not in the params", fn, path,
                       nm ? nm : "(null)");
    if (k < DTRAIN_SPLIT_ROWS || k > DTRAIN_SPLIT_QKV)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: '%s': split kind %d of '%s'", fn, path, k, nm);
    for (int j = 0; j < i; j++)
      if (strcmp(part->split_names[j], nm) == 0)
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: '%s': '%s' is split twice", fn, path, nm);
  }
  dt__io_buf pj, sj, bj;
  memset(&pj, 0, sizeof pj);
  memset(&sj, 0, sizeof sj);
  memset(&bj, 0, sizeof bj);
  char tmp[128];
  snprintf(tmp, sizeof tmp, "{\"stage\":%d,\"stages\":%d,\"shard\":%d,\"shards\":%d}", part->stage, P, part->shard, T);
  dt__io_buf_str(&pj, tmp);
  dt__io_buf_str(&sj, "{");
  for (int i = 0; i < part->nsplit; i++) {
    if (i) dt__io_buf_str(&sj, ",");
    dt__io_buf_jstr(&sj, part->split_names[i]); /* UTF-8: checked by the save (a parameter name) */
    dt__io_buf_str(&sj, ":");
    dt__io_buf_jstr(&sj, dt__pt_kinds[part->split_kinds[i]]);
  }
  dt__io_buf_str(&sj, "}");
  dt__io_buf_str(&bj, "[");
  for (int i = 0, nb = 0; i < dt_params_count(p); i++) {
    dt_param_info in;
    dt_params_info(p, i, &in);
    if (in.trainable || !dt__io_valid_utf8(in.name)) continue; /* the save refuses a bad name */
    if (nb++) dt__io_buf_str(&bj, ",");
    dt__io_buf_jstr(&bj, in.name);
  }
  dt__io_buf_str(&bj, "]");
  dt_result r;
  if (pj.nomem || sj.nomem || bj.nomem) {
    r = dt__error(DTRAIN_ERR_NOMEM, "%s: '%s': out of memory", fn, path);
  } else {
    const char *xk[3] = {"part", "split", "buffers"}, *xv[3] = {pj.p, sj.p, bj.p};
    r = dt__io_save(path, st, fn, xk, xv, 3);
  }
  dt__io_buf_free(&pj);
  dt__io_buf_free(&sj);
  dt__io_buf_free(&bj);
  return r;
}

/* ---- gather ---------------------------------------------------------------------------- */

/* One tensor of the output: a parameter (slot NULL) or its optimizer state. */
typedef struct dt__pt_tensor {
  const char *name, *slot;
  int stage, kind, trainable, ndim;
  int64_t shape[DTRAIN_MAX_DIMS]; /* in the output */
  size_t n, off;                  /* floats; where in the output's data */
} dt__pt_tensor;

/* Output-side bookkeeping shared by gather and split. */
typedef struct dt__pt_out {
  dt__pt_tensor *t;
  int nt, cap;
  const char *slots[DT__PT_SLOTS];
  int nslots;
  dt__io_buf names, scratch;
  float *data;
  size_t total;
} dt__pt_out;

static void dt__pt_out_free(dt__pt_out *o) {
  dt__free(o->t, (size_t)(o->cap > 0 ? o->cap : 1) * sizeof(dt__pt_tensor));
  dt__free(o->data, (o->total > 0 ? o->total : 1) * sizeof(float));
  dt__io_buf_free(&o->names);
  dt__io_buf_free(&o->scratch);
  memset(o, 0, sizeof *o);
}

/* "optim.<slot>.<name>" or name, in o->scratch (valid until the next call). */
static const char *dt__pt_full_name(dt__pt_out *o, const char *slot, const char *name) {
  o->scratch.len = 0;
  dt__io_buf_put(&o->scratch, "", 0);
  if (slot) {
    dt__io_buf_str(&o->scratch, "optim.");
    dt__io_buf_str(&o->scratch, slot);
    dt__io_buf_str(&o->scratch, ".");
  }
  dt__io_buf_str(&o->scratch, name);
  return o->scratch.nomem ? NULL : o->scratch.p;
}

/* The optimizer slots of c in order of appearance; -1 when more than DT__PT_SLOTS. */
static int dt__pt_slots(const dt_checkpoint *c, const char **slots) {
  int n = 0;
  for (int e = 0; e < c->nentries; e++) {
    const char *slot;
    if (!dt__pt_optim_of(c, e, &slot)) continue;
    int seen = 0;
    for (int k = 0; k < n; k++) seen |= strcmp(slots[k], slot) == 0;
    if (seen) continue;
    if (n == DT__PT_SLOTS) return -1;
    slots[n++] = slot;
  }
  return n;
}

/* Adds the optimizer-state tensors (slot-major, like dt_checkpoint_save) of
 * the parameters o->t[0..np), and lays out every tensor's data. */
static dt_result dt__pt_layout(const dt__io_ctx *ctx, dt__pt_out *o, int np) {
  int need = np + o->nslots * np;
  need = need > 0 ? need : 1;
  dt__pt_tensor *nt = (dt__pt_tensor *)dt__realloc(o->t, (size_t)o->cap * sizeof(dt__pt_tensor),
                                                   (size_t)need * sizeof(dt__pt_tensor));
  if (!nt) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
  o->t = nt;
  o->cap = need;
  o->nt = np;
  for (int s = 0; s < o->nslots; s++)
    for (int i = 0; i < np; i++)
      if (o->t[i].trainable) {
        o->t[o->nt] = o->t[i];
        o->t[o->nt++].slot = o->slots[s];
      }
  o->total = 0;
  for (int i = 0; i < o->nt; i++) {
    size_t n = 1;
    for (int d = 0; d < o->t[i].ndim; d++) n *= (size_t)o->t[i].shape[d];
    o->t[i].n = n;
    o->t[i].off = o->total;
    if (n > SIZE_MAX / sizeof(float) - o->total) return dt__io_err(ctx, DTRAIN_ERR_OVERFLOW, "the tensors are too large");
    o->total += n;
  }
  o->data = (float *)dt__alloc((o->total > 0 ? o->total : 1) * sizeof(float));
  if (!o->data) {
    size_t t = o->total;
    o->total = 0;
    return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory for %zu floats", t);
  }
  return DTRAIN_OK;
}

/* A JSON object of the split parameters / an array of the buffers among o->t[a..b). */
static void dt__pt_split_json(dt__io_buf *b, const dt__pt_out *o, int a, int bnd) {
  int n = 0;
  dt__io_buf_str(b, "{");
  for (int i = a; i < bnd; i++)
    if (o->t[i].kind != DTRAIN_SPLIT_NONE) {
      if (n++) dt__io_buf_str(b, ",");
      dt__io_buf_jstr(b, o->t[i].name);
      dt__io_buf_str(b, ":");
      dt__io_buf_jstr(b, dt__pt_kinds[o->t[i].kind]);
    }
  dt__io_buf_str(b, "}");
}

static void dt__pt_buffers_json(dt__io_buf *b, const dt__pt_out *o, int a, int bnd) {
  int n = 0;
  dt__io_buf_str(b, "[");
  for (int i = a; i < bnd; i++)
    if (!o->t[i].trainable) {
      if (n++) dt__io_buf_str(b, ",");
      dt__io_buf_jstr(b, o->t[i].name);
    }
  dt__io_buf_str(b, "]");
}

/* Writes o's tensors and the metadata mk/mv. */
static dt_result dt__pt_write(const dt__io_ctx *ctx, dt__pt_out *o, const char **mk, const char **mv, int nm) {
  dt__io_out *outs = (dt__io_out *)dt__calloc((size_t)(o->nt > 0 ? o->nt : 1) * sizeof(dt__io_out));
  if (!outs) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
  o->names.len = 0;
  for (int i = 0; i < o->nt; i++) {
    const char *full = dt__pt_full_name(o, o->t[i].slot, o->t[i].name);
    outs[i].name_off = o->names.len;
    if (full) dt__io_buf_put(&o->names, full, strlen(full) + 1);
    outs[i].src = o->data + o->t[i].off;
    outs[i].n = o->t[i].n;
    outs[i].ndim = o->t[i].ndim;
    for (int d = 0; d < DTRAIN_MAX_DIMS; d++) outs[i].shape[d] = d < o->t[i].ndim ? o->t[i].shape[d] : 1;
  }
  dt_result r = o->names.nomem || o->scratch.nomem ? dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory")
                                                   : dt__io_write_file(ctx, outs, o->nt, o->names.p, mk, mv, nm);
  dt__free(outs, (size_t)(o->nt > 0 ? o->nt : 1) * sizeof(dt__io_out));
  return r;
}

static uint64_t dt__pt_hash(const dt__pt_out *o, int a, int b) {
  uint64_t h = DT__FNV64_OFFSET;
  for (int i = a; i < b; i++) h = dt__layout_hash_add(h, o->t[i].name, o->t[i].ndim, o->t[i].shape, o->t[i].trainable);
  return h;
}

/* Rows and columns of a tensor of n floats with this (whole) shape, for its kind. */
static void dt__pt_rc(const dt__pt_tensor *t, int64_t *rows, int64_t *cols) {
  int64_t last = t->ndim > 0 ? t->shape[t->ndim - 1] : 1, first = t->ndim > 0 ? t->shape[0] : 1;
  if (t->kind == DTRAIN_SPLIT_COLS) {
    *cols = last;
    *rows = last > 0 ? (int64_t)t->n / last : 0;
  } else {
    *rows = first;
    *cols = first > 0 ? (int64_t)t->n / first : 0;
  }
}

/* Checks parts[] against each other and fills grid (stage * T + shard -> file). */
static dt_result dt__pt_check_parts(const dt__io_ctx *ctx, dt__pt_file *f, int n, int *grid, int *P, int *T) {
  *P = f[0].stages;
  *T = f[0].shards;
  if ((int64_t)*P * *T != n)
    return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s' is one of %d x %d parts, but %d were given", f[0].path, *P,
                      *T, n);
  for (int i = 0; i < n; i++) grid[i] = -1;
  for (int i = 0; i < n; i++) {
    if (f[i].stages != *P || f[i].shards != *T)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s' is a part of %d x %d, '%s' of %d x %d", f[i].path, f[i].stages,
                        f[i].shards, f[0].path, *P, *T);
    int g = f[i].stage * *T + f[i].shard;
    if (grid[g] >= 0)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s' and '%s' are both stage %d shard %d", f[grid[g]].path,
                        f[i].path, f[i].stage, f[i].shard);
    grid[g] = i;
    for (int k = 0; k < DT__PT_NCOPY; k++) {
      if (dt__pt_copied[k].how != DT__PT_SAME) continue; /* the first part's */
      const char *key = dt__pt_copied[k].key;
      const char *a = dt__io_meta_get(f[0].c, key), *b = dt__io_meta_get(f[i].c, key);
      if ((a == NULL) != (b == NULL) || (a && strcmp(a, b) != 0))
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s' has %s %s, '%s' %s (parts of different runs or steps)",
                          f[i].path, key, b ? b : "(none)", f[0].path, a ? a : "(none)");
    }
  }
  return DTRAIN_OK;
}

/* The parameters of stage s (files f[grid[s*T + t]]) appended to o, checked shard by shard. */
static dt_result dt__pt_gather_stage(const dt__io_ctx *ctx, dt__pt_file *f, const int *grid, int s, int T,
                                     dt__pt_out *o) {
  const dt__pt_file *f0 = &f[grid[s * T]];
  for (int t = 1; t < T; t++)
    if (f[grid[s * T + t]].c->nentries != f0->c->nentries)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s' has %d tensors, '%s' %d", f[grid[s * T + t]].path,
                        f[grid[s * T + t]].c->nentries, f0->path, f0->c->nentries);
  for (int e = 0; e < f0->c->nentries; e++) {
    const char *slot, *name = f0->c->entries[e].name;
    if (dt__pt_optim_of(f0->c, e, &slot)) continue;
    for (int i = 0; i < o->nt; i++)
      if (strcmp(o->t[i].name, name) == 0)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' is in stage %d and stage %d", name, o->t[i].stage, s);
    dt__pt_tensor *d = &o->t[o->nt];
    memset(d, 0, sizeof *d);
    d->name = name;
    d->stage = s;
    d->kind = dt__pt_kind_in(&f0->split, name);
    d->trainable = !dt__pt_in_array(&f0->buffers, name);
    d->ndim = f0->c->entries[e].ndim;
    memcpy(d->shape, f0->c->entries[e].shape, sizeof d->shape);
    for (int t = 1; t < T; t++) {
      const dt__pt_file *ft = &f[grid[s * T + t]];
      int k = dt__io_find(ft->c, name);
      if (k < 0 || dt__pt_kind_in(&ft->split, name) != d->kind || ft->c->entries[k].ndim != d->ndim ||
          memcmp(ft->c->entries[k].shape, d->shape, sizeof d->shape) != 0)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' is %s in '%s' than in '%s'", name,
                          k < 0 ? "missing" : "split or shaped otherwise", ft->path, f0->path);
    }
    if (d->kind != DTRAIN_SPLIT_NONE && (d->ndim == 0 || (d->kind == DTRAIN_SPLIT_QKV && d->shape[0] % 3 != 0)))
      return dt__io_err(ctx, DTRAIN_ERR_SHAPE, "tensor '%s' in '%s' cannot be split as %s", name, f0->path,
                        dt__pt_kinds[d->kind]);
    if (d->kind == DTRAIN_SPLIT_COLS) d->shape[d->ndim - 1] *= T;
    else if (d->kind != DTRAIN_SPLIT_NONE) d->shape[0] *= T;
    o->nt++;
  }
  return DTRAIN_OK;
}

/* Reads every shard's piece of tensor i of o into its place. */
static dt_result dt__pt_gather_data(const dt__io_ctx *ctx, dt__pt_file *f, const int *grid, int T, dt__pt_out *o,
                                    int i, float *tmp) {
  const dt__pt_tensor *d = &o->t[i];
  float *dst = o->data + d->off;
  size_t pn = d->kind == DTRAIN_SPLIT_NONE ? d->n : d->n / (size_t)T;
  int64_t rows, cols;
  dt__pt_rc(d, &rows, &cols);
  for (int t = 0; t < T; t++) {
    const dt__pt_file *ft = &f[grid[d->stage * T + t]];
    const char *full = dt__pt_full_name(o, d->slot, d->name);
    int k = full ? dt__io_find(ft->c, full) : -1;
    if (!full) return dt__io_err(ctx, DTRAIN_ERR_NOMEM, "out of memory");
    if (k < 0 || ft->c->entries[k].nelem != pn)
      return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "'%s': tensor '%s' is %s", ft->path, full,
                        k < 0 ? "missing" : "not the size of its parameter's part");
    dt_result r = dt_checkpoint_read_f32(ft->c, k, d->kind == DTRAIN_SPLIT_NONE && t == 0 ? dst : tmp, pn);
    if (r == DTRAIN_OK) {
      if (d->kind == DTRAIN_SPLIT_NONE && t > 0 && memcmp(dst, tmp, pn * sizeof(float)) != 0)
        return dt__io_err(ctx, DTRAIN_ERR_MISMATCH, "tensor '%s' is whole on every shard but differs between '%s' and '%s'",
                          full, f[grid[d->stage * T]].path, ft->path);
      if (d->kind == DTRAIN_SPLIT_ROWS) r = dt_tp_unshard_rows(dst, rows, cols, T, t, tmp);
      else if (d->kind == DTRAIN_SPLIT_COLS) r = dt_tp_unshard_cols(dst, rows, cols, T, t, tmp);
      else if (d->kind == DTRAIN_SPLIT_QKV) r = dt_tp_unshard_qkv(dst, rows, cols, T, t, tmp);
    }
    if (r != DTRAIN_OK) return dt__io_err(ctx, r, "tensor '%s' of '%s': %s", full, ft->path, dt_last_error());
  }
  return DTRAIN_OK;
}

/* "gathered": {"stages":P,"shards":T,"stage_starts":[...],"rng":[["params","graph"],...]}. */
static void dt__pt_gathered_json(dt__io_buf *b, dt__pt_file *f, const int *grid, int P, int T, const dt__pt_out *o,
                                 const int *stage_first) {
  char tmp[64];
  snprintf(tmp, sizeof tmp, "{\"stages\":%d,\"shards\":%d,\"stage_starts\":[", P, T);
  dt__io_buf_str(b, tmp);
  for (int s = 1; s < P; s++) {
    if (s > 1) dt__io_buf_str(b, ",");
    dt__io_buf_jstr(b, o->t[stage_first[s]].name);
  }
  dt__io_buf_str(b, "],\"rng\":[");
  for (int g = 0; g < P * T; g++) {
    const char *pr = dt__io_meta_get(f[grid[g]].c, "params_rng"), *gr = dt__io_meta_get(f[grid[g]].c, "graph_rng");
    if (g) dt__io_buf_str(b, ",");
    dt__io_buf_str(b, "[");
    dt__io_buf_jstr(b, pr && dt__io_valid_utf8(pr) ? pr : "");
    dt__io_buf_str(b, ",");
    dt__io_buf_jstr(b, gr && dt__io_valid_utf8(gr) ? gr : "");
    dt__io_buf_str(b, "]");
  }
  dt__io_buf_str(b, "]}");
}

DTRAIN_API dt_result dt_checkpoint_gather(const char *const *parts, int nparts, const char *out) {
  dt__io_ctx ctx;
  ctx.fn = "dt_checkpoint_gather";
  ctx.path = out ? out : "(null)";
  if (!parts || !out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_gather: %s is NULL", !parts ? "parts" : "out");
  if (nparts < 1 || nparts > DT__PT_MAX)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_checkpoint_gather: %d parts (1..%d)", nparts, DT__PT_MAX);
  for (int i = 0; i < nparts; i++)
    if (!parts[i]) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_gather: parts[%d] is NULL", i);
  dt__pt_file *f = (dt__pt_file *)dt__calloc((size_t)nparts * sizeof(dt__pt_file));
  int *grid = (int *)dt__alloc((size_t)nparts * sizeof(int));
  int *stage_first = (int *)dt__alloc((size_t)(nparts + 1) * sizeof(int));
  dt__pt_out o;
  dt__io_buf sj, bj, gj;
  float *tmp = NULL;
  size_t tmp_n = 0;
  int P = 0, T = 0, ntot = 0;
  dt_result r = DTRAIN_OK;
  memset(&o, 0, sizeof o);
  memset(&sj, 0, sizeof sj);
  memset(&bj, 0, sizeof bj);
  memset(&gj, 0, sizeof gj);
  if (!f || !grid || !stage_first) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int i = 0; i < nparts && r == DTRAIN_OK; i++) r = dt__pt_open(ctx.fn, parts[i], 1, &f[i]);
  if (r == DTRAIN_OK) r = dt__pt_check_parts(&ctx, f, nparts, grid, &P, &T);
  if (r != DTRAIN_OK) goto done;
  for (int s = 0; s < P; s++) ntot += f[grid[s * T]].c->nentries;
  o.cap = ntot > 0 ? ntot : 1;
  o.t = (dt__pt_tensor *)dt__calloc((size_t)o.cap * sizeof(dt__pt_tensor));
  if (!o.t) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int s = 0; s < P && r == DTRAIN_OK; s++) {
    stage_first[s] = o.nt;
    r = dt__pt_gather_stage(&ctx, f, grid, s, T, &o);
    if (r == DTRAIN_OK && o.nt == stage_first[s])
      r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "stage %d ('%s') has no parameters", s, f[grid[s * T]].path);
  }
  stage_first[P] = o.nt;
  if (r != DTRAIN_OK) goto done;
  o.nslots = dt__pt_slots(f[grid[0]].c, o.slots);
  if (o.nslots < 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "'%s' has more than %d optimizer slots", f[grid[0]].path, DT__PT_SLOTS);
    goto done;
  }
  {
    r = dt__pt_layout(&ctx, &o, o.nt);
    if (r != DTRAIN_OK) goto done;
    /* Every part has exactly its stage's optimizer state: no more tensors than that. */
    for (int g = 0; g < nparts; g++) {
      int s = g / T, want = stage_first[s + 1] - stage_first[s];
      for (int i = stage_first[s]; i < stage_first[s + 1]; i++) want += o.t[i].trainable ? o.nslots : 0;
      if (f[grid[g]].c->nentries != want) {
        r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "'%s' has %d tensors; its stage's parameters and %d optimizer slots are %d",
                       f[grid[g]].path, f[grid[g]].c->nentries, o.nslots, want);
        goto done;
      }
    }
  }
  for (int i = 0; i < o.nt; i++) tmp_n = DT__MAX(tmp_n, o.t[i].n);
  tmp = (float *)dt__alloc((tmp_n > 0 ? tmp_n : 1) * sizeof(float));
  if (!tmp) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int i = 0; i < o.nt && r == DTRAIN_OK; i++) r = dt__pt_gather_data(&ctx, f, grid, T, &o, i, tmp);
  if (r != DTRAIN_OK) goto done;
  {
    const char *mk[DT__PT_NMETA], *mv[DT__PT_NMETA];
    char hash[17];
    int np = stage_first[P];
    int nm = dt__pt_meta(f[grid[0]].c, NULL, NULL, hash, dt__pt_hash(&o, 0, np), mk, mv);
    if (!dt__io_meta_get(f[grid[0]].c, "config")) {
      mk[nm] = "config"; mv[nm++] = "";
    }
    dt__pt_split_json(&sj, &o, 0, np);
    dt__pt_buffers_json(&bj, &o, 0, np);
    dt__pt_gathered_json(&gj, f, grid, P, T, &o, stage_first);
    if (sj.nomem || bj.nomem || gj.nomem) {
      r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
      goto done;
    }
    mk[nm] = "split"; mv[nm++] = sj.p;
    mk[nm] = "buffers"; mv[nm++] = bj.p;
    mk[nm] = "gathered"; mv[nm++] = gj.p;
    r = dt__pt_write(&ctx, &o, mk, mv, nm);
  }
done:
  for (int i = 0; f && i < nparts; i++) dt__pt_file_free(&f[i]);
  dt__free(f, (size_t)nparts * sizeof(dt__pt_file));
  dt__free(grid, (size_t)nparts * sizeof(int));
  dt__free(stage_first, (size_t)(nparts + 1) * sizeof(int));
  dt__free(tmp, (tmp_n > 0 ? tmp_n : 1) * sizeof(float));
  dt__pt_out_free(&o);
  dt__io_buf_free(&sj);
  dt__io_buf_free(&bj);
  dt__io_buf_free(&gj);
  return r;
}

/* ---- split ----------------------------------------------------------------------------- */

/* Index of parameter `name` among o->t[0..np), or -1. */
static int dt__pt_param_index(const dt__pt_out *o, int np, const char *name) {
  for (int i = 0; i < np; i++)
    if (strcmp(o->t[i].name, name) == 0) return i;
  return -1;
}

/* The gathered layout's stage starts, when it has P stages; element s-1 of "stage_starts". */
static const char *dt__pt_gathered_start(const dt__json *g, int s) {
  int32_t a = dt__pt_member(g, "stage_starts");
  if (a < 0 || g->v[a].type != DT__JSON_ARR) return NULL;
  int32_t k = g->v[a].child;
  for (int i = 1; i < s && k >= 0; i++) k = g->v[k].next;
  return k >= 0 && g->v[k].type == DT__JSON_STR ? dt__json_str(g, k) : NULL;
}

/* Part g's RNG states from the gathered layout, when it is this plan's layout. */
static int dt__pt_gathered_rng(const dt__json *g, int P, int T, const char *const *starts, int part, const char **pr,
                               const char **gr) {
  int gp, gt;
  if (g->nv == 0 || !dt__pt_int(g, "stages", 1, DT__PT_MAX, &gp) || !dt__pt_int(g, "shards", 1, DT__PT_MAX, &gt) ||
      gp != P || gt != T)
    return 0;
  for (int s = 1; s < P; s++) {
    const char *a = dt__pt_gathered_start(g, s);
    if (!a || strcmp(a, starts[s - 1]) != 0) return 0;
  }
  int32_t a = dt__pt_member(g, "rng");
  if (a < 0 || g->v[a].type != DT__JSON_ARR || g->v[a].count != P * T) return 0;
  int32_t k = g->v[a].child;
  for (int i = 0; i < part; i++) k = g->v[k].next;
  if (g->v[k].type != DT__JSON_ARR || g->v[k].count != 2) return 0;
  int32_t p0 = g->v[k].child, g0 = g->v[p0].next;
  if (g->v[p0].type != DT__JSON_STR || g->v[g0].type != DT__JSON_STR) return 0;
  *pr = dt__json_str(g, p0);
  *gr = dt__json_str(g, g0);
  return 1;
}

DTRAIN_API dt_result dt_checkpoint_split(const char *full, const dt_split_plan *plan, int stage, int shard,
                                         const char *out) {
  dt__io_ctx ctx;
  ctx.fn = "dt_checkpoint_split";
  ctx.path = full ? full : "(null)";
  if (!full || !plan || !out)
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_checkpoint_split: %s is NULL", !full ? "full" : !plan ? "plan" : "out");
  const int P = plan->stages > 1 ? plan->stages : 1, T = plan->shards > 1 ? plan->shards : 1;
  if (P > DT__PT_MAX || T > DT__PT_MAX || stage < 0 || stage >= P || shard < 0 || shard >= T || plan->nsplit < 0 ||
      (plan->nsplit > 0 && (!plan->split_names || !plan->split_kinds)))
    return dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "part stage %d of %d, shard %d of %d, %d splits", stage, plan->stages,
                      shard, plan->shards, plan->nsplit);
  dt__pt_file f;
  dt__pt_out o, po;
  dt__io_buf pj, sj, bj;
  const char **starts = NULL;
  int np = 0, a = 0, b = 0;
  float *tmp = NULL;
  size_t tmp_n = 0;
  memset(&o, 0, sizeof o);
  memset(&po, 0, sizeof po);
  memset(&pj, 0, sizeof pj);
  memset(&sj, 0, sizeof sj);
  memset(&bj, 0, sizeof bj);
  dt_result r = dt__pt_open(ctx.fn, full, 0, &f);
  if (r != DTRAIN_OK) goto done;
  /* The full file's parameters, in file order. */
  o.cap = f.c->nentries > 0 ? f.c->nentries : 1;
  o.t = (dt__pt_tensor *)dt__calloc((size_t)o.cap * sizeof(dt__pt_tensor));
  starts = (const char **)dt__calloc((size_t)P * sizeof(char *));
  if (!o.t || !starts) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  o.nslots = dt__pt_slots(f.c, o.slots);
  if (o.nslots < 0) {
    r = dt__io_err(&ctx, DTRAIN_ERR_FORMAT, "more than %d optimizer slots", DT__PT_SLOTS);
    goto done;
  }
  for (int e = 0; e < f.c->nentries; e++) {
    const char *slot;
    if (dt__pt_optim_of(f.c, e, &slot)) continue;
    dt__pt_tensor *d = &o.t[np++];
    d->name = f.c->entries[e].name;
    d->kind = dt__pt_kind_in(&f.split, d->name);
    d->ndim = f.c->entries[e].ndim;
    memcpy(d->shape, f.c->entries[e].shape, sizeof d->shape);
    d->n = (size_t)f.c->entries[e].nelem;
    /* Trainable: not in "buffers"; without that list, whatever has optimizer state (or everything). */
    if (f.buffers.nv) {
      d->trainable = !dt__pt_in_array(&f.buffers, d->name);
    } else {
      d->trainable = o.nslots == 0;
      for (int s = 0; s < o.nslots && !d->trainable; s++) {
        const char *fn = dt__pt_full_name(&o, o.slots[s], d->name);
        d->trainable = fn && dt__io_find(f.c, fn) >= 0;
      }
    }
  }
  for (int i = 0; i < plan->nsplit; i++) {
    int k = dt__pt_param_index(&o, np, plan->split_names[i] ? plan->split_names[i] : "");
    if (k < 0) {
      r = dt__io_err(&ctx, DTRAIN_ERR_MISMATCH, "split parameter '%s' is not in the file",
                     plan->split_names[i] ? plan->split_names[i] : "(null)");
      goto done;
    }
    if (plan->split_kinds[i] < DTRAIN_SPLIT_NONE || plan->split_kinds[i] > DTRAIN_SPLIT_QKV) {
      r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "split kind %d of '%s'", plan->split_kinds[i], o.t[k].name);
      goto done;
    }
  }
  if (plan->nsplit > 0)
    for (int i = 0; i < np; i++) {
      o.t[i].kind = DTRAIN_SPLIT_NONE;
      for (int k = 0; k < plan->nsplit; k++)
        if (strcmp(plan->split_names[k], o.t[i].name) == 0) o.t[i].kind = plan->split_kinds[k];
    }
  /* The stage's parameters: [a, b). */
  for (int s = 1; s < P; s++) {
    starts[s - 1] = plan->stage_starts ? plan->stage_starts[s - 1] : dt__pt_gathered_start(&f.gathered, s);
    int gp = 0;
    if (!plan->stage_starts && (!dt__pt_int(&f.gathered, "stages", 1, DT__PT_MAX, &gp) || gp != P)) {
      r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "the file was not gathered from %d stages: give stage_starts", P);
      goto done;
    }
    int k = starts[s - 1] ? dt__pt_param_index(&o, np, starts[s - 1]) : -1;
    int prev = s == 1 ? 0 : dt__pt_param_index(&o, np, starts[s - 2]);
    if (k <= prev) {
      r = dt__io_err(&ctx, DTRAIN_ERR_INVALID_ARG, "stage %d would start at '%s': %s", s,
                     starts[s - 1] ? starts[s - 1] : "(null)",
                     k < 0 ? "no such parameter" : "stages must start at increasing parameters after the first");
      goto done;
    }
    if (s == stage) a = k;
    if (s == stage + 1) b = k;
  }
  if (stage == P - 1) b = np;
  /* The part: parameters a..b-1 cut for shard `shard`, then their optimizer state. */
  po.cap = b - a > 0 ? b - a : 1;
  po.t = (dt__pt_tensor *)dt__calloc((size_t)po.cap * sizeof(dt__pt_tensor));
  if (!po.t) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  po.nslots = o.nslots;
  memcpy(po.slots, o.slots, sizeof po.slots);
  for (int i = a; i < b; i++) {
    dt__pt_tensor *d = &po.t[i - a];
    *d = o.t[i];
    int dim = d->kind == DTRAIN_SPLIT_COLS ? d->ndim - 1 : 0;
    int64_t div = d->kind == DTRAIN_SPLIT_QKV ? 3 * (int64_t)T : T;
    if (d->kind != DTRAIN_SPLIT_NONE && T > 1) {
      if (d->ndim == 0 || d->shape[dim] % div != 0) {
        r = dt__io_err(&ctx, DTRAIN_ERR_SHAPE, "tensor '%s' (%lld along the split dimension) does not split %s into %d",
                       d->name, d->ndim ? (long long)d->shape[dim] : 0LL, dt__pt_kinds[d->kind], T);
        goto done;
      }
      d->shape[dim] /= T;
    }
    tmp_n = DT__MAX(tmp_n, o.t[i].n);
  }
  r = dt__pt_layout(&ctx, &po, b - a);
  if (r != DTRAIN_OK) goto done;
  tmp = (float *)dt__alloc((tmp_n > 0 ? tmp_n : 1) * sizeof(float));
  if (!tmp) {
    r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int i = 0; i < po.nt; i++) {
    dt__pt_tensor *d = &po.t[i];
    const dt__pt_tensor *w = &o.t[a + (i < b - a ? i : dt__pt_param_index(&po, b - a, d->name))];
    const char *fn = dt__pt_full_name(&o, d->slot, d->name);
    int k = fn ? dt__io_find(f.c, fn) : -1;
    if (k < 0 || (size_t)f.c->entries[k].nelem != w->n) {
      r = dt__io_err(&ctx, fn ? DTRAIN_ERR_MISMATCH : DTRAIN_ERR_NOMEM, "tensor '%s' is %s", fn ? fn : "?",
                     k < 0 ? "missing" : "not the size of its parameter");
      goto done;
    }
    int64_t rows, cols;
    dt__pt_tensor whole = *w;
    whole.kind = d->kind;
    dt__pt_rc(&whole, &rows, &cols);
    r = dt_checkpoint_read_f32(f.c, k, T == 1 || d->kind == DTRAIN_SPLIT_NONE ? po.data + d->off : tmp, w->n);
    if (r == DTRAIN_OK && T > 1) {
      if (d->kind == DTRAIN_SPLIT_ROWS) r = dt_tp_shard_rows(tmp, rows, cols, T, shard, po.data + d->off);
      else if (d->kind == DTRAIN_SPLIT_COLS) r = dt_tp_shard_cols(tmp, rows, cols, T, shard, po.data + d->off);
      else if (d->kind == DTRAIN_SPLIT_QKV) r = dt_tp_shard_qkv(tmp, rows, cols, T, shard, po.data + d->off);
    }
    if (r != DTRAIN_OK) {
      r = dt__io_err(&ctx, r, "tensor '%s': %s", fn, dt_last_error());
      goto done;
    }
  }
  {
    const char *mk[DT__PT_NMETA], *mv[DT__PT_NMETA], *pr = NULL, *gr = NULL;
    char hash[17], tmpj[128];
    int nm;
    ctx.path = out;
    if (!dt__pt_gathered_rng(&f.gathered, P, T, starts, stage * T + shard, &pr, &gr)) pr = gr = NULL;
    nm = dt__pt_meta(f.c, pr, gr, hash, dt__pt_hash(&po, 0, b - a), mk, mv);
    if (!dt__io_meta_get(f.c, "config")) {
      mk[nm] = "config"; mv[nm++] = "";
    }
    snprintf(tmpj, sizeof tmpj, "{\"stage\":%d,\"stages\":%d,\"shard\":%d,\"shards\":%d}", stage, P, shard, T);
    dt__io_buf_str(&pj, tmpj);
    dt__pt_split_json(&sj, &po, 0, b - a);
    dt__pt_buffers_json(&bj, &po, 0, b - a);
    if (pj.nomem || sj.nomem || bj.nomem) {
      r = dt__io_err(&ctx, DTRAIN_ERR_NOMEM, "out of memory");
      goto done;
    }
    mk[nm] = "part"; mv[nm++] = pj.p;
    mk[nm] = "split"; mv[nm++] = sj.p;
    mk[nm] = "buffers"; mv[nm++] = bj.p;
    r = dt__pt_write(&ctx, &po, mk, mv, nm);
  }
done:
  dt__free((void *)starts, (size_t)P * sizeof(char *));
  dt__free(tmp, (tmp_n > 0 ? tmp_n : 1) * sizeof(float));
  dt__pt_out_free(&o);
  dt__pt_out_free(&po);
  dt__io_buf_free(&pj);
  dt__io_buf_free(&sj);
  dt__io_buf_free(&bj);
  dt__pt_file_free(&f);
  return r;
}

#undef DT__PT_MAX
#undef DT__PT_SLOTS
#undef DT__PT_NCOPY
#undef DT__PT_NMETA
#undef DT__PT_STR2
#undef DT__PT_STR

#else /* DTRAIN_NO_STDIO */

DTRAIN_API dt_result dt_checkpoint_save_part(const char *path, const dt_train_state *st, const dt_part *part) {
  (void)path; (void)st; (void)part;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_checkpoint_save_part: built with DTRAIN_NO_STDIO (no file I/O)");
}
DTRAIN_API dt_result dt_checkpoint_gather(const char *const *parts, int nparts, const char *out) {
  (void)parts; (void)nparts; (void)out;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_checkpoint_gather: built with DTRAIN_NO_STDIO (no file I/O)");
}
DTRAIN_API dt_result dt_checkpoint_split(const char *full, const dt_split_plan *plan, int stage, int shard,
                                         const char *out) {
  (void)full; (void)plan; (void)stage; (void)shard; (void)out;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_checkpoint_split: built with DTRAIN_NO_STDIO (no file I/O)");
}

#endif /* DTRAIN_NO_STDIO */
