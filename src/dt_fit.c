/* ===========================================================================
 * dt_fit.c -- the training loop, progress output, metrics CSV, SVG chart
 * ===========================================================================
 * Sections: progress (bar / lines), CSV, SVG chart, the loop.
 * Nothing here runs inside a training step: the loop calls the user's step
 * and only does arithmetic and (throttled) printing in between.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_fit.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_strategy.h"
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_file.h"

#if !defined(DTRAIN_NO_FIT) /* the whole file; the stubs at the end stand in without it */

#if !defined(DTRAIN_NO_STDIO)
#  include <errno.h>
#  if defined(_WIN32)
#    include <io.h>
#    include <process.h>
#  else
#    include <unistd.h>
#  endif
#endif

#define DT__FIT_BAR_WIDTH 28
#define DT__FIT_REDRAW_SECONDS 0.1

static int dt__fit_finite(double x) { return isfinite(x) != 0; }

/* ---- progress ------------------------------------------------------------------------ */

#ifndef DTRAIN_NO_STDIO

static int dt__fit_isatty(FILE *f) {
#if defined(_WIN32)
  return _isatty(_fileno(f)) != 0;
#else
  return isatty(fileno(f)) != 0;
#endif
}

/* "12.3s", "4m05s", "1h02m" */
static void dt__fit_duration(char *buf, size_t cap, double s) {
  if (!dt__fit_finite(s) || s < 0) s = 0;
  if (s < 60) snprintf(buf, cap, "%.1fs", s);
  else if (s < 3600) snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
  else snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), ((int)s % 3600) / 60);
}

/* " name 0.1234" when finite; nothing otherwise. */
static void dt__fit_metric(FILE *out, const char *name, double v) {
  if (dt__fit_finite(v)) fprintf(out, "  %s %.4f", name, v);
}

/* The bar line (no newline); final: the epoch is complete. */
static void dt__fit_draw_bar(FILE *out, int64_t epoch, int64_t epochs, int64_t done, int64_t total, double loss,
                             double acc, double rate, double eta, const dt_fit_epoch *row) {
  char bar[DT__FIT_BAR_WIDTH + 1], d[32];
  int fill = total > 0 ? (int)((double)DT__FIT_BAR_WIDTH * (double)done / (double)total) : DT__FIT_BAR_WIDTH;
  for (int i = 0; i < DT__FIT_BAR_WIDTH; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
  bar[DT__FIT_BAR_WIDTH] = '\0';
  fprintf(out, "\repoch %lld/%lld [%s] %lld/%lld", (long long)epoch + 1, (long long)epochs, bar, (long long)done,
          (long long)total);
  dt__fit_metric(out, "loss", loss);
  dt__fit_metric(out, "acc", acc);
  if (row) {
    dt__fit_metric(out, "val_loss", row->val_loss);
    dt__fit_metric(out, "val_acc", row->val_acc);
    dt__fit_duration(d, sizeof d, row->train_seconds);
    fprintf(out, "  %s  %.0f samples/s", d, row->samples_per_sec);
  } else {
    dt__fit_duration(d, sizeof d, eta);
    fprintf(out, "  %.0f samples/s  ETA %s", rate, d);
  }
  fputs("\033[K", out); /* clear the rest of the line */
  fflush(out);
}

static void dt__fit_print_line(FILE *out, int64_t epochs, const dt_fit_epoch *row) {
  char d[32];
  fprintf(out, "epoch %lld/%lld  step %lld", (long long)row->epoch, (long long)epochs, (long long)row->step);
  dt__fit_metric(out, "loss", row->train_loss);
  dt__fit_metric(out, "acc", row->train_acc);
  dt__fit_metric(out, "val_loss", row->val_loss);
  dt__fit_metric(out, "val_acc", row->val_acc);
  if (dt__fit_finite(row->lr)) fprintf(out, "  lr %.3g", row->lr);
  dt__fit_duration(d, sizeof d, row->train_seconds);
  fprintf(out, "  %s  %.0f samples/s\n", d, row->samples_per_sec);
  fflush(out);
}

/* ---- CSV --------------------------------------------------------------------------------- */

static void dt__fit_csv_num(FILE *f, double v, int last) {
  if (dt__fit_finite(v)) fprintf(f, "%.6g", v);
  fputc(last ? '\n' : ',', f);
}

static dt_result dt__fit_csv_append(const char *path, const dt_fit_epoch *row) {
  char why[160];
  FILE *f = dt__file_open_append(path, why, sizeof why);
  if (!f) return dt__error(DTRAIN_ERR_IO, "dt_fit: cannot open metrics CSV '%s': %s", path, why);
  long at = -1;
  if (fseek(f, 0, SEEK_END) == 0) at = ftell(f);
  if (at == 0) fputs("epoch,step,train_loss,train_acc,val_loss,val_acc,lr,seconds\n", f);
  fprintf(f, "%lld,%lld,", (long long)row->epoch, (long long)row->step);
  dt__fit_csv_num(f, row->train_loss, 0);
  dt__fit_csv_num(f, row->train_acc, 0);
  dt__fit_csv_num(f, row->val_loss, 0);
  dt__fit_csv_num(f, row->val_acc, 0);
  dt__fit_csv_num(f, row->lr, 0);
  fprintf(f, "%.3f\n", row->seconds);
  int bad = ferror(f) != 0;
  int saved = errno;
  if (fclose(f) != 0 && !bad) {
    bad = 1;
    saved = errno;
  }
  if (bad) return dt__error(DTRAIN_ERR_IO, "dt_fit: writing metrics CSV '%s' failed: %s", path, strerror(saved));
  return DTRAIN_OK;
}

/* ---- SVG chart ------------------------------------------------------------------------------ */

typedef struct dt__fit_axis {
  double lo, hi, step; /* tick range and spacing */
  int decimals;
} dt__fit_axis;

static double dt__fit_nice(double x, int round_it) {
  double e = floor(log10(x)), f = x / pow(10.0, e), nf;
  if (round_it) nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  else nf = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return nf * pow(10.0, e);
}

/* "Nice numbers" axis covering [lo, hi] with about `target` ticks. */
static void dt__fit_make_axis(dt__fit_axis *a, double lo, double hi, int target, int integer) {
  if (!(hi > lo)) {
    double pad = fabs(lo) > 0 ? fabs(lo) * 0.1 : 1.0;
    lo -= pad;
    hi += pad;
  }
  double range = dt__fit_nice(hi - lo, 0);
  double step = dt__fit_nice(range / (double)(target - 1), 1);
  if (integer && step < 1) step = 1;
  a->step = step;
  a->lo = floor(lo / step) * step;
  a->hi = ceil(hi / step) * step;
  a->decimals = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
  if (a->decimals > 6) a->decimals = 6;
}

/* Text with XML special characters escaped. */
static void dt__fit_xml_text(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      case '\'': fputs("&apos;", f); break;
      default:
        if ((unsigned char)*s >= 0x20 || *s == '\t') fputc(*s, f);
    }
  }
}

