/* The fit loop: learning a tiny problem, early stopping on crafted sequences,
 * stopping hooks, the metrics CSV, the SVG chart (parsed as XML by python3
 * when present), progress output (plain lines off a terminal, a bar on a
 * pseudo-terminal, nothing when quiet), and resuming through checkpoints. */
#define _XOPEN_SOURCE 700
/* The test lists a directory itself (test_outputs_checked_first): readdir of a 32-bit build
 * needs large-file support where inode numbers are 64-bit (armhf under qemu: EOVERFLOW). */
#define _FILE_OFFSET_BITS 64
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if !defined(_WIN32)
#  include <sys/wait.h>
#endif

#include "harness.h"

static char tmpdir[256];
static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

static char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = (char *)malloc((size_t)sz + 1);
  size_t got = fread(b, 1, (size_t)sz, f);
  b[got] = 0;
  if (n) *n = got;
  fclose(f);
  return b;
}

static int count_lines(const char *s) {
  int n = 0;
  for (; *s; s++) n += *s == '\n';
  return n;
}

/* ---- a tiny classification task and model -------------------------------------- */
#define NS 240
#define NV 120
#define NF 6
#define NC 3
#define BATCH 24
static float tr_x[NS * NF], va_x[NV * NF];
static int32_t tr_y[NS], va_y[NV];

static void make_data(void) {
  th_seed(777);
  for (int i = 0; i < NS + NV; i++) {
    int c = i % NC;
    float *x = i < NS ? tr_x + i * NF : va_x + (i - NS) * NF;
    if (i < NS) tr_y[i] = c;
    else va_y[i - NS] = c;
    for (int f = 0; f < NF; f++) x[f] = th_uniform(-1, 1) + ((f / 2 == c) ? 1.5f : 0.0f);
  }
}

typedef struct {
  dt_params *P;
  dt_nn_linear l1, l2;
  dt_optim *opt;
  dt_graph *g;
  float dropout;
  int64_t bad_at; /* at this batch (epoch * batches + index; 0: never) the step ... */
  int bad;        /* ... 1: reports a NaN loss and returns OK; 2: gets an Inf gradient before its update */
} net;

static void net_init(net *m, uint64_t seed, float dropout) {
  m->P = dt_params_create(seed);
  dt_nn_linear_init(&m->l1, m->P, "l1", NF, 24, 1);
  dt_nn_linear_init(&m->l2, m->P, "l2", 24, NC, 1);
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_ADAM;
  d.lr = 0.02f;
  m->opt = dt_optim_create(m->P, &d);
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.seed = seed + 1;
  m->g = dt_graph_create(m->P, &gd);
  m->dropout = dropout;
  m->bad_at = 0;
  m->bad = 0;
}

static void net_free(net *m) {
  dt_graph_destroy(m->g);
  dt_optim_destroy(m->opt);
  dt_params_destroy(m->P);
}

static dt_tensor *net_logits(net *m, const float *x, int64_t n) {
  int64_t xs[2];
  xs[0] = n;
  xs[1] = NF;
  dt_tensor *h = dt_relu(m->g, dt_nn_linear_forward(m->g, &m->l1, dt_tensor_from(m->g, 2, xs, x)));
  if (m->dropout > 0) h = dt_dropout(m->g, h, m->dropout);
  return dt_nn_linear_forward(m->g, &m->l2, h);
}

static int64_t count_correct(const dt_tensor *lg, const int32_t *y, int64_t n) {
  int64_t ok = 0;
  for (int64_t i = 0; i < n; i++) {
    int best = 0;
    for (int c = 1; c < NC; c++)
      if (lg->data[i * NC + c] > lg->data[i * NC + best]) best = c;
    ok += best == y[i];
  }
  return ok;
}

/* Batch `index` of epoch `epoch`: a shuffle seeded by the epoch (a loader's job). */
static dt_result net_step(dt_fit_batch *b, void *user) {
  net *m = (net *)user;
  int32_t idx[NS], y[BATCH];
  float x[BATCH * NF];
  dt_rng r;
  dt_rng_seed(&r, 50 + (uint64_t)b->epoch);
  for (int i = 0; i < NS; i++) idx[i] = i;
  dt_rng_shuffle(&r, idx, NS);
  for (int i = 0; i < BATCH; i++) {
    int s = idx[b->index * BATCH + i];
    memcpy(x + i * NF, tr_x + s * NF, NF * sizeof(float));
    y[i] = tr_y[s];
  }
  dt_graph_reset(m->g);
  dt_params_zero_grad(m->P);
  dt_tensor *lg = net_logits(m, x, BATCH);
  dt_tensor *loss = dt_cross_entropy(m->g, lg, y);
  dt_result rc = dt_backward(m->g, loss);
  if (rc != DTRAIN_OK) return rc;
  if (m->bad && b->epoch * (NS / BATCH) + b->index == m->bad_at) { /* the batch, not b->step: a skip does not advance it */
    if (m->bad == 1) { /* a step that reports NaN without failing */
      b->loss = NAN;
      return DTRAIN_OK;
    }
    dt_params_grad(m->P)[7] = INFINITY; /* finite loss, Inf gradient: the update makes weights Inf */
  }
  rc = dt_optim_step(m->opt);
  if (rc != DTRAIN_OK) return rc;
  b->loss = dt_item(loss);
  b->samples = BATCH;
  b->correct = count_correct(lg, y, BATCH);
  return DTRAIN_OK;
}

