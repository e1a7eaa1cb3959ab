/* 03_char_model.c -- a character-level language model: a tiny GPT learns to write
 * like Ambrose Bierce's "The Devil's Dictionary" (data/text/, public domain).
 *
 * Shows: text data (dt_text_read, dt_text_sample), a small transformer built from
 * layers (embedding, learned positions, causal self-attention, layer norm, MLP),
 * cross-entropy over every position, AdamW with warm-up, cosine decay and gradient
 * clipping, no-grad evaluation and generation, checkpoints and bitwise resume.
 *
 * Build: make                 (builds build/examples/03_char_model)
 *    or: cc -std=c11 -O2 -I. examples/03_char_model.c -o char_model -lm -lpthread
 * Run from the repository root (the text's default path is relative to it):
 *        build/examples/03_char_model            (about 1.5 minutes on one core)
 *        build/examples/03_char_model --help     (all flags)
 *        build/examples/03_char_model --stop-at 1000 --checkpoint run.safetensors
 *        build/examples/03_char_model --resume run.safetensors   (same result as one run)
 *
 * Prints the model size, then every --log-every steps the mean training loss
 * (in nats per character; ln(84) = 4.43 is a uniform guess), and every
 * --sample-every steps the validation loss and a short generated sample, which
 * goes from random letters to words, punctuation and dictionary entries
 * ("WORD, n.  Definition..."). At the end: the validation loss on the held-out
 * last 10% of the text (about 1.78 with the defaults) and a checksum of the
 * weights, so that two runs can be compared bit for bit.
 *
 * The model, for a window of T characters c_0 .. c_{T-1}:
 *   x_t = tok[c_t] + pos[t]                                 (embedding tables)
 *   for each layer:  x = x + attention(layer_norm(x))       (looks only back)
 *                    x = x + W2 relu(W1 layer_norm(x))      (per position MLP)
 *   logits_t = head(layer_norm(x_t))  -> a guess for c_{t+1}
 * and the loss is the cross-entropy of every guess against the real next
 * character. Generation feeds the model its own samples one at a time.
 * (GPT-2 uses GELU in the MLP; ReLU learns as well here and costs less.) */
#define DTRAIN_IMPLEMENTATION
#include "dtrain.h"
#include "example_flags.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LAYERS 8

/* ---- settings (all of them are flags) --------------------------------------- */

typedef struct settings {
  long steps, stop_at, seq, batch, dim, layers, heads;
  long log_every, sample_every, sample_len;
  long seed;
  double lr, temperature;
  const char *data, *checkpoint, *resume, *prompt;
} settings;

static double now_seconds(void) { return dt_time_now(); } /* monotonic, and on Windows too */

/* An output flag is checked at start, before any data loads: a path whose
 * directory does not exist or takes no new file would otherwise fail only
 * when the first file is written, after the training it was to keep
 * (dt_check_writable; is_dir: path is the directory itself). */
static int output_ok(const char *flag, const char *path, int is_dir) {
  if (!path || dt_check_writable(path, is_dir) == DTRAIN_OK) return 1;
  fprintf(stderr, "error: %s %s: %s\n", flag, path, dt_last_error());
  return 0;
}

/* Fills s from argv. Returns 1 to go on, 0 after printing what is wrong with
 * a flag, -1 after printing the help (--help). */
static int parse_flags(int argc, char **argv, settings *s) {
  const char *trace = NULL; /* --trace */
  const ex_flag flags[] = {
      {"steps", 'L', &s->steps, 0, 1e9, "training steps in all, resumed ones included"},
      {"stop-at", 'L', &s->stop_at, 0, 1e9, "stop at this step as if interrupted (to try --resume)"},
      {"seq", 'L', &s->seq, 2, 4096, "characters per training window"},
      {"batch", 'L', &s->batch, 1, 1e6, "windows per step"},
      {"dim", 'L', &s->dim, 1, 4096, "width of the model (a multiple of --heads)"},
      {"layers", 'L', &s->layers, 1, MAX_LAYERS, "transformer blocks"},
      {"heads", 'L', &s->heads, 1, 64, "attention heads"},
      {"lr", 'd', &s->lr, 1e-7, 10, "peak learning rate of AdamW"},
      {"seed", 'L', &s->seed, 0, 2147483647, "seed of the weights, batches and samples"},
      {"temperature", 'd', &s->temperature, 0, 100, "sampling temperature, 0 = greedy"},
      {"log-every", 'L', &s->log_every, 1, 1e9, "print the mean training loss every N steps"},
      {"sample-every", 'L', &s->sample_every, 0, 1e9, "validate and sample every N steps, 0 = never"},
      {"sample-len", 'L', &s->sample_len, 1, 100000, "characters per sample"},
      {"prompt", 's', &s->prompt, 0, 0, "text the samples start from"},
      {"data", 's', &s->data, 0, 0, "text file to learn"},
      {"checkpoint", 's', &s->checkpoint, 0, 0, "save the training state here at each sample and the end"},
      {"resume", 's', &s->resume, 0, 0, "continue from this checkpoint (same --dim --layers --heads --seq)"},
      {"trace", 's', &trace, 0, 0, EX_TRACE_HELP},
  };
  int r = ex_parse("03_char_model", argc, argv, flags, (int)(sizeof flags / sizeof flags[0]), NULL);
  if (r == 0) ex_usage(stderr, "03_char_model", flags, (int)(sizeof flags / sizeof flags[0]), NULL);
  if (r <= 0) return r;
  if (!ex_trace_begin(trace)) return 0;
  if (s->dim % s->heads != 0) {
    fprintf(stderr, "03_char_model: --dim %ld is not a multiple of --heads %ld\n", s->dim, s->heads);
    return 0;
  }
  return 1;
}