typedef struct dt__fit_series {
  const char *name, *color;
  int dashed;
  size_t field; /* offsetof the double in dt_fit_epoch */
} dt__fit_series;

static double dt__fit_get(const dt_fit_epoch *r, size_t field) {
  double v;
  memcpy(&v, (const char *)r + field, sizeof v);
  return v;
}

/* One panel at (x0, y0) of size w x h. */
static void dt__fit_panel(FILE *f, double x0, double y0, double w, double h, const char *ylabel,
                          const dt_fit_epoch *rows, int64_t n, const dt__fit_series *ser, int nser, int unit_range) {
  const double ml = 62, mr = 16, mt = 14, mb = 46; /* plot margins inside the panel */
  const double px = x0 + ml, py = y0 + mt, pw = w - ml - mr, ph = h - mt - mb;
  double ylo = INFINITY, yhi = -INFINITY;
  int64_t emin = rows[0].epoch, emax = rows[0].epoch;
  for (int64_t i = 0; i < n; i++) {
    emin = DT__MIN(emin, rows[i].epoch);
    emax = DT__MAX(emax, rows[i].epoch);
    for (int s = 0; s < nser; s++) {
      double v = dt__fit_get(&rows[i], ser[s].field);
      if (!dt__fit_finite(v)) continue;
      ylo = DT__MIN(ylo, v);
      yhi = DT__MAX(yhi, v);
    }
  }
  fprintf(f, "<g>\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#ffffff\" stroke=\"#cccccc\"/>\n",
          px, py, pw, ph);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
             "transform=\"rotate(-90 %.1f %.1f)\">",
          x0 + 16, py + ph / 2, x0 + 16, py + ph / 2);
  dt__fit_xml_text(f, ylabel);
  fputs("</text>\n", f);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">epoch</text>\n", px + pw / 2,
          y0 + h - 8);
  if (!(yhi >= ylo)) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" fill=\"#888888\" text-anchor=\"middle\">"
               "no %s reported</text>\n</g>\n",
            px + pw / 2, py + ph / 2, ylabel);
    return;
  }
  if (unit_range) { /* accuracy: stay inside [0, 1] */
    ylo = DT__MAX(0.0, ylo - 0.02);
    yhi = DT__MIN(1.0, yhi + 0.02);
  }
  dt__fit_axis xa, ya;
  dt__fit_make_axis(&xa, (double)emin, (double)emax, 8, 1);
  if (emin == emax) {
    xa.lo = (double)emin - 1;
    xa.hi = (double)emin + 1;
  }
  dt__fit_make_axis(&ya, ylo, yhi, 6, 0);
  double xs = pw / (xa.hi - xa.lo), ys = ph / (ya.hi - ya.lo);
