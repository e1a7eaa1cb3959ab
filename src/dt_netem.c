/* ===========================================================================
 * dt_netem.c -- link emulation in the transport (DTRAIN_NETEM): the sends of
 * each TCP connection pass through a delay line that holds them to a rate,
 * a one-way delay with jitter, the stalls that lost segments cause, and a
 * cut that silences the link (see dt_net_core.h)
 * ===========================================================================
 * How a line works. A send copies what fits into the line's buffer (like a
 * socket's send buffer: the sender goes on at once) and schedules it in
 * segments: a segment departs when the link is free (free_at), takes
 * bytes/rate to serialise, plus one round trip for each 1448-byte TCP segment
 * drawn as lost (fast retransmit: TCP loses no bytes, a loss costs time), and
 * arrives delay + jitter later; arrivals keep their order, as TCP's do. A
 * thread per line (the wire) writes each segment to the real socket at its
 * arrival time, never before. Because times are absolute, a late wake-up of
 * the wire never lowers the rate: the next segments are written at once.
 * After a cut the line drops what is sent and hides what arrives (receives
 * see nothing, poll reports no input): both ends wait until their deadline,
 * as they would on a pulled cable. With DTRAIN_NETEM unset no line exists and
 * every wrapper below is one relaxed atomic load and the system call.
 */
#include "dt_internal.h"
#include "dt_tensor.h"
#include "dt_ops.h"
#include "dt_params.h"
#include "dt_optim.h"
#include "dt_nn.h"
#include "dt_io.h"
#include "dt_data.h"
#include "dt_memory.h"
#include "dt_comm.h"
#include "dt_net.h"
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_net_core.h"
#include "dt_platform.h"

#ifndef DTRAIN_NO_NET
#  include <ctype.h>
#  include <errno.h>
#  if !defined(_WIN32)
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/uio.h>
#  endif

#  define DT__NE_MSS 1448         /* one TCP segment's payload (loss draws, header overhead) */
#  define DT__NE_HDR 66           /* its Ethernet + IP + TCP headers */
#  define DT__NE_MAX_LINES 256    /* emulated connections in one process */
#  define DT__NE_SEGS 8192        /* scheduled segments a line holds */
#  define DT__NE_POLL_MAX 2048    /* pollfds one dt__sock_poll call adjusts */

/* ---- the specification ------------------------------------------------------------------ */

static const char *dt__ne_skip(const char *s) {
  while (*s == ' ' || *s == '\t') s++;
  return s;
}

/* "<number><unit>" with unit from the table (case-insensitive, whole word). */
static int dt__ne_number(const char *v, size_t n, const char *const *units, const double *scale, double *out) {
  char tmp[64];
  if (n == 0 || n >= sizeof tmp) return 0;
  memcpy(tmp, v, n);
  tmp[n] = '\0';
  char *end = NULL;
  double x = strtod(tmp, &end);
  if (end == tmp || !(x >= 0) || x > 1e15) return 0;
  for (int i = 0; units[i]; i++) {
    size_t k = strlen(units[i]);
    if (strlen(end) != k) continue;
    int same = 1;
    for (size_t j = 0; j < k && same; j++) same = tolower((unsigned char)end[j]) == units[i][j];
    if (same) {
      *out = x * scale[i];
      return 1;
    }
  }
  return 0;
}

static int dt__ne_time(const char *v, size_t n, double *out) {
  static const char *const u[] = {"s", "ms", "us", NULL};
  static const double sc[] = {1.0, 1e-3, 1e-6};
  return dt__ne_number(v, n, u, sc, out);
}

static int dt__ne_rate(const char *v, size_t n, double *bytes_per_s) {
  static const char *const u[] = {"bit", "kbit", "mbit", "gbit", "tbit", NULL};
  static const double sc[] = {1.0 / 8, 1e3 / 8, 1e6 / 8, 1e9 / 8, 1e12 / 8};
  return dt__ne_number(v, n, u, sc, bytes_per_s) && *bytes_per_s > 0;
}

static int dt__ne_loss(const char *v, size_t n, double *p) {
  static const char *const u[] = {"%", "", NULL};
  static const double sc[] = {0.01, 1.0};
  return dt__ne_number(v, n, u, sc, p) && *p < 0.5;
}

