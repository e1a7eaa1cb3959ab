/* tests/test_cuda.cu -- CPU <-> GPU parity of the CUDA backend (dtrain_cuda.h).
 *
 * The checks of tests/cuda_parity.h (every op with a device path forward and
 * backward, MLP training steps with SGD/Adam/AdamW, clean errors for what has
 * no kernel) run against a real GPU, plus the CUDA-only error paths (out of
 * memory, a bad device index); with two or more GPUs also the all-reduce
 * over every GPU (dt_device_group) and mirrored over every GPU against CPU
 * mirrored (built once more with -DDTRAIN_USE_NCCL as test_cuda_nccl where
 * NCCL links: the same checks through ncclAllReduce). Built with nvcc by `make test` where nvcc
 * exists; on a machine without a GPU (or driver) it prints
 * "skip test_cuda: no CUDA device (...)" and "test_cuda: 0 passed, 0 failed,
 * 1 skipped". */
/* dtrain itself comes from build/dtrain.o (the C compiler); this file holds
 * only the CUDA backend, the way users are meant to split it. */
#define DTRAIN_CUDA_IMPLEMENTATION
#include "dtrain_cuda.h"
#ifdef DTRAIN_USE_NCCL
#  define TEST_NAME "test_cuda_nccl"
#else
#  define TEST_NAME "test_cuda"
#endif
#include "cuda_parity.h"

/* An arena block larger than any GPU: DTRAIN_ERR_NOMEM naming cudaMalloc and
 * the byte count; the graph stays usable after a reset. */
static void test_out_of_memory(void) {
  dt_graph_options gd;
  memset(&gd, 0, sizeof gd);
  gd.device = cp_dev;
  gd.arena_bytes = (size_t)1 << 50;
  dt_graph *g = dt_graph_create(NULL, &gd);
  CHECK(g != NULL);
  if (!g) return;
  CHECK(dt_tensor_new1(g, 4) == NULL);
  CHECK(dt_graph_error(g) == DTRAIN_ERR_NOMEM);
  CHECK(strstr(dt_graph_message(g), "cudaMalloc of 1125899906842624 bytes") != NULL);
  dt_graph_destroy(g);
}

/* ---- several GPUs: mirrored over every GPU against the CPU ---- */
#define MG_NS 96
#define MG_NF 8
#define MG_NC 4
#define MG_K 4
static float mg_x[MG_NS * MG_NF];
static int32_t mg_y[MG_NS];
static int mg_gpus;
static dt_device *mg_dev[8];

typedef struct mg_model {
  dt_params *P;
  dt_nn_linear l1, l2;
} mg_model;

static dt_tensor *mg_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  mg_model *m = (mg_model *)user;
  (void)replica;
  int64_t xs[2] = {b->rows, MG_NF};
  dt_tensor *h = dt_tanh(g, dt_nn_linear_forward(g, &m->l1, dt_tensor_from(g, 2, xs, b->x)));
  return dt_cross_entropy(g, dt_nn_linear_forward(g, &m->l2, h), b->y);
}

/* MG_K steps; the final params in out (n floats). 0 on failure. */
static int mg_train(int ndev, float *out, size_t *n) {
  mg_model m;
  m.P = dt_params_create(9);
  dt_nn_linear_init(&m.l1, m.P, "l1", MG_NF, 16, 1);
  dt_nn_linear_init(&m.l2, m.P, "l2", 16, MG_NC, 1);
  dt_optim_options od;
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_SGD;
  od.lr = 0.1f;
  od.momentum = 0.9f;
  od.clip_norm = 0.5f;
  dt_optim *opt = dt_optim_create(m.P, &od);
  dt_strategy_options sd = dt_strategy_mirrored(mg_gpus);
  if (ndev) {
    sd.replicas = 0;
    sd.devices = mg_dev;
    sd.ndevices = ndev;
  }
  dt_strategy *s = dt_strategy_create(m.P, opt, mg_step, &m, &sd);
  CHECK_MSG(s != NULL, "%s", dt_last_error());
  int ok = s != NULL;
  for (int k = 0; ok && k < MG_K; k++) {
    dt_minibatch b;
    memset(&b, 0, sizeof b);
    b.rows = 37;
    b.x = mg_x + k * 10 * MG_NF;
    b.x_cols = MG_NF;
    b.y = mg_y + k * 10;
    float loss;
    dt_result rc = dt_strategy_step(s, &b, &loss);
    CHECK_MSG(rc == DTRAIN_OK, "%s", dt_last_error());
    ok = rc == DTRAIN_OK;
  }
  *n = dt_params_size(m.P);
  memcpy(out, dt_params_data(m.P), *n * sizeof(float));
  dt_strategy_destroy(s);
  dt_optim_destroy(opt);
  dt_params_destroy(m.P);
  return ok;
}

