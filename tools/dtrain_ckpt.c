/* tools/dtrain_ckpt.c -- dtrain-ckpt: model-parallel checkpoints from the shell
 * (dt_checkpoint_gather / _split, dt_io.h).
 *
 *   dtrain-ckpt info FILE
 *       the tensors (name, dtype, shape) and the metadata of a checkpoint or part
 *   dtrain-ckpt gather -o FULL PART...
 *       one full checkpoint (one_device loads it) from every stage's / shard's part
 *   dtrain-ckpt split FULL -o PATTERN [--stages P] [--start NAME]... [--tensor T]
 *                     [--split NAME=rows|cols|qkv]...
 *       every part of a layout of P stages x T shards: PATTERN names the files,
 *       "{stage}" and "{shard}" replaced by the numbers. Stage s >= 1 starts at
 *       the s-th --start parameter (default: the gathered layout's, for the
 *       same P); --split says how a parameter is cut for T shards (default:
 *       the file's "split" metadata).
 *   dtrain-ckpt export-c FILE -o OUT.h [--prefix NAME]
 *       the weights as C source (dt_checkpoint_export_c): const float arrays
 *       and a table of names and shapes, for inference on a board
 *       (examples/board/board_inference.c)
 *
 * Exit status: 0 done, 1 the library refused (its message on stderr, nothing
 * written by that call), 2 bad usage.
 */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 256

static int usage(void) {
  fprintf(stderr,
          "usage: dtrain-ckpt info FILE\n"
          "       dtrain-ckpt gather -o FULL PART...\n"
          "       dtrain-ckpt split FULL -o PATTERN [--stages P] [--start NAME]... [--tensor T]\n"
          "                         [--split NAME=rows|cols|qkv]...\n"
          "       dtrain-ckpt export-c FILE -o OUT.h [--prefix NAME]   (the weights as C source)\n"
          "PATTERN: a file name with {stage} and {shard} in it (e.g. part-{stage}-{shard}.safetensors)\n");
  return 2;
}

static int info(const char *path) {
  dt_checkpoint *c = dt_checkpoint_open(path);
  if (!c) {
    fprintf(stderr, "dtrain-ckpt: %s\n", dt_last_error());
    return 1;
  }
  printf("%s: %d tensors, %llu bytes\n", path, dt_checkpoint_count(c), (unsigned long long)dt_checkpoint_file_size(c));
  for (int i = 0; i < dt_checkpoint_count(c); i++) {
    dt_checkpoint_entry e;
    dt_checkpoint_entry_at(c, i, &e);
    printf("  %-40s %-4s [", e.name, e.dtype);
    for (int d = 0; d < e.ndim; d++) printf(d ? ", %lld" : "%lld", (long long)e.shape[d]);
    printf("]\n");
  }
  for (int i = 0; i < dt_checkpoint_meta_count(c); i++) {
    const char *k, *v;
    dt_checkpoint_meta_at(c, i, &k, &v);
    printf("  meta %s = %s\n", k, v);
  }
  dt_checkpoint_close(c);
  return 0;
}

/* PATTERN with {stage} and {shard} replaced; 0 when it does not fit. */
static int expand(const char *pat, int stage, int shard, char *out, size_t cap) {
  size_t n = 0;
  for (const char *p = pat; *p;) {
    char num[16];
    const char *rep = NULL;
    size_t skip = 1;
    if (strncmp(p, "{stage}", 7) == 0) {
      snprintf(num, sizeof num, "%d", stage);
      rep = num;
      skip = 7;
    } else if (strncmp(p, "{shard}", 7) == 0) {
      snprintf(num, sizeof num, "%d", shard);
      rep = num;
      skip = 7;
    }
    size_t len = rep ? strlen(rep) : 1;
    if (n + len + 1 > cap) return 0;
    memcpy(out + n, rep ? rep : p, len);
    n += len;
    p += skip;
  }
  out[n] = '\0';
  return 1;
}

/* The tool prints the library's errors itself, once. */
static void quiet(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)level; (void)code; (void)msg; (void)user;
}

