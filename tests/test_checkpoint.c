/* Checkpoints: round trip, an independent safetensors reader written here from
 * the spec, corrupted and mismatched files refused with the right code while
 * the model stays unchanged, bitwise resume, atomic save under a write
 * failure, and a Python (json + numpy, safetensors/torch when present)
 * cross-check. */
#define _POSIX_C_SOURCE 200809L
/* The test lists its directory itself (count_tmp): readdir of a 32-bit build needs large-file
 * support where inode numbers are 64-bit (armhf under qemu). dtrain has no off_t in its API. */
#define _FILE_OFFSET_BITS 64
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#if !defined(_WIN32)
#  include <sys/resource.h>
#  include <sys/wait.h>
#endif

#include "harness.h"

static char tmpdir[256];

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

static unsigned char *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = (unsigned char *)malloc((size_t)sz + 1);
  *n = fread(b, 1, (size_t)sz, f);
  fclose(f);
  return b;
}

static void write_all(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return;
  fwrite(b, 1, n, f);
  fclose(f);
}

static uint64_t le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static void put_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A safetensors file from a header text and a data buffer (the test's own writer). */
static void write_st(const char *path, const char *header, const void *data, size_t ndata) {
  size_t hn = strlen(header);
  unsigned char *b = (unsigned char *)malloc(8 + hn + ndata + 1);
  put_le64(b, hn);
  memcpy(b + 8, header, hn);
  if (ndata) memcpy(b + 8 + hn, data, ndata);
  write_all(path, b, 8 + hn + ndata);
  free(b);
}

/* ---- a small model: linear, batch norm (with buffers), dropout, a scalar ---- */
#define NS 192
#define NF 8
#define NC 3
#define BATCH 32
static float data_x[NS * NF];
static int32_t data_y[NS];

static void make_data(void) {
  th_seed(4321);
  for (int i = 0; i < NS; i++) {
    int c = i % NC;
    data_y[i] = c;
    for (int f = 0; f < NF; f++) data_x[i * NF + f] = th_uniform(-1, 1) + ((f / 2 == c) ? 1.2f : 0.0f);
  }
}

typedef struct {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_nn_batch_norm bn;
  int temp;
  dt_optim *opt;
  dt_graph *g;
} model;

static dt_optim_options optim_desc(dt_optim_kind kind) {
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = kind;
  switch (kind) {
    case DTRAIN_OPTIM_SGD: d.lr = 0.05f; d.momentum = 0.9f; d.nesterov = 1; d.weight_decay = 1e-3f; break;
    case DTRAIN_OPTIM_ADAM: d.lr = 0.01f; break;
    case DTRAIN_OPTIM_ADAMW: d.lr = 0.01f; d.weight_decay = 0.05f; d.clip_norm = 1.0f; break;
    case DTRAIN_OPTIM_RMSPROP: d.lr = 0.005f; d.momentum = 0.5f; break;
  }
  d.schedule.kind = DTRAIN_SCHED_COSINE;
  d.schedule.warmup_steps = 4;
  d.schedule.total_steps = 60;
  return d;
}

static void model_init(model *m, uint64_t seed, dt_optim_kind kind, uint64_t graph_seed) {
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 16, 1);
  dt_nn_batch_norm_init(&m->bn, m->P, "bn", 16);
  dt_nn_linear_init(&m->l2, m->P, "l2", 16, NC, 1);
  m->temp = dt_params_add(m->P, "temperature", 0, NULL, dt_init_constant(1.0f));
  dt_optim_options d = optim_desc(kind);
  m->opt = dt_optim_create(m->P, &d);
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.seed = graph_seed;
  m->g = dt_graph_create(m->P, &gd);
}