static void test_multi_gpu(void) {
  th_seed(5);
  for (int i = 0; i < MG_NS; i++) {
    mg_y[i] = (int32_t)(th_rand() * MG_NC);
    for (int f = 0; f < MG_NF; f++) mg_x[i * MG_NF + f] = th_uniform(-1, 1) + (f % MG_NC == mg_y[i] ? 1.0f : 0.0f);
  }
  int ok = 1;
  for (int i = 0; i < mg_gpus; i++) {
    mg_dev[i] = dt_cuda_device_create(i);
    CHECK_MSG(mg_dev[i] != NULL, "dt_cuda_device_create(%d): %s", i, dt_last_error());
    ok = ok && mg_dev[i];
  }
  if (ok) {
    /* the all-reduce alone: exact sums of small integers, the same on every GPU */
    enum { CNT = 1000 };
    float *buf[8], h[CNT], got[CNT];
    dt_device_group *grp = dt_device_group_create(mg_dev, mg_gpus, CNT);
    CHECK_MSG(grp != NULL, "%s", dt_last_error());
    printf(TEST_NAME ": all-reduce over %d GPUs: %s\n", mg_gpus, dt_device_group_method(grp));
    for (int r = 0; grp && r < mg_gpus; r++) {
      void *p = NULL;
      CHECK(mg_dev[r]->alloc(mg_dev[r], sizeof h, &p) == DTRAIN_OK);
      buf[r] = (float *)p;
      for (int i = 0; i < CNT; i++) h[i] = (float)((i + r) % 7);
      CHECK(mg_dev[r]->copy(mg_dev[r], buf[r], h, sizeof h, DTRAIN_COPY_H2D) == DTRAIN_OK);
    }
    if (grp) {
      CHECK_MSG(dt_device_group_allreduce(grp, buf) == DTRAIN_OK, "%s", dt_last_error());
      for (int r = 0; r < mg_gpus; r++) {
        CHECK(mg_dev[r]->copy(mg_dev[r], got, buf[r], sizeof got, DTRAIN_COPY_D2H) == DTRAIN_OK);
        int bad = 0;
        for (int i = 0; i < CNT; i++) {
          float want = 0.0f;
          for (int q = 0; q < mg_gpus; q++) want += (float)((i + q) % 7);
          bad += got[i] != want;
        }
        CHECK_MSG(bad == 0, "GPU %d: %d wrong sums", r, bad);
        mg_dev[r]->free(mg_dev[r], buf[r], sizeof h);
      }
      dt_device_group_destroy(grp);
    }
    /* mirrored over every GPU = CPU mirrored, and repeats bitwise */
    static float cpu[4096], gpu[4096], gpu2[4096];
    size_t n = 0;
    if (mg_train(0, cpu, &n) && mg_train(mg_gpus, gpu, &n) && mg_train(mg_gpus, gpu2, &n)) {
      double d = 0.0, mx = 1e-12;
      for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)cpu[i] - (double)gpu[i]));
        mx = fmax(mx, fabs((double)cpu[i]));
      }
      CHECK_MSG(d <= 1e-4 * mx, "mirrored over %d GPUs vs the CPU: max difference %.3g (scale %.3g)", mg_gpus, d, mx);
      CHECK(memcmp(gpu, gpu2, n * sizeof(float)) == 0);
      cp_compared += (int)n;
    }
  }
  for (int i = 0; i < mg_gpus; i++) dt_cuda_device_destroy(mg_dev[i]);
}

static void test_bad_index(void) {
  int n = dt_cuda_device_count();
  CHECK(dt_cuda_device_create(n) == NULL);
  CHECK(dt_last_result() == DTRAIN_ERR_INVALID_ARG);
  CHECK(dt_cuda_device_create(-1) == NULL);
}

int main(void) {
  dt_set_logger(th_log, NULL, DTRAIN_LOG_DEBUG); /* the expected failure below is not an error */
  int n = dt_cuda_device_count();
  if (n <= 0) {
    th_skip_item(TEST_NAME, "no CUDA device (%s)", n < 0 ? dt_last_error() : "cudaGetDeviceCount: 0 devices");
    return th_summary(TEST_NAME);
  }
  cp_dev = dt_cuda_device_create(0);
  if (!cp_dev) {
    printf(TEST_NAME ": dt_cuda_device_create(0) failed: %s\n", dt_last_error());
    th_failed++;
    return th_summary(TEST_NAME);
  }
  cp_run_all();
  TH_RUN(test_out_of_memory);
  TH_RUN(test_bad_index);
  if (n >= 2) {
    mg_gpus = n > 8 ? 8 : n;
    TH_RUN(test_multi_gpu);
  } else {
    th_skip_item("test_multi_gpu", "1 CUDA device: the multi-GPU check (mirrored over every GPU) needs 2 or more");
  }
  printf(TEST_NAME ": %d floats compared between the CPU ops and %s\n", cp_compared, cp_dev->name);
  dt_cuda_device_destroy(cp_dev);
  return th_summary(TEST_NAME);
}