static dt_result net_eval(dt_fit_eval *e, void *user) {
  net *m = (net *)user;
  dt_graph_reset(m->g);
  int was = dt_graph_set_grad_enabled(m->g, 0);
  dt_graph_set_training(m->g, 0);
  dt_tensor *lg = net_logits(m, va_x, NV);
  dt_tensor *loss = dt_cross_entropy(m->g, lg, va_y);
  dt_graph_set_training(m->g, 1);
  dt_graph_set_grad_enabled(m->g, was);
  if (!loss) return dt_graph_error(m->g);
  e->loss = dt_item(loss);
  e->accuracy = (double)count_correct(lg, va_y, NV) / NV;
  return DTRAIN_OK;
}

static dt_fit_options net_desc(net *m, int64_t epochs) {
  dt_fit_options d;
  memset(&d, 0, sizeof d);
  d.epochs = epochs;
  d.steps_per_epoch = NS / BATCH;
  d.train_step = net_step;
  d.evaluate = net_eval;
  d.user = m;
  d.params = m->P;
  d.optim = m->opt;
  d.graph = m->g;
  d.progress = DTRAIN_FIT_PROGRESS_QUIET;
  return d;
}

/* ---- learning ------------------------------------------------------------------------ */
static void test_fit_learns(void) {
  net m;
  net_init(&m, 3, 0.0f);
  dt_fit_options d = net_desc(&m, 12);
  dt_fit_result res;
  CHECK_MSG(dt_fit(&d, &res) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(res.epochs_run == 12 && !res.stopped_early && !res.stopped_by_callback);
  CHECK(res.step == 12 * (NS / BATCH) && dt_optim_steps(m.opt) == res.step);
  CHECK(res.samples == 12 * NS && res.last.samples == NS);
  CHECK_MSG(res.last.train_loss < 0.15 && res.last.val_loss < 0.2 && res.last.val_acc > 0.95,
            "train loss %g, val loss %g, val acc %g", res.last.train_loss, res.last.val_loss, res.last.val_acc);
  CHECK(res.last.train_acc > 0.9 && res.last.train_acc <= 1.0);
  CHECK(res.last.epoch == 12 && res.last.step == res.step);
  CHECK(fabs(res.last.lr - 0.02) < 1e-9);
  CHECK(res.train_seconds > 0 && res.total_seconds >= res.train_seconds && res.samples_per_sec > 0);
  CHECK(res.best_epoch >= 1 && res.best_epoch <= 12 && isfinite(res.best_value));
  net_free(&m);
}

/* ---- early stopping on crafted sequences -------------------------------------------------- */
typedef struct {
  const double *loss, *acc;
  int n;
  int calls;
  dt_params *P;       /* optional: the step writes the epoch into parameter 0 */
  int stop_epoch;     /* on_epoch_end stops after this 1-based epoch (0: never) */
  int64_t stop_batch; /* on_batch_end stops at this global step (-1: never) */
  int fail_at;        /* the step fails at this global step (-1: never) */
} seq;

static dt_result seq_step(dt_fit_batch *b, void *user) {
  seq *s = (seq *)user;
  if (s->fail_at >= 0 && b->step == s->fail_at) return DTRAIN_ERR_NONFINITE;
  if (s->P) dt_params_data(s->P)[0] = (float)(b->epoch + 1);
  b->loss = 1.0;
  return DTRAIN_OK;
}

static dt_result seq_eval(dt_fit_eval *e, void *user) {
  seq *s = (seq *)user;
  s->calls++;
  int i = (int)e->epoch < s->n ? (int)e->epoch : s->n - 1;
  e->loss = s->loss ? s->loss[i] : NAN;
  e->accuracy = s->acc ? s->acc[i] : NAN;
  return DTRAIN_OK;
}

static int seq_epoch_end(const dt_fit_epoch *e, void *user) {
  seq *s = (seq *)user;
  return s->stop_epoch > 0 && e->epoch >= s->stop_epoch;
}

static int seq_batch_end(const dt_fit_batch *b, void *user) {
  seq *s = (seq *)user;
  return s->stop_batch >= 0 && b->step + 1 >= s->stop_batch;
}

static dt_fit_options seq_desc(seq *s, int64_t epochs) {
  dt_fit_options d;
  memset(&d, 0, sizeof d);
  d.epochs = epochs;
  d.steps_per_epoch = 4;
  d.batch_size = 8;
  d.train_step = seq_step;
  d.evaluate = seq_eval;
  d.on_epoch_end = seq_epoch_end;
  d.on_batch_end = seq_batch_end;
  d.user = s;
  d.progress = DTRAIN_FIT_PROGRESS_QUIET;
  s->calls = 0;
  s->fail_at = -1;
  s->stop_batch = -1;
  return d;
}

static void test_early_stopping(void) {
  dt_fit_result res;
  /* Best at epoch 3, then two epochs without improvement: stop after epoch 5. */
  static const double l1[] = {1.0, 0.8, 0.7, 0.75, 0.71, 0.69, 0.5, 0.4, 0.3, 0.2};
  seq s;
  memset(&s, 0, sizeof s);
  s.loss = l1;
  s.n = 10;
  dt_fit_options d = seq_desc(&s, 10);
  d.patience = 2;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK_MSG(res.epochs_run == 5 && res.stopped_early && res.best_epoch == 3, "ran %lld, best %lld",
            (long long)res.epochs_run, (long long)res.best_epoch);
  CHECK(res.best_value == 0.7 && s.calls == 5 && res.step == 20 && res.samples == 5 * 4 * 8);
  /* Patience 3 sees 0.69 at epoch 6 in time. */
  d = seq_desc(&s, 10);
  d.patience = 3;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK(res.epochs_run == 10 && !res.stopped_early && res.best_epoch == 10);
  /* min_delta: 0.97 and 0.95 are not better than 1.0 by more than 0.05. */
  static const double l2[] = {1.0, 0.97, 0.95, 0.5, 0.4};
  s.loss = l2;
  s.n = 5;
  d = seq_desc(&s, 5);
  d.patience = 2;
  d.min_delta = 0.05;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK_MSG(res.epochs_run == 3 && res.stopped_early && res.best_epoch == 1, "ran %lld", (long long)res.epochs_run);
  d.min_delta = 0;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.epochs_run == 5 && res.best_epoch == 5);
  /* Maximizing accuracy; NaN losses are never an improvement. */
  static const double a1[] = {0.5, 0.6, 0.6, 0.55, 0.9};
  static const double lnan[] = {1.0, NAN, NAN, NAN, 0.1};
  s.loss = lnan;
  s.acc = a1;
  d = seq_desc(&s, 5);
  d.patience = 2;
  d.monitor = DTRAIN_FIT_MONITOR_VAL_ACC;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK_MSG(res.epochs_run == 4 && res.best_epoch == 2 && res.best_value == 0.6, "ran %lld best %lld",
            (long long)res.epochs_run, (long long)res.best_epoch);
  d.monitor = DTRAIN_FIT_MONITOR_VAL_LOSS;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.epochs_run == 3 && res.best_epoch == 1);
  /* Without patience nothing stops. */
  d.patience = 0;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.epochs_run == 5 && !res.stopped_early);
  /* Restoring the best weights: the step writes the epoch number into a parameter. */
  s.P = dt_params_create(1);
  int64_t sh[1] = {4};
  dt_params_add(s.P, "p", 1, sh, dt_init_zeros());
  s.loss = l1;
  s.acc = NULL;
  s.n = 10;
  d = seq_desc(&s, 10);
  d.params = s.P;
  d.patience = 2;
  d.restore_best = 1;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK(res.restored_best && res.best_epoch == 3);
  CHECK_MSG(dt_params_data(s.P)[0] == 3.0f, "parameter is %g after restore", (double)dt_params_data(s.P)[0]);
  d.restore_best = 0;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && !res.restored_best && dt_params_data(s.P)[0] == 5.0f);
  dt_params_destroy(s.P);
  s.P = NULL;
  /* Without evaluate the default monitor is the training loss (constant here). */
  d = seq_desc(&s, 6);
  d.evaluate = NULL;
  d.patience = 2;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.epochs_run == 3 && res.best_epoch == 1 && isnan(res.last.val_loss));
}

