/* test_char_model.c -- checks examples/03_char_model.c.
 *
 * The example is compiled into this test with its main() renamed, so the test
 * calls the program with command lines and also its pieces (pick, generate,
 * evaluate, model_forward) directly. The library is the build's object, as
 * for the examples (DTRAIN__IMPLEMENTATION_DONE skips the example's copy of
 * the implementation: compiling it again took 14 s of the 82 s that all the
 * test programs took under ASan). Output of the program goes to files that
 * the test reads back. Tiny models keep it fast (also under ASan and qemu). */
#define _POSIX_C_SOURCE 200809L
#if defined(DTRAIN_NO_DATA) /* the example reads its corpus with dt_text_read: none of it can run */
#  include "dtrain.h"
#  include "harness.h"
static void test_compiled_out(void) {
  dt_text t;
  CHECK_ERR(dt_text_read("text.txt", &t), DTRAIN_ERR_UNSUPPORTED, "DTRAIN_NO_DATA");
}
int main(void) {
  TH_RUN(test_compiled_out);
  th_skip_item("test_char_model", "the text corpus reader is compiled out (DTRAIN_NO_DATA)");
  return th_summary("test_char_model");
}
#else
#define DTRAIN__IMPLEMENTATION_DONE
#define main char_model_main
#include "../examples/03_char_model.c"
#undef main
#include "harness.h"
#include <unistd.h>

static char tmpdir[256], text_path[300];
static char out_text[1 << 16], err_text[1 << 12];

static void read_all(const char *path, char *buf, size_t cap) {
  buf[0] = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return;
  size_t n = fread(buf, 1, cap - 1, f);
  buf[n] = 0;
  fclose(f);
}

/* Runs the program with args (NULL-terminated); its stdout and stderr land in
 * out_text and err_text. Returns its exit code. */