static void model_free(model *m) {
  dt_graph_destroy(m->g);
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

/* A loader: the order of epoch e is a shuffle seeded by e; position (epoch, batch). */
static void epoch_order(int64_t epoch, int32_t *idx) {
  dt_rng r;
  dt_rng_seed(&r, 1000 + (uint64_t)epoch);
  for (int i = 0; i < NS; i++) idx[i] = i;
  dt_rng_shuffle(&r, idx, NS);
}

static float model_step(model *m, int64_t epoch, int64_t batch) {
  int32_t idx[NS], y[BATCH];
  float x[BATCH * NF];
  epoch_order(epoch, idx);
  for (int i = 0; i < BATCH; i++) {
    int s = idx[batch * BATCH + i];
    memcpy(x + i * NF, data_x + s * NF, NF * sizeof(float));
    y[i] = data_y[s];
  }
  dt_graph *g = m->g;
  dt_graph_reset(g);
  dt_params_zero_grad(m->P);
  int64_t xs[2] = {BATCH, NF};
  dt_tensor *h = dt_nn_linear_forward(g, &m->l1, dt_tensor_from(g, 2, xs, x));
  h = dt_relu(g, dt_nn_batch_norm_forward(g, &m->bn, h));
  h = dt_dropout(g, h, 0.25f);
  dt_tensor *logits = dt_mul(g, dt_nn_linear_forward(g, &m->l2, h), dt_param(g, m->temp));
  dt_tensor *loss = dt_cross_entropy(g, logits, y);
  if (dt_backward(g, loss) != DTRAIN_OK) return NAN;
  if (dt_optim_step(m->opt) != DTRAIN_OK) return NAN;
  return dt_item(loss);
}

/* Train n steps from position (*e, *b), advancing it. */
static void model_train(model *m, int64_t *e, int64_t *b, int n) {
  for (int i = 0; i < n; i++) {
    model_step(m, *e, *b);
    if (++*b == NS / BATCH) {
      *b = 0;
      ++*e;
    }
  }
}

/* ---- snapshots: "the model is unchanged" -------------------------------------- */
typedef struct {
  float *data, *s0, *s1;
  size_t n;
  int64_t steps;
  uint64_t prng[4], grng[4];
} snapshot;

static void snap_take(snapshot *s, model *m) {
  s->n = dt_params_size(m->P);
  s->data = (float *)malloc(s->n * sizeof(float));
  s->s0 = (float *)calloc(s->n, sizeof(float));
  s->s1 = (float *)calloc(s->n, sizeof(float));
  memcpy(s->data, dt_params_data(m->P), s->n * sizeof(float));
  if (dt_optim_state_slots(m->opt) > 0) memcpy(s->s0, dt_optim_state(m->opt, 0), s->n * sizeof(float));
  if (dt_optim_state_slots(m->opt) > 1) memcpy(s->s1, dt_optim_state(m->opt, 1), s->n * sizeof(float));
  s->steps = dt_optim_steps(m->opt);
  memcpy(s->prng, dt_params_rng(m->P)->s, sizeof s->prng);
  dt_graph_rng_state(m->g, s->grng);
}

static int snap_same(const snapshot *s, model *m) {
  uint64_t g[4];
  dt_graph_rng_state(m->g, g);
  int ok = memcmp(s->data, dt_params_data(m->P), s->n * sizeof(float)) == 0;
  if (dt_optim_state_slots(m->opt) > 0) ok &= memcmp(s->s0, dt_optim_state(m->opt, 0), s->n * sizeof(float)) == 0;
  if (dt_optim_state_slots(m->opt) > 1) ok &= memcmp(s->s1, dt_optim_state(m->opt, 1), s->n * sizeof(float)) == 0;
  ok &= s->steps == dt_optim_steps(m->opt);
  ok &= memcmp(s->prng, dt_params_rng(m->P)->s, sizeof s->prng) == 0;
  ok &= memcmp(s->grng, g, sizeof g) == 0;
  return ok;
}

static void snap_free(snapshot *s) {
  free(s->data);
  free(s->s0);
  free(s->s1);
}

static dt_train_state full_state(model *m) {
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = m->P;
  st.optim = m->opt;
  st.graph = m->g;
  return st;
}

/* Saves a trained model's checkpoint to `path`. */
static void save_trained(const char *path, dt_optim_kind kind) {
  model m;
  int64_t e = 0, b = 0;
  model_init(&m, 11, kind, 3);
  model_train(&m, &e, &b, 5);
  dt_train_state st = full_state(&m);
  st.epoch = e;
  st.data_epoch = e;
  st.data_index = b;
  st.config = "{\"model\":\"test\"}";
  CHECK(dt_checkpoint_save(path, &st) == DTRAIN_OK);
  model_free(&m);
}

/* ---- round trip -------------------------------------------------------------------- */
static void test_roundtrip(void) {
  char path[512];
  path_of(path, sizeof path, "rt.safetensors");
  model a, b;
  int64_t e = 0, bi = 0;
  model_init(&a, 1, DTRAIN_OPTIM_ADAM, 9);
  model_init(&b, 2, DTRAIN_OPTIM_ADAM, 10);
  model_train(&a, &e, &bi, 8);
  dt_train_state st = full_state(&a);
  st.epoch = 1;
  st.data_epoch = e;
  st.data_index = bi;
  st.config = "lr=0.01 \"quoted\"\n\ttab \\ unicode: \xc3\xa9\xe2\x82\xac";
  CHECK_MSG(dt_checkpoint_save(path, &st) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(dt_params_checksum(a.P) != dt_params_checksum(b.P));

  dt_train_state ld = full_state(&b);
  CHECK_MSG(dt_checkpoint_load(path, &ld) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(dt_params_checksum(a.P) == dt_params_checksum(b.P));
  CHECK(memcmp(dt_params_data(a.P), dt_params_data(b.P), dt_params_size(a.P) * sizeof(float)) == 0);
  for (int s = 0; s < 2; s++)
    CHECK(memcmp(dt_optim_state(a.opt, s), dt_optim_state(b.opt, s), dt_params_size(a.P) * sizeof(float)) == 0);
  CHECK(dt_optim_steps(b.opt) == 8 && ld.step == 8);
  CHECK(ld.epoch == 1 && ld.data_epoch == e && ld.data_index == bi);
  CHECK(memcmp(dt_params_rng(a.P)->s, dt_params_rng(b.P)->s, 4 * sizeof(uint64_t)) == 0);
  uint64_t ga[4], gb[4];
  dt_graph_rng_state(a.g, ga);
  dt_graph_rng_state(b.g, gb);
  CHECK(memcmp(ga, gb, sizeof ga) == 0);

  /* Listing: tensors in data order, metadata, config text round trip. */
  dt_checkpoint *c = dt_checkpoint_open(path);
  CHECK(c != NULL);
  if (c) {
    int np = dt_params_count(a.P), ntrain = 0;
    for (int i = 0; i < np; i++) {
      dt_param_info info;
      dt_params_info(a.P, i, &info);
      ntrain += info.trainable;
    }
    CHECK(dt_checkpoint_count(c) == np + 2 * ntrain);
    uint64_t at = 0;
    for (int i = 0; i < dt_checkpoint_count(c); i++) {
      dt_checkpoint_entry en;
      CHECK(dt_checkpoint_entry_at(c, i, &en) == DTRAIN_OK);
      CHECK(en.begin == at && strcmp(en.dtype, "F32") == 0);
      at = en.end;
    }
    CHECK((8 + dt_checkpoint_header_size(c)) % 8 == 0);
    CHECK(dt_checkpoint_file_size(c) == 8 + dt_checkpoint_header_size(c) + at);
    CHECK(dt_checkpoint_meta(c, "config") && strcmp(dt_checkpoint_meta(c, "config"), st.config) == 0);
    CHECK(dt_checkpoint_meta(c, "format") && strcmp(dt_checkpoint_meta(c, "format"), "dtrain") == 0);
    CHECK(dt_checkpoint_meta(c, "step") && strcmp(dt_checkpoint_meta(c, "step"), "8") == 0);
    CHECK(dt_checkpoint_meta(c, "optimizer") && strstr(dt_checkpoint_meta(c, "optimizer"), "\"kind\":\"adam\""));
    CHECK(dt_checkpoint_meta(c, "nope") == NULL);
    int found = 0;
    for (int i = 0; i < dt_checkpoint_meta_count(c); i++) {
      const char *k, *v;
      CHECK(dt_checkpoint_meta_at(c, i, &k, &v) == DTRAIN_OK);
      found += strcmp(k, "layout_hash") == 0;
    }
    CHECK(found == 1);
    /* read_f32 of a named tensor equals the parameter. */
    int wi = dt_checkpoint_find(c, "l1.weight");
    dt_param_info info;
    dt_params_info(a.P, dt_params_find(a.P, "l1.weight"), &info);
    float *tmp = (float *)malloc(info.size * sizeof(float));
    CHECK(wi >= 0 && dt_checkpoint_read_f32(c, wi, tmp, info.size) == DTRAIN_OK);
    CHECK(memcmp(tmp, dt_params_data(a.P) + info.offset, info.size * sizeof(float)) == 0);
    CHECK_ERR(dt_checkpoint_read_f32(c, wi, tmp, info.size - 1), DTRAIN_ERR_SHAPE, "l1.weight");
    CHECK_ERR(dt_checkpoint_entry_at(c, 999, NULL), DTRAIN_ERR_NULL_ARG, "NULL");
    dt_checkpoint_entry en;
    CHECK_ERR(dt_checkpoint_entry_at(c, 999, &en), DTRAIN_ERR_INDEX, "999");
    CHECK(dt_checkpoint_find(c, "missing") == DTRAIN_ERR_NOT_FOUND);
    free(tmp);
    dt_checkpoint_close(c);
  }
  dt_checkpoint_close(NULL);

  /* Weights only into a third model: parameters equal, optimizer untouched. */
  model w;
  model_init(&w, 3, DTRAIN_OPTIM_SGD, 1);
  CHECK_MSG(dt_checkpoint_load_weights(path, w.P) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(dt_params_checksum(w.P) == dt_params_checksum(a.P));
  CHECK(dt_optim_steps(w.opt) == 0);
  /* Full load into an SGD optimizer is refused: the file holds Adam state. */
  dt_train_state sw = full_state(&w);
  CHECK_ERR(dt_checkpoint_load(path, &sw), DTRAIN_ERR_MISMATCH, "adam");
  /* Without an optimizer: parameters, counters and RNGs only. */
  sw.optim = NULL;
  CHECK(dt_checkpoint_load(path, &sw) == DTRAIN_OK && sw.step == 8);
  model_free(&w);
  model_free(&a);
  model_free(&b);
}

/* ---- an independent reader ---------------------------------------------------------
 * A minimal JSON parser written here (not the library's) and the safetensors
 * layout from the spec: u64 LE header length, JSON, then the byte buffer. */
typedef struct jv {
  int t; /* 'o' object, 'a' array, 's' string, 'n' number, 'l' literal */
  char *s;
  double num;
  int n;
  char **keys;
  struct jv *kids;
} jv;

static const char *jp;
static int jparse(jv *v);
static void jskip(void) { while (*jp == ' ' || *jp == '\n' || *jp == '\r' || *jp == '\t') jp++; }
static char *jstring(void) {
  size_t cap = 64, n = 0;
  char *s = (char *)malloc(cap);
  jp++;
  while (*jp && *jp != '"') {
    char c = *jp++;
    if (c == '\\') {
      char e = *jp++;
      c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'b' ? '\b' : e == 'f' ? '\f' : e;
      if (e == 'u') { /* ASCII only here */
        char hx[5];
        memcpy(hx, jp, 4);
        hx[4] = 0;
        c = (char)strtol(hx, NULL, 16);
        jp += 4;
      }
    }
    if (n + 2 > cap) s = (char *)realloc(s, cap *= 2);
    s[n++] = c;
  }
  jp++;
  s[n] = 0;
  return s;
}
static int jparse(jv *v) {
  memset(v, 0, sizeof *v);
  jskip();
  if (*jp == '{' || *jp == '[') {
    int obj = *jp == '{';
    v->t = obj ? 'o' : 'a';
    jp++;
    jskip();
    if (*jp == (obj ? '}' : ']')) { jp++; return 1; }
    for (;;) {
      v->kids = (jv *)realloc(v->kids, (size_t)(v->n + 1) * sizeof(jv));
      v->keys = (char **)realloc(v->keys, (size_t)(v->n + 1) * sizeof(char *));
      v->keys[v->n] = NULL;
      jskip();
      if (obj) {
        if (*jp != '"') return 0;
        v->keys[v->n] = jstring();
        jskip();
        if (*jp++ != ':') return 0;
      }
      if (!jparse(&v->kids[v->n])) return 0;
      v->n++;
      jskip();
      if (*jp == ',') { jp++; continue; }
      if (*jp == (obj ? '}' : ']')) { jp++; return 1; }
      return 0;
    }
  }
  if (*jp == '"') { v->t = 's'; v->s = jstring(); return 1; }
  if (*jp == '-' || (*jp >= '0' && *jp <= '9')) {
    char *end;
    v->t = 'n';
    v->num = strtod(jp, &end);
    jp = end;
    return 1;
  }
  return 0;
}
static void jfree(jv *v) {
  for (int i = 0; i < v->n; i++) { jfree(&v->kids[i]); free(v->keys[i]); }
  free(v->kids);
  free(v->keys);
  free(v->s);
}
static jv *jget(jv *o, const char *k) {
  for (int i = 0; o->t == 'o' && i < o->n; i++)
    if (strcmp(o->keys[i], k) == 0) return &o->kids[i];
  return NULL;
}

/* Checks one tensor of the file against floats in memory, bit for bit. */
static int indep_check_tensor(jv *root, const unsigned char *buf, size_t nbuf, const char *name,
                              const dt_param_info *info, const float *expect) {
  jv *t = jget(root, name);
  if (!t) { fprintf(stderr, "independent reader: no tensor '%s'\n", name); return 0; }
  jv *dtype = jget(t, "dtype"), *shape = jget(t, "shape"), *offs = jget(t, "data_offsets");
  if (!dtype || strcmp(dtype->s, "F32") != 0 || !shape || !offs || offs->n != 2) return 0;
  if (shape->n != info->ndim) return 0;
  for (int d = 0; d < info->ndim; d++) if ((int64_t)shape->kids[d].num != info->shape[d]) return 0;
  size_t b = (size_t)offs->kids[0].num, e = (size_t)offs->kids[1].num;
  if (e - b != info->size * 4 || e > nbuf) return 0;
  for (size_t i = 0; i < info->size; i++) {
    const unsigned char *q = buf + b + 4 * i;
    uint32_t u = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24, w;
    memcpy(&w, &expect[i], 4);
    if (u != w) { fprintf(stderr, "independent reader: '%s'[%zu] differs\n", name, i); return 0; }
  }
  return 1;
}

static void test_independent_reader(void) {
  char path[512];
  path_of(path, sizeof path, "indep.safetensors");
  model a;
  int64_t e = 0, b = 0;
  model_init(&a, 21, DTRAIN_OPTIM_ADAMW, 4);
  model_train(&a, &e, &b, 3);
  dt_train_state st = full_state(&a);
  CHECK(dt_checkpoint_save(path, &st) == DTRAIN_OK);
  size_t n = 0;
  unsigned char *file = read_all(path, &n);
  CHECK(file && n >= 8);
  if (!file) { model_free(&a); return; }
  uint64_t hn = le64(file);
  CHECK(hn + 8 <= n && file[8] == '{' && (8 + hn) % 8 == 0);
  char *hdr = (char *)malloc(hn + 1);
  memcpy(hdr, file + 8, hn);
  hdr[hn] = 0;
  jv root;
  jp = hdr;
  int ok = jparse(&root);
  jskip();
  CHECK(ok && root.t == 'o' && *jp == '\0'); /* only spaces pad the header */
  const unsigned char *buf = file + 8 + hn;
  size_t nbuf = n - 8 - hn;
  /* Every byte of the buffer belongs to exactly one tensor. */
  size_t covered = 0;
  for (int i = 0; ok && i < root.n; i++) {
    if (strcmp(root.keys[i], "__metadata__") == 0) continue;
    jv *o = jget(&root.kids[i], "data_offsets");
    CHECK(o && o->n == 2);
    if (o && o->n == 2) covered += (size_t)(o->kids[1].num - o->kids[0].num);
  }
  CHECK(covered == nbuf);
  int np = dt_params_count(a.P);
  for (int i = 0; ok && i < np; i++) {
    dt_param_info info;
    dt_params_info(a.P, i, &info);
    CHECK_MSG(indep_check_tensor(&root, buf, nbuf, info.name, &info, dt_params_data(a.P) + info.offset), "%s",
              info.name);
    if (!info.trainable) continue;
    char nm[256];
    snprintf(nm, sizeof nm, "optim.exp_avg.%s", info.name);
    CHECK_MSG(indep_check_tensor(&root, buf, nbuf, nm, &info, dt_optim_state(a.opt, 0) + info.offset), "%s", nm);
    snprintf(nm, sizeof nm, "optim.exp_avg_sq.%s", info.name);
    CHECK_MSG(indep_check_tensor(&root, buf, nbuf, nm, &info, dt_optim_state(a.opt, 1) + info.offset), "%s", nm);
  }
  jv *meta = jget(&root, "__metadata__");
  CHECK(meta && meta->t == 'o');
  for (int i = 0; meta && i < meta->n; i++) CHECK(meta->kids[i].t == 's'); /* strings only */
  jv *step = meta ? jget(meta, "step") : NULL;
  CHECK(step && strcmp(step->s, "3") == 0);
  jv *dp = meta ? jget(meta, "data_index") : NULL;
  CHECK(dp && strcmp(dp->s, "0") == 0);
  if (ok) jfree(&root);
  free(hdr);
  free(file);
  model_free(&a);
}

/* ---- corrupted files ------------------------------------------------------------------- */

/* Loads `path` fully into m; returns the code and checks that m did not change. */
static dt_result load_unchanged(model *m, const char *path, int *unchanged) {
  snapshot s;
  snap_take(&s, m);
  dt_train_state st = full_state(m);
  st.epoch = 77;
  dt_result r = dt_checkpoint_load(path, &st);
  *unchanged = snap_same(&s, m) && st.epoch == 77;
  snap_free(&s);
  return r;
}

static void test_truncated(void) {
  char good[512], bad[512];
  path_of(good, sizeof good, "trunc_good.safetensors");
  path_of(bad, sizeof bad, "trunc_bad.safetensors");
  save_trained(good, DTRAIN_OPTIM_ADAM);
  size_t n;
  unsigned char *f = read_all(good, &n);
  size_t hn = (size_t)le64(f);
  size_t cuts[] = {0, 1, 7, 8, 9, 8 + hn / 2, 8 + hn - 1, 8 + hn, 8 + hn + 1, 8 + hn + 4, n / 2 + hn / 2, n - 4, n - 1};
  model m;
  model_init(&m, 99, DTRAIN_OPTIM_ADAM, 1);
  for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
    write_all(bad, f, cuts[k]);
    int same;
    dt_result r = load_unchanged(&m, bad, &same);
    CHECK_MSG(r == DTRAIN_ERR_CORRUPT, "cut at %zu of %zu: %s (%s)", cuts[k], n, dt_result_name(r), dt_last_error());
    CHECK_MSG(same, "cut at %zu changed the model", cuts[k]);
    CHECK(strstr(dt_last_error(), bad) != NULL);
  }
  CHECK_ERR(dt_checkpoint_load_weights(bad, m.P), DTRAIN_ERR_CORRUPT, "out of bounds");
  /* An extra byte at the end is refused too. */
  unsigned char *g = (unsigned char *)malloc(n + 1);
  memcpy(g, f, n);
  g[n] = 0;
  write_all(bad, g, n + 1);
  int same;
  CHECK(load_unchanged(&m, bad, &same) == DTRAIN_ERR_CORRUPT && same);
  CHECK(strstr(dt_last_error(), "cover") != NULL);
  /* The good file still loads. */
  dt_train_state st = full_state(&m);
  CHECK_MSG(dt_checkpoint_load(good, &st) == DTRAIN_OK, "%s", dt_last_error());
  free(g);
  free(f);
  model_free(&m);
}

static void test_header_flips(void) {
  char good[512], bad[512];
  path_of(good, sizeof good, "flip_good.safetensors");
  path_of(bad, sizeof bad, "flip_bad.safetensors");
  save_trained(good, DTRAIN_OPTIM_ADAM);
  size_t n;
  unsigned char *f = read_all(good, &n);
  size_t hn = (size_t)le64(f);
  model m;
  model_init(&m, 98, DTRAIN_OPTIM_ADAM, 1);
  const unsigned char masks[3] = {0x01, 0x80, 0x24};
  int counts[3] = {0, 0, 0}, accepted = 0, changed = 0;
  for (size_t pos = 8; pos < 8 + hn; pos++) {
    for (int k = 0; k < 3; k++) {
      f[pos] ^= masks[k];
      write_all(bad, f, n);
      f[pos] ^= masks[k];
      int same;
      dt_result r = load_unchanged(&m, bad, &same);
      if (r == DTRAIN_ERR_FORMAT) counts[0]++;
      else if (r == DTRAIN_ERR_CORRUPT) counts[1]++;
      else if (r == DTRAIN_ERR_MISMATCH) counts[2]++;
      else {
        if (accepted < 5) fprintf(stderr, "flip 0x%02x at header byte %zu accepted: %s\n", masks[k], pos - 8, dt_result_name(r));
        accepted++;
      }
      if (!same && r != DTRAIN_OK) changed++;
    }
  }
  CHECK_MSG(accepted == 0, "%d flipped headers accepted", accepted);
  CHECK_MSG(changed == 0, "%d refused loads changed the model", changed);
  /* Broken JSON is a format error; a well-formed but changed header fails the checksum. */
  CHECK(counts[0] > 0 && counts[1] > 0);
  /* Flipped bytes in the data are caught by the checksum. */
  for (size_t pos = 8 + hn; pos < n; pos += (n - 8 - hn) / 7 + 1) {
    f[pos] ^= 0x10;
    write_all(bad, f, n);
    f[pos] ^= 0x10;
    int same;
    dt_result r = load_unchanged(&m, bad, &same);
    CHECK_MSG(r == DTRAIN_ERR_CORRUPT && same, "data flip at %zu: %s", pos, dt_result_name(r));
    CHECK(strstr(dt_last_error(), "checksum") != NULL);
  }
  free(f);
  model_free(&m);
}

static void test_header_length(void) {
  char good[512], bad[512];
  path_of(good, sizeof good, "len_good.safetensors");
  path_of(bad, sizeof bad, "len_bad.safetensors");
  save_trained(good, DTRAIN_OPTIM_ADAM);
  size_t n;
  unsigned char *f = read_all(good, &n);
  uint64_t hn = le64(f);
  model m;
  model_init(&m, 97, DTRAIN_OPTIM_ADAM, 1);
  struct { uint64_t len; dt_result code; const char *needle; } cases[] = {
    {n - 7, DTRAIN_ERR_CORRUPT, "exceeds the file"},
    {n, DTRAIN_ERR_CORRUPT, "exceeds the file"},
    {UINT64_MAX, DTRAIN_ERR_CORRUPT, "exceeds the file"},
    {(uint64_t)1 << 63, DTRAIN_ERR_CORRUPT, "exceeds the file"},
    {0, DTRAIN_ERR_FORMAT, "does not start with '{'"},
    {hn - 9, DTRAIN_ERR_FORMAT, "header JSON"},
    {hn + 8, DTRAIN_ERR_FORMAT, "header JSON"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    put_le64(f, cases[k].len);
    write_all(bad, f, n);
    int same;
    dt_result r = load_unchanged(&m, bad, &same);
    CHECK_MSG(r == cases[k].code && same, "length %llu: %s (%s)", (unsigned long long)cases[k].len,
              dt_result_name(r), dt_last_error());
    CHECK_MSG(strstr(dt_last_error(), cases[k].needle) != NULL, "'%s' lacks '%s'", dt_last_error(), cases[k].needle);
  }
  /* Not a safetensors file at all (text, an image): said so, not only that the
   * first 8 bytes read as a length make no sense (issue 22 item 11). */
  {
    const char *text = "name,value\n1,2\n3,4\n";
    write_all(bad, text, strlen(text));
    CHECK_ERR(dt_checkpoint_load_weights(bad, m.P), DTRAIN_ERR_FORMAT, "not a safetensors file");
    CHECK(dt_checkpoint_open(bad) == NULL && strstr(dt_last_error(), "not a safetensors file") != NULL);
    static const unsigned char png[16] = {0x89, 'P', 'N', 'G', 13, 10, 26, 10, 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
    write_all(bad, png, sizeof png);
    CHECK_ERR(dt_checkpoint_load_weights(bad, m.P), DTRAIN_ERR_FORMAT, "not a safetensors file");
  }
  /* Over the 100 MB cap but within a (sparse) file: FORMAT before reading any JSON. */
  FILE *big = fopen(bad, "wb");
  if (big) {
    unsigned char h[8];
    put_le64(h, (uint64_t)DTRAIN_CHECKPOINT_MAX_HEADER + 1);
    fwrite(h, 1, 8, big);
    fputc('{', big);
    fseek(big, (long)DTRAIN_CHECKPOINT_MAX_HEADER + 16, SEEK_SET);
    fputc(' ', big);
    fclose(big);
    CHECK_ERR(dt_checkpoint_load_weights(bad, m.P), DTRAIN_ERR_FORMAT, "limit");
    remove(bad);
  }
  free(f);
  model_free(&m);
}

/* Crafted files for a two-tensor model: w [2,3] and b [3]. */
static void test_crafted(void) {
  char p[512];
  path_of(p, sizeof p, "crafted.safetensors");
  dt_params *P = dt_params_create(5);
  int64_t ws[2] = {2, 3}, bs[1] = {3};
  dt_params_add(P, "w", 2, ws, dt_init_normal(0, 1));
  dt_params_add(P, "b", 1, bs, dt_init_normal(0, 1));
  float vals[9];
  for (int i = 0; i < 9; i++) vals[i] = (float)i * 0.5f - 1.0f;
  unsigned char le[40];
  for (int i = 0; i < 9; i++) {
    uint32_t u;
    memcpy(&u, &vals[i], 4);
    for (int k = 0; k < 4; k++) le[4 * i + k] = (unsigned char)(u >> (8 * k));
  }
  memset(le + 36, 0, 4);
  const char *W = "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}";
  const char *B = "\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,36]}";
  char h[1024];
  uint64_t before = dt_params_checksum(P);

  /* A valid hand-written file (whitespace, other key order) loads. */
  snprintf(h, sizeof h, "{ \"b\" : {\"shape\": [3], \"data_offsets\": [24, 36], \"dtype\": \"F32\"},\n %s , "
                        "\"__metadata__\": {\"who\": \"hand\"} }   ", W);
  write_st(p, h, le, 36);
  CHECK_MSG(dt_checkpoint_load_weights(p, P) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(memcmp(dt_params_data(P), vals, 6 * sizeof(float)) == 0);
  /* The full state needs a dtrain checkpoint. */
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = P;
  CHECK_ERR(dt_checkpoint_load(p, &st), DTRAIN_ERR_FORMAT, "not a dtrain checkpoint");
  before = dt_params_checksum(P);

  struct { const char *header; size_t ndata; dt_result code; const char *needle; } cases[] = {
    /* offsets */
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,40]}}", 36, DTRAIN_ERR_CORRUPT, "out of bounds"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[20,32]}}", 32, DTRAIN_ERR_CORRUPT, "overlap"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[28,40]}}", 40, DTRAIN_ERR_CORRUPT, "gap"},
    {"{%W,%B}", 40, DTRAIN_ERR_CORRUPT, "cover"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[36,24]}}", 36, DTRAIN_ERR_CORRUPT, "'b'"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,32]}}", 32, DTRAIN_ERR_CORRUPT, "'b'"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,99999999999999999999999]}}", 36, DTRAIN_ERR_FORMAT, "'b'"},
    /* dtype and shape */
    {"{%W,\"b\":{\"dtype\":\"F16\",\"shape\":[6],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "F16"},
    {"{%W,\"b\":{\"dtype\":\"X32\",\"shape\":[3],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "X32"},
    {"{\"w\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]},%B}", 36, DTRAIN_ERR_MISMATCH, "[3,2]"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3,1],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_MISMATCH, "'b'"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,3],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "7 dimensions"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3.0],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "'b'"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[-3],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "'b'"},
    /* names */
    {"{%W}", 24, DTRAIN_ERR_MISMATCH, "'b' is missing"},
    {"{%W,%B,\"extra\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[36,40]}}", 40, DTRAIN_ERR_MISMATCH, "'extra'"},
    {"{%W,%B,%B}", 36, DTRAIN_ERR_FORMAT, "duplicate"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[24,36],\"extra\":1}}", 36, DTRAIN_ERR_FORMAT, "'extra'"},
    {"{%W,\"b\":{\"shape\":[3],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "dtype"},
    /* metadata */
    {"{\"__metadata__\":{\"k\":1},%W,%B}", 36, DTRAIN_ERR_FORMAT, "'k'"},
    {"{\"__metadata__\":[],%W,%B}", 36, DTRAIN_ERR_FORMAT, "__metadata__"},
    {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "duplicate"},
    /* not JSON, or JSON that is not strict */
    {"{this is not json}", 36, DTRAIN_ERR_FORMAT, "header JSON"},
    {"[1,2,3]", 36, DTRAIN_ERR_FORMAT, "start with '{'"},
    {"{%W,%B,}", 36, DTRAIN_ERR_FORMAT, "header JSON"},
    {"{%W,%B}x", 36, DTRAIN_ERR_FORMAT, "after the JSON"},
    {"{%W,%B} {}", 36, DTRAIN_ERR_FORMAT, "after the JSON"},
    {"{%W,\"b\":{\"dtype\":\"F32\",\"shape\":[03],\"data_offsets\":[24,36]}}", 36, DTRAIN_ERR_FORMAT, "leading zero"},
    {"{\"__metadata__\":{\"k\":\"a\tb\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "control character"},
    {"{\"__metadata__\":{\"k\":\"a\\qb\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "bad escape"},
    {"{\"__metadata__\":{\"k\":\"\\ud800x\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "surrogate"},
    {"{\"__metadata__\":{\"k\":\"\\u0000\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "u0000"},
    {"{\"__metadata__\":{\"k\":\"\xc3\x28\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "UTF-8"},
    {"{\"__metadata__\":{\"k\":\"\xed\xa0\x80\"},%W,%B}", 36, DTRAIN_ERR_FORMAT, "UTF-8"},
    {"{\"__metadata__\":{\"k\":\"abc}}", 36, DTRAIN_ERR_FORMAT, "unterminated"},
    {"{\"n\":nul}", 36, DTRAIN_ERR_FORMAT, "header JSON"},
    {"{\"n\":NaN}", 36, DTRAIN_ERR_FORMAT, "header JSON"},
    {"{\"x\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
     36, DTRAIN_ERR_FORMAT, "deeply"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    /* Expand %W and %B. */
    char *o = h;
    for (const char *s = cases[k].header; *s; s++) {
      if (s[0] == '%' && (s[1] == 'W' || s[1] == 'B')) {
        const char *ins = s[1] == 'W' ? W : B;
        memcpy(o, ins, strlen(ins));
        o += strlen(ins);
        s++;
      } else {
        *o++ = *s;
      }
    }
    *o = 0;
    unsigned char data[64];
    memset(data, 0, sizeof data);
    memcpy(data, le, 40);
    write_st(p, h, data, cases[k].ndata);
    dt_result r = dt_checkpoint_load_weights(p, P);
    CHECK_MSG(r == cases[k].code, "case %zu '%s': %s (%s)", k, h, dt_result_name(r), dt_last_error());
    CHECK_MSG(strstr(dt_last_error(), cases[k].needle) != NULL, "case %zu: '%s' lacks '%s'", k, dt_last_error(),
              cases[k].needle);
    CHECK_MSG(dt_params_checksum(P) == before, "case %zu changed the params", k);
  }
  /* Listing accepts other dtypes (not checked against a model). */
  snprintf(h, sizeof h, "{%s,\"b\":{\"dtype\":\"F16\",\"shape\":[6],\"data_offsets\":[24,36]},"
                        "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[36,44]},"
                        "\"e\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[44,44]}}", W);
  unsigned char data[64];
  memset(data, 0, sizeof data);
  write_st(p, h, data, 44);
  dt_checkpoint *c = dt_checkpoint_open(p);
  CHECK_MSG(c != NULL, "%s", dt_last_error());
  if (c) {
    dt_checkpoint_entry en;
    CHECK(dt_checkpoint_count(c) == 4);
    int si = dt_checkpoint_find(c, "s");
    CHECK(si >= 0 && dt_checkpoint_entry_at(c, si, &en) == DTRAIN_OK && en.ndim == 0 && strcmp(en.dtype, "I64") == 0);
    float f6[6];
    CHECK_ERR(dt_checkpoint_read_f32(c, dt_checkpoint_find(c, "b"), f6, 6), DTRAIN_ERR_FORMAT, "F16");
    dt_checkpoint_close(c);
  }
  /* Missing and unreadable files. */
  path_of(p, sizeof p, "does_not_exist.safetensors");
  CHECK_ERR(dt_checkpoint_load_weights(p, P), DTRAIN_ERR_IO, "does_not_exist");
  CHECK(dt_checkpoint_open(p) == NULL && dt_last_result() == DTRAIN_ERR_IO);
  CHECK_ERR(dt_checkpoint_load_weights(tmpdir, P), DTRAIN_ERR_IO, tmpdir);
  CHECK_ERR(dt_checkpoint_load_weights(NULL, P), DTRAIN_ERR_NULL_ARG, "path");
  CHECK_ERR(dt_checkpoint_load(p, NULL), DTRAIN_ERR_NULL_ARG, "state");
  dt_params_destroy(P);
}

/* Files that are valid but do not fit the model or the optimizer. */
static void test_mismatch(void) {
  char p[512];
  path_of(p, sizeof p, "mismatch.safetensors");
  save_trained(p, DTRAIN_OPTIM_ADAM);
  int same;
  /* Wider hidden layer: shape mismatch naming the tensor. */
  {
    model m;
    memset(&m, 0, sizeof m);
    m.P = dt_params_create(1);
    dt_nn_linear_init(&m.l1, m.P, "l1", NF, 17, 1);
    dt_nn_batch_norm_init(&m.bn, m.P, "bn", 17);
    dt_nn_linear_init(&m.l2, m.P, "l2", 17, NC, 1);
    m.temp = dt_params_add(m.P, "temperature", 0, NULL, dt_init_constant(1.0f));
    dt_optim_options d = optim_desc(DTRAIN_OPTIM_ADAM);
    m.opt = dt_optim_create(m.P, &d);
    m.g = dt_graph_create(m.P, NULL);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    CHECK(strstr(dt_last_error(), "l1.weight") && strstr(dt_last_error(), "[16,8]") && strstr(dt_last_error(), "[17,8]"));
    CHECK_ERR(dt_checkpoint_load_weights(p, m.P), DTRAIN_ERR_MISMATCH, "l1.weight");
    model_free(&m);
  }
  /* A model without the scalar: unknown tensor. */
  {
    model m;
    memset(&m, 0, sizeof m);
    m.P = dt_params_create(1);
    dt_nn_linear_init(&m.l1, m.P, "l1", NF, 16, 1);
    dt_nn_batch_norm_init(&m.bn, m.P, "bn", 16);
    dt_nn_linear_init(&m.l2, m.P, "l2", 16, NC, 1);
    dt_optim_options d = optim_desc(DTRAIN_OPTIM_ADAM);
    m.opt = dt_optim_create(m.P, &d);
    m.g = dt_graph_create(m.P, NULL);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    CHECK_MSG(strstr(dt_last_error(), "temperature") != NULL, "%s", dt_last_error());
    CHECK_ERR(dt_checkpoint_load_weights(p, m.P), DTRAIN_ERR_MISMATCH, "unknown tensor 'temperature'");
    model_free(&m);
  }
  /* Same names and shapes in another order: the layout hash differs. */
  {
    model m;
    memset(&m, 0, sizeof m);
    m.P = dt_params_create(1);
    m.temp = dt_params_add(m.P, "temperature", 0, NULL, dt_init_constant(1.0f));
    dt_nn_linear_init(&m.l1, m.P, "l1", NF, 16, 1);
    dt_nn_batch_norm_init(&m.bn, m.P, "bn", 16);
    dt_nn_linear_init(&m.l2, m.P, "l2", 16, NC, 1);
    dt_optim_options d = optim_desc(DTRAIN_OPTIM_ADAM);
    m.opt = dt_optim_create(m.P, &d);
    m.g = dt_graph_create(m.P, NULL);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    CHECK_MSG(strstr(dt_last_error(), "layout") != NULL, "%s", dt_last_error());
    /* Weights by name still load. */
    CHECK_MSG(dt_checkpoint_load_weights(p, m.P) == DTRAIN_OK, "%s", dt_last_error());
    model_free(&m);
  }
  /* Other optimizers: kind and slots must match. */
  {
    model m;
    model_init(&m, 1, DTRAIN_OPTIM_ADAMW, 1);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    CHECK(strstr(dt_last_error(), "adam") && strstr(dt_last_error(), "adamw"));
    model_free(&m);
    model_init(&m, 1, DTRAIN_OPTIM_RMSPROP, 1);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    model_free(&m);
  }
  /* Saved without optimizer and graph: loading them is refused, loading without works. */
  {
    model m;
    model_init(&m, 1, DTRAIN_OPTIM_ADAM, 1);
    dt_train_state st;
    memset(&st, 0, sizeof st);
    st.params = m.P;
    st.step = 42;
    CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
    CHECK(load_unchanged(&m, p, &same) == DTRAIN_ERR_MISMATCH && same);
    CHECK_MSG(strstr(dt_last_error(), "graph") != NULL, "%s", dt_last_error());
    st.graph = NULL;
    st.optim = m.opt;
    CHECK_ERR(dt_checkpoint_load(p, &st), DTRAIN_ERR_MISMATCH, "no optimizer state");
    st.optim = NULL;
    CHECK(dt_checkpoint_load(p, &st) == DTRAIN_OK && st.step == 42);
    model_free(&m);
  }
}

static void test_save_errors(void) {
  char p[512];
  path_of(p, sizeof p, "save_err.safetensors");
  dt_params *P = dt_params_create(1);
  int64_t s[1] = {4};
  dt_params_add(P, "x", 1, s, dt_init_zeros());
  dt_params_add(P, "optim.exp_avg.x", 1, s, dt_init_zeros());
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  dt_optim *o = dt_optim_create(P, &d);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = P;
  st.optim = o;
  CHECK_ERR(dt_checkpoint_save(p, &st), DTRAIN_ERR_INVALID_ARG, "collides");
  st.optim = NULL;
  CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK); /* without optimizer state no collision */
  st.config = "bad \xff utf-8";
  CHECK_ERR(dt_checkpoint_save(p, &st), DTRAIN_ERR_INVALID_ARG, "UTF-8");
  st.config = NULL;
  st.epoch = -1;
  CHECK_ERR(dt_checkpoint_save(p, &st), DTRAIN_ERR_INVALID_ARG, ">= 0");
  st.epoch = 0;
  CHECK_ERR(dt_checkpoint_save(NULL, &st), DTRAIN_ERR_NULL_ARG, "path");
  CHECK_ERR(dt_checkpoint_save(p, NULL), DTRAIN_ERR_NULL_ARG, "state");
  st.params = NULL;
  CHECK_ERR(dt_checkpoint_save(p, &st), DTRAIN_ERR_NULL_ARG, "params");
  /* An optimizer made for other (smaller) params is refused, not overrun. */
  dt_params *Q = dt_params_create(1);
  int64_t s2[1] = {2};
  dt_params_add(Q, "y", 1, s2, dt_init_zeros());
  dt_optim *oq = dt_optim_create(Q, &d);
  st.params = P;
  st.optim = oq;
  CHECK_ERR(dt_checkpoint_save(p, &st), DTRAIN_ERR_MISMATCH, "not created for these params");
  st.optim = NULL;
  CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
  st.optim = oq;
  CHECK_ERR(dt_checkpoint_load(p, &st), DTRAIN_ERR_MISMATCH, "not created for these params");
  st.optim = NULL;
  dt_optim_destroy(oq);
  dt_params_destroy(Q);
  /* An empty model saves and loads. */
  dt_params *E = dt_params_create(1);
  st.params = E;
  CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
  CHECK_MSG(dt_checkpoint_load(p, &st) == DTRAIN_OK, "%s", dt_last_error());
  dt_params_destroy(E);
  dt_optim_destroy(o);
  dt_params_destroy(P);
}

/* ---- resume is bitwise --------------------------------------------------------------- */
static void test_resume_bitwise(void) {
  const dt_optim_kind kinds[4] = {DTRAIN_OPTIM_SGD, DTRAIN_OPTIM_ADAM, DTRAIN_OPTIM_ADAMW, DTRAIN_OPTIM_RMSPROP};
  char p[512];
  path_of(p, sizeof p, "resume.safetensors");
  for (int k = 0; k < 4; k++) {
    const int K = 13, M = 11; /* 6 batches per epoch: the save falls mid-epoch */
    model a, b, c;
    int64_t e = 0, bi = 0;
    model_init(&a, 5, kinds[k], 7);
    model_train(&a, &e, &bi, K);
    dt_train_state st = full_state(&a);
    st.epoch = e;
    st.data_epoch = e;
    st.data_index = bi;
    CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
    model_train(&a, &e, &bi, M);

    /* A fresh model with other seeds, loaded, trained M more from the stored position. */
    model_init(&b, 500 + (uint64_t)k, kinds[k], 8);
    dt_train_state ld = full_state(&b);
    CHECK_MSG(dt_checkpoint_load(p, &ld) == DTRAIN_OK, "%s", dt_last_error());
    CHECK(ld.data_epoch == 2 && ld.data_index == 1 && ld.step == K);
    int64_t e2 = ld.data_epoch, b2 = ld.data_index;
    model_train(&b, &e2, &b2, M);
    CHECK_MSG(dt_params_checksum(a.P) == dt_params_checksum(b.P), "optimizer %d: resumed run differs", k);
    CHECK(memcmp(dt_params_data(a.P), dt_params_data(b.P), dt_params_size(a.P) * sizeof(float)) == 0);
    for (int s = 0; s < dt_optim_state_slots(a.opt); s++)
      CHECK_MSG(memcmp(dt_optim_state(a.opt, s), dt_optim_state(b.opt, s), dt_params_size(a.P) * sizeof(float)) == 0,
                "optimizer %d slot %d", k, s);
    CHECK(dt_optim_steps(a.opt) == dt_optim_steps(b.opt));
    uint64_t ga[4], gb[4];
    dt_graph_rng_state(a.g, ga);
    dt_graph_rng_state(b.g, gb);
    CHECK(memcmp(ga, gb, sizeof ga) == 0);

    /* Control: without the graph RNG the dropout masks differ, and so does the run. */
    model_init(&c, 600, kinds[k], 8);
    dt_train_state lc = full_state(&c);
    lc.graph = NULL;
    CHECK(dt_checkpoint_load(p, &lc) == DTRAIN_OK);
    e2 = lc.data_epoch;
    b2 = lc.data_index;
    model_train(&c, &e2, &b2, M);
    CHECK(dt_params_checksum(a.P) != dt_params_checksum(c.P));
    model_free(&a);
    model_free(&b);
    model_free(&c);
  }
}

/* ---- atomic save ------------------------------------------------------------------------- */
static int count_tmp_files(void) {
  DIR *d = opendir(tmpdir);
  int n = 0;
  struct dirent *de;
  if (!d) return -1;
  while ((de = readdir(d)) != NULL) n += strstr(de->d_name, ".tmp-") != NULL;
  closedir(d);
  return n;
}

static void test_atomic(void) {
#if defined(_WIN32)
  th_skip("Windows: no RLIMIT_FSIZE to make a write fail");
#else
  char p[512];
  path_of(p, sizeof p, "atomic.safetensors");
  save_trained(p, DTRAIN_OPTIM_ADAM);
  size_t n0;
  unsigned char *orig = read_all(p, &n0);
  model m;
  model_init(&m, 1234, DTRAIN_OPTIM_ADAM, 1);
  dt_train_state st = full_state(&m);

  /* A full disk, simulated with the file size limit (write fails with EFBIG). */
  struct rlimit old, lim;
  void (*old_sig)(int) = signal(SIGXFSZ, SIG_IGN);
  CHECK(getrlimit(RLIMIT_FSIZE, &old) == 0);
  const rlim_t limits[3] = {0, 100, (rlim_t)(n0 / 2)};
  for (int k = 0; k < 3; k++) {
    lim = old;
    lim.rlim_cur = limits[k];
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    dt_result r = dt_checkpoint_save(p, &st);
    setrlimit(RLIMIT_FSIZE, &old);
    CHECK_MSG(r == DTRAIN_ERR_IO, "limit %lu: %s", (unsigned long)limits[k], dt_result_name(r));
    CHECK_MSG(strstr(dt_last_error(), p) && strstr(dt_last_error(), strerror(EFBIG)), "%s", dt_last_error());
    size_t n1;
    unsigned char *now = read_all(p, &n1);
    CHECK(now && n1 == n0 && memcmp(now, orig, n0) == 0); /* the old checkpoint is intact */
    free(now);
    CHECK(count_tmp_files() == 0);                       /* and no temporary file is left */
  }
  signal(SIGXFSZ, old_sig);

  /* A really full file system, when one is offered (e.g. a 64 KiB tmpfs:
   * mount -t tmpfs -o size=64k tmpfs /mnt/tiny; DTRAIN_TEST_FULL_DIR=/mnt/tiny). */
  const char *full_dir = getenv("DTRAIN_TEST_FULL_DIR");
  if (full_dir) {
    char fp[600];
    snprintf(fp, sizeof fp, "%s/ckpt.safetensors", full_dir);
    dt_params *small = dt_params_create(1), *large = dt_params_create(2);
    int64_t s1[1] = {64}, s2[2] = {256, 256};
    dt_params_add(small, "w", 1, s1, dt_init_normal(0, 1));
    dt_params_add(large, "w", 2, s2, dt_init_normal(0, 1));
    dt_train_state a;
    memset(&a, 0, sizeof a);
    a.params = small;
    CHECK_MSG(dt_checkpoint_save(fp, &a) == DTRAIN_OK, "%s", dt_last_error());
    size_t na;
    unsigned char *before = read_all(fp, &na);
    a.params = large;
    CHECK_ERR(dt_checkpoint_save(fp, &a), DTRAIN_ERR_IO, strerror(ENOSPC));
    size_t nb;
    unsigned char *after = read_all(fp, &nb);
    CHECK(before && after && na == nb && memcmp(before, after, na) == 0);
    DIR *dd = opendir(full_dir);
    int leftovers = 0;
    struct dirent *de;
    while (dd && (de = readdir(dd)) != NULL) leftovers += strstr(de->d_name, ".tmp-") != NULL;
    if (dd) closedir(dd);
    CHECK(leftovers == 0);
    printf("test_atomic: full file system at %s: %s\n", full_dir, dt_last_error());
    remove(fp);
    free(before);
    free(after);
    dt_params_destroy(small);
    dt_params_destroy(large);
  }
  /* (/dev/full cannot stand in here: the temporary file is created next to
   * the target, and /dev is not full. The file size limit above, or a tiny
   * tmpfs through DTRAIN_TEST_FULL_DIR, makes the writes themselves fail.) */
  /* A directory that does not exist: the temporary file cannot be created. */
  char q[600];
  snprintf(q, sizeof q, "%s/no/such/dir/x.safetensors", tmpdir);
  CHECK_ERR(dt_checkpoint_save(q, &st), DTRAIN_ERR_IO, "no/such/dir");
  /* The target is a directory: rename fails, the temp file goes away. */
  char dpath[600];
  snprintf(dpath, sizeof dpath, "%s/adir", tmpdir);
  mkdir(dpath, 0700);
  CHECK_ERR(dt_checkpoint_save(dpath, &st), DTRAIN_ERR_IO, "adir");
  CHECK(count_tmp_files() == 0);
  rmdir(dpath);
  /* And a successful save replaces the file. */
  CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
  size_t n2;
  unsigned char *now = read_all(p, &n2);
  CHECK(now && memcmp(now, orig, n0 < n2 ? n0 : n2) != 0);
  free(now);
  free(orig);
  model_free(&m);
#endif
}

/* ---- Python cross-check ---------------------------------------------------------------- */
static void test_python(void) {
#if defined(_WIN32)
  th_skip("Windows: runs python3 through the shell");
#else
  const char *py = "/usr/bin/python3", *script = "tests/safetensors_check.py";
  if (access(py, X_OK) != 0 || access(script, R_OK) != 0) {
    TH_SKIP("%s or %s not found", py, script);
  }
  char p[512], ex[512], cmd[1400];
  path_of(p, sizeof p, "py.safetensors");
  path_of(ex, sizeof ex, "py_expected.txt");
  model a;
  int64_t e = 0, b = 0;
  model_init(&a, 31, DTRAIN_OPTIM_ADAM, 2);
  model_train(&a, &e, &b, 4);
  dt_train_state st = full_state(&a);
  st.config = "python cross-check";
  CHECK(dt_checkpoint_save(p, &st) == DTRAIN_OK);
  FILE *f = fopen(ex, "w");
  for (int i = 0; f && i < dt_params_count(a.P); i++) {
    dt_param_info info;
    dt_params_info(a.P, i, &info);
    for (int s = -1; s < 2; s++) {
      if (s >= 0 && !info.trainable) continue;
      const float *src = (s < 0 ? dt_params_data(a.P) : dt_optim_state(a.opt, s)) + info.offset;
      fprintf(f, "%s%s %d", s < 0 ? "" : s == 0 ? "optim.exp_avg." : "optim.exp_avg_sq.", info.name, info.ndim);
      for (int d = 0; d < info.ndim; d++) fprintf(f, " %lld", (long long)info.shape[d]);
      for (size_t j = 0; j < info.size; j++) fprintf(f, " %a", (double)src[j]);
      fputc('\n', f);
    }
  }
  if (f) fclose(f);
  snprintf(cmd, sizeof cmd, "%s %s %s %s", py, script, p, ex);
  int rc = system(cmd);
  int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code == 77) th_skip("numpy not importable by %s (apt-get install python3-numpy)", py);
  else CHECK_MSG(code == 0, "python cross-check exit code %d", code);
  model_free(&a);
#endif
}

/* ---- no temporary files linger; clean up --------------------------------------------- */
static void cleanup(void) {
  DIR *d = opendir(tmpdir);
  struct dirent *de;
  char p[600];
  if (!d) return;
  while ((de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", tmpdir, de->d_name);
    remove(p);
  }
  closedir(d);
  rmdir(tmpdir);
}

/* DTRAIN_NO_STDIO builds have no file I/O: every file call says so cleanly. */
static void test_no_stdio_build(void) {
  dt_params *P = dt_params_create(1);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = P;
  CHECK_ERR(dt_checkpoint_save("/tmp/x.safetensors", &st), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
  CHECK_ERR(dt_checkpoint_load("/tmp/x.safetensors", &st), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
  CHECK(dt_checkpoint_open("/tmp/x.safetensors") == NULL && dt_last_result() == DTRAIN_ERR_UNSUPPORTED);
  dt_params_destroy(P);
}

/* ---- issue 17: planted links, stale temporaries ------------------------------------------ */
static int count_tmp(const char *prefix) {
  DIR *d = opendir(tmpdir);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d)) != NULL) n += strncmp(de->d_name, prefix, strlen(prefix)) == 0;
  if (d) closedir(d);
  return n;
}

/* A symbolic link planted at every temporary name a writer could pick is
 * never written through: the victim stays as it was (the save either finds a
 * free name or fails with DTRAIN_ERR_IO). Covers the checkpoint and the
 * dt_fit chart (whose writer followed such a link). */
static void test_planted_links(void) {
#if defined(_WIN32)
  th_skip("Windows: no symbolic links without privileges");
#else
  char victim[300], path[300], link[400];
  path_of(victim, sizeof victim, "victim.txt");
  write_all(victim, "precious", 8);
  const char *names[2] = {"linked.safetensors", "linked.svg"};
  for (int w = 0; w < 2; w++) {
    path_of(path, sizeof path, names[w]);
    for (int n = 0; n < 600; n++) {
      snprintf(link, sizeof link, "%s.tmp-%ld-%d", path, (long)getpid(), n);
      CHECK(symlink(victim, link) == 0);
    }
    dt_result r;
    if (w == 0) {
      model m;
      model_init(&m, 5, DTRAIN_OPTIM_SGD, 1);
      dt_train_state st;
      memset(&st, 0, sizeof st);
      st.params = m.P;
      r = dt_checkpoint_save(path, &st);
      model_free(&m);
    } else {
      r = dt_fit_write_svg(path, NULL, 0, "chart");
      if (r == DTRAIN_ERR_UNSUPPORTED) { /* the training loop compiled out (DTRAIN_NO_FIT): no chart writer */
        for (int k = 0; k < 600; k++) {
          snprintf(link, sizeof link, "%s.tmp-%ld-%d", path, (long)getpid(), k);
          unlink(link);
        }
        continue;
      }
    }
    CHECK_MSG(r == DTRAIN_OK || r == DTRAIN_ERR_IO, "%s: %s", names[w], dt_last_error());
    size_t n = 0;
    unsigned char *b = read_all(victim, &n);
    CHECK_MSG(b && n == 8 && memcmp(b, "precious", 8) == 0, "%s wrote through a planted link", names[w]);
    free(b);
    struct stat sb;
    CHECK(r != DTRAIN_OK || (lstat(path, &sb) == 0 && S_ISREG(sb.st_mode)));
    for (int k = 0; k < 600; k++) {
      snprintf(link, sizeof link, "%s.tmp-%ld-%d", path, (long)getpid(), k);
      unlink(link);
    }
    remove(path);
  }
  remove(victim);
#endif
}

/* A process killed while saving leaves "<path>.tmp-PID-N"; the next save to
 * the same path removes it (the PID is gone), and keeps the temporaries of
 * living processes. */
static void test_stale_temporaries(void) {
#if defined(_WIN32)
  th_skip("Windows: forks a process to kill it while saving");
#else
  char path[300], dead[400], alive[400], other[400];
#if !defined(__linux__)
  {
    /* readdir can fail outright (EOVERFLOW: a 32-bit build without
     * large-file support, e.g. armhf under qemu on a 64-bit host's file
     * system): then nothing can be listed and the library says so. On
     * Linux the library reads the directory with getdents64, which has no
     * such limit (the armhf cross run checks it). */
    DIR *d = opendir(tmpdir);
    CHECK(d != NULL);
    if (!d) return;
    errno = 0;
    int listed = readdir(d) != NULL || errno == 0;
    int why = errno;
    closedir(d);
    if (!listed) TH_SKIP("readdir fails here (%s): stale temporaries cannot be listed", strerror(why));
  }
#endif
  path_of(path, sizeof path, "stale.safetensors");
  pid_t child = fork();
  if (child == 0) _exit(0);
  CHECK(child > 0);
  int status;
  waitpid(child, &status, 0); /* reaped: the PID no longer exists */
  snprintf(dead, sizeof dead, "%s.tmp-%ld-3", path, (long)child);
  snprintf(alive, sizeof alive, "%s.tmp-%ld-99999", path, (long)getpid());
  path_of(other, sizeof other, "other.safetensors.tmp-1-0");
  write_all(dead, "half a checkpoint", 17);
  write_all(alive, "being written", 13);
  write_all(other, "another file's", 14);
  model m;
  model_init(&m, 5, DTRAIN_OPTIM_SGD, 1);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = m.P;
  CHECK_MSG(dt_checkpoint_save(path, &st) == DTRAIN_OK, "%s", dt_last_error());
  model_free(&m);
  struct stat sb;
  CHECK_MSG(stat(dead, &sb) != 0, "the temporary of dead process %ld is still there", (long)child);
  CHECK(stat(alive, &sb) == 0);
  CHECK(stat(other, &sb) == 0);
  CHECK(count_tmp("stale.safetensors.tmp-") == 1);
  remove(alive);
  remove(other);
  remove(path);
#endif
}

/* ---- issue 17: checksums always verified, hostile files refused ---------------------------- */
static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL: a checkpoint loader blocked on a FIFO\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}

static void test_checksum_any_format(void) {
  char path[300];
  path_of(path, sizeof path, "other_format.safetensors");
  model m;
  model_init(&m, 5, DTRAIN_OPTIM_SGD, 1);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = m.P;
  CHECK(dt_checkpoint_save(path, &st) == DTRAIN_OK);
  size_t n = 0;
  unsigned char *b = read_all(path, &n);
  /* Another writer's format name: the checksum (over the metadata too) no
   * longer matches, and it must be checked although format is not dtrain. */
  char *fmt = strstr((char *)b + 8, "\"format\":\"dtrain\"");
  CHECK(fmt != NULL);
  if (fmt) fmt[10] = 'D';
  write_all(path, b, n);
  free(b);
  CHECK_ERR(dt_checkpoint_load_weights(path, m.P), DTRAIN_ERR_CORRUPT, "checksum");
  CHECK(dt_checkpoint_open(path) == NULL && dt_last_result() == DTRAIN_ERR_CORRUPT);
  model_free(&m);
  remove(path);
}

static void test_hostile_files(void) {
#if defined(_WIN32)
  th_skip("Windows: no FIFOs or /dev/zero");
#else
  char fifo[300];
  path_of(fifo, sizeof fifo, "fifo.safetensors");
  model m;
  model_init(&m, 5, DTRAIN_OPTIM_SGD, 1);
  CHECK(mkfifo(fifo, 0600) == 0);
  signal(SIGALRM, on_alarm);
  alarm(20);
  CHECK_ERR(dt_checkpoint_load_weights(fifo, m.P), DTRAIN_ERR_IO, "FIFO");
  CHECK(dt_checkpoint_open(fifo) == NULL && dt_last_result() == DTRAIN_ERR_IO);
  CHECK_ERR(dt_checkpoint_load_weights("/dev/zero", m.P), DTRAIN_ERR_IO, "not a regular file");
  CHECK_ERR(dt_checkpoint_load_weights(tmpdir, m.P), DTRAIN_ERR_IO, "directory");
  alarm(0);
  remove(fifo);
  /* A huge sparse file whose header is garbage is refused from its header,
   * without reading the rest. */
  char big[300];
  path_of(big, sizeof big, "sparse.safetensors");
  FILE *f = fopen(big, "wb");
  unsigned char h[16];
  put_le64(h, 4);
  memcpy(h + 8, "{}  ", 4);
  if (f) {
    fwrite(h, 1, 12, f);
    if (fseek(f, (long)((1L << 30) - 1), SEEK_SET) == 0) fputc(0, f);
    fclose(f);
  }
  double t0 = dt_time_now();
  CHECK_ERR(dt_checkpoint_load_weights(big, m.P), DTRAIN_ERR_CORRUPT, "cover");
  CHECK_MSG(dt_time_now() - t0 < 5.0, "refusing the sparse file took %.1f s", dt_time_now() - t0);
  remove(big);
  model_free(&m);
#endif
}

int main(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_STDIO)) {
    TH_RUN(test_no_stdio_build);
    th_skip_item("checkpoint file tests", "DTRAIN_NO_STDIO build has no file I/O");
    return th_summary("checkpoint");
  }
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dtrain_ckpt_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  make_data();
  TH_RUN(test_roundtrip);
  TH_RUN(test_independent_reader);
  TH_RUN(test_truncated);
  TH_RUN(test_header_flips);
  TH_RUN(test_header_length);
  TH_RUN(test_crafted);
  TH_RUN(test_mismatch);
  TH_RUN(test_save_errors);
  TH_RUN(test_resume_bitwise);
  TH_RUN(test_atomic);
  TH_RUN(test_python);
  TH_RUN(test_planted_links);
  TH_RUN(test_stale_temporaries);
  TH_RUN(test_checksum_any_format);
  TH_RUN(test_hostile_files);
  cleanup();
  return th_summary("checkpoint");
}