static void test_callbacks(void) {
  dt_fit_result res;
  static const double l[] = {1.0, 0.9, 0.8, 0.7, 0.6, 0.5};
  seq s;
  memset(&s, 0, sizeof s);
  s.loss = l;
  s.n = 6;
  dt_fit_options d = seq_desc(&s, 6);
  s.stop_epoch = 3;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK(res.epochs_run == 3 && res.stopped_by_callback && !res.stopped_early);
  s.stop_epoch = 0;
  /* Stop inside epoch 2 at global step 6 (its second batch): the epoch's row covers 2 batches. */
  d = seq_desc(&s, 6);
  s.stop_batch = 6;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK);
  CHECK_MSG(res.epochs_run == 2 && res.stopped_by_callback && res.step == 6 && res.last.samples == 16,
            "ran %lld step %lld samples %lld", (long long)res.epochs_run, (long long)res.step,
            (long long)res.last.samples);
  /* A failing step stops the loop with its error. */
  d = seq_desc(&s, 6);
  s.fail_at = 9;
  CHECK_ERR(dt_fit(&d, &res), DTRAIN_ERR_NONFINITE, "epoch 3, batch 2 of 4: NaN or Inf");
  CHECK(res.epochs_run == 2 && res.step == 9);
  /* Without an optimizer the step counter resumes from the start position. */
  d = seq_desc(&s, 3);
  d.start_epoch = 1;
  d.start_batch = 2;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.step == 12 && res.epochs_run == 2 && s.calls == 2);
}

