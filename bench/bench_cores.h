/* bench_cores.h -- how this host hands cache lines between its cores, for
 * the benchmarks of two replicas (bench_strategy.c, bench_async.c).
 *
 * mirrored's exchange and the async push both move the parameters' lines
 * from one core to the other every step. What that costs depends on where
 * the host put the two threads' CPUs (two vCPUs in one core complex, with a
 * shared cache, or in two), and a VM's host may move them while a bench
 * runs: on a 2-vCPU Zen 5 EPYC (2026-12-02) the one-way hand-off of a flag
 * went between about 100 and 250-800 ns within minutes, and with it
 * mirrored(2) at batch 64 between 1.6x and 1.0x one_device. So the benches
 * print it beside their rows: the hand-off, and 1 MiB (about the MLP's
 * 0.94 MB of parameters) written by one thread and read by the other,
 * against the same read again from the reader's own cache.
 * Include after dtrain.h (dt_time_now); needs threads. */
#ifndef BENCH_CORES_H
#define BENCH_CORES_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XC_FLOATS ((size_t)1 << 18) /* 1 MiB */
typedef struct xcore {
  _Atomic int turn; /* 0: the other thread's, 1: the measuring thread's */
  float *buf;       /* NULL: only hand the flag back */
  int rounds;
} xcore;

static void *xcore_other(void *arg) {
  xcore *x = (xcore *)arg;
  for (int r = 0; r < x->rounds; r++) {
    while (atomic_load_explicit(&x->turn, memory_order_acquire) != 0) {
    }
    if (x->buf)
      for (size_t i = 0; i < XC_FLOATS; i++) x->buf[i] = (float)(r + (int)(i & 7));
    atomic_store_explicit(&x->turn, 1, memory_order_release);
  }
  return NULL;
}

static float xcore_sum(const float *b) {
  float s[16] = {0};
  for (size_t i = 0; i < XC_FLOATS; i += 16)
    for (int j = 0; j < 16; j++) s[j] += b[i + j];
  float t = 0.0f;
  for (int j = 0; j < 16; j++) t += s[j];
  return t;
}

/* Prints one line: "cores (when): ...". */
static void print_cores(const char *when) {
  xcore x;
  pthread_t th;
  /* the hand-off: the flag goes back and forth 20000 times */
  atomic_init(&x.turn, 1);
  x.rounds = 20000;
  x.buf = NULL;
  if (pthread_create(&th, NULL, xcore_other, &x) != 0) return;
  double t0 = dt_time_now();
  for (int r = 0; r < x.rounds; r++) {
    while (atomic_load_explicit(&x.turn, memory_order_acquire) != 1) {
    }
    atomic_store_explicit(&x.turn, 0, memory_order_release);
  }
  pthread_join(th, NULL);
  double hand_ns = (dt_time_now() - t0) / (2.0 * x.rounds) * 1e9;
  /* 1 MiB written by the other thread, read here, then read again; best of 40 */
  x.buf = (float *)malloc(XC_FLOATS * sizeof(float));
  if (!x.buf) return;
  memset(x.buf, 0, XC_FLOATS * sizeof(float));
  atomic_store(&x.turn, 0);
  x.rounds = 40;
  if (pthread_create(&th, NULL, xcore_other, &x) != 0) {
    free(x.buf);
    return;
  }
  double remote = 1e9, local = 1e9;
  volatile float sink = 0.0f;
  for (int r = 0; r < x.rounds; r++) {
    while (atomic_load_explicit(&x.turn, memory_order_acquire) != 1) {
    }
    double a = dt_time_now();
    sink += xcore_sum(x.buf);
    double b = dt_time_now();
    sink += xcore_sum(x.buf);
    double c = dt_time_now();
    if (b - a < remote) remote = b - a;
    if (c - b < local) local = c - b;
    atomic_store_explicit(&x.turn, 0, memory_order_release);
  }
  pthread_join(th, NULL);
  free(x.buf);
  const double gb = (double)(XC_FLOATS * sizeof(float)) / 1e9;
  printf("cores (%s): a flag handed over in %.0f ns one way; 1 MiB another core wrote read at %.1f GB/s, "
         "from this core's cache %.1f GB/s\n", when, hand_ns, gb / remote, gb / local);
  (void)sink;
}

#endif /* BENCH_CORES_H */
