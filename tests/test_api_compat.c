/* The names renamed in 0.2 (CHANGELOG.md, "Deprecated"): each old name still
 * compiles, links and does what its replacement does, for one release. This is
 * the one file that may call them, so it turns their deprecation warning off
 * (the suite builds with -Werror). Delete it with the old names. */
#define _POSIX_C_SOURCE 200809L
#if defined(__GNUC__) || defined(__clang__)
#  pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
#include "harness.h"

#include <stdint.h>
#include <unistd.h>

/* The old option type names are the same types as the new ones. */
#define SAME_TYPE(a, b) _Generic((a *)0, b *: 1, default: 0)

static void test_option_types(void) {
  CHECK(SAME_TYPE(dt_graph_desc, dt_graph_options));
  CHECK(SAME_TYPE(dt_optim_desc, dt_optim_options));
  CHECK(SAME_TYPE(dt_strategy_desc, dt_strategy_options));
  CHECK(SAME_TYPE(dt_fit_desc, dt_fit_options));
  CHECK(SAME_TYPE(dt_loader_desc, dt_loader_options));
  CHECK(SAME_TYPE(dt_csv_desc, dt_csv_options));
}

static dt_tensor *tiny_step(dt_graph *g, int replica, const dt_minibatch *b, void *user) {
  (void)replica; (void)b; (void)user;
  return dt_sum(g, dt_param(g, 0));
}

static void test_get_options(void) {
  dt_params *P = dt_params_create(1);
  int64_t sh[1] = {3};
  CHECK(dt_params_add(P, "w", 1, sh, dt_init_constant(1.0f)) == 0);
  dt_optim_desc od = {0};
  od.kind = DTRAIN_OPTIM_ADAM;
  od.lr = 0.01f;
  dt_optim *o = dt_optim_create(P, &od);
  /* (float): where FLT_EVAL_METHOD is 1 (s390x in C11 mode) 0.01f is evaluated as a double. */
  CHECK(o && dt_optim_get_desc(o) == dt_optim_get_options(o) && dt_optim_get_desc(o)->lr == (float)0.01f);
  CHECK(dt_optim_get_desc(NULL) == NULL);
  dt_strategy_desc sd = dt_one_device();
  dt_strategy *s = dt_strategy_create(P, o, tiny_step, NULL, &sd);
  CHECK_MSG(s != NULL, "%s", dt_last_error());
  CHECK(dt_strategy_get_desc(s) == dt_strategy_get_options(s) && dt_strategy_get_desc(s)->replicas == 1);
  CHECK(dt_strategy_get_desc(NULL) == NULL);
  dt_strategy_destroy(s);
  dt_optim_destroy(o);
  dt_params_destroy(P);
}

/* Field by field: the padding of a struct returned by value is unspecified. */
static int same_options(dt_strategy_options a, dt_strategy_options b) {
  return a.kind == b.kind && a.replicas == b.replicas && a.max_staleness == b.max_staleness &&
         a.async_update == b.async_update && a.loss == b.loss && a.check_numerics == b.check_numerics &&
         a.arena_bytes == b.arena_bytes && a.seed == b.seed && a.spin_us == b.spin_us &&
         a.straggler == b.straggler && a.straggler_factor == b.straggler_factor && a.comm == b.comm &&
         a.store == b.store && a.devices == b.devices && a.ndevices == b.ndevices;
}

static void test_strategy_makers(void) {
  dt_comm *comm = (dt_comm *)(uintptr_t)0x10;     /* only stored, never used */
  dt_pstore *store = (dt_pstore *)(uintptr_t)0x20;
  CHECK(same_options(dt_one_device(), dt_strategy_one_device()));
  CHECK(same_options(dt_mirrored(3), dt_strategy_mirrored(3)));
  CHECK(same_options(dt_central_storage(2), dt_strategy_central_storage(2)));
  CHECK(same_options(dt_async(4, 2), dt_strategy_async(4, 2)));
  CHECK(same_options(dt_multi_worker_mirrored(comm, 2), dt_strategy_multi_worker_mirrored(comm, 2)));
  CHECK(same_options(dt_parameter_server(store, 1), dt_strategy_parameter_server(store, 1)));
  CHECK(dt_mirrored(3).kind == DTRAIN_STRATEGY_MIRRORED && dt_parameter_server(store, 1).store == store);
}

static int same_dataset(const dt_dataset *a, const dt_dataset *b) {
  if (!a || !b || a->n != b->n || a->ndim != b->ndim || a->sample_size != b->sample_size ||
      a->num_classes != b->num_classes || (a->y == NULL) != (b->y == NULL))
    return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return 0;
  if (memcmp(a->x, b->x, (size_t)(a->n * a->sample_size) * sizeof(float)) != 0) return 0;
  return !a->y || memcmp(a->y, b->y, (size_t)a->n * sizeof(int32_t)) == 0;
}