/* One clause's "key=value,key=value" into *s (fields it names are set). */
static dt_result dt__ne_clause(const char *p, const char *end, dt__netem_spec *s) {
  while (p < end) {
    p = dt__ne_skip(p);
    const char *e = p;
    while (e < end && *e != ',') e++;
    const char *q = e;
    while (q > p && (q[-1] == ' ' || q[-1] == '\t')) q--;
    const char *eq = (const char *)memchr(p, '=', (size_t)(q - p));
    int len = (int)(q - p);
    if (len == 0) {
      p = e + 1;
      continue;
    }
    if (!eq) return dt__error(DTRAIN_ERR_INVALID_ARG, "DTRAIN_NETEM: '%.*s': expected key=value", len, p);
    size_t kn = (size_t)(eq - p), vn = (size_t)(q - eq - 1);
    const char *v = eq + 1;
    int ok = 1;
    const char *want = "";
    if (kn == 4 && !memcmp(p, "rate", 4)) {
      ok = dt__ne_rate(v, vn, &s->rate);
      s->set |= DT__NE_RATE;
      want = "a rate above 0 like 10mbit, 100mbit or 1gbit (bits per second, as tc writes them)";
    } else if (kn == 5 && !memcmp(p, "delay", 5)) {
      ok = dt__ne_time(v, vn, &s->delay) && s->delay <= 60;
      s->set |= DT__NE_DELAY;
      want = "a time up to 60s like 2ms, 500us or 0.1s";
    } else if (kn == 6 && !memcmp(p, "jitter", 6)) {
      ok = dt__ne_time(v, vn, &s->jitter) && s->jitter <= 60;
      s->set |= DT__NE_JITTER;
      want = "a time up to 60s like 1ms";
    } else if (kn == 4 && !memcmp(p, "loss", 4)) {
      ok = dt__ne_loss(v, vn, &s->loss);
      s->set |= DT__NE_LOSS;
      want = "a fraction of segments below 50% like 0.5% or 0.005";
    } else if (kn == 3 && !memcmp(p, "cut", 3)) {
      ok = dt__ne_time(v, vn, &s->cut);
      s->set |= DT__NE_CUT;
      want = "a time like 30s (when the link is severed)";
    } else {
      return dt__error(DTRAIN_ERR_INVALID_ARG, "DTRAIN_NETEM: unknown key '%.*s' (keys: rate, delay, jitter, loss, cut)",
                       (int)kn, p);
    }
    if (!ok) return dt__error(DTRAIN_ERR_INVALID_ARG, "DTRAIN_NETEM: '%.*s': expected %s", len, p, want);
    p = e + 1;
  }
  return DTRAIN_OK;
}

/* A clause's prefix "rank3:" / "worker3:" / "ps1:" -> role and index; none: role -1. */
static dt_result dt__ne_prefix(const char **pp, const char *end, int *role, int *index) {
  const char *p = dt__ne_skip(*pp);
  const char *colon = (const char *)memchr(p, ':', (size_t)(end - p));
  *role = -1;
  *index = -1;
  if (!colon) return DTRAIN_OK;
  size_t n = (size_t)(colon - p);
  const char *digits = NULL;
  if (n > 4 && !memcmp(p, "rank", 4)) digits = p + 4, *role = DTRAIN_ROLE_WORKER;
  else if (n > 6 && !memcmp(p, "worker", 6)) digits = p + 6, *role = DTRAIN_ROLE_WORKER;
  else if (n > 2 && !memcmp(p, "ps", 2)) digits = p + 2, *role = DTRAIN_ROLE_PS;
  long v = 0;
  int ok = digits != NULL;
  for (const char *d = digits; ok && d < colon; d++) {
    ok = *d >= '0' && *d <= '9' && v < DTRAIN_MAX_PEERS;
    v = v * 10 + (*d - '0');
  }
  if (!ok || v >= DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "DTRAIN_NETEM: '%.*s:': expected rankN:, workerN: or psN: before a clause",
                     (int)n, p);
  *index = (int)v;
  *pp = colon + 1;
  return DTRAIN_OK;
}

/* The slower of two ends, field by field. */
static dt__netem_spec dt__ne_worse(dt__netem_spec a, dt__netem_spec b) {
  dt__netem_spec s = a;
  s.set = a.set | b.set;
  if (b.set & DT__NE_RATE) s.rate = (a.set & DT__NE_RATE) ? DT__MIN(a.rate, b.rate) : b.rate;
  if (b.set & DT__NE_DELAY) s.delay = DT__MAX(a.delay, b.delay);
  if (b.set & DT__NE_JITTER) s.jitter = DT__MAX(a.jitter, b.jitter);
  if (b.set & DT__NE_LOSS) s.loss = DT__MAX(a.loss, b.loss);
  if (b.set & DT__NE_CUT) s.cut = (a.set & DT__NE_CUT) ? DT__MIN(a.cut, b.cut) : b.cut;
  return s;
}