#define DT__FIT_X(e) (px + ((double)(e) - xa.lo) * xs)
#define DT__FIT_Y(v) (py + ph - ((v) - ya.lo) * ys)
  /* Grid, ticks and tick labels. */
  for (int k = 0;; k++) {
    double v = ya.lo + k * ya.step;
    if (v > ya.hi + ya.step * 1e-6) break;
    double y = DT__FIT_Y(v);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n", px, y, px + pw, y);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px - 4, y, px, y);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%.*f</text>\n", px - 7, y + 4,
            ya.decimals, v);
  }
  for (int k = 0;; k++) {
    double e = xa.lo + k * xa.step;
    if (e > xa.hi + 1e-9) break;
    if (e < 0.5 || e != floor(e)) continue; /* epochs are whole and start at 1 */
    double x = DT__FIT_X(e);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n", x, py, x, py + ph);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", x, py + ph, x,
            py + ph + 4);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%.0f</text>\n", x, py + ph + 17,
            e);
  }
  /* Axes. */
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px, py, px, py + ph);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333333\"/>\n", px, py + ph, px + pw,
          py + ph);
  /* Series: polylines broken at NaN, with markers. */
  int shown[4] = {0, 0, 0, 0}, nshown = 0;
  for (int s = 0; s < nser && s < 4; s++) {
    int open = 0;
    for (int64_t i = 0; i < n; i++) {
      double v = dt__fit_get(&rows[i], ser[s].field);
      if (!dt__fit_finite(v)) {
        if (open) fputs("\"/>\n", f);
        open = 0;
        continue;
      }
      if (!open) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", ser[s].color,
                ser[s].dashed ? " stroke-dasharray=\"6 3\"" : "");
        open = 1;
      }
      fprintf(f, "%.1f,%.1f ", DT__FIT_X(rows[i].epoch), DT__FIT_Y(v));
      shown[s] = 1;
    }
    if (open) fputs("\"/>\n", f);
    if (!shown[s]) continue;
    nshown++;
    if (n <= 80)
      for (int64_t i = 0; i < n; i++) {
        double v = dt__fit_get(&rows[i], ser[s].field);
        if (dt__fit_finite(v))
          fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", DT__FIT_X(rows[i].epoch),
                  DT__FIT_Y(v), ser[s].color);
      }
  }
  /* Legend over a translucent box: top right for losses (they fall), bottom right for accuracy (it rises). */
  double lx = px + pw - 118, ly = unit_range ? py + ph - 16 - 18.0 * nshown : py + 8;
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"110\" height=\"%.1f\" fill=\"#ffffff\" fill-opacity=\"0.85\" "
             "stroke=\"#cccccc\"/>\n",
          lx, ly, 8.0 + 18.0 * nshown);
  for (int s = 0, k = 0; s < nser && s < 4; s++) {
    if (!shown[s]) continue;
    double y = ly + 18 + 18 * k++;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", lx + 8,
            y - 4, lx + 30, y - 4, ser[s].color, ser[s].dashed ? " stroke-dasharray=\"6 3\"" : "");
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">%s</text>\n", lx + 36, y, ser[s].name);
  }
#undef DT__FIT_X
#undef DT__FIT_Y
  fputs("</g>\n", f);
}

static dt_result dt__fit_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title) {
  const double W = 960, H = 400, top = 40;
  /* The shared atomic writer (dt_file.h): exclusive temporary, fsync, rename. */
  dt__file_out fo;
  dt_result r = dt__file_create(&fo, path);
  if (r != DTRAIN_OK) return dt__error(r, "dt_fit_write_svg: '%s': %s", path, fo.msg);
  FILE *f = fo.f;
  dt__fit_series loss[2], acc[2];
  loss[0].name = "train"; loss[0].color = "#1f77b4"; loss[0].dashed = 0; loss[0].field = offsetof(dt_fit_epoch, train_loss);
  loss[1].name = "validation"; loss[1].color = "#ff7f0e"; loss[1].dashed = 1; loss[1].field = offsetof(dt_fit_epoch, val_loss);
  acc[0] = loss[0];
  acc[0].field = offsetof(dt_fit_epoch, train_acc);
  acc[1] = loss[1];
  acc[1].field = offsetof(dt_fit_epoch, val_acc);
  fputs("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n", f);
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
             "font-family=\"Helvetica, Arial, sans-serif\">\n",
          W, H, W, H);
  fputs("<title>", f);
  dt__fit_xml_text(f, title);
  fputs("</title>\n", f);
  fprintf(f, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#fafafa\"/>\n", W, H);
  fprintf(f, "<text x=\"%.1f\" y=\"26\" font-size=\"16\" font-weight=\"bold\" text-anchor=\"middle\">", W / 2);
  dt__fit_xml_text(f, title);
  fputs("</text>\n", f);
  if (n > 0) {
    dt__fit_panel(f, 0, top, W / 2, H - top, "loss", rows, n, loss, 2, 0);
    dt__fit_panel(f, W / 2, top, W / 2, H - top, "accuracy", rows, n, acc, 2, 1);
  } else {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">no epochs yet</text>\n", W / 2,
            H / 2);
  }
  fputs("</svg>\n", f);
  r = dt__file_commit(&fo);
  if (r != DTRAIN_OK) r = dt__error(r, "dt_fit_write_svg: writing '%s' failed: %s", path, fo.msg);
  return r;
}

#endif /* DTRAIN_NO_STDIO */

