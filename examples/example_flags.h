/* example_flags.h -- the examples' command lines: one table per program, the
 * same rules everywhere (issue 22: flags that help).
 *
 *   --help / -h      the usage (every flag, its meaning and its default) on
 *                    stdout; the program exits 0
 *   numbers          parsed strictly: "--epochs 2.7", "--limit abc", "--lr 1e"
 *                    and values outside the flag's range are errors, never
 *                    rounded or read as 0
 *   errors           one line on stderr, "error: ...", then the usage; exit 2
 *
 * A table entry: the name (without "--"), a kind, where the value goes, the
 * allowed range for numbers, and the help text. The default shown is the
 * value the variable holds when ex_parse starts, so set the defaults first.
 * Kinds: 'i' int, 'L' long, 'l' int64_t, 'u' uint64_t, 'f' float, 'd' double, 's' a
 * string (const char *), 'b' a switch without a value (int set to 1).
 * Included by the examples (a plain header beside them: "cc -I. examples/X.c"
 * finds it); the programs stay single files otherwise. At the end: the
 * examples' logger (ex_log_init), which leaves printing errors to them. */
#ifndef DTRAIN_EXAMPLE_FLAGS_H
#define DTRAIN_EXAMPLE_FLAGS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#  define EX_UNUSED __attribute__((unused))
#else
#  define EX_UNUSED
#endif

typedef struct ex_flag {
  const char *name;
  char kind;
  void *value;
  double lo, hi;
  const char *help;
} ex_flag;

/* The default of f as text (its variable's value now). */
EX_UNUSED static void ex_default(const ex_flag *f, char *buf, size_t cap) {
  switch (f->kind) {
    case 'i': snprintf(buf, cap, "%d", *(int *)f->value); break;
    case 'L': snprintf(buf, cap, "%ld", *(long *)f->value); break;
    case 'l': snprintf(buf, cap, "%lld", (long long)*(int64_t *)f->value); break;
    case 'u': snprintf(buf, cap, "%llu", (unsigned long long)*(uint64_t *)f->value); break;
    case 'f': snprintf(buf, cap, "%g", (double)*(float *)f->value); break;
    case 'd': snprintf(buf, cap, "%g", *(double *)f->value); break;
    case 's': {
      const char *v = *(const char **)f->value;
      size_t k = 0;
      if (!v) v = "none";
      for (; *v && k + 3 < cap; v++) { /* control characters shown escaped: "\n" */
        if (*v == '\n' || *v == '\t') buf[k++] = '\\', buf[k++] = *v == '\n' ? 'n' : 't';
        else buf[k++] = *v;
      }
      buf[k] = '\0';
      break;
    }
    default: buf[0] = '\0';
  }
}

/* The usage: one line per flag, its help and [its default]; `extra` (may be NULL) after. */
EX_UNUSED static void ex_usage(FILE *out, const char *prog, const ex_flag *flags, int n, const char *extra) {
  fprintf(out, "usage: %s [--flag value]...\n", prog);
  for (int i = 0; i < n; i++) {
    char def[128], left[48];
    ex_default(&flags[i], def, sizeof def);
    snprintf(left, sizeof left, "--%s%s", flags[i].name, flags[i].kind == 'b' ? "" : " X");
    if (flags[i].kind == 'b') fprintf(out, "  %-22s %s\n", left, flags[i].help);
    else fprintf(out, "  %-22s %s [%s]\n", left, flags[i].help, def);
  }
  fprintf(out, "  %-22s this help\n", "--help, -h");
  if (extra) fprintf(out, "%s", extra);
}

/* Parses argv against the table. Returns 1 to go on, 0 after printing what is
 * wrong (exit 2), -1 after printing the help (exit 0). */