static void dt__ne_override(dt__netem_spec *base, const dt__netem_spec *o) {
  if (o->set & DT__NE_RATE) base->rate = o->rate;
  if (o->set & DT__NE_DELAY) base->delay = o->delay;
  if (o->set & DT__NE_JITTER) base->jitter = o->jitter;
  if (o->set & DT__NE_LOSS) base->loss = o->loss;
  if (o->set & DT__NE_CUT) base->cut = o->cut;
  base->set |= o->set;
}

DTRAIN_PRIVATE dt_result dt__netem_parse(const char *text, int role, int index, int peer_role, int peer_index,
                                         dt__netem_spec *out) {
  dt__netem_spec def, mine, theirs;
  memset(&def, 0, sizeof def);
  memset(&mine, 0, sizeof mine);
  memset(&theirs, 0, sizeof theirs);
  memset(out, 0, sizeof *out);
  if (!text) return DTRAIN_OK;
  const char *p = text;
  while (*p) {
    const char *end = strchr(p, ';');
    if (!end) end = p + strlen(p);
    int r, i;
    dt_result rc = dt__ne_prefix(&p, end, &r, &i);
    if (rc != DTRAIN_OK) return rc;
    dt__netem_spec s;
    memset(&s, 0, sizeof s);
    rc = dt__ne_clause(p, end, &s);
    if (rc != DTRAIN_OK) return rc;
    if (r < 0) dt__ne_override(&def, &s);
    if (r >= 0 && r == role && i == index) dt__ne_override(&mine, &s);
    if (r >= 0 && r == peer_role && i == peer_index) dt__ne_override(&theirs, &s);
    p = *end ? end + 1 : end;
  }
  /* Each end: the defaults with its own clause over them; the link: the slower end. */
  dt__netem_spec a = def, b = def;
  dt__ne_override(&a, &mine);
  dt__ne_override(&b, &theirs);
  *out = dt__ne_worse(a, b);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE dt_result dt__netem_check_env(void) {
  dt__netem_spec s;
  return dt__netem_parse(getenv("DTRAIN_NETEM"), -1, -1, -1, -1, &s);
}

/* ---- lines --------------------------------------------------------------------------------- */

typedef struct dt__line_seg {
  size_t n;
  double due;  /* when its bytes reach the other end (and are written here) */
  double sent; /* when its last byte left (serialised) */
} dt__line_seg;

typedef struct dt__line {
  int fd;
  dt__netem_spec sp;
  dt__mutex mu;
  dt__cond cv;   /* the wire waits here for segments; detach for the drain */
  dt__thread th;
  DT__ATOMIC(int) stop;
  unsigned char *buf; /* ring of the bytes not yet written */
  size_t cap, head, len;
  dt__line_seg *seg;  /* ring of their segments */
  size_t shead, slen;
  size_t seg_bytes;
  double free_at, last_due, cut_at, rtt;
  int err; /* errno of a failed write: every later send fails with it */
  uint64_t rng;
  dt__netem_stats st;
} dt__line;

static dt__line *dt__ne_tab[DT__NE_MAX_LINES];
static DT__ATOMIC(int) dt__ne_count;  /* lines in the table: 0 = no emulation anywhere */
static DT__ATOMIC(int) dt__ne_lock;
static DT__ATOMIC(long) dt__ne_created; /* lines ever made (tests: none while unset) */
static double dt__ne_t0 = -1.0;         /* this process's first emulated link (cut times count from it) */

static void dt__ne_tab_lock(void) {
  int z = 0;
  while (!DT__ACAS(&dt__ne_lock, &z, 1, DT__MO_ACQUIRE)) {
    z = 0;
    dt__cpu_relax();
  }
}
static void dt__ne_tab_unlock(void) { DT__ASTORE(&dt__ne_lock, 0, DT__MO_RELEASE); }

static dt__line *dt__ne_find(int fd) {
  if (fd < 0 || DT__ALOAD(&dt__ne_count, DT__MO_RELAXED) == 0) return NULL;
  dt__line *L = NULL;
  dt__ne_tab_lock();
  for (int i = 0; i < DT__NE_MAX_LINES && !L; i++)
    if (dt__ne_tab[i] && dt__ne_tab[i]->fd == fd) L = dt__ne_tab[i];
  dt__ne_tab_unlock();
  return L;
}

static int dt__ne_cut(const dt__line *L, double now) { return L->cut_at >= 0 && now >= L->cut_at; }

static double dt__ne_uniform(dt__line *L) { return (double)(dt__splitmix64(&L->rng) >> 11) * (1.0 / 9007199254740992.0); }

/* The wire: writes each segment at its arrival time. */
static void dt__ne_wire(void *arg) {
  dt__line *L = (dt__line *)arg;
  dt__mutex_lock(&L->mu);
  for (;;) {
    while (!DT__ALOAD(&L->stop, DT__MO_ACQUIRE) && L->slen == 0) dt__cond_wait(&L->cv, &L->mu);
    if (DT__ALOAD(&L->stop, DT__MO_ACQUIRE)) break;
    dt__line_seg s = L->seg[L->shead];
    size_t off = L->head;
    dt__mutex_unlock(&L->mu);
    for (;;) { /* sleep until it is due, 10 ms at a time so that a stop is seen */
      double w = s.due - dt__now();
      if (w <= 0 || DT__ALOAD(&L->stop, DT__MO_ACQUIRE)) break;
      dt__sleep(w < 0.01 ? w : 0.01);
    }
    double at = dt__now();
    int cut = dt__ne_cut(L, at), e = 0;
    size_t done = 0;
    while (!cut && done < s.n && !DT__ALOAD(&L->stop, DT__MO_ACQUIRE)) {
      size_t a = (off + done) % L->cap;
      size_t run = DT__MIN(s.n - done, L->cap - a);
      ssize_t k = dt__sk_send(L->fd, L->buf + a, run, DT__NET_SEND_FLAGS);
      if (k > 0) {
        done += (size_t)k;
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        struct pollfd p;
        p.fd = L->fd;
        p.events = POLLOUT;
        p.revents = 0;
        (void)dt__sk_poll(&p, 1, 20); /* the peer reads slowly: wait, checking for a stop */
      } else {
        e = k < 0 ? errno : EPIPE;
        break;
      }
    }
    dt__mutex_lock(&L->mu);
    if (done == s.n || cut) {
      L->head = (L->head + s.n) % L->cap;
      L->len -= s.n;
      L->shead = (L->shead + 1) % DT__NE_SEGS;
      L->slen--;
      if (cut) L->st.bytes_dropped += s.n;
      else {
        L->st.bytes_out += s.n;
        if (at < s.due) L->st.early++;
        double lat = at - s.sent;
        if (L->st.segments_out == 0 || lat < L->st.min_latency) L->st.min_latency = lat;
        L->st.segments_out++;
      }
    }
    if (e) { /* the socket failed: what is queued cannot go, and every later send says why */
      L->err = e;
      L->st.bytes_dropped += L->len;
      L->len = 0;
      L->slen = 0;
    }
    dt__cond_broadcast(&L->cv);
  }
  dt__mutex_unlock(&L->mu);
}

/* A send into the line: what fits (at least one byte, or -1 with EAGAIN). */
static ssize_t dt__ne_put(dt__line *L, const struct iovec *iov, size_t cnt) {
  size_t total = 0;
  for (size_t i = 0; i < cnt; i++) total += iov[i].iov_len;
  dt__mutex_lock(&L->mu);
  double now = dt__now();
  if (L->err) {
    int e = L->err;
    dt__mutex_unlock(&L->mu);
    errno = e;
    return -1;
  }
  if (dt__ne_cut(L, now)) { /* into the void, as on a severed link */
    L->st.bytes_dropped += total;
    dt__mutex_unlock(&L->mu);
    return (ssize_t)total;
  }
  size_t room = L->cap - L->len;
  if (total == 0 || room == 0 || L->slen == DT__NE_SEGS) {
    dt__mutex_unlock(&L->mu);
    if (total == 0) return 0;
    errno = EAGAIN;
    return -1;
  }
  /* Schedule first: the segments decide how many bytes are taken. */
  size_t take = 0, want = DT__MIN(total, room);
  int was_empty = L->slen == 0;
  while (take < want && L->slen < DT__NE_SEGS) {
    size_t n = DT__MIN(want - take, L->seg_bytes);
    double d = DT__MAX(now, L->free_at);
    if (L->st.segments_in == 0) L->st.first_depart = d;
    /* On the wire each TCP segment carries 66 bytes of Ethernet, IP and TCP
     * headers (with timestamps), as the kernel's shapers count them. */
    double wire = (double)n + (double)((n + DT__NE_MSS - 1) / DT__NE_MSS) * DT__NE_HDR;
    L->st.wire_bytes += (uint64_t)wire;
    double t = d + (L->sp.rate > 0 ? wire / L->sp.rate : 0.0);
    if (L->sp.loss > 0)
      for (size_t m = 0; m < n; m += DT__NE_MSS)
        if (dt__ne_uniform(L) < L->sp.loss) {
          t += L->rtt;
          L->st.lost++;
        }
    L->st.busy_s += t - d;
    L->free_at = t;
    double due = t + L->sp.delay + (L->sp.jitter > 0 ? (2.0 * dt__ne_uniform(L) - 1.0) * L->sp.jitter : 0.0);
    if (due < t) due = t;
    if (due < L->last_due) due = L->last_due; /* in order, as TCP delivers */
    L->last_due = due;
    dt__line_seg *s = &L->seg[(L->shead + L->slen) % DT__NE_SEGS];
    s->n = n;
    s->due = due;
    s->sent = t;
    L->slen++;
    L->st.segments_in++;
    take += n;
  }
  L->st.last_free = L->free_at;
  L->st.bytes_in += take;
  /* Then copy them into the ring. */
  size_t tail = (L->head + L->len) % L->cap, copied = 0;
  for (size_t i = 0; i < cnt && copied < take; i++) {
    const unsigned char *b = (const unsigned char *)iov[i].iov_base;
    size_t n = DT__MIN(iov[i].iov_len, take - copied), o = 0;
    while (o < n) {
      size_t run = DT__MIN(n - o, L->cap - tail);
      memcpy(L->buf + tail, b + o, run);
      tail = (tail + run) % L->cap;
      o += run;
    }
    copied += n;
  }
  L->len += take;
  if (was_empty) dt__cond_broadcast(&L->cv);
  dt__mutex_unlock(&L->mu);
  return (ssize_t)take;
}

static void dt__ne_free(dt__line *L) {
  if (!L) return;
  dt__free(L->buf, L->cap);
  dt__free(L->seg, sizeof(dt__line_seg) * DT__NE_SEGS);
  dt__cond_destroy(&L->cv);
  dt__mutex_destroy(&L->mu);
  dt__free(L, sizeof *L);
}

DTRAIN_PRIVATE dt_result dt__netem_attach(int fd, uint32_t self_id, int peer_role, int peer_index) {
  const char *env = getenv("DTRAIN_NETEM");
  if (!env || !env[0] || fd < 0) return DTRAIN_OK;
  int role = self_id >= DT__NET_SERVER_ID0 ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER;
  int index = (int)(self_id >= DT__NET_SERVER_ID0 ? self_id - DT__NET_SERVER_ID0 : self_id);
  dt__netem_spec sp;
  dt_result rc = dt__netem_parse(env, role, index, peer_role, peer_index, &sp);
  if (rc != DTRAIN_OK || !sp.set) return rc;
  dt__line *L = (dt__line *)dt__calloc(sizeof *L);
  if (!L) return dt__error(DTRAIN_ERR_NOMEM, "DTRAIN_NETEM: no memory for a link");
  L->fd = fd;
  L->sp = sp;
  /* A send buffer of 1 MiB plus two delay-bandwidth products (at most 64 MiB). */
  double bdp = sp.rate > 0 ? sp.rate * (sp.delay + sp.jitter) : 4.0 * 1048576.0;
  L->cap = (size_t)DT__MIN(64.0 * 1048576.0, 1048576.0 + 2.0 * bdp);
  /* Segments of about a millisecond of the link, 1448 bytes to 64 KiB. */
  double sb = sp.rate > 0 ? sp.rate * 1e-3 : 65536.0;
  L->seg_bytes = (size_t)DT__MAX((double)DT__NE_MSS, DT__MIN(65536.0, sb));
  L->rtt = DT__MAX(2.0 * sp.delay, 1e-3);
  L->rng = 0x9E3779B97F4A7C15ull ^ ((uint64_t)self_id << 32) ^ (uint64_t)(int64_t)(peer_index + 7) * (uint64_t)0x100000001B3ull ^
           (uint64_t)(unsigned)peer_role;
  L->buf = (unsigned char *)dt__calloc(L->cap);
  L->seg = (dt__line_seg *)dt__calloc(sizeof(dt__line_seg) * DT__NE_SEGS);
  if (!L->buf || !L->seg) {
    dt__free(L->buf, L->cap);
    dt__free(L->seg, sizeof(dt__line_seg) * DT__NE_SEGS);
    dt__free(L, sizeof *L);
    return dt__error(DTRAIN_ERR_NOMEM, "DTRAIN_NETEM: no memory for a link's buffer");
  }
  int have_mu = dt__mutex_init(&L->mu) == DTRAIN_OK;
  if (!have_mu || dt__cond_init(&L->cv) != DTRAIN_OK) {
    if (have_mu) dt__mutex_destroy(&L->mu);
    dt__free(L->buf, L->cap);
    dt__free(L->seg, sizeof(dt__line_seg) * DT__NE_SEGS);
    dt__free(L, sizeof *L);
    return dt__error(DTRAIN_ERR_THREAD, "DTRAIN_NETEM: could not make a link's lock");
  }
  int slot = -1;
  dt__ne_tab_lock();
  if (dt__ne_t0 < 0) dt__ne_t0 = dt__now();
  L->cut_at = (sp.set & DT__NE_CUT) ? dt__ne_t0 + sp.cut : -1.0;
  for (int i = 0; i < DT__NE_MAX_LINES && slot < 0; i++)
    if (!dt__ne_tab[i]) slot = i;
  if (slot >= 0) dt__ne_tab[slot] = L;
  dt__ne_tab_unlock();
  if (slot < 0) {
    dt__ne_free(L);
    return dt__error(DTRAIN_ERR_NOMEM, "DTRAIN_NETEM: more than %d emulated links in one process",
                     DT__NE_MAX_LINES);
  }
  if (dt__thread_start(&L->th, dt__ne_wire, L) != DTRAIN_OK) {
    dt__ne_tab_lock();
    dt__ne_tab[slot] = NULL;
    dt__ne_tab_unlock();
    dt__ne_free(L);
    return dt__error(DTRAIN_ERR_THREAD, "DTRAIN_NETEM: could not start a link's thread");
  }
  DT__AFETCH_ADD(&dt__ne_created, 1, DT__MO_RELAXED);
  DT__AFETCH_ADD(&dt__ne_count, 1, DT__MO_SEQ_CST);
  return DTRAIN_OK;
}

DTRAIN_PRIVATE void dt__netem_detach(int fd) {
  dt__line *L = NULL;
  if (fd < 0 || DT__ALOAD(&dt__ne_count, DT__MO_RELAXED) == 0) return;
  dt__ne_tab_lock();
  for (int i = 0; i < DT__NE_MAX_LINES && !L; i++)
    if (dt__ne_tab[i] && dt__ne_tab[i]->fd == fd) {
      L = dt__ne_tab[i];
      dt__ne_tab[i] = NULL;
    }
  dt__ne_tab_unlock();
  if (!L) return;
  DT__AFETCH_SUB(&dt__ne_count, 1, DT__MO_SEQ_CST);
  /* Let what is queued (a goodbye) arrive: until it is due and half a second
   * more, at most 2 s; a cut or failed link has nothing to let go. */
  dt__mutex_lock(&L->mu);
  double limit = DT__MIN(L->last_due + 0.5, dt__now() + 2.0);
  while (L->slen > 0 && !L->err && !dt__ne_cut(L, dt__now()) && dt__now() < limit) {
    dt__mutex_unlock(&L->mu);
    dt__sleep(0.001);
    dt__mutex_lock(&L->mu);
  }
  DT__ASTORE(&L->stop, 1, DT__MO_RELEASE);
  dt__cond_broadcast(&L->cv);
  dt__mutex_unlock(&L->mu);
  dt__thread_join(&L->th);
  dt__ne_free(L);
}

DTRAIN_PRIVATE int dt__netem_stats_of(int fd, dt__netem_stats *st) {
  dt__line *L = dt__ne_find(fd);
  if (!L) return 0;
  dt__mutex_lock(&L->mu);
  *st = L->st;
  st->rate = L->sp.rate;
  st->delay = L->sp.delay;
  st->queued = L->len;
  dt__mutex_unlock(&L->mu);
  return 1;
}

DTRAIN_PRIVATE long dt__netem_lines_made(void) { return DT__ALOAD(&dt__ne_created, DT__MO_RELAXED); }
DTRAIN_PRIVATE int dt__netem_lines_live(void) { return DT__ALOAD(&dt__ne_count, DT__MO_RELAXED); }
DTRAIN_PRIVATE void dt__netem_clock_restart(void) { dt__ne_t0 = -1.0; }

/* ---- the socket calls --------------------------------------------------------------------- */

DTRAIN_PRIVATE ssize_t dt__sock_sendmsg(int fd, const struct msghdr *mh, int flags) {
  dt__line *L = dt__ne_find(fd);
  if (!L) return dt__sk_sendmsg(fd, mh, flags);
  return dt__ne_put(L, mh->msg_iov, (size_t)mh->msg_iovlen);
}

DTRAIN_PRIVATE ssize_t dt__sock_send(int fd, const void *p, size_t n, int flags) {
  dt__line *L = dt__ne_find(fd);
  if (!L) return dt__sk_send(fd, p, n, flags);
  struct iovec v;
  v.iov_base = (void *)(uintptr_t)p;
  v.iov_len = n;
  return dt__ne_put(L, &v, 1);
}

DTRAIN_PRIVATE ssize_t dt__sock_recv(int fd, void *p, size_t n, int flags) {
  dt__line *L = dt__ne_find(fd);
  if (L && dt__ne_cut(L, dt__now())) { /* nothing arrives on a severed link */
    errno = EAGAIN;
    return -1;
  }
  return dt__sk_recv(fd, p, n, flags);
}

DTRAIN_PRIVATE int dt__sock_poll(struct pollfd *p, nfds_t n, int ms) {
  if (DT__ALOAD(&dt__ne_count, DT__MO_RELAXED) == 0 || n > DT__NE_POLL_MAX) return dt__sk_poll(p, n, ms);
  /* Emulated links: a full line is not writable (wake when its head is
   * due), a line with room is (without asking the kernel), and a cut one
   * shows no input and accepts (drops) everything. */
  int keep_fd[DT__NE_POLL_MAX];
  short keep_ev[DT__NE_POLL_MAX];
  unsigned char out[DT__NE_POLL_MAX];
  double now = dt__now(), wake = -1.0;
  int any = 0, ready = 0;
  for (nfds_t i = 0; i < n; i++) {
    dt__line *L = dt__ne_find(p[i].fd);
    keep_fd[i] = p[i].fd;
    keep_ev[i] = p[i].events;
    out[i] = 0;
    if (!L) continue;
    any = 1;
    dt__mutex_lock(&L->mu);
    int cut = dt__ne_cut(L, now);
    int room = cut || L->err || (L->len < L->cap && L->slen < DT__NE_SEGS);
    double head_due = L->slen ? L->seg[L->shead].due : now;
    dt__mutex_unlock(&L->mu);
    short ev = p[i].events;
    if (cut) ev = (short)(ev & ~POLLIN);
    if (p[i].events & POLLOUT) {
      ev = (short)(ev & ~POLLOUT);
      if (room) {
        out[i] = 1;
        ready = 1;
      } else {
        double w = DT__MAX(head_due - now, 1e-3);
        if (wake < 0 || w < wake) wake = w;
      }
    }
    p[i].events = ev;
    if (ev == 0 || cut) p[i].fd = -1; /* nothing to ask the kernel (and a cut link reports nothing) */
  }
  if (!any) return dt__sk_poll(p, n, ms);
  int t = ms;
  if (ready) t = 0;
  else if (wake >= 0) {
    int wm = (int)(wake * 1000.0) + 1;
    if (t < 0 || wm < t) t = wm;
  }
  int r = dt__sk_poll(p, n, t);
  int e = errno;
  int count = 0;
  for (nfds_t i = 0; i < n; i++) {
    p[i].fd = keep_fd[i];
    p[i].events = keep_ev[i];
    if (r < 0) continue;
    if (keep_fd[i] >= 0 && out[i]) p[i].revents = (short)(p[i].revents | POLLOUT);
    if (p[i].revents) count++;
  }
  errno = e;
  return r < 0 ? r : count;
}

#endif /* DTRAIN_NO_NET */