static void test_bad_desc(void) {
  seq s;
  memset(&s, 0, sizeof s);
  dt_fit_options d = seq_desc(&s, 3);
  dt_fit_result res;
  CHECK_ERR(dt_fit(NULL, &res), DTRAIN_ERR_NULL_ARG, "desc");
  d.train_step = NULL;
  CHECK_ERR(dt_fit(&d, &res), DTRAIN_ERR_NULL_ARG, "train_step");
  d = seq_desc(&s, 3);
  d.steps_per_epoch = 0;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, "steps_per_epoch");
  d = seq_desc(&s, 3);
  d.start_batch = 4;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, "start position");
  d = seq_desc(&s, 3);
  d.evaluate = NULL;
  d.monitor = DTRAIN_FIT_MONITOR_VAL_ACC;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, "needs an evaluate");
  d = seq_desc(&s, 3);
  d.restore_best = 1;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_NULL_ARG, "params");
  d = seq_desc(&s, 3);
  d.min_delta = -1;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, "min_delta");
  d = seq_desc(&s, 3);
  d.patience = -1;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, ">= 0");
  d = seq_desc(&s, 3);
  d.progress = (dt_fit_progress)9;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_INVALID_ARG, "progress");
  /* A CSV in a directory that does not exist stops training with an I/O error. */
  char p[512];
  path_of(p, sizeof p, "nodir/metrics.csv");
  d = seq_desc(&s, 3);
  d.csv_path = p;
  CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_IO, "nodir/metrics.csv");
  CHECK_ERR(dt_fit_write_svg(p, NULL, 0, NULL), DTRAIN_ERR_IO, "nodir");
  CHECK_ERR(dt_fit_write_svg(NULL, NULL, 0, NULL), DTRAIN_ERR_NULL_ARG, "NULL");
}

/* ---- output paths are checked before the first step (issue 17) ---------------------------- */
static int64_t outputs_steps;
static dt_result outputs_step(dt_fit_batch *b, void *user) {
  (void)user;
  outputs_steps++;
  b->loss = 1.0;
  return DTRAIN_OK;
}

static void test_outputs_checked_first(void) {
  const int64_t shape[1] = {2};
  dt_params *P = dt_params_create(1);
  CHECK(P && dt_params_add(P, "w", 1, shape, dt_init_zeros()) == 0);
  if (!P) return;
  const char *what[4] = {"csv_path", "svg_path", "checkpoint_path", "best_path"};
  char bad[512], dir[400], ro[512];
  path_of(bad, sizeof bad, "no_such_dir/out.file");
  for (int i = 0; i < 4; i++) {
    dt_fit_options d;
    memset(&d, 0, sizeof d);
    d.epochs = 2;
    d.steps_per_epoch = 3;
    d.train_step = outputs_step;
    d.params = P;
    d.progress = DTRAIN_FIT_PROGRESS_QUIET;
    const char **slot = i == 0 ? &d.csv_path : i == 1 ? &d.svg_path : i == 2 ? &d.checkpoint_path : &d.best_path;
    *slot = bad;
    outputs_steps = 0;
    double t0 = dt_time_now();
    CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_IO, "no_such_dir/out.file");
    CHECK_MSG(strstr(dt_last_error(), what[i]) != NULL, "%s: %s", what[i], dt_last_error());
    CHECK_MSG(outputs_steps == 0, "%s: %lld steps ran before the bad path was found", what[i], (long long)outputs_steps);
    CHECK(dt_time_now() - t0 < 2.0);
  }
  /* A directory that exists but takes no new file (unless we are root). */
  path_of(dir, sizeof dir, "read_only");
  CHECK(th_mkdir(dir, 0555) == 0);
  snprintf(ro, sizeof ro, "%s/metrics.csv", dir);
  FILE *f = fopen(ro, "w");
  if (f) {
    fclose(f);
    remove(ro);
    th_skip("a read-only directory is writable here (root)");
  } else {
    dt_fit_options d;
    memset(&d, 0, sizeof d);
    d.steps_per_epoch = 3;
    d.train_step = outputs_step;
    d.progress = DTRAIN_FIT_PROGRESS_QUIET;
    d.csv_path = ro;
    outputs_steps = 0;
    CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_IO, "read_only");
    CHECK(outputs_steps == 0);
  }
  chmod(dir, 0755);
  /* A symbolic link planted at the CSV path is refused before the first step
   * and never written through (the CSV is the one output appended to). */