/* ---- the model ------------------------------------------------------------------- */

typedef struct block {
  dt_nn_layer_norm ln1, ln2;
  dt_nn_attention attn;
  dt_nn_linear fc1, fc2;   /* the MLP: dim -> 4*dim -> dim */
} block;

typedef struct model {
  int64_t vocab, seq, dim;
  int layers;
  dt_nn_embedding tok;     /* character id -> vector [vocab, dim] */
  int pos;                 /* parameter index of the position table [seq, dim] */
  block blocks[MAX_LAYERS];
  dt_nn_layer_norm ln_f;
  dt_nn_linear head;       /* vector -> one score (logit) per character */
} model;

/* Adds every parameter to P; the order of the adds fixes the initial numbers. */
static dt_result model_init(model *m, dt_params *P, int64_t vocab, int64_t seq, int64_t dim,
                            int layers, int heads) {
  char name[64];
  int64_t pos_shape[2];
  m->vocab = vocab;
  m->seq = seq;
  m->dim = dim;
  m->layers = layers;
  dt_result r = dt_nn_embedding_init(&m->tok, P, "tok", vocab, dim);   /* N(0, 1) */
  if (r != DTRAIN_OK) return r;
  pos_shape[0] = seq;
  pos_shape[1] = dim;
  m->pos = dt_params_add(P, "pos.weight", 2, pos_shape, dt_init_normal(0.0f, 0.1f));
  if (m->pos < 0) return (dt_result)m->pos;
  for (int l = 0; l < layers; l++) {
    block *b = &m->blocks[l];
    snprintf(name, sizeof name, "blocks.%d.ln1", l);
    if (r == DTRAIN_OK) r = dt_nn_layer_norm_init(&b->ln1, P, name, dim);
    snprintf(name, sizeof name, "blocks.%d.attn", l);
    if (r == DTRAIN_OK) r = dt_nn_attention_init(&b->attn, P, name, dim, heads);
    snprintf(name, sizeof name, "blocks.%d.ln2", l);
    if (r == DTRAIN_OK) r = dt_nn_layer_norm_init(&b->ln2, P, name, dim);
    snprintf(name, sizeof name, "blocks.%d.fc1", l);
    if (r == DTRAIN_OK) r = dt_nn_linear_init(&b->fc1, P, name, dim, 4 * dim, 1);
    snprintf(name, sizeof name, "blocks.%d.fc2", l);
    if (r == DTRAIN_OK) r = dt_nn_linear_init(&b->fc2, P, name, 4 * dim, dim, 1);
  }
  if (r == DTRAIN_OK) r = dt_nn_layer_norm_init(&m->ln_f, P, "ln_f", dim);
  if (r == DTRAIN_OK) r = dt_nn_linear_init(&m->head, P, "head", dim, vocab, 1);
  return r;
}

/* ids: B windows of T characters (B*T ids, T <= m->seq) -> logits [B*T, vocab].
 * Row b*T + t scores the character that follows ids[b*T + t]. Errors are sticky
 * on g: the caller checks once (dt_backward, or dt_graph_error). */
