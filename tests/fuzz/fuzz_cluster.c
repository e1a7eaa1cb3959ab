/* libFuzzer target: the cluster description (`make fuzz`).
 *
 * The first input byte chooses:
 *  even: the rest as DTRAIN_CONFIG text: dt_cluster_parse_json ends in
 *        success or a FORMAT/INVALID_ARG error with a message, never a crash
 *        or an out-of-bounds read; what it accepts goes through
 *        dt_cluster_to_json and parses back to the same cluster, and clones;
 *  odd:  the rest as command-line words (split at NUL bytes) for
 *        dt_cluster_from_args: on success the used flags are gone and the
 *        cluster round-trips through JSON; on failure argv is untouched. */
#define DTRAIN_STATIC
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdlib.h>

#define FZ_FAIL(msg) do { fprintf(stderr, "fuzz_cluster: %s\n", msg); abort(); } while (0)

static int fz_same(const dt_cluster *a, const dt_cluster *b) {
  if (a->workers != b->workers || a->servers != b->servers || a->role != b->role || a->index != b->index) return 0;
  for (int k = 0; k < a->workers; k++)
    if (strcmp(a->worker_addr[k], b->worker_addr[k]) != 0) return 0;
  for (int k = 0; k < a->servers; k++)
    if (strcmp(a->server_addr[k], b->server_addr[k]) != 0) return 0;
  return 1;
}

static void fz_round_trip(const dt_cluster *c) {
  size_t cap = 64 + (size_t)(c->workers + c->servers) * 600;
  char *json = (char *)malloc(cap);
  if (!json) return;
  if (dt_cluster_to_json(c, json, cap) != DTRAIN_OK) FZ_FAIL("to_json refused an accepted cluster");
  dt_cluster *d = NULL;
  if (dt_cluster_parse_json(json, &d) != DTRAIN_OK || !fz_same(c, d)) FZ_FAIL("to_json does not round-trip");
  dt_cluster_destroy(d);
  d = dt_cluster_clone(c);
  if (!d || !fz_same(c, d)) FZ_FAIL("clone differs");
  dt_cluster_destroy(d);
  free(json);
}

static void fz_quiet(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level, (void)code, (void)msg, (void)user;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size);
int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
  if (size < 1) return 0;
  dt_set_logger(fz_quiet, NULL, DTRAIN_LOG_DEBUG);
  char *text = (char *)malloc(size);
  if (!text) return 0;
  memcpy(text, data + 1, size - 1);
  text[size - 1] = '\0';
  dt_cluster *c = NULL;
  if ((data[0] & 1) == 0) {
    dt_result rc = dt_cluster_parse_json(text, &c);
    if (rc == DTRAIN_OK) {
      if (!c) FZ_FAIL("success without a cluster");
      fz_round_trip(c);
    } else if ((rc != DTRAIN_ERR_FORMAT && rc != DTRAIN_ERR_INVALID_ARG) || c || !dt_last_error()[0]) {
      FZ_FAIL("unexpected failure");
    }
  } else {
    char *argv[34], *orig[34];
    int argc = 0;
    argv[argc++] = (char *)"prog";
    for (size_t k = 0; k < size - 1 && argc < 33;) {
      argv[argc++] = text + k;
      k += strlen(text + k) + 1;
    }
    argv[argc] = NULL;
    memcpy(orig, argv, sizeof argv);
    int n = argc;
    dt_result rc = dt_cluster_from_args(&n, argv, &c);
    if (rc == DTRAIN_OK) {
      if (!c || n > argc || n < 1 || argv[n] != NULL) FZ_FAIL("bad argv after success");
      fz_round_trip(c);
    } else if (n != argc || memcmp(orig, argv, sizeof argv) != 0 || c) {
      FZ_FAIL("argv changed by a failure");
    }
  }
  dt_cluster_destroy(c);
  free(text);
  return 0;
}