static int run(const char *const *args) {
  char *argv[40];
  int argc = 0;
  argv[argc++] = (char *)"03_char_model";
  for (; *args && argc < 39; args++) argv[argc++] = (char *)*args;
  argv[argc] = NULL;
  char out_path[300], err_path[300];
  snprintf(out_path, sizeof out_path, "%s/stdout.txt", tmpdir);
  snprintf(err_path, sizeof err_path, "%s/stderr.txt", tmpdir);
  fflush(stdout);
  fflush(stderr);
  int saved_out = dup(1), saved_err = dup(2);
  FILE *fo = fopen(out_path, "wb"), *fe = fopen(err_path, "wb");
  if (saved_out < 0 || saved_err < 0 || !fo || !fe) {
    fprintf(stderr, "test_char_model: cannot redirect output\n");
    exit(1);
  }
  dup2(fileno(fo), 1);
  dup2(fileno(fe), 2);
  int rc = char_model_main(argc, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(saved_out);
  close(saved_err);
  fclose(fo);
  fclose(fe);
  read_all(out_path, out_text, sizeof out_text);
  read_all(err_path, err_text, sizeof err_text);
  return rc;
}

static int has_stdio(void) { return (dt_build_features() & DTRAIN_FEATURE_STDIO) != 0; }

/* The number after the last occurrence of `key` in text, NAN if none. */
static double number_after(const char *text, const char *key) {
  const char *p = NULL, *q = text;
  while ((q = strstr(q, key)) != NULL) p = q++;
  return p ? strtod(p + strlen(key), NULL) : NAN;
}

/* The sample printed after the validation line of `step` (its "  | " lines). */
static int sample_at(const char *text, int step, char *buf, size_t cap) {
  char key[64];
  snprintf(key, sizeof key, "step %5d  validation loss", step);
  const char *p = strstr(text, key);
  size_t n = 0;
  buf[0] = 0;
  if (!p || !(p = strchr(p, '\n'))) return 0;
  for (p++; strncmp(p, "  | ", 4) == 0 && n + 1 < cap; p++) {
    for (p += 4; *p && *p != '\n' && n + 1 < cap; p++) buf[n++] = *p;
    if (n + 1 < cap) buf[n++] = '\n';
    if (!*p) break;
  }
  buf[n] = 0;
  return n > 0;
}

/* Copies text without the timings ("(1.2 s)", ", 3.4 s"): the numbers before " s". */
static void without_times(const char *src, char *dst) {
  while (*src) {
    const char *end = src;
    while ((*end >= '0' && *end <= '9') || *end == '.') end++;
    if (end > src && strncmp(end, " s", 2) == 0 && (end[2] == ')' || end[2] == '\n')) src = end;
    else if (end > src) while (src < end) *dst++ = *src++;
    else *dst++ = *src++;
  }
  *dst = 0;
}

/* A tiny configuration: one layer of width 16, windows of 16 characters, on the
 * first 40 KB of the shipped text (written to text_path by main). */
#define TINY                                                                             \
  "--data", text_path, "--seq", "16", "--batch", "8", "--dim", "16", "--heads", "2", \
      "--layers", "1", "--lr", "0.02"

static void test_bad_flags(void) {
  const char *const unknown[] = {"--bogus", "1", NULL};
  CHECK(run(unknown) == 2);
  CHECK_MSG(strstr(err_text, "unknown option --bogus") && strstr(err_text, "usage:"), "%s", err_text);
  const char *const no_value[] = {"--steps", NULL};
  CHECK(run(no_value) == 2);
  CHECK_MSG(strstr(err_text, "--steps needs a value"), "%s", err_text);
  const char *const not_int[] = {"--steps", "12x", NULL};
  CHECK(run(not_int) == 2);
  CHECK_MSG(strstr(err_text, "--steps '12x': expected a whole number"), "%s", err_text);
  const char *const fraction[] = {"--batch", "1.5", NULL};
  CHECK(run(fraction) == 2);
  CHECK_MSG(strstr(err_text, "--batch '1.5'"), "%s", err_text);
  const char *const range[] = {"--layers", "99", NULL};
  CHECK(run(range) == 2);
  CHECK_MSG(strstr(err_text, "--layers '99': expected a whole number from 1 to 8"), "%s", err_text);
  const char *const lr[] = {"--lr", "-1", NULL};
  CHECK(run(lr) == 2);
  CHECK_MSG(strstr(err_text, "--lr '-1': expected a number"), "%s", err_text);
  const char *const heads[] = {"--dim", "30", "--heads", "4", NULL};
  CHECK(run(heads) == 2);
  CHECK_MSG(strstr(err_text, "--dim 30 is not a multiple of --heads 4"), "%s", err_text);
  const char *const help[] = {"--help", NULL};
  CHECK(run(help) == 0);
  CHECK(strstr(out_text, "--temperature") != NULL && strstr(out_text, "--resume") != NULL);
}

static void test_missing_data(void) {
  const char *const missing[] = {"--data", "/nonexistent/dtrain/text.txt", NULL};
  CHECK(run(missing) == 1);
  CHECK_MSG(strstr(err_text, "03_char_model: cannot read the text"), "%s", err_text);
  if (has_stdio()) CHECK_MSG(strstr(err_text, "/nonexistent/dtrain/text.txt"), "%s", err_text);
  else CHECK_MSG(strstr(err_text, "DTRAIN_NO_STDIO"), "%s", err_text);
}

static void test_bad_prompt_and_resume(void) {
  if (!has_stdio()) TH_SKIP("DTRAIN_NO_STDIO build has no file I/O");
  const char *const prompt[] = {"--steps", "0", "--prompt", "\xc3\xa9", TINY, NULL};
  CHECK(run(prompt) == 1);
  CHECK_MSG(strstr(err_text, "--prompt") && strstr(err_text, "not in the vocabulary"), "%s", err_text);
  char ck[300];
  snprintf(ck, sizeof ck, "%s/missing.safetensors", tmpdir);
  const char *const resume[] = {"--steps", "1", "--resume", ck, TINY, NULL};
  CHECK(run(resume) == 1);
  CHECK_MSG(strstr(err_text, "cannot resume") && strstr(err_text, "missing.safetensors"), "%s", err_text);
}

/* A short run learns: the validation loss falls far below the untrained one,
 * and every sample point prints a sample. */
static void test_short_run_learns(void) {
  if (!has_stdio()) TH_SKIP("DTRAIN_NO_STDIO build has no file I/O");
  const char *const args[] = {"--steps", "80", "--sample-every", "40", "--sample-len", "50", TINY, NULL};
  CHECK(run(args) == 0);
  double first = number_after(out_text, "step     0  validation loss ");
  double last = number_after(out_text, "final validation loss ");
  CHECK_MSG(first > 4.0 && last < first - 1.0, "validation loss %g -> %g\n%s", first, last, out_text);
  int lines = 0;
  for (const char *p = out_text; (p = strstr(p, "validation loss")) != NULL; p++) lines++;
  CHECK_MSG(lines == 4, "%d validation lines (steps 0, 40, 80 and the final line)", lines);
  char sample[512];
  CHECK(sample_at(out_text, 0, sample, sizeof sample) && strlen(sample) >= 50);
  CHECK(sample_at(out_text, 80, sample, sizeof sample) && strlen(sample) >= 50);
}

/* The same command line prints the same text (loss values, samples, checksum),
 * and --temperature 0 (greedy) differs from sampling. */
static void test_repeatable(void) {
  if (!has_stdio()) TH_SKIP("DTRAIN_NO_STDIO build has no file I/O");
  /* 20 steps, under an emulator (th_emulated) 10; a sample at step 10 either way */
  const char *steps = th_emulated() ? "10" : "20";
  const char *const args[] = {"--steps", steps, "--sample-every", "10", "--sample-len", "40", TINY, NULL};
  static char first[sizeof out_text], second[sizeof out_text];
  CHECK(run(args) == 0);
  without_times(out_text, first);
  CHECK(run(args) == 0);
  without_times(out_text, second);
  CHECK_MSG(strcmp(first, second) == 0, "two runs differ:\n%s\n----\n%s", first, second);
  CHECK(strstr(out_text, "params checksum") != NULL);
  const char *const greedy[] = {"--steps", steps, "--sample-every", "10", "--sample-len", "40",
                                       "--temperature", "0", TINY, NULL};
  CHECK(run(greedy) == 0);
  CHECK(number_after(first, "final validation loss ") == number_after(out_text, "final validation loss "));
  CHECK(strcmp(strstr(first, "params checksum"), strstr(out_text, "params checksum")) == 0);
  char sampled[512], greedy_sample[512];
  CHECK(sample_at(first, 10, sampled, sizeof sampled));
  CHECK(sample_at(out_text, 10, greedy_sample, sizeof greedy_sample));
  CHECK_MSG(strcmp(sampled, greedy_sample) != 0, "%s", sampled);
}

/* Tensors of two checkpoint files are bitwise equal (weights and Adam state). */
static int same_tensors(const char *pa, const char *pb, int verbose) {
  dt_checkpoint *a = dt_checkpoint_open(pa), *b = dt_checkpoint_open(pb);
  int same = a && b && dt_checkpoint_count(a) == dt_checkpoint_count(b) && dt_checkpoint_count(a) > 0;
  for (int i = 0; same && i < dt_checkpoint_count(a); i++) {
    dt_checkpoint_entry ea, eb;
    dt_checkpoint_entry_at(a, i, &ea);
    dt_checkpoint_entry_at(b, i, &eb);
    size_t n = (size_t)((ea.end - ea.begin) / 4);
    float *xa = (float *)malloc(n * sizeof(float) + 4), *xb = (float *)malloc(n * sizeof(float) + 4);
    same = xa && xb && strcmp(ea.name, eb.name) == 0 && ea.end - ea.begin == eb.end - eb.begin &&
           dt_checkpoint_read_f32(a, i, xa, n) == DTRAIN_OK &&
           dt_checkpoint_read_f32(b, i, xb, n) == DTRAIN_OK && memcmp(xa, xb, n * sizeof(float)) == 0;
    if (!same && verbose) fprintf(stderr, "tensor %d (%s) differs\n", i, ea.name);
    free(xa);
    free(xb);
  }
  same = same && strcmp(dt_checkpoint_meta(a, "step"), dt_checkpoint_meta(b, "step")) == 0;
  dt_checkpoint_close(a);
  dt_checkpoint_close(b);
  return same;
}

/* 30 steps in one go == 30 steps stopped at 12, then --resume: same weights, same
 * optimizer state, same final loss and checksum (under an emulator 14 and 6). */
static void test_resume_is_bitwise(void) {
  if (!has_stdio()) TH_SKIP("DTRAIN_NO_STDIO build has no file I/O");
  char full[300], half[300], resumed[300];
  snprintf(full, sizeof full, "%s/full.safetensors", tmpdir);
  snprintf(half, sizeof half, "%s/half.safetensors", tmpdir);
  snprintf(resumed, sizeof resumed, "%s/resumed.safetensors", tmpdir);
  static char out_full[sizeof out_text];
  const int emu = th_emulated();
  const char *total = emu ? "14" : "30", *stop = emu ? "6" : "12";
  const char *const a[] = {"--steps", total, "--sample-every", "0", "--checkpoint", full, TINY, NULL};
  CHECK(run(a) == 0);
  snprintf(out_full, sizeof out_full, "%s", out_text);
  const char *const b[] = {"--steps", total, "--stop-at", stop, "--sample-every", "0", "--checkpoint", half,
                           TINY, NULL};
  CHECK(run(b) == 0);
  const char *const c[] = {"--steps", total, "--sample-every", "0", "--resume", half, "--checkpoint", resumed,
                           TINY, NULL};
  CHECK(run(c) == 0);
  char at[32];
  snprintf(at, sizeof at, "at step %s", stop);
  CHECK_MSG(strstr(out_text, "resumed from") && strstr(out_text, at), "%s", out_text);
  const char *ca = strstr(out_full, "params checksum"), *cc = strstr(out_text, "params checksum");
  CHECK_MSG(ca && cc && strncmp(ca, cc, 32) == 0, "%s\n----\n%s", out_full, out_text);
  CHECK(number_after(out_full, "final validation loss ") == number_after(out_text, "final validation loss "));
  CHECK(same_tensors(full, resumed, 1));
  CHECK(!same_tensors(full, half, 0));
  /* another shape of model cannot resume from it */
  const char *const d[] = {"--steps", "30", "--resume", half, "--seq", "16", "--batch", "8", "--dim", "32",
                           "--heads", "2", "--layers", "1", NULL};
  CHECK(run(d) == 1);
  CHECK_MSG(strstr(err_text, "cannot resume"), "%s", err_text);
}

/* pick(): argmax at temperature 0, softmax(logits / T) frequencies otherwise. */
static void test_pick(void) {
  const float logits[4] = {logf(0.1f), logf(0.2f), logf(0.6f), logf(0.1f)};
  float scratch[4];
  dt_rng rng;
  dt_rng_seed(&rng, 7);
  CHECK(pick(logits, 4, 0.0, &rng, scratch) == 2);
  int counts[4] = {0, 0, 0, 0};
  const int n = 40000;
  for (int i = 0; i < n; i++) counts[pick(logits, 4, 1.0, &rng, scratch)]++;
  CHECK_NEAR(counts[0] / (double)n, 0.1, 0.01);
  CHECK_NEAR(counts[1] / (double)n, 0.2, 0.01);
  CHECK_NEAR(counts[2] / (double)n, 0.6, 0.01);
  CHECK_NEAR(counts[3] / (double)n, 0.1, 0.01);
  /* T = 0.5 squares the probabilities: 0.36 / (0.01 + 0.04 + 0.36 + 0.01) */
  memset(counts, 0, sizeof counts);
  for (int i = 0; i < n; i++) counts[pick(logits, 4, 0.5, &rng, scratch)]++;
  CHECK_NEAR(counts[2] / (double)n, 0.36 / 0.42, 0.01);
}

/* Builds a tiny model over a small text. */
typedef struct tiny {
  dt_text text;
  dt_params *P;
  model m;
  dt_graph *g;
} tiny;

static int tiny_make(tiny *t, int64_t seq) {
  static const char src[] =
      "ABSURDITY, n.  A statement or belief manifestly inconsistent with one's own opinion.\n\n"
      "ACADEME, n.  An ancient school where morality and philosophy were taught.\n\n"
      "ACCORD, n.  Harmony.\n\nADAGE, n.  Boned wisdom for weak teeth.\n";
  memset(t, 0, sizeof *t);
  if (dt_text_parse(src, sizeof src - 1, &t->text) != DTRAIN_OK) return 0;
  t->P = dt_params_create(3);
  t->g = dt_graph_create(t->P, NULL);
  return t->P && t->g && model_init(&t->m, t->P, t->text.vocab_size, seq, 16, 2, 2) == DTRAIN_OK;
}

static void tiny_free(tiny *t) {
  dt_graph_destroy(t->g);
  dt_params_destroy(t->P);
  dt_text_free(&t->text);
}

/* evaluate() in batches equals the mean of the windows' losses one by one. */
static void test_evaluate(void) {
  tiny t;
  CHECK(tiny_make(&t, 8));
  dt_graph_set_grad_enabled(t.g, 0);
  int64_t begin = 5, end = t.text.n, windows = (end - begin - 1) / 8;
  double sum = 0.0;
  for (int64_t w = 0; w < windows; w++) {
    dt_graph_reset(t.g);
    const int32_t *x = t.text.ids + begin + w * 8;
    sum += dt_item(dt_cross_entropy(t.g, model_forward(t.g, &t.m, x, 1, 8), x + 1));
  }
  CHECK(windows > 10);
  double batched = evaluate(t.g, &t.m, &t.text, begin, end, 3); /* 3 does not divide the windows */
  CHECK_NEAR(batched, sum / (double)windows, 1e-5);
  CHECK_NEAR(evaluate(t.g, &t.m, &t.text, begin, end, 1000), batched, 1e-5);
  CHECK(isnan(evaluate(t.g, &t.m, &t.text, 0, 8, 4))); /* no whole window */
  tiny_free(&t);
}

/* generate(): greedy continues with the argmax of a full forward pass; the
 * model sees at most seq characters; the same rng seed repeats a sample. */
static void test_generate(void) {
  tiny t;
  CHECK(tiny_make(&t, 8));
  dt_graph_set_grad_enabled(t.g, 0);
  int32_t ctx[40], ctx2[40];
  float scratch[256];
  dt_rng rng;
  CHECK(dt_text_encode(&t.text, "ACC", 3, ctx) == DTRAIN_OK);
  memcpy(ctx2, ctx, sizeof ctx);
  CHECK(generate(t.g, &t.m, ctx, 3, 37, 0.0, &rng, scratch) == DTRAIN_OK);
  for (int len = 3; len < 40; len++) {
    int64_t T = len < 8 ? len : 8;
    dt_graph_reset(t.g);
    dt_tensor *lg = model_forward(t.g, &t.m, ctx + len - T, 1, T);
    const float *row = lg->data + (T - 1) * t.m.vocab;
    int best = 0;
    for (int i = 1; i < t.m.vocab; i++)
      if (row[i] > row[best]) best = i;
    CHECK(ctx[len] == best);
  }
  dt_rng_seed(&rng, 11);
  CHECK(generate(t.g, &t.m, ctx, 3, 37, 1.0, &rng, scratch) == DTRAIN_OK);
  dt_rng_seed(&rng, 11);
  CHECK(generate(t.g, &t.m, ctx2, 3, 37, 1.0, &rng, scratch) == DTRAIN_OK);
  CHECK(memcmp(ctx, ctx2, sizeof ctx) == 0);
  tiny_free(&t);
}

/* ---- counting allocator: a training step allocates nothing after the first ---- */
static long alloc_count;
static void *count_alloc(size_t size, size_t align, void *user) {
  (void)user;
  alloc_count++;
  if (align < sizeof(void *)) align = sizeof(void *);
  return th_aligned_alloc(align, (size + align - 1) / align * align);
}
static void count_free(void *p, size_t size, void *user) {
  (void)size;
  (void)user;
  th_aligned_free(p);
}

static void test_no_allocation_per_step(void) {
  dt_allocator al;
  al.alloc = count_alloc;
  al.free = count_free;
  al.user = NULL;
  dt_set_allocator(&al);
  tiny t;
  CHECK(tiny_make(&t, 16));
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAMW;
  od.clip_norm = 1.0f;
  dt_optim *opt = dt_optim_create(t.P, &od);
  dt_graph *ev = dt_graph_create(t.P, NULL);
  dt_graph_set_grad_enabled(ev, 0);
  int32_t x[4 * 16], y[4 * 16], ctx[30];
  float scratch[256];
  dt_rng rng;
  dt_rng_seed(&rng, 5);
  float first = 0.0f, last = 0.0f;
  long after_first = 0;
  for (int step = 0; step < 40; step++) {
    CHECK(dt_text_sample(&t.text, 0, t.text.n, &rng, 4, 16, x, y) == DTRAIN_OK);
    dt_graph_reset(t.g);
    dt_params_zero_grad(t.P);
    dt_tensor *loss = dt_cross_entropy(t.g, model_forward(t.g, &t.m, x, 4, 16), y);
    CHECK(dt_backward(t.g, loss) == DTRAIN_OK);
    CHECK(dt_optim_step(opt) == DTRAIN_OK);
    memcpy(ctx, t.text.ids, 2 * sizeof(int32_t));
    CHECK(generate(ev, &t.m, ctx, 2, 28, 0.8, &rng, scratch) == DTRAIN_OK);
    if (step == 0) {
      first = dt_item(loss);
      after_first = alloc_count;
    }
    last = dt_item(loss);
  }
  CHECK_MSG(alloc_count == after_first, "%ld allocations after the first step", alloc_count - after_first);
  CHECK_MSG(last < first - 0.5f, "loss %g -> %g", first, last);
  dt_graph_destroy(ev);
  dt_optim_destroy(opt);
  tiny_free(&t);
  dt_set_allocator(NULL);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dtrain_test_char_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  /* the program reads data/text/ relative to the repository root */
  if (has_stdio() && access("data/text/devils_dictionary.txt", R_OK) != 0) {
    const char *file = __FILE__, *slash = strrchr(file, '/');
    char dir[512];
    snprintf(dir, sizeof dir, "%.*s/..", slash ? (int)(slash - file) : 1, slash ? file : ".");
    if (chdir(dir) != 0) perror("chdir");
  }
  if (has_stdio()) {
    static char head[40000];
    FILE *f = fopen("data/text/devils_dictionary.txt", "rb");
    size_t n = f ? fread(head, 1, sizeof head, f) : 0;
    if (f) fclose(f);
    snprintf(text_path, sizeof text_path, "%s/text.txt", tmpdir);
    f = fopen(text_path, "wb");
    if (n != sizeof head || !f || fwrite(head, 1, n, f) != n) {
      fprintf(stderr, "test_char_model: cannot copy data/text/devils_dictionary.txt to %s\n", text_path);
      return 1;
    }
    fclose(f);
  }
  TH_RUN(test_bad_flags);
  TH_RUN(test_missing_data);
  TH_RUN(test_bad_prompt_and_resume);
  TH_RUN(test_pick);
  TH_RUN(test_evaluate);
  TH_RUN(test_generate);
  TH_RUN(test_no_allocation_per_step);
  TH_RUN(test_short_run_learns);
  TH_RUN(test_repeatable);
  TH_RUN(test_resume_is_bitwise);
  static const char *const names[] = {"text.txt", "stdout.txt", "stderr.txt", "full.safetensors",
                                      "half.safetensors", "resumed.safetensors"};
  char p[300];
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    snprintf(p, sizeof p, "%s/%s", tmpdir, names[i]);
    remove(p);
  }
  rmdir(tmpdir);
  return th_summary("test_char_model");
}
#endif /* DTRAIN_NO_DATA */
