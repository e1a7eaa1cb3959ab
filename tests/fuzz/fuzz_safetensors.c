/* libFuzzer target: the safetensors / checkpoint loader (`make fuzz`).
 *
 * The input is written to a file and read back the ways dtrain reads one:
 * dt_checkpoint_open (the strict index, any dtype), then every entry and
 * metadata pair is visited and every F32 tensor copied out; then
 * dt_checkpoint_load_weights and dt_checkpoint_load into a small model whose
 * names are those of the seeds ("w" [2, 3], "b" [3]). Each ends in success or
 * an error with a message, never a crash, an out-of-bounds read or a leak;
 * on an error the model's values are unchanged. */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>
#include <unistd.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_safetensors: %s\n", msg); abort(); } while (0)

static char fz_path[64];
static dt_params *fz_P;
static dt_optim *fz_opt;

static void fz_quiet(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

static void fz_setup(void) {
  if (fz_P) return;
  dt_set_logger(fz_quiet, NULL, DTRAIN_LOG_ERROR);
  snprintf(fz_path, sizeof fz_path, "/tmp/fuzz_safetensors_%ld.st", (long)getpid());
  fz_P = dt_params_create(1);
  int64_t ws[2] = {2, 3}, bs[1] = {3};
  dt_params_add(fz_P, "w", 2, ws, dt_init_constant(0.5f));
  dt_params_add(fz_P, "b", 1, bs, dt_init_constant(0.25f));
  dt_optim_options d;
  memset(&d, 0, sizeof d);
  d.kind = DTRAIN_OPTIM_SGD;
  d.lr = 0.1f;
  d.momentum = 0.9f;
  fz_opt = dt_optim_create(fz_P, &d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_setup();
  FILE *f = fopen(fz_path, "wb");
  if (!f) return 0;
  if (size) fwrite(data, 1, size, f);
  fclose(f);

  dt_checkpoint *c = dt_checkpoint_open(fz_path);
  if (c) {
    if (dt_checkpoint_file_size(c) != size) FZ_FAIL("file size differs from the input");
    if (dt_checkpoint_header_size(c) + 8 > size) FZ_FAIL("header beyond the file");
    for (int i = 0; i < dt_checkpoint_count(c); i++) {
      dt_checkpoint_entry e;
      if (dt_checkpoint_entry_at(c, i, &e) != DTRAIN_OK) FZ_FAIL("entry_at failed on a listed entry");
      if (e.end < e.begin || e.end > size) FZ_FAIL("entry out of bounds");
      if (dt_checkpoint_find(c, e.name) != i) FZ_FAIL("find does not give the entry back");
      if (strcmp(e.dtype, "F32") == 0 && (e.end - e.begin) / 4 <= (1u << 20)) {
        size_t n = (size_t)((e.end - e.begin) / 4);
        float *buf = (float *)malloc(n ? n * sizeof(float) : 1);
        if (buf && dt_checkpoint_read_f32(c, i, buf, n) != DTRAIN_OK) FZ_FAIL("read_f32 refused a listed F32 tensor");
        free(buf);
      }
    }
    for (int i = 0; i < dt_checkpoint_meta_count(c); i++) {
      const char *k = NULL, *v = NULL;
      if (dt_checkpoint_meta_at(c, i, &k, &v) != DTRAIN_OK || !k || !v) FZ_FAIL("meta_at failed");
    }
    dt_checkpoint_close(c);
  } else if (dt_last_error()[0] == '\0') {
    FZ_FAIL("refused without a message");
  }

  float before[9], after[9];
  memcpy(before, dt_params_data(fz_P), sizeof before);
  if (dt_checkpoint_load_weights(fz_path, fz_P) != DTRAIN_OK) {
    memcpy(after, dt_params_data(fz_P), sizeof after);
    if (memcmp(before, after, sizeof before) != 0) FZ_FAIL("a failed load_weights changed the params");
  }
  memcpy(before, dt_params_data(fz_P), sizeof before);
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = fz_P;
  st.optim = fz_opt;
  if (dt_checkpoint_load(fz_path, &st) != DTRAIN_OK) {
    memcpy(after, dt_params_data(fz_P), sizeof after);
    if (memcmp(before, after, sizeof before) != 0) FZ_FAIL("a failed load changed the params");
  }
  /* Back to known values, so that every input starts from the same model. */
  float *p = dt_params_data(fz_P);
  for (int i = 0; i < 6; i++) p[i] = 0.5f;
  for (int i = 6; i < 9; i++) p[i] = 0.25f;
  remove(fz_path);
  return 0;
}