#if !defined(_WIN32) /* (Windows: no symbolic links without privileges) */
  {
    char victim[512], link[512];
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    snprintf(link, sizeof link, "%s/linked.csv", dir);
    FILE *v = fopen(victim, "wb");
    CHECK(v != NULL);
    if (v) {
      fputs("precious", v);
      fclose(v);
    }
    CHECK(symlink(victim, link) == 0);
    dt_fit_options d;
    memset(&d, 0, sizeof d);
    d.steps_per_epoch = 3;
    d.train_step = outputs_step;
    d.progress = DTRAIN_FIT_PROGRESS_QUIET;
    d.csv_path = link;
    outputs_steps = 0;
    CHECK_ERR(dt_fit(&d, NULL), DTRAIN_ERR_IO, "symbolic link");
    CHECK(outputs_steps == 0);
    char buf[32] = {0};
    v = fopen(victim, "rb");
    CHECK(v != NULL && fread(buf, 1, sizeof buf - 1, v) == 8 && strcmp(buf, "precious") == 0);
    if (v) fclose(v);
    remove(link);
    remove(victim);
  }
#endif
  /* Good paths still train, and the probe leaves nothing behind. */
  {
    dt_fit_options d;
    memset(&d, 0, sizeof d);
    d.steps_per_epoch = 3;
    d.train_step = outputs_step;
    d.progress = DTRAIN_FIT_PROGRESS_QUIET;
    char csv[512];
    snprintf(csv, sizeof csv, "%s/ok.csv", dir);
    d.csv_path = csv;
    outputs_steps = 0;
    CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
    CHECK(outputs_steps == 3);
    DIR *dd = opendir(dir);
    int others = 0, ok_csv = 0;
    for (struct dirent *e; dd && (e = readdir(dd)) != NULL;) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      if (strcmp(e->d_name, "ok.csv") == 0) ok_csv++;
      else others++;
    }
    if (dd) closedir(dd);
    CHECK_MSG(dd && ok_csv == 1 && others == 0, "the directory holds more than ok.csv (%d others)", others);
  }
  dt_params_destroy(P);
}

/* ---- CSV ------------------------------------------------------------------------------------ */
static void test_csv(void) {
  char p[512];
  path_of(p, sizeof p, "metrics.csv");
  remove(p);
  net m;
  net_init(&m, 5, 0.0f);
  dt_fit_options d = net_desc(&m, 3);
  d.csv_path = p;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  /* A resumed run appends, without a second header. */
  d.epochs = 5;
  d.start_epoch = 3;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  char *csv = slurp(p, NULL);
  CHECK(csv != NULL);
  if (!csv) { net_free(&m); return; }
  CHECK(count_lines(csv) == 6);
  const char *hdr = "epoch,step,train_loss,train_acc,val_loss,val_acc,lr,seconds\n";
  CHECK(strncmp(csv, hdr, strlen(hdr)) == 0);
  char *line = strchr(csv, '\n') + 1;
  double last_seconds = -1;
  for (int r = 1; r <= 5; r++) {
    long long ep, st;
    double tl, ta, vl, va, lr, sec;
    int got = sscanf(line, "%lld,%lld,%lf,%lf,%lf,%lf,%lf,%lf", &ep, &st, &tl, &ta, &vl, &va, &lr, &sec);
    CHECK_MSG(got == 8, "row %d: '%.60s'", r, line);
    CHECK(ep == r && st == r * (NS / BATCH));
    CHECK(tl > 0 && ta >= 0 && ta <= 1 && vl > 0 && va >= 0 && va <= 1 && fabs(lr - 0.02) < 1e-9);
    if (r != 4) CHECK(sec >= last_seconds); /* seconds restart with the second run */
    last_seconds = sec;
    int commas = 0;
    char *end = strchr(line, '\n');
    for (char *q = line; q < end; q++) commas += *q == ',';
    CHECK(commas == 7);
    line = end + 1;
  }
  free(csv);
  /* Metrics not reported stay empty: no accuracy, no evaluation, no optimizer. */
  seq s;
  memset(&s, 0, sizeof s);
  remove(p);
  dt_fit_options sd = seq_desc(&s, 2);
  sd.evaluate = NULL;
  sd.csv_path = p;
  CHECK(dt_fit(&sd, NULL) == DTRAIN_OK);
  csv = slurp(p, NULL);
  CHECK(csv && count_lines(csv) == 3);
  CHECK(csv && strstr(csv, "\n1,4,1,,,,,") != NULL);
  free(csv);
  net_free(&m);
}

/* ---- SVG ------------------------------------------------------------------------------------- */
static int python_xml_check(const char *svg, const char *expect_texts) {
#if defined(_WIN32)
  (void)svg;
  (void)expect_texts;
  return 77; /* no python3 through the shell */
#else
  if (access("/usr/bin/python3", X_OK) != 0) return 77;
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "/usr/bin/python3 -c \"import sys, xml.etree.ElementTree as E\n"
           "r = E.parse(sys.argv[1]).getroot()\n"
           "ns = '{http://www.w3.org/2000/svg}'\n"
           "assert r.tag == ns + 'svg', r.tag\n"
           "texts = [t.text or '' for t in r.iter(ns + 'text')]\n"
           "for want in sys.argv[2].split('|'):\n"
           "    assert any(want in t for t in texts), want\n"
           "assert len(list(r.iter(ns + 'polyline'))) >= int(sys.argv[3]), 'polylines'\n"
           "\" '%s' '%s' 4",
           svg, expect_texts);
  int rc = system(cmd);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
