/* libFuzzer target: the parameter server's shard-checkpoint reader
 * (dt__ps_ckpt_read, what dt_ps_serve resumes from; `make fuzz`).
 *
 * A genuine checkpoint of a small model's one shard (Adam: two optimizer
 * slots) is written once at start. The first input byte chooses how the rest
 * makes the file:
 *   bit 0 set    the rest is the whole file;
 *   bit 0 clear  the rest edits the genuine file: u16 length to cut it to (0:
 *                keep), then (u16 offset, xor byte) pairs;
 *   bit 1 set    the trailing CRC-32C is then made right again, so that the
 *                reader's checks after the checksum are reached too.
 * Each read ends in success or an error with a message, never a crash, an
 * out-of-bounds read or a leak; what is accepted is a file of exactly the
 * checkpoint's size (or of a version-1 one, without the work queue) whose
 * counts the server then holds (a negative optimizer step was once
 * "accepted" while dt_optim_set_steps refused it), and whose work queue adds
 * up. */
#define _POSIX_C_SOURCE 200809L
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>
#include <unistd.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_ps_ckpt: %s\n", msg); abort(); } while (0)

static void fz_quiet(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

static dt__ps_server S;
static dt_cluster cl;
static char *saddr[1] = {"127.0.0.1:1"}, *waddr[1] = {"127.0.0.1:2"};
static unsigned char *genuine;
static size_t genuine_n;

static int fz_setup(void) {
  dt_params *P = dt_params_create(3);
  int64_t w1[2] = {5, 3}, b1[1] = {3}, w2[2] = {3, 2};
  dt_params_add(P, "w1", 2, w1, dt_init_normal(0.0f, 0.5f));
  dt_params_add(P, "b1", 1, b1, dt_init_zeros());
  dt_params_add(P, "w2", 2, w2, dt_init_normal(0.0f, 0.5f));
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.01f;
  dt_optim *opt = dt_optim_create(P, &od);
  if (!P || !opt) return 0;
  cl.workers = 1;
  cl.servers = 1;
  cl.worker_addr = waddr;
  cl.server_addr = saddr;
  cl.role = DTRAIN_ROLE_PS;
  S.c = &cl;
  S.params = P;
  S.opt = opt;
  S.me = 0;
  S.np = dt_params_count(P);
  S.owner = (int *)calloc((size_t)S.np, sizeof(int));
  if (!S.owner || dt_ps_shard(P, 1, S.owner) != DTRAIN_OK) return 0;
  /* a work queue of 9 items (server 0's) and 2 workers: 4 handed out, item 2 given back,
   * item 3 held by worker 1 (worker 0 holds none) */
  S.W = 2;
  S.w = (dt__ps_worker *)calloc(2, sizeof(dt__ps_worker));
  S.q_back = (int64_t *)calloc(2, sizeof(int64_t));
  if (!S.w || !S.q_back) return 0;
  S.q.items = 9;
  S.q_next = 4;
  S.q_back[0] = 2;
  S.q_nback = 1;
  S.w[0].lease = -1;
  S.w[1].lease = 3;
  S.q.done = 2;
  S.q.handed_out = 5;
  S.q.returned = 1;
  S.shard = dt__ps_shard_floats(P, S.owner, 0);
  S.layout = dt__ps_layout_hash(P, S.owner, 0, 1);
  S.ckpt_bytes = dt__ps_ckpt_size(&S);
  S.ckpt = (unsigned char *)malloc(S.ckpt_bytes);
  if (!S.ckpt) return 0;
  snprintf(S.ckpt_path, sizeof S.ckpt_path, "/tmp/fuzz_ps_ckpt_%ld.ckpt", (long)getpid());
  S.version = 77;
  dt_optim_set_steps(opt, 77);
  if (dt__ps_ckpt_write(&S) != DTRAIN_OK) return 0;
  FILE *f = fopen(S.ckpt_path, "rb");
  if (!f) return 0;
  genuine = (unsigned char *)malloc(S.ckpt_bytes);
  genuine_n = genuine ? fread(genuine, 1, S.ckpt_bytes, f) : 0;
  fclose(f);
  return genuine_n == S.ckpt_bytes;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int ready;
  if (!ready) {
    dt_set_logger(fz_quiet, NULL, DTRAIN_LOG_ERROR);
    if (!fz_setup()) FZ_FAIL("set-up: cannot write a genuine checkpoint");
    ready = 1;
  }
  if (size < 1) return 0;
  unsigned flags = data[0];
  data++;
  size--;
  unsigned char *file;
  size_t n;
  if (flags & 1) {
    file = (unsigned char *)malloc(size ? size : 1);
    if (!file) return 0;
    if (size) memcpy(file, data, size);
    n = size;
  } else {
    file = (unsigned char *)malloc(genuine_n);
    if (!file) return 0;
    memcpy(file, genuine, genuine_n);
    n = genuine_n;
    if (size >= 2) {
      size_t cut = (size_t)data[0] | (size_t)data[1] << 8;
      if (cut && cut < n) n = cut;
      for (size_t i = 2; i + 3 <= size; i += 3) {
        size_t off = (size_t)data[i] | (size_t)data[i + 1] << 8;
        if (off < n) file[off] ^= data[i + 2];
      }
    }
  }
  if ((flags & 2) && n >= 4) dt__put_le32(file + n - 4, dt__crc32c(0, file, n - 4));
  FILE *f = fopen(S.ckpt_path, "wb");
  if (!f) {
    free(file);
    return 0;
  }
  if (n) fwrite(file, 1, n, f);
  fclose(f);
  uint64_t version = n >= 56 ? dt__get_le64(file + 40) : 0, steps = n >= 56 ? dt__get_le64(file + 48) : 0;
  uint32_t fv = n >= 8 ? dt__get_le32(file + 4) : 0;
  const size_t v1 = 64 + 3 * S.shard * 4 + 4; /* (Adam: 2 slots) */
  uint64_t qcount = n >= v1 + 44 ? dt__get_le64(file + v1 - 4 + 40) : 0;
  free(file);
  dt_clear_error();
  dt_result r = dt__ps_ckpt_read(&S);
  if (r != DTRAIN_OK && dt_last_error()[0] == '\0') FZ_FAIL("refused without a message");
  /* (version 1 has no work queue section; version 2's holds count items to do again) */
  if (r == DTRAIN_OK && n != v1 + (fv == 2 ? 48 + 8 * (size_t)qcount : 0)) FZ_FAIL("accepted a file of the wrong size");
  if (r == DTRAIN_OK && fv == 2 && (S.q_next > S.q.items || S.q.done != S.q_next - S.q_nback || S.q_nback > S.W))
    FZ_FAIL("accepted a work queue that does not add up");
  /* What is accepted is taken whole: the server's counts are the file's. */
  if (r == DTRAIN_OK && (S.version != version || (uint64_t)dt_optim_steps(S.opt) != steps))
    FZ_FAIL("accepted counts it did not take (a negative optimizer step?)");
  if (getenv("DTRAIN_FUZZ_VERBOSE")) /* (to see what a seed reaches) */
    fprintf(stderr, "fuzz_ps_ckpt: %zu bytes, version %u: %s\n", n, (unsigned)fv,
            r == DTRAIN_OK ? "accepted" : dt_last_error());
  remove(S.ckpt_path);
  return 0;
}