int main(int argc, char **argv) {
  dt_set_logger(quiet, NULL, DTRAIN_LOG_ERROR);
  if (argc < 2) return usage();
  const char *cmd = argv[1];
  if (strcmp(cmd, "info") == 0) return argc == 3 ? info(argv[2]) : usage();
  if (strcmp(cmd, "export-c") == 0) {
    const char *in = NULL, *to = NULL, *prefix = NULL;
    for (int i = 2; i < argc; i++) {
      if ((strcmp(argv[i], "-o") == 0 || strcmp(argv[i], "--prefix") == 0) && i + 1 < argc) {
        if (argv[i][1] == 'o') to = argv[++i];
        else prefix = argv[++i];
      } else if (argv[i][0] != '-' && !in) {
        in = argv[i];
      } else {
        return usage();
      }
    }
    if (!in || !to) return usage();
    if (dt_checkpoint_export_c(in, to, prefix) != DTRAIN_OK) {
      fprintf(stderr, "dtrain-ckpt: %s\n", dt_last_error());
      return 1;
    }
    return 0;
  }
  const char *out = NULL, *full = NULL;
  const char *inputs[MAXN], *starts[MAXN], *split_names[MAXN];
  int split_kinds[MAXN], nin = 0, nstart = 0, nsplit = 0, P = 1, T = 1;
  static char split_buf[MAXN][256];
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "-o") == 0 || strcmp(a, "--stages") == 0 || strcmp(a, "--start") == 0 ||
        strcmp(a, "--tensor") == 0 || strcmp(a, "--split") == 0) {
      if (!v) return usage();
      i++;
      if (strcmp(a, "-o") == 0) out = v;
      else if (strcmp(a, "--stages") == 0) P = atoi(v);
      else if (strcmp(a, "--tensor") == 0) T = atoi(v);
      else if (strcmp(a, "--start") == 0) {
        if (nstart == MAXN) return usage();
        starts[nstart++] = v;
      } else {
        const char *eq = strrchr(v, '=');
        static const char *const kinds[4] = {"none", "rows", "cols", "qkv"};
        if (!eq || nsplit == MAXN || (size_t)(eq - v) >= sizeof split_buf[0]) return usage();
        memcpy(split_buf[nsplit], v, (size_t)(eq - v));
        split_buf[nsplit][eq - v] = '\0';
        split_kinds[nsplit] = -1;
        for (int k = 0; k < 4; k++)
          if (strcmp(eq + 1, kinds[k]) == 0) split_kinds[nsplit] = k;
        if (split_kinds[nsplit] < 0) {
          fprintf(stderr, "dtrain-ckpt: --split %s: the kind is rows, cols, qkv or none\n", v);
          return 2;
        }
        split_names[nsplit] = split_buf[nsplit];
        nsplit++;
      }
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "dtrain-ckpt: unknown option %s\n", a);
      return usage();
    } else {
      if (nin == MAXN) return usage();
      inputs[nin++] = a;
    }
  }
  if (!out) return usage();
  if (strcmp(cmd, "gather") == 0) {
    if (nin < 1 || nstart || nsplit || P != 1 || T != 1) return usage();
    if (dt_checkpoint_gather(inputs, nin, out) != DTRAIN_OK) {
      fprintf(stderr, "dtrain-ckpt: %s\n", dt_last_error());
      return 1;
    }
    printf("dtrain-ckpt: gathered %d parts into %s\n", nin, out);
    return 0;
  }
  if (strcmp(cmd, "split") != 0 || nin != 1) return usage();
  full = inputs[0];
  if (P < 1 || T < 1 || (nstart && nstart != P - 1)) {
    fprintf(stderr, "dtrain-ckpt: --stages %d needs %d --start names (or none: the gathered layout's)\n", P, P - 1);
    return 2;
  }
  if ((P > 1 && !strstr(out, "{stage}")) || (T > 1 && !strstr(out, "{shard}"))) {
    fprintf(stderr, "dtrain-ckpt: -o %s: the pattern needs {stage} (P > 1) and {shard} (T > 1)\n", out);
    return 2;
  }
  dt_split_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.stages = P;
  plan.shards = T;
  plan.stage_starts = nstart ? starts : NULL;
  plan.nsplit = nsplit;
  plan.split_names = split_names;
  plan.split_kinds = split_kinds;
  for (int s = 0; s < P; s++)
    for (int t = 0; t < T; t++) {
      char path[4096];
      if (!expand(out, s, t, path, sizeof path)) {
        fprintf(stderr, "dtrain-ckpt: -o %s: the name is too long\n", out);
        return 2;
      }
      if (dt_checkpoint_split(full, &plan, s, t, path) != DTRAIN_OK) {
        fprintf(stderr, "dtrain-ckpt: %s\n", dt_last_error());
        return 1;
      }
      printf("dtrain-ckpt: stage %d shard %d -> %s\n", s, t, path);
    }
  return 0;
}