static dt_tensor *model_forward(dt_graph *g, const model *m, const int32_t *ids, int64_t B, int64_t T) {
  int64_t shape[3];
  shape[0] = B;
  shape[1] = T;
  shape[2] = m->dim;
  dt_tensor *x = dt_nn_embedding_forward(g, &m->tok, ids, B * T);     /* [B*T, C] */
  x = dt_reshape(g, x, 3, shape);                                      /* [B, T, C] */
  x = dt_add(g, x, dt_slice(g, dt_param(g, m->pos), 0, 0, T));        /* + [T, C] */
  for (int l = 0; l < m->layers; l++) {
    const block *b = &m->blocks[l];
    x = dt_add(g, x, dt_nn_attention_forward(g, &b->attn, dt_nn_layer_norm_forward(g, &b->ln1, x)));
    dt_tensor *h = dt_relu(g, dt_nn_linear_forward(g, &b->fc1, dt_nn_layer_norm_forward(g, &b->ln2, x)));
    x = dt_add(g, x, dt_nn_linear_forward(g, &b->fc2, h));
  }
  x = dt_nn_layer_norm_forward(g, &m->ln_f, x);
  return dt_reshape2(g, dt_nn_linear_forward(g, &m->head, x), B * T, m->vocab);
}

/* ---- evaluation and sampling (no-grad graph) ------------------------------------- */

/* Mean cross-entropy over ids[begin, end), cut into windows of m->seq characters,
 * `batch` windows per forward pass. Returns NAN on error. */
static double evaluate(dt_graph *g, const model *m, const dt_text *text, int64_t begin, int64_t end,
                       int64_t batch) {
  int64_t T = m->seq, windows = (end - begin - 1) / T;
  double total = 0.0;
  for (int64_t w = 0; w < windows; w += batch) {
    int64_t B = windows - w < batch ? windows - w : batch;
    const int32_t *x = text->ids + begin + w * T;   /* B*T consecutive characters */
    dt_graph_reset(g);
    /* the targets are the same characters shifted by one */
    dt_tensor *loss = dt_cross_entropy(g, model_forward(g, m, x, B, T), x + 1);
    if (!loss) return NAN;
    total += (double)dt_item(loss) * (double)(B * T);
  }
  return windows > 0 ? total / (double)(windows * T) : NAN;
}

/* Draws the next character from the scores of the last position:
 * p_i = softmax(logits / temperature); temperature 0 takes the best. */
static int32_t pick(const float *logits, int64_t vocab, double temperature, dt_rng *rng, float *p) {
  int32_t best = 0;
  for (int64_t i = 1; i < vocab; i++)
    if (logits[i] > logits[best]) best = (int32_t)i;
  if (temperature <= 0.0) return best;
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; i++) {
    p[i] = (float)exp((double)(logits[i] - logits[best]) / temperature);
    sum += p[i];
  }
  double u = (double)dt_rng_uniform(rng) * sum;
  for (int64_t i = 0; i < vocab; i++) {
    u -= p[i];
    if (u < 0.0) return (int32_t)i;
  }
  return best;
}

/* Continues ctx[0, n_prompt) by n characters (ctx holds n_prompt + n ids);
 * the model sees at most the last m->seq of them. p: vocab floats of scratch. */
static dt_result generate(dt_graph *g, const model *m, int32_t *ctx, int64_t n_prompt, int64_t n,
                          double temperature, dt_rng *rng, float *p) {
  for (int64_t len = n_prompt; len < n_prompt + n; len++) {
    int64_t T = len < m->seq ? len : m->seq;
    dt_graph_reset(g);
    dt_tensor *logits = model_forward(g, m, ctx + len - T, 1, T);
    if (!logits) return dt_graph_error(g);
    ctx[len] = pick(logits->data + (T - 1) * m->vocab, m->vocab, temperature, rng, p);
  }
  return DTRAIN_OK;
}

/* Prints text with "  | " before every line. */
static void print_sample(const char *s) {
  printf("  | ");
  for (; *s; s++) {
    putchar(*s);
    if (*s == '\n' && s[1]) printf("  | ");
  }
  printf("\n");
}

/* ---- the program --------------------------------------------------------------------- */

/* Prints "03_char_model: what: why" on stderr. */
static void complain(const char *what, const char *why) {
  fprintf(stderr, "03_char_model: %s: %s\n", what, why);
}

