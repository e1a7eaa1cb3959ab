/* tests/synth_task.h -- the strategies' tests' fixed synthetic task: 3
 * classes in 8-D (class c has mean 1.5 on features 2c, 2c+1) plus a float
 * regression target, NS samples drawn from th_seed(seed). Include after
 * harness.h, in one test file. */
#ifndef DT_TESTS_SYNTH_TASK_H
#define DT_TESTS_SYNTH_TASK_H

#define NS 512
#define NF 8
#define NC 3
static float data_x[NS * NF];
static int32_t data_y[NS];
static float data_t[NS];

static void make_data_seeded(uint64_t seed) {
  th_seed(seed);
  for (int i = 0; i < NS; i++) {
    int c = (int)(th_rand() * NC);
    data_y[i] = c;
    float s = 0.0f;
    for (int f = 0; f < NF; f++) {
      data_x[i * NF + f] = th_uniform(-1, 1) + ((f / 2 == c) ? 1.5f : 0.0f);
      s += data_x[i * NF + f] * (float)(f + 1) * 0.1f;
    }
    data_t[i] = s;
  }
}

/* Global batch number `step` of `rows` rows (wrapping around the data set). */
static inline dt_minibatch batch_at(int64_t step, int64_t rows) {
  dt_minibatch b;
  memset(&b, 0, sizeof b);
  int64_t first = (step * rows) % (NS - rows);
  b.rows = rows;
  b.x = data_x + first * NF;
  b.x_cols = NF;
  b.y = data_y + first;
  b.y_cols = 1;
  b.t = data_t + first;
  b.t_cols = 1;
  return b;
}

#endif
