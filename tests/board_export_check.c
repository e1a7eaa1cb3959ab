/* tests/board_export_check.c -- a header written by dt_checkpoint_export_c
 * (prefix "model", included as MODEL_HEADER) against the checkpoint it came
 * from: every float32 tensor but the optimizer's, in order, with its name,
 * shape and every float bit for bit. Built and run by tests/board_checks.sh.
 * Prints "export: N tensors, N floats identical" or what differs; exit 1 then. */
#include "harness.h"
#include MODEL_HEADER
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  dt_checkpoint *c = dt_checkpoint_open(argv[1]);
  if (!c) {
    printf("FAIL: %s\n", dt_last_error());
    return 1;
  }
  int t = 0, bad = 0;
  long long floats = 0;
  for (int i = 0; i < dt_checkpoint_count(c) && !bad; i++) {
    dt_checkpoint_entry e;
    dt_checkpoint_entry_at(c, i, &e);
    if (strncmp(e.name, "optim.", 6) == 0) continue;
    if (t >= MODEL_TENSORS) {
      printf("FAIL: '%s' missing from the header\n", e.name);
      bad = 1;
      break;
    }
    const model_tensor *m = &model_tensors[t++];
    size_t n = (size_t)((e.end - e.begin) / 4);
    float *v = (float *)malloc(n ? n * sizeof(float) : 1);
    if (!v || dt_checkpoint_read_f32(c, i, v, n) != DTRAIN_OK) {
      printf("FAIL: reading '%s'\n", e.name);
      bad = 1;
    } else if (strcmp(m->name, e.name) != 0 || m->ndim != e.ndim ||
               memcmp(m->shape, e.shape, sizeof e.shape) != 0) {
      printf("FAIL: tensor %d is '%s' (rank %d) in the header, '%s' (rank %d) in the file\n", t - 1, m->name, m->ndim,
             e.name, e.ndim);
      bad = 1;
    } else if (memcmp(m->data, v, n * sizeof(float)) != 0) {
      for (size_t k = 0; k < n; k++)
        if (memcmp(&m->data[k], &v[k], sizeof(float)) != 0) {
          printf("FAIL: '%s'[%zu] is %.9g in the header, %.9g in the file\n", e.name, k, (double)m->data[k], (double)v[k]);
          break;
        }
      bad = 1;
    }
    floats += (long long)n;
    free(v);
  }
  if (!bad && t != MODEL_TENSORS) {
    printf("FAIL: the header has %d tensors, the file %d\n", MODEL_TENSORS, t);
    bad = 1;
  }
  dt_checkpoint_close(c);
  if (!bad) printf("export: %d tensors, %lld floats identical\n", t, floats);
  return bad;
}