#endif
}

static void test_svg(void) {
  char p[512];
  path_of(p, sizeof p, "curves.svg");
  net m;
  net_init(&m, 7, 0.0f);
  dt_fit_options d = net_desc(&m, 4);
  d.svg_path = p;
  d.title = "tiny <task> & \"quotes\"";
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  char *svg = slurp(p, NULL);
  CHECK(svg != NULL);
  if (svg) {
    CHECK(strncmp(svg, "<?xml", 5) == 0 && strstr(svg, "<svg") && strstr(svg, "</svg>"));
    CHECK(strstr(svg, "tiny &lt;task&gt; &amp; &quot;quotes&quot;") != NULL);
    CHECK(strstr(svg, "<polyline") && strstr(svg, ">loss<") && strstr(svg, ">accuracy<") && strstr(svg, ">epoch<"));
    CHECK(strstr(svg, ">train<") && strstr(svg, ">validation<"));
    free(svg);
  }
  int rc = python_xml_check(p, "loss|accuracy|epoch|train|validation|tiny <task>");
  if (rc == 77) th_skip("python3 not found: the XML parse check did not run");
  else CHECK_MSG(rc == 0, "python xml check exit %d", rc);

  /* Edge cases: no epochs, one epoch, accuracy never reported, NaN gaps. */
  dt_fit_epoch rows[3];
  memset(rows, 0, sizeof rows);
  for (int i = 0; i < 3; i++) {
    rows[i].epoch = i + 1;
    rows[i].train_loss = 1.0 / (i + 1);
    rows[i].val_loss = i == 1 ? NAN : 1.2 / (i + 1);
    rows[i].train_acc = rows[i].val_acc = NAN;
  }
  CHECK(dt_fit_write_svg(p, rows, 0, NULL) == DTRAIN_OK);
  svg = slurp(p, NULL);
  CHECK(svg && strstr(svg, "no epochs yet"));
  free(svg);
  CHECK(dt_fit_write_svg(p, rows, 1, "one") == DTRAIN_OK);
  CHECK(dt_fit_write_svg(p, rows, 3, "gaps") == DTRAIN_OK);
  svg = slurp(p, NULL);
  CHECK(svg && strstr(svg, "no accuracy reported"));
  free(svg);
#if !defined(_WIN32)
  if (access("/usr/bin/python3", X_OK) == 0) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])\" '%s'", p);
    CHECK(system(cmd) == 0);
  }
#endif
  CHECK_ERR(dt_fit_write_svg(p, rows, -1, NULL), DTRAIN_ERR_INVALID_ARG, "< 0");
  net_free(&m);
}

/* ---- progress output ---------------------------------------------------------------------- */
static void test_progress(void) {
  char p[512];
  path_of(p, sizeof p, "progress.txt");
  seq s;
  static const double l[] = {1.0, 0.9, 0.8};
  memset(&s, 0, sizeof s);
  s.loss = l;
  s.n = 3;

  /* Not a terminal (AUTO): plain lines, one per epoch, no bar. */
  FILE *f = fopen(p, "wb");
  dt_fit_options d = seq_desc(&s, 3);
  d.progress = DTRAIN_FIT_PROGRESS_AUTO;
  d.out = f;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  fclose(f);
  char *t = slurp(p, NULL);
  CHECK(t && count_lines(t) == 3);
  CHECK(t && strncmp(t, "epoch 1/3  step 4  loss 1.0000", 30) == 0);
  CHECK(t && strstr(t, "\nepoch 3/3  step 12") && strstr(t, "val_loss 0.8000"));
  CHECK(t && !strchr(t, '\r') && !strchr(t, '\033') && !strchr(t, '['));
  free(t);

  /* log_every adds batch lines. */
  f = fopen(p, "wb");
  d = seq_desc(&s, 2);
  d.out = f;
  d.progress = DTRAIN_FIT_PROGRESS_LINES;
  d.log_every = 2;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  fclose(f);
  t = slurp(p, NULL);
  CHECK(t && count_lines(t) == 4 && strstr(t, "epoch 1/2  batch 2/4  loss 1.0000\n"));
  free(t);

  /* Quiet: nothing at all, even on early stop. */
  f = fopen(p, "wb");
  d = seq_desc(&s, 3);
  d.out = f;
  d.patience = 1;
  static const double flat[] = {1.0, 1.0, 1.0};
  s.loss = flat;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  fclose(f);
  size_t n = 99;
  t = slurp(p, &n);
  CHECK(n == 0);
  free(t);
  s.loss = l;

  /* Early stopping is announced in line mode. */
  f = fopen(p, "wb");
  d = seq_desc(&s, 3);
  d.out = f;
  d.progress = DTRAIN_FIT_PROGRESS_LINES;
  d.patience = 1;
  d.monitor = DTRAIN_FIT_MONITOR_TRAIN_LOSS;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  fclose(f);
  t = slurp(p, NULL);
  CHECK(t && strstr(t, "early stopping: train_loss did not improve"));
  free(t);

  /* A forced bar: redrawn with carriage returns, one newline per epoch, no plain lines. */
  f = fopen(p, "wb");
  d = seq_desc(&s, 2);
  d.out = f;
  d.progress = DTRAIN_FIT_PROGRESS_BAR;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  fclose(f);
  t = slurp(p, NULL);
  CHECK(t && count_lines(t) == 2 && strchr(t, '\r') && strstr(t, "epoch 2/2 [====") && strstr(t, "] 4/4"));
  CHECK(t && !strstr(t, "  step "));
  free(t);

  /* A pseudo-terminal: AUTO picks the bar. */
#if defined(_WIN32)
  TH_SKIP("Windows: no pseudo-terminal to check the TTY choice with");
#else
  int master = posix_openpt(O_RDWR | O_NOCTTY);
  if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) {
    if (master >= 0) close(master);
    TH_SKIP("no pseudo-terminal: the TTY check did not run");
  }
  int slave = open(ptsname(master), O_RDWR | O_NOCTTY);
  FILE *tty = slave >= 0 ? fdopen(slave, "w") : NULL;
  CHECK(tty != NULL);
  if (tty) {
    CHECK(isatty(fileno(tty)));
    d = seq_desc(&s, 2);
    d.out = tty;
    d.progress = DTRAIN_FIT_PROGRESS_AUTO;
    CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
    fflush(tty);
    char buf[8192];
    size_t got = 0;
    fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK);
    for (int tries = 0; tries < 50 && got < sizeof buf - 1; tries++) {
      ssize_t k = read(master, buf + got, sizeof buf - 1 - got);
      if (k > 0) got += (size_t)k;
      else if (got > 0) break;
      else {
        struct timespec ts;
        ts.tv_sec = 0;
        ts.tv_nsec = 10000000;
        nanosleep(&ts, NULL);
      }
    }
    buf[got] = 0;
    CHECK_MSG(strchr(buf, '\r') && strstr(buf, "epoch 1/2 [") && strstr(buf, "\033[K"), "tty output: '%s'", buf);
    CHECK(!strstr(buf, "  step "));
    fclose(tty);
  }
  close(master);