EX_UNUSED static int ex_parse(const char *prog, int argc, char **argv, const ex_flag *flags, int n, const char *extra) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      ex_usage(stdout, prog, flags, n, extra);
      return -1;
    }
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    const ex_flag *f = NULL;
    for (int k = 0; k < n && !f; k++)
      if (strncmp(arg, "--", 2) == 0 && strcmp(arg + 2, flags[k].name) == 0) f = &flags[k];
    if (!f) {
      fprintf(stderr, "error: unknown option %s (--help lists them)\n", arg);
      return 0;
    }
    if (f->kind == 'b') {
      *(int *)f->value = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "error: %s needs a value\n", arg);
      return 0;
    }
    const char *text = argv[++i];
    if (f->kind == 's') {
      *(const char **)f->value = text;
      continue;
    }
    char *end = NULL;
    double v = strtod(text, &end);
    int integer = f->kind == 'i' || f->kind == 'L' || f->kind == 'l' || f->kind == 'u';
    for (const char *q = text; f->kind == 'u' && *q; q++)
      if (*q < '0' || *q > '9') end = (char *)(uintptr_t)text; /* digits only: read exactly below */
    if (end == text || *end != '\0' || !(v >= f->lo && v <= f->hi) || (integer && v != floor(v))) {
      fprintf(stderr, "error: %s '%s': expected %s from %.10g to %.10g\n", arg, text,
              integer ? "a whole number" : "a number", f->lo, f->hi);
      return 0;
    }
    switch (f->kind) {
      case 'i': *(int *)f->value = (int)v; break;
      case 'L': *(long *)f->value = (long)v; break;
      case 'l': *(int64_t *)f->value = (int64_t)v; break;
      case 'u': *(uint64_t *)f->value = strtoull(text, NULL, 10); break; /* exact past 2^53 */
      case 'f': *(float *)f->value = (float)v; break;
      default: *(double *)f->value = v; break;
    }
  }
  return 1;
}

/* Whether --name appears on the command line (a default that depends on it). */
EX_UNUSED static int ex_given(int argc, char **argv, const char *name) {
  for (int i = 1; i < argc; i++)
    if (strncmp(argv[i], "--", 2) == 0 && strcmp(argv[i] + 2, name) == 0) return 1;
  return 0;
}

/* The examples' logger: ex_log_init() first thing in main. dtrain's default
 * logger prints every error it sets ("dtrain error (CODE): ..."), and an
 * example prints each failure itself, from dt_last_error() with what it was
 * doing: so here errors are dropped (each is printed once, by the example,
 * and a failure the example expects, a probe, prints nothing), and warnings,
 * which nothing else reports, print as the default prints them. Uses dtrain.h:
 * include this header after it. */
EX_UNUSED static void ex_log(dt_log_level level, dt_result code, const char *msg, void *user) {
  (void)user;
  if (level != DTRAIN_LOG_WARN) return;
  if (code != DTRAIN_OK) fprintf(stderr, "dtrain warning (%s): %s\n", dt_result_name(code), msg);
  else fprintf(stderr, "dtrain warning: %s\n", msg);
}

EX_UNUSED static void ex_log_init(void) { dt_set_logger(ex_log, NULL, DTRAIN_LOG_WARN); }

/* --trace FILE: the run's timeline (dt_trace_start), written when the
 * program exits, whichever way main returns; a file that cannot be written
 * is an error (exit 1, after the program's own output is flushed). */
#define EX_TRACE_HELP                                                                                          \
  "write the run's timeline (every thread's ops, collectives, pushes, pulls, waits) to FILE as Chrome "        \
  "trace-event JSON at exit (ui.perfetto.dev, chrome://tracing; tools/dtrain-trace merges processes and draws " \
  "an SVG); worker N of a multi-process run writes FILE.workerN.json, server N FILE.serverN.json"

EX_UNUSED static void ex_trace_end(void) {
  if (!dt_trace_active()) return;
  if (dt_trace_stop() != DTRAIN_OK) {
    fprintf(stderr, "error: --trace: %s\n", dt_last_error());
    fflush(NULL);
    _Exit(1);
  }
}

EX_UNUSED static int ex_trace_begin(const char *path) {
  if (!path) return 1;
  if (dt_trace_start(path) != DTRAIN_OK) {
    fprintf(stderr, "error: --trace %s: %s\n", path, dt_last_error());
    return 0;
  }
  atexit(ex_trace_end);
  return 1;
}

#endif /* DTRAIN_EXAMPLE_FLAGS_H */