int main(int argc, char **argv) {
  ex_log_init(); /* each error is printed once, below, not by dtrain's logger too */
  settings s;
  memset(&s, 0, sizeof s);
  s.steps = 2000; s.seq = 64; s.batch = 16; s.dim = 64; s.layers = 2; s.heads = 4;
  s.lr = 0.01; s.seed = 1; s.temperature = 0.8;
  s.log_every = 100; s.sample_every = 500; s.sample_len = 240;
  s.prompt = "\n\n";
  s.data = "data/text/devils_dictionary.txt";
  int parsed = parse_flags(argc, argv, &s);
  if (parsed <= 0) return parsed < 0 ? 0 : 2;
  if (!output_ok("--checkpoint", s.checkpoint, 0)) return 2;
  uint64_t seed = (uint64_t)s.seed;
  if (dt_get_threads() == 1 && dt_cpu_count() > 1) /* said once: the user may not know */
    printf("note: training on 1 of %d cores; DTRAIN_THREADS=%d (or auto) splits the big kernels over them\n",
           dt_cpu_count(), dt_cpu_count());

  /* Everything the program owns; freed at `done` whatever happens. */
  int exit_code = 1;
  dt_text text;
  memset(&text, 0, sizeof text);
  int32_t *xb = NULL, *yb = NULL, *ctx = NULL;
  char *sample_text = NULL;
  float *scratch = NULL;
  dt_params *P = NULL;
  dt_optim *opt = NULL;
  dt_graph *g = NULL, *eval = NULL;
  model m;
  dt_optim_options od;
  dt_train_state st;
  char config[256];
  dt_rng rng;
  double t0, loss_sum = 0.0, val = NAN;
  int64_t n_train, n_prompt, loss_count = 0, start;

  /* The text: the first 90% to learn from, the last 10% to check on. */
  if (dt_text_read(s.data, &text) != DTRAIN_OK) {
    complain("cannot read the text", dt_last_error());
    goto done;
  }
  n_train = text.n * 9 / 10;
  if (n_train <= s.seq || text.n - n_train <= s.seq + 1) {
    complain(s.data, "too short for --seq (the last 10% must hold a window)");
    goto done;
  }

  /* Buffers allocated once: a batch of windows, the sample and its text. */
  n_prompt = (int64_t)strlen(s.prompt);
  xb = (int32_t *)malloc((size_t)(s.batch * s.seq) * sizeof *xb);
  yb = (int32_t *)malloc((size_t)(s.batch * s.seq) * sizeof *yb);
  ctx = (int32_t *)malloc((size_t)(n_prompt + s.sample_len) * sizeof *ctx);
  sample_text = (char *)malloc((size_t)(n_prompt + s.sample_len) + 1);
  scratch = (float *)malloc((size_t)text.vocab_size * sizeof *scratch);
  if (!xb || !yb || !ctx || !sample_text || !scratch) {
    complain("malloc", "out of memory");
    goto done;
  }
  if (n_prompt == 0 || dt_text_encode(&text, s.prompt, (size_t)n_prompt, ctx) != DTRAIN_OK) {
    complain("--prompt", n_prompt == 0 ? "must not be empty" : dt_last_error());
    goto done;
  }

  /* The model and its optimizer: AdamW, linear warm-up over the first 5% of
   * the steps, cosine decay to lr/10, gradient norm clipped to 1. */
  P = dt_params_create(seed);
  if (!P || model_init(&m, P, text.vocab_size, s.seq, s.dim, (int)s.layers, (int)s.heads) != DTRAIN_OK) {
    complain("model", dt_last_error());
    goto done;
  }
  memset(&od, 0, sizeof od);
  od.kind = DTRAIN_OPTIM_ADAMW;
  od.lr = (float)s.lr;
  od.weight_decay = 0.01f;
  od.clip_norm = 1.0f;
  od.schedule.kind = DTRAIN_SCHED_COSINE;
  od.schedule.warmup_steps = s.steps / 20;
  od.schedule.total_steps = s.steps - od.schedule.warmup_steps;
  od.schedule.min_lr = (float)s.lr / 10;
  opt = dt_optim_create(P, &od);
  g = dt_graph_create(P, NULL);       /* training steps */
  eval = dt_graph_create(P, NULL);    /* validation and samples */
  if (!opt || !g || !eval) {
    complain("setup", dt_last_error());
    goto done;
  }
  dt_graph_set_grad_enabled(eval, 0); /* no-grad: no tape, no gradients */

  /* The training state a checkpoint holds: weights, Adam's moments and step
   * count (which drives the schedule and the batches). */
  memset(&st, 0, sizeof st);
  st.params = P;
  st.optim = opt;
  st.graph = g;
  snprintf(config, sizeof config,
           "{\"model\":\"char_gpt\",\"seq\":%ld,\"dim\":%ld,\"layers\":%ld,\"heads\":%ld}", s.seq, s.dim,
           s.layers, s.heads);
  st.config = config;
  if (s.resume) {
    if (dt_checkpoint_load(s.resume, &st) != DTRAIN_OK) {
      complain("cannot resume", dt_last_error());
      goto done;
    }
    printf("resumed from %s at step %lld\n", s.resume, (long long)dt_optim_steps(opt));
  }

  printf("text: %s, %lld characters, %d distinct (%lld to train on, %lld held out)\n", s.data,
         (long long)text.n, text.vocab_size, (long long)n_train, (long long)(text.n - n_train));
  printf("model: %ld layer%s, dim %ld, %ld heads, window %ld: %zu parameters\n", s.layers,
         s.layers == 1 ? "" : "s", s.dim, s.heads, s.seq, dt_params_trainable_size(P));
  printf("training: %ld steps of %ld windows, AdamW lr %g (a uniform guess has loss %.2f)\n", s.steps,
         s.batch, s.lr, log((double)text.vocab_size));

  t0 = now_seconds();
  start = dt_optim_steps(opt);
  for (int64_t step = start;; step++) {
    int last = step >= s.steps || (s.stop_at > 0 && step == s.stop_at);
    /* Validation and a sample every --sample-every steps (step 0: untrained) and at the end. */
    if (last || (s.sample_every > 0 && step % s.sample_every == 0)) {
      val = evaluate(eval, &m, &text, n_train, text.n, s.batch);
      if (isnan(val)) {
        complain("evaluation", dt_graph_message(eval));
        goto done;
      }
      printf("step %5lld  validation loss %.4f  (%.1f s)\n", (long long)step, val, now_seconds() - t0);
      if (s.sample_every > 0) {
        dt_rng_seed(&rng, seed ^ (0x5A3C1E0F2D4B6A79ull * (uint64_t)(step + 1)));  /* repeatable */
        if (generate(eval, &m, ctx, n_prompt, s.sample_len, s.temperature, &rng, scratch) != DTRAIN_OK) {
          complain("generation", dt_graph_message(eval));
          goto done;
        }
        dt_text_decode(&text, ctx, n_prompt + s.sample_len, sample_text,
                       (size_t)(n_prompt + s.sample_len) + 1);
        print_sample(sample_text + n_prompt);
      }
      if (s.checkpoint && step > start && dt_checkpoint_save(s.checkpoint, &st) != DTRAIN_OK) {
        complain("cannot save the checkpoint", dt_last_error());
        goto done;
      }
      fflush(stdout);
    }
    if (last) break;

    /* One training step. The batch of step k is a pure function of (seed, k),
     * so a resumed run sees the same batches as an uninterrupted one. */
    dt_rng_seed(&rng, seed + 0x9E3779B97F4A7C15ull * (uint64_t)(step + 1));
    dt_text_sample(&text, 0, n_train, &rng, s.batch, s.seq, xb, yb);
    dt_graph_reset(g);                /* forget the last step, keep its memory */
    dt_params_zero_grad(P);
    dt_tensor *loss = dt_cross_entropy(g, model_forward(g, &m, xb, s.batch, s.seq), yb);
    if (dt_backward(g, loss) != DTRAIN_OK) {
      complain("training step", dt_graph_message(g));
      goto done;
    }
    dt_optim_step(opt);
    loss_sum += dt_item(loss);
    loss_count++;
    if ((step + 1) % s.log_every == 0) {
      printf("step %5lld  train loss %.4f  lr %.2e  (%.1f s)\n", (long long)(step + 1),
             loss_sum / (double)loss_count, (double)dt_optim_lr(opt), now_seconds() - t0);
      loss_sum = 0.0;
      loss_count = 0;
      fflush(stdout);
    }
  }
  printf("final validation loss %.4f (%.3f bits per character) after %lld steps, %.1f s\n", val,
         val / log(2.0), (long long)dt_optim_steps(opt), now_seconds() - t0);
  printf("params checksum %016llx\n", (unsigned long long)dt_params_checksum(P));
  if (s.checkpoint) printf("checkpoint: %s\n", s.checkpoint);
  if (dt_optim_steps(opt) < s.steps)
    printf("stopped before step %ld: continue with --resume %s\n", s.steps,
           s.checkpoint ? s.checkpoint : "(needs --checkpoint FILE)");
  exit_code = 0;

done:
  dt_graph_destroy(eval);
  dt_graph_destroy(g);
  dt_optim_destroy(opt);
  dt_params_destroy(P);
  dt_text_free(&text);
  free(xb);
  free(yb);
  free(ctx);
  free(sample_text);
  free(scratch);
  return exit_code;
}