#endif
}

/* ---- checkpoints and resume through dt_fit ------------------------------------------------ */
typedef struct {
  int64_t stop_at; /* on_batch_end stops when the global step reaches this (-1: never) */
} crash;
static crash crash_cfg;
static int crash_batch_end(const dt_fit_batch *b, void *user) {
  (void)user;
  return crash_cfg.stop_at >= 0 && b->step + 1 >= crash_cfg.stop_at;
}

static void test_resume(void) {
  char ck[512], best[512];
  path_of(ck, sizeof ck, "fit.safetensors");
  path_of(best, sizeof best, "best.safetensors");
  const int64_t E = 4, spe = NS / BATCH;
  /* Uninterrupted. */
  net a;
  net_init(&a, 9, 0.3f);
  dt_fit_options d = net_desc(&a, E);
  dt_fit_result ra;
  CHECK(dt_fit(&d, &ra) == DTRAIN_OK);
  uint64_t want = dt_params_checksum(a.P);

  /* Two epochs, a checkpoint, a fresh process-like start from it. */
  net b;
  net_init(&b, 9, 0.3f);
  d = net_desc(&b, 2);
  d.checkpoint_path = ck;
  d.best_path = best;
  d.config = "fit test";
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  net_free(&b);
  net_init(&b, 123, 0.3f);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = b.P;
  st.optim = b.opt;
  st.graph = b.g;
  CHECK_MSG(dt_checkpoint_load(ck, &st) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(st.data_epoch == 2 && st.data_index == 0 && st.epoch == 2 && st.step == 2 * spe);
  d = net_desc(&b, E);
  d.start_epoch = st.data_epoch;
  d.start_batch = st.data_index;
  dt_fit_result rb;
  CHECK(dt_fit(&d, &rb) == DTRAIN_OK);
  CHECK(rb.epochs_run == 2 && rb.step == ra.step);
  CHECK_MSG(dt_params_checksum(b.P) == want, "resumed fit differs from the uninterrupted one");
  dt_checkpoint *c = dt_checkpoint_open(best);
  CHECK(c && dt_checkpoint_meta(c, "config") && strcmp(dt_checkpoint_meta(c, "config"), "fit test") == 0);
  dt_checkpoint_close(c);
  net_free(&b);

  /* A crash mid-epoch: periodic step checkpoints, stop at global step 10 (epoch 1, batch 4). */
  net c2;
  net_init(&c2, 9, 0.3f);
  d = net_desc(&c2, E);
  d.checkpoint_path = ck;
  d.checkpoint_every = 100;
  d.checkpoint_steps = 3;
  d.on_batch_end = crash_batch_end;
  crash_cfg.stop_at = spe + 4;
  dt_fit_result rc;
  CHECK(dt_fit(&d, &rc) == DTRAIN_OK && rc.stopped_by_callback);
  net_free(&c2);
  crash_cfg.stop_at = -1;
  net_init(&c2, 77, 0.3f);
  memset(&st, 0, sizeof st);
  st.params = c2.P;
  st.optim = c2.opt;
  st.graph = c2.g;
  CHECK(dt_checkpoint_load(ck, &st) == DTRAIN_OK);
  CHECK_MSG(st.data_epoch == 1 && st.data_index == 4 && st.step == spe + 4, "position (%lld, %lld) step %lld",
            (long long)st.data_epoch, (long long)st.data_index, (long long)st.step);
  d = net_desc(&c2, E);
  d.start_epoch = st.data_epoch;
  d.start_batch = st.data_index;
  CHECK(dt_fit(&d, NULL) == DTRAIN_OK);
  CHECK_MSG(dt_params_checksum(c2.P) == want, "fit resumed mid-epoch differs");
  net_free(&c2);
  net_free(&a);
}

static void cleanup(void) {
  if (th_rm_rf(tmpdir) != 0) fprintf(stderr, "cleanup of %s failed\n", tmpdir);
}

/* DTRAIN_NO_STDIO builds have no file I/O: the SVG writer says so cleanly. */
static void test_no_stdio_build(void) {
  dt_fit_epoch row;
  memset(&row, 0, sizeof row);
  CHECK_ERR(dt_fit_write_svg("/tmp/x.svg", &row, 1, "t"), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_STDIO");
}

/* ---- non-finite steps (issue 17) ---------------------------------------------------------
 * A NaN loss reported with DTRAIN_OK, or an Inf gradient, used to pass:
 * NaN metrics, then NaN parameters. Now dt_fit stops naming the step, or
 * with skip_nonfinite puts the step back and trains on. */
static int params_finite(dt_params *P) {
  for (size_t i = 0; i < dt_params_size(P); i++)
    if (!isfinite(dt_params_data(P)[i])) return 0;
  return 1;
}

static void test_nonfinite_steps(void) {
  const int64_t spe = NS / BATCH;
  for (int bad = 1; bad <= 2; bad++) {
    net m;
    net_init(&m, 3, 0.0f);
    m.bad = bad;
    m.bad_at = spe + 2; /* epoch 2, batch 3 */
    dt_fit_options d = net_desc(&m, 3);
    dt_fit_result res;
    char want[96];
    snprintf(want, sizeof want, "step %lld (epoch 2, batch 3 of %lld): %s", (long long)m.bad_at, (long long)spe,
             bad == 1 ? "loss is NaN" : "gradient of 'l1.weight' is Inf at element 7");
    CHECK_ERR(dt_fit(&d, &res), DTRAIN_ERR_NONFINITE, want);
    CHECK(res.epochs_run == 1);
    net_free(&m);

    /* skip: the step is put back (Adam's state and step count too) and left out */
    net_init(&m, 3, 0.0f);
    m.bad = bad;
    m.bad_at = spe + 2;
    d = net_desc(&m, 3);
    d.skip_nonfinite = 1;
    CHECK_MSG(dt_fit(&d, &res) == DTRAIN_OK, "%s", dt_last_error());
    CHECK_MSG(res.skipped_steps == 1 && res.epochs_run == 3, "skipped %lld", (long long)res.skipped_steps);
    CHECK(dt_optim_steps(m.opt) == 3 * spe - 1 && res.step == 3 * spe - 1);
    CHECK(params_finite(m.P) && isfinite(res.last.train_loss) && res.last.samples == NS);
    CHECK(res.samples == 3 * NS - BATCH);
    CHECK_MSG(res.last.val_acc > 0.9, "val acc %g", res.last.val_acc);
    net_free(&m);
  }
  /* a step that reports no loss is not checked (its metrics stay NaN, as before) */
  seq s;
  memset(&s, 0, sizeof s);
  dt_fit_options d = seq_desc(&s, 1);
  dt_fit_result res;
  CHECK(dt_fit(&d, &res) == DTRAIN_OK && res.skipped_steps == 0);
}

int main(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_FIT)) {
    th_skip_item("test_fit", "dt_fit is compiled out (DTRAIN_NO_FIT)");
    return th_summary("fit");
  }
  if (!(dt_build_features() & DTRAIN_FEATURE_STDIO)) {
    TH_RUN(test_no_stdio_build);
    th_skip_item("fit file tests", "DTRAIN_NO_STDIO build has no file I/O");
    return th_summary("fit");
  }
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dtrain_fit_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  crash_cfg.stop_at = -1;
  make_data();
  TH_RUN(test_fit_learns);
  TH_RUN(test_early_stopping);
  TH_RUN(test_callbacks);
  TH_RUN(test_bad_desc);
  TH_RUN(test_outputs_checked_first);
  TH_RUN(test_csv);
  TH_RUN(test_svg);
  TH_RUN(test_progress);
  TH_RUN(test_resume);
  TH_RUN(test_nonfinite_steps);
  cleanup();
  return th_summary("fit");
}