static int write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  int ok = fwrite(data, 1, n, f) == n;
  return fclose(f) == 0 && ok;
}

static void test_dataset_constructors(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_DATA)) TH_SKIP("the data loaders are compiled out (DTRAIN_NO_DATA)");
  const int files = (dt_build_features() & DTRAIN_FEATURE_STDIO) != 0;
  /* dt_dataset_create / dt_dataset_new */
  int64_t sh[2] = {2, 3};
  dt_dataset *a = NULL, *b = dt_dataset_new(4, 2, sh, 1);
  CHECK(dt_dataset_create(&a, 4, 2, sh, 1) == DTRAIN_OK && same_dataset(a, b));
  for (int64_t i = 0; a && b && i < 4 * 6; i++) a->x[i] = b->x[i] = (float)i;
  for (int i = 0; a && b && i < 4; i++) a->y[i] = b->y[i] = 3 - i;
  dt_dataset *e = a; /* the failing call must set its out-parameter to NULL */
  CHECK_ERR(dt_dataset_create(&e, 0, 2, sh, 0), DTRAIN_ERR_EMPTY, "dt_dataset_create: a dataset needs at least 1");
  CHECK(e == NULL);
  CHECK_ERR(dt_dataset_create(NULL, 4, 2, sh, 0), DTRAIN_ERR_NULL_ARG, "out");
  /* dt_dataset_subset / dt_dataset_select */
  int64_t idx[3] = {2, 0, 2};
  dt_dataset *s1 = NULL, *s2 = dt_dataset_select(b, idx, 3);
  CHECK(dt_dataset_subset(b, idx, 3, &s1) == DTRAIN_OK && same_dataset(s1, s2) && s1->x[0] == 12.0f);
  int64_t bad[1] = {9};
  dt_dataset *s3 = NULL;
  CHECK_ERR(dt_dataset_subset(b, bad, 1, &s3), DTRAIN_ERR_INDEX, "dt_dataset_subset: idx[0] = 9");
  CHECK(s3 == NULL && dt_dataset_select(b, bad, 1) == NULL && dt_last_result() == DTRAIN_ERR_INDEX);
  dt_dataset_destroy(s1);
  dt_dataset_destroy(s2);
  dt_dataset_destroy(b);
  dt_dataset_destroy(a);

  /* IDX: 3 images of 2x2 and 3 labels, in memory and in files. */
  static const unsigned char im[] = {0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2,
                                     0, 51, 102, 153, 204, 255, 1, 2, 3, 4, 5, 6};
  static const unsigned char lb[] = {0, 0, 8, 1, 0, 0, 0, 3, 2, 0, 1};
  a = NULL;
  b = dt_dataset_from_idx(im, sizeof im, lb, sizeof lb, 0);
  CHECK(dt_dataset_parse_idx(&a, im, sizeof im, lb, sizeof lb, 0) == DTRAIN_OK && same_dataset(a, b));
  CHECK(b && b->n == 3 && b->num_classes == 3);
  dt_dataset_destroy(a);
  dt_dataset_destroy(b);
  CHECK_ERR(dt_dataset_parse_idx(&a, lb, sizeof lb, NULL, 0, 0), DTRAIN_ERR_FORMAT, "dt_dataset_parse_idx");
  char dir[] = "/tmp/dtrain_test_api_compat_XXXXXX", ip[128], lp[128], cp[128];
  if (!files) th_skip("the file readers (a build without stdio: DTRAIN_NO_STDIO)");
  CHECK(!files || mkdtemp(dir) != NULL);
  snprintf(ip, sizeof ip, "%s/images.idx", dir);
  snprintf(lp, sizeof lp, "%s/labels.idx", dir);
  snprintf(cp, sizeof cp, "%s/data.csv", dir);
  if (files) {
    CHECK(write_file(ip, im, sizeof im) && write_file(lp, lb, sizeof lb));
    a = NULL;
    b = dt_dataset_load_idx(ip, lp, DTRAIN_DATA_RAW);
    CHECK(dt_dataset_read_idx(&a, ip, lp, DTRAIN_DATA_RAW) == DTRAIN_OK && same_dataset(a, b));
    CHECK(b && b->x[5] == 255.0f);
    dt_dataset_destroy(a);
    dt_dataset_destroy(b);
    CHECK_ERR(dt_dataset_read_idx(&a, "/nonexistent/i.idx", NULL, 0), DTRAIN_ERR_IO, "dt_dataset_read_idx: ");
    CHECK(a == NULL);
  }

  /* CSV, in memory and in a file. */
  const char *csv = "f1,f2,label\n1,2,0\n3,4.5,1\n";
  dt_csv_desc cd = {0};
  cd.header = 1;
  cd.has_labels = 1;
  cd.label_column = -1;
  CHECK(!files || write_file(cp, csv, strlen(csv)));
  a = NULL;
  b = dt_dataset_from_csv(csv, strlen(csv), &cd);
  CHECK(dt_dataset_parse_csv(&a, csv, strlen(csv), &cd) == DTRAIN_OK && same_dataset(a, b));
  CHECK(b && b->n == 2 && b->x[3] == 4.5f && b->y[1] == 1);
  dt_dataset_destroy(a);
  if (files) {
    a = NULL;
    dt_dataset *c = dt_dataset_load_csv(cp, &cd);
    CHECK(dt_dataset_read_csv(&a, cp, &cd) == DTRAIN_OK && same_dataset(a, c) && same_dataset(b, c));
    dt_dataset_destroy(a);
    dt_dataset_destroy(c);
    CHECK_ERR(dt_dataset_read_csv(&a, "/nonexistent.csv", NULL), DTRAIN_ERR_IO, "dt_dataset_read_csv: ");
    remove(ip);
    remove(lp);
    remove(cp);
    rmdir(dir);
  }
  dt_dataset_destroy(b);
  CHECK_ERR(dt_dataset_parse_csv(&a, "1,x\n", 4, NULL), DTRAIN_ERR_FORMAT, "dt_dataset_parse_csv: line 1");

  /* NPY arrays. */
  float xv[6] = {1, 2, 3, 4, 5, 6};
  int32_t yv[2] = {1, 0};
  dt_npy x, y;
  memset(&x, 0, sizeof x);
  memset(&y, 0, sizeof y);
  x.data = xv; x.dtype = DTRAIN_NPY_F32; x.ndim = 2; x.shape[0] = 2; x.shape[1] = 3; x.size = 6;
  y.data = yv; y.dtype = DTRAIN_NPY_I32; y.ndim = 1; y.shape[0] = 2; y.size = 2;
  a = NULL;
  b = dt_dataset_from_arrays(&x, &y, 0);
  CHECK(dt_dataset_from_npy(&a, &x, &y, 0) == DTRAIN_OK && same_dataset(a, b));
  CHECK(b && b->x[5] == 6.0f && b->num_classes == 2);
  dt_dataset_destroy(a);
  dt_dataset_destroy(b);
  CHECK_ERR(dt_dataset_from_npy(NULL, &x, &y, 0), DTRAIN_ERR_NULL_ARG, "dt_dataset_from_npy: out");
}