DTRAIN_API dt_result dt_fit_write_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title) {
  if (!path || (!rows && n > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fit_write_svg: NULL argument");
  if (n < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "dt_fit_write_svg: n = %lld < 0", (long long)n);
#ifdef DTRAIN_NO_STDIO
  (void)title;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fit_write_svg: built with DTRAIN_NO_STDIO (no file I/O)");
#else
  return dt__fit_svg(path, rows, n, title ? title : "training");
#endif
}

/* ---- the loop ---------------------------------------------------------------------------- */

typedef struct dt__fit_run {
  const dt_fit_desc *d;
  int mode;                 /* DTRAIN_FIT_PROGRESS_BAR / LINES / QUIET after AUTO resolved */
  FILE *out;
  dt_fit_epoch *hist;       /* this call's epochs, for the chart */
  int64_t nhist, hist_cap;
  float *best;              /* restore_best: parameters of the best epoch */
  size_t best_n;
  int64_t step;             /* global step counter when there is no optimizer */
} dt__fit_run;

static int64_t dt__fit_step_now(const dt__fit_run *run) {
  return run->d->optim ? dt_optim_steps(run->d->optim) : run->step;
}

/* ---- non-finite steps -------------------------------------------------------------------
 * What dt_fit puts in b->loss before a step: a NaN whose low payload bits
 * no float NaN converted to double carries, so that a step reporting no
 * loss is told apart from one reporting a NaN loss. */
static double dt__fit_loss_unset(void) {
  uint64_t u = 0x7ff8000000000001ull;
  double v;
  memcpy(&v, &u, sizeof v);
  return v;
}

static int dt__fit_loss_reported(double v) {
  double unset = dt__fit_loss_unset();
  return memcmp(&v, &unset, sizeof v) != 0;
}

/* The first non-finite gradient element of a trainable parameter: what the
 * step's dt_backward left in the params' grad buffer (one pass; no buffer
 * is read with devices or async strategies, whose own checks cover it).
 * 0 when all are finite, else 1 with a description in why. */
static int dt__fit_grad_bad(dt_params *P, char *why, size_t cap) {
  const float *g = dt_params_grad(P);
  for (int i = 0; g && i < dt_params_count(P); i++) {
    dt_param_info in;
    if (dt_params_info(P, i, &in) != DTRAIN_OK || !in.trainable) continue;
    for (size_t k = 0; k < in.size; k++) {
      float v = g[in.offset + k];
      if (!isfinite(v)) {
        snprintf(why, cap, "gradient of '%s' is %s at element %zu", in.name, isnan(v) ? "NaN" : "Inf", k);
        return 1;
      }
    }
  }
  return 0;
}

/* skip_nonfinite: the params' values and the optimizer's state and step
 * count from before a step, put back when the step is skipped (so that it
 * touches nothing even when it made its update before dt_fit saw it). */
typedef struct dt__fit_snap {
  float *buf;   /* data, then each optimizer state slot: n floats each */
  size_t n, floats;
  int slots;
  int64_t steps;
} dt__fit_snap;

static void dt__fit_snap_take(dt__fit_snap *sn, const dt_fit_desc *d, int restore) {
  float *data = dt_params_data(d->params);
  if (restore) memcpy(data, sn->buf, sn->n * sizeof(float));
  else memcpy(sn->buf, data, sn->n * sizeof(float));
  for (int k = 0; k < sn->slots; k++) {
    float *st = dt_optim_state(d->optim, k);
    if (!st) continue;
    if (restore) memcpy(st, sn->buf + (size_t)(k + 1) * sn->n, sn->n * sizeof(float));
    else memcpy(sn->buf + (size_t)(k + 1) * sn->n, st, sn->n * sizeof(float));
  }
  if (d->optim && restore) dt_optim_set_steps(d->optim, sn->steps);
  else if (d->optim) sn->steps = dt_optim_steps(d->optim);
}

static dt_result dt__fit_checkpoint(const dt__fit_run *run, const char *path, int64_t epoch_done, int64_t data_epoch,
                                    int64_t data_index) {
  dt_train_state st;
  memset(&st, 0, sizeof st);
  st.params = run->d->params;
  st.optim = run->d->optim;
  st.graph = run->d->graph;
  st.step = dt__fit_step_now(run);
  st.epoch = epoch_done;
  st.data_epoch = data_epoch;
  st.data_index = data_index;
  st.config = run->d->config;
  return dt_checkpoint_save(path, &st);
}

static double dt__fit_monitored(dt_fit_monitor m, const dt_fit_epoch *row) {
  switch (m) {
    case DTRAIN_FIT_MONITOR_VAL_LOSS: return row->val_loss;
    case DTRAIN_FIT_MONITOR_VAL_ACC: return row->val_acc;
    case DTRAIN_FIT_MONITOR_TRAIN_ACC: return row->train_acc;
    case DTRAIN_FIT_MONITOR_TRAIN_LOSS:
    default: return row->train_loss;
  }
}

static const char *dt__fit_monitor_name(dt_fit_monitor m) {
  switch (m) {
    case DTRAIN_FIT_MONITOR_VAL_LOSS: return "val_loss";
    case DTRAIN_FIT_MONITOR_VAL_ACC: return "val_acc";
    case DTRAIN_FIT_MONITOR_TRAIN_ACC: return "train_acc";
    case DTRAIN_FIT_MONITOR_TRAIN_LOSS:
    default: return "train_loss";
  }
}

#ifndef DTRAIN_NO_STDIO
/* The output files are first written at an epoch's end, maybe hours in: a
 * missing or read-only directory must show at set-up instead
 * (dt_check_writable does what the writers will do). */
static dt_result dt__fit_probe_dir(const char *what, const char *path) {
  dt__quiet_push(); /* one log line: the message below, not also the inner one */
  if (dt_check_writable(path, 0) == DTRAIN_OK) return dt__quiet_pop(DTRAIN_OK);
  char why[DT__MSG_CAP];
  snprintf(why, sizeof why, "%s", dt_last_error());
  return dt__quiet_pop(dt__error(dt_last_result(), "dt_fit: %s '%s': %s", what, path, why));
}
#endif

static dt_result dt__fit_check(const dt_fit_desc *d) {
  const char *fn = "dt_fit";
  if (!d->train_step) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: train_step is NULL", fn);
  if (d->steps_per_epoch <= 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: steps_per_epoch %lld must be >= 1", fn, (long long)d->steps_per_epoch);
  if (d->epochs < 0 || d->batch_size < 0 || d->patience < 0 || d->log_every < 0 || d->checkpoint_every < 0 ||
      d->checkpoint_steps < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: epochs, batch_size, patience, log_every and checkpoint intervals must be >= 0", fn);
  if (!(d->min_delta >= 0))
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: min_delta %g must be >= 0", fn, d->min_delta);
  if (d->start_epoch < 0 || d->start_batch < 0 || d->start_batch >= d->steps_per_epoch)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: start position (epoch %lld, batch %lld) is outside [0, %lld batches)",
                     fn, (long long)d->start_epoch, (long long)d->start_batch, (long long)d->steps_per_epoch);
  if ((int)d->monitor < (int)DTRAIN_FIT_MONITOR_AUTO || (int)d->monitor > (int)DTRAIN_FIT_MONITOR_TRAIN_ACC)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown monitor %d", fn, (int)d->monitor);
  if ((int)d->progress < (int)DTRAIN_FIT_PROGRESS_AUTO || (int)d->progress > (int)DTRAIN_FIT_PROGRESS_QUIET)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: unknown progress mode %d", fn, (int)d->progress);
  if ((d->monitor == DTRAIN_FIT_MONITOR_VAL_LOSS || d->monitor == DTRAIN_FIT_MONITOR_VAL_ACC) && !d->evaluate)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: monitor %s needs an evaluate callback", fn,
                     dt__fit_monitor_name(d->monitor));
  if ((d->restore_best || d->checkpoint_path || d->best_path) && !d->params)
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: restore_best and checkpoints need params", fn);
#ifdef DTRAIN_NO_STDIO
  if (d->csv_path || d->svg_path || d->checkpoint_path || d->best_path ||
      d->progress == DTRAIN_FIT_PROGRESS_BAR || d->progress == DTRAIN_FIT_PROGRESS_LINES)
    return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: built with DTRAIN_NO_STDIO: no progress output or files", fn);
#else
  /* Every output path before the first step (see dt__fit_probe_dir). */
  const char *what[4] = {"csv_path", "svg_path", "checkpoint_path", "best_path"};
  const char *path[4] = {d->csv_path, d->svg_path, d->checkpoint_path, d->best_path};
  for (int i = 0; i < 4; i++) {
    dt_result r = path[i] ? dt__fit_probe_dir(what[i], path[i]) : DTRAIN_OK;
    if (r != DTRAIN_OK) return r;
  }
  /* The CSV grows by appending (the others are replaced whole): opened once
   * now as each epoch will open it, so a link planted there or a FIFO is
   * refused before the first step, not after an epoch. */
  if (d->csv_path) {
    char why[160];
    FILE *f = dt__file_open_append(d->csv_path, why, sizeof why);
    if (!f) return dt__error(DTRAIN_ERR_IO, "%s: csv_path '%s': %s", fn, d->csv_path, why);
    fclose(f);
  }
#endif
  return DTRAIN_OK;
}

/* Appends row to the history (for the chart). */
static dt_result dt__fit_push(dt__fit_run *run, const dt_fit_epoch *row) {
  if (run->nhist == run->hist_cap) {
    int64_t ncap = run->hist_cap ? run->hist_cap * 2 : 16;
    dt_fit_epoch *nh = (dt_fit_epoch *)dt__realloc(run->hist, (size_t)run->hist_cap * sizeof(dt_fit_epoch),
                                                   (size_t)ncap * sizeof(dt_fit_epoch));
    if (!nh) return dt__error(DTRAIN_ERR_NOMEM, "dt_fit: out of memory for the history");
    run->hist = nh;
    run->hist_cap = ncap;
  }
  run->hist[run->nhist++] = *row;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_fit(const dt_fit_desc *desc, dt_fit_result *result) {
  dt_fit_result res;
  dt__fit_run run;
  dt_result r;
  memset(&res, 0, sizeof res);
  memset(&run, 0, sizeof run);
  res.best_value = NAN;
  if (result) *result = res;
  if (!desc) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_fit: desc is NULL");
  r = dt__fit_check(desc);
  if (r != DTRAIN_OK) return r;

  const dt_fit_desc *d = desc;
  const int64_t epochs = d->epochs ? d->epochs : 1;
  const int64_t bsize = d->batch_size ? d->batch_size : 1;
  const int64_t ckpt_every = d->checkpoint_every ? d->checkpoint_every : 1;
  const dt_fit_monitor mon = d->monitor != DTRAIN_FIT_MONITOR_AUTO ? d->monitor
                           : d->evaluate ? DTRAIN_FIT_MONITOR_VAL_LOSS : DTRAIN_FIT_MONITOR_TRAIN_LOSS;
  const int maximize = mon == DTRAIN_FIT_MONITOR_VAL_ACC || mon == DTRAIN_FIT_MONITOR_TRAIN_ACC;
  const double t_start = dt_time_now();
  int64_t wait = 0, start_batch = d->start_batch, last_ckpt_step = -1;
  int stop = 0;
  run.d = d;
  run.step = d->start_epoch * d->steps_per_epoch + d->start_batch;
  run.mode = DTRAIN_FIT_PROGRESS_QUIET;
#ifndef DTRAIN_NO_STDIO
  run.out = d->out ? d->out : stdout;
  run.mode = d->progress == DTRAIN_FIT_PROGRESS_AUTO ? (dt__fit_isatty(run.out) ? DTRAIN_FIT_PROGRESS_BAR
                                                                               : DTRAIN_FIT_PROGRESS_LINES)
                                                     : (int)d->progress;
#endif
  dt__fit_snap snap;
  memset(&snap, 0, sizeof snap);
  if (d->skip_nonfinite && d->params) {
    snap.n = dt_params_size(d->params);
    snap.slots = d->optim ? dt_optim_state_slots(d->optim) : 0;
    snap.floats = snap.n * (size_t)(1 + snap.slots);
    snap.buf = (float *)dt__alloc((snap.floats ? snap.floats : 1) * sizeof(float));
    if (!snap.buf) {
      r = dt__error(DTRAIN_ERR_NOMEM, "dt_fit: out of memory for skip_nonfinite's copy of %zu floats", snap.floats);
      goto done;
    }
  }
  if (d->restore_best) {
    run.best_n = dt_params_size(d->params);
    run.best = (float *)dt__alloc((run.best_n ? run.best_n : 1) * sizeof(float));
    if (!run.best) {
      r = dt__error(DTRAIN_ERR_NOMEM, "dt_fit: out of memory for a copy of %zu parameters", run.best_n);
      goto done;
    }
  }

  for (int64_t e = d->start_epoch; e < epochs && !stop; e++) {
    dt_fit_epoch row;
    double loss_sum = 0, tr_secs = 0, last_draw = -1;
    int64_t samples = 0, acc_samples = 0, correct = 0, done_batches = 0, pos = start_batch;
    memset(&row, 0, sizeof row);
    (void)last_draw;
    (void)pos;
    for (int64_t b = start_batch; b < d->steps_per_epoch; b++) {
      dt_fit_batch bt;
      bt.epoch = e;
      bt.index = b;
      bt.step = dt__fit_step_now(&run);
      bt.loss = dt__fit_loss_unset();
      bt.samples = 0;
      bt.correct = -1;
      if (snap.buf) dt__fit_snap_take(&snap, d, 0);
      double t0 = dt_time_now();
      r = d->train_step(&bt, d->user);
      tr_secs += dt_time_now() - t0;
      /* A non-finite step: the step says so (dt_backward refuses a NaN
       * loss, a strategy a NaN gradient), or its loss or gradient shows it. */
      char why[DT__MSG_CAP];
      why[0] = '\0';
      if (r == DTRAIN_ERR_NONFINITE)
        snprintf(why, sizeof why, "%s", dt_last_result() == r ? dt_last_error() : dt_result_str(r));
      else if (r == DTRAIN_OK && dt__fit_loss_reported(bt.loss) && !dt__fit_finite(bt.loss))
        snprintf(why, sizeof why, "loss is %s", isnan(bt.loss) ? "NaN" : "Inf");
      else if (r == DTRAIN_OK && d->params)
        (void)dt__fit_grad_bad(d->params, why, sizeof why);
      if (why[0] && d->skip_nonfinite) { /* put back what the step changed, leave it out of the metrics */
        if (snap.buf) dt__fit_snap_take(&snap, d, 1);
        res.skipped_steps++;
        dt__log(DTRAIN_LOG_WARN, DTRAIN_ERR_NONFINITE, "dt_fit: step %lld (epoch %lld, batch %lld of %lld) skipped: %s",
                (long long)bt.step, (long long)e + 1, (long long)b + 1, (long long)d->steps_per_epoch, why);
        if (!d->optim) run.step++;
        pos = b + 1;
        continue;
      }
      if (why[0] && r == DTRAIN_OK) {
        r = dt__error(DTRAIN_ERR_NONFINITE,
                      "dt_fit: step %lld (epoch %lld, batch %lld of %lld): %s; training stopped (skip_nonfinite "
                      "skips such steps)", (long long)bt.step, (long long)e + 1, (long long)b + 1,
                      (long long)d->steps_per_epoch, why);
        goto done;
      }
      if (r != DTRAIN_OK) {
        char inner[DT__MSG_CAP];
        snprintf(inner, sizeof inner, "%s", dt_last_result() == r ? dt_last_error() : dt_result_str(r));
        dt__error(r, "dt_fit: step %lld: train step failed in epoch %lld, batch %lld of %lld: %s", (long long)bt.step,
                  (long long)e + 1, (long long)b + 1, (long long)d->steps_per_epoch, inner);
        goto done;
      }
      if (!dt__fit_loss_reported(bt.loss)) bt.loss = NAN; /* not reported: the metrics say NaN, as before */
      if (!d->optim) run.step++;
      int64_t ns = bt.samples > 0 ? bt.samples : bsize;
      samples += ns;
      loss_sum += bt.loss * (double)ns;
      if (bt.correct >= 0) {
        correct += bt.correct;
        acc_samples += ns;
      }
      done_batches++;
      pos = b + 1;
#ifndef DTRAIN_NO_STDIO
      if (run.mode == DTRAIN_FIT_PROGRESS_BAR) {
        double now = dt_time_now();
        if (b + 1 == d->steps_per_epoch || last_draw < 0 || now - last_draw >= DT__FIT_REDRAW_SECONDS) {
          double rate = tr_secs > 0 ? (double)samples / tr_secs : 0;
          double eta = done_batches > 0 ? tr_secs / (double)done_batches * (double)(d->steps_per_epoch - b - 1) : 0;
          dt__fit_draw_bar(run.out, e, epochs, b + 1, d->steps_per_epoch, loss_sum / (double)samples,
                           acc_samples ? (double)correct / (double)acc_samples : NAN, rate, eta, NULL);
          last_draw = now;
        }
      } else if (run.mode == DTRAIN_FIT_PROGRESS_LINES && d->log_every > 0 && (b + 1) % d->log_every == 0 &&
                 b + 1 < d->steps_per_epoch) {
        fprintf(run.out, "epoch %lld/%lld  batch %lld/%lld", (long long)e + 1, (long long)epochs, (long long)b + 1,
                (long long)d->steps_per_epoch);
        dt__fit_metric(run.out, "loss", loss_sum / (double)samples);
        if (acc_samples) dt__fit_metric(run.out, "acc", (double)correct / (double)acc_samples);
        fputc('\n', run.out);
        fflush(run.out);
      }
#endif
      if (d->checkpoint_path && d->checkpoint_steps > 0 && b + 1 < d->steps_per_epoch) {
        int64_t now_step = dt__fit_step_now(&run);
        if (now_step % d->checkpoint_steps == 0 && now_step != last_ckpt_step) { /* once per step */
          r = dt__fit_checkpoint(&run, d->checkpoint_path, e, e, b + 1);
          if (r != DTRAIN_OK) goto done;
          last_ckpt_step = now_step;
        }
      }
      if (d->on_batch_end && d->on_batch_end(&bt, d->user)) {
        stop = 1;
        res.stopped_by_callback = 1;
        break;
      }
    }
    start_batch = 0;

    /* Epoch bookkeeping. */
    row.epoch = e + 1;
    row.step = dt__fit_step_now(&run);
    row.train_loss = samples ? loss_sum / (double)samples : NAN;
    row.train_acc = acc_samples ? (double)correct / (double)acc_samples : NAN;
    row.val_loss = row.val_acc = NAN;
    row.lr = d->optim ? (double)dt_optim_lr(d->optim) : NAN;
    row.train_seconds = tr_secs;
    row.samples = samples;
    row.samples_per_sec = tr_secs > 0 ? (double)samples / tr_secs : 0;
    if (d->evaluate) {
      dt_fit_eval ev;
      ev.epoch = e;
      ev.loss = NAN;
      ev.accuracy = NAN;
      r = d->evaluate(&ev, d->user);
      if (r != DTRAIN_OK) {
        char inner[DT__MSG_CAP];
        snprintf(inner, sizeof inner, "%s", dt_last_result() == r ? dt_last_error() : dt_result_str(r));
        dt__error(r, "dt_fit: evaluation failed after epoch %lld: %s", (long long)e + 1, inner);
        goto done;
      }
      row.val_loss = ev.loss;
      row.val_acc = ev.accuracy;
    }
    row.seconds = dt_time_now() - t_start;
    res.samples += samples;
    res.train_seconds += tr_secs;
    res.epochs_run++;
    res.last = row;
    r = dt__fit_push(&run, &row);
    if (r != DTRAIN_OK) goto done;

#ifndef DTRAIN_NO_STDIO
    if (run.mode == DTRAIN_FIT_PROGRESS_BAR) {
      dt__fit_draw_bar(run.out, e, epochs, pos, d->steps_per_epoch, row.train_loss, row.train_acc, 0, 0, &row);
      fputc('\n', run.out);
      fflush(run.out);
    } else if (run.mode == DTRAIN_FIT_PROGRESS_LINES) {
      dt__fit_print_line(run.out, epochs, &row);
    }
    if (d->csv_path) {
      r = dt__fit_csv_append(d->csv_path, &row);
      if (r != DTRAIN_OK) goto done;
    }
    if (d->svg_path) {
      r = dt_fit_write_svg(d->svg_path, run.hist, run.nhist, d->title);
      if (r != DTRAIN_OK) goto done;
    }
#endif

    /* Early stopping and the best epoch. */
    {
      double v = dt__fit_monitored(mon, &row);
      int improved = 0;
      if (dt__fit_finite(v)) {
        if (res.best_epoch == 0) improved = 1;
        else if (maximize) improved = v > res.best_value + d->min_delta;
        else improved = v < res.best_value - d->min_delta;
      }
      if (improved) {
        res.best_epoch = row.epoch;
        res.best_value = v;
        wait = 0;
        if (run.best) memcpy(run.best, dt_params_data(d->params), run.best_n * sizeof(float));
        if (d->best_path) {
          r = dt__fit_checkpoint(&run, d->best_path, e + 1, e + 1, 0);
          if (r != DTRAIN_OK) goto done;
        }
      } else {
        wait++;
        if (d->patience > 0 && wait >= d->patience) {
          stop = 1;
          res.stopped_early = 1;
        }
      }
    }
    if (d->on_epoch_end && d->on_epoch_end(&row, d->user)) {
      stop = 1;
      res.stopped_by_callback = 1;
    }
    if (d->checkpoint_path && ((e + 1 - d->start_epoch) % ckpt_every == 0 || e + 1 == epochs || stop)) {
      /* A hook may have stopped the epoch early: store where it stopped. */
      int complete = pos == d->steps_per_epoch;
      r = dt__fit_checkpoint(&run, d->checkpoint_path, complete ? e + 1 : e, complete ? e + 1 : e,
                             complete ? 0 : pos);
      if (r != DTRAIN_OK) goto done;
    }
#ifndef DTRAIN_NO_STDIO
    if (res.stopped_early && run.mode != DTRAIN_FIT_PROGRESS_QUIET)
      fprintf(run.out, "early stopping: %s did not improve by more than %g for %lld epochs (best %.4f at epoch %lld)\n",
              dt__fit_monitor_name(mon), d->min_delta, (long long)wait, res.best_value, (long long)res.best_epoch);
#endif
  }

  if (run.best && res.best_epoch > 0) {
    memcpy(dt_params_data(d->params), run.best, run.best_n * sizeof(float));
    res.restored_best = 1;
#ifndef DTRAIN_NO_STDIO
    if (run.mode != DTRAIN_FIT_PROGRESS_QUIET && res.best_epoch != res.last.epoch)
      fprintf(run.out, "restored the parameters of epoch %lld (%s %.4f)\n", (long long)res.best_epoch,
              dt__fit_monitor_name(mon), res.best_value);
#endif
  }
  r = DTRAIN_OK;

done:
#ifndef DTRAIN_NO_STDIO
  if (r != DTRAIN_OK && run.mode == DTRAIN_FIT_PROGRESS_BAR) {
    fputc('\n', run.out); /* do not leave the error behind a half-drawn bar */
    fflush(run.out);
  }
#endif
  res.step = dt__fit_step_now(&run);
  res.total_seconds = dt_time_now() - t_start;
  res.samples_per_sec = res.train_seconds > 0 ? (double)res.samples / res.train_seconds : 0;
  if (result) *result = res;
  dt__free(run.best, (run.best_n ? run.best_n : 1) * sizeof(float));
  dt__free(snap.buf, (snap.floats ? snap.floats : 1) * sizeof(float));
  dt__free(run.hist, (size_t)run.hist_cap * sizeof(dt_fit_epoch));
  return r;
}

#undef DT__FIT_BAR_WIDTH
#undef DT__FIT_REDRAW_SECONDS

#else /* DTRAIN_NO_FIT: the loop, its progress output and its files are compiled out */

DTRAIN_API dt_result dt_fit(const dt_fit_desc *desc, dt_fit_result *result) {
  (void)desc;
  if (result) memset(result, 0, sizeof *result); /* as dt_fit does: the result is set on failure too */
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fit: the training loop is compiled out (DTRAIN_NO_FIT)");
}

DTRAIN_API dt_result dt_fit_write_svg(const char *path, const dt_fit_epoch *rows, int64_t n, const char *title) {
  (void)path;
  (void)rows;
  (void)n;
  (void)title;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_fit_write_svg: the training loop is compiled out (DTRAIN_NO_FIT)");
}

#endif /* DTRAIN_NO_FIT */