static void test_loader(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_DATA)) TH_SKIP("the data loaders are compiled out (DTRAIN_NO_DATA)");
  int64_t sh[1] = {2};
  dt_dataset *ds = dt_dataset_new(10, 1, sh, 1);
  CHECK(ds != NULL);
  if (!ds) return;
  for (int i = 0; i < 20; i++) ds->x[i] = (float)i;
  for (int i = 0; i < 10; i++) ds->y[i] = i % 3;
  dt_loader_desc ld = {0};
  ld.batch_size = 4;
  ld.shuffle = 1;
  ld.seed = 7;
  dt_loader *a = NULL, *b = dt_loader_new(ds, &ld);
  CHECK(dt_loader_create(&a, ds, &ld) == DTRAIN_OK && a && b);
  dt_batch ba, bb;
  int na, nb, batches = 0;
  while (a && b && (na = dt_loader_next(a, &ba)) > 0 && (nb = dt_loader_next(b, &bb)) > 0) {
    CHECK(ba.size == bb.size && memcmp(ba.index, bb.index, (size_t)ba.size * sizeof(int64_t)) == 0);
    batches++;
  }
  CHECK(batches == 3);
  dt_loader_destroy(a);
  dt_loader_destroy(b);
  ld.batch_size = 0;
  a = NULL;
  CHECK_ERR(dt_loader_create(&a, ds, &ld), DTRAIN_ERR_INVALID_ARG, "dt_loader_create: batch_size 0");
  CHECK(a == NULL && dt_loader_new(ds, &ld) == NULL && strstr(dt_last_error(), "dt_loader_new: batch_size 0"));
  dt_dataset_destroy(ds);
}

int main(void) {
  TH_RUN(test_option_types);
  TH_RUN(test_get_options);
  TH_RUN(test_strategy_makers);
  TH_RUN(test_dataset_constructors);
  TH_RUN(test_loader);
  return th_summary("api_compat");
}
