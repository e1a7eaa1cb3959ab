/* ===========================================================================
 * dt_cluster.c -- the cluster description: DTRAIN_CONFIG (JSON in the style
 * of TF_CONFIG), command-line flags, and back to JSON (see dt_net.h)
 * ===========================================================================
 * The text is read by the strict JSON reader that checkpoints use too
 * (dt_json.c, RFC 8259): it checks the whole text, including keys this file
 * ignores, decodes string escapes, checks UTF-8 and limits nesting, so a bad
 * DTRAIN_CONFIG fails loudly with the byte offset and what was expected
 * instead of being half read. The values are then walked once to check and
 * count the addresses, and copied into one allocation.
 *
 * A dt_cluster made here is one block: the struct, the two address arrays and
 * the strings, so destroy needs no bookkeeping beyond the block's size. This
 * file needs no networking: the parser works under DTRAIN_NO_NET too.
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
#include "dt_json.h"

#if !defined(DTRAIN_NO_DIST) /* the whole file; the stubs at the end stand in without it */

#define DT__CLUSTER_MAX_DEPTH 32  /* nesting of arrays/objects in DTRAIN_CONFIG */
#define DT__CLUSTER_ADDR_MAX 255  /* longest "host:port" */
#define DT__CLUSTER_DEFAULT_PORT 29500

typedef struct dt__cluster_block {
  dt_cluster pub; /* first: a dt_cluster* is a dt__cluster_block* */
  size_t bytes;   /* the whole block, for dt__free */
} dt__cluster_block;

/* ---- the one-block cluster -------------------------------------------------------------- */

/* A cluster with nw + ns address slots and str_bytes of string space (*strs). */
static dt_cluster *dt__cluster_new(int nw, int ns, size_t str_bytes, char **strs) {
  size_t bytes = sizeof(dt__cluster_block) + (size_t)(nw + ns) * sizeof(char *) + str_bytes;
  dt__cluster_block *b = (dt__cluster_block *)dt__calloc(bytes);
  if (!b) {
    dt__error(DTRAIN_ERR_NOMEM, "dt_cluster: out of memory (%zu bytes)", bytes);
    return NULL;
  }
  b->bytes = bytes;
  char **slots = (char **)(void *)(b + 1);
  b->pub.workers = nw;
  b->pub.servers = ns;
  b->pub.worker_addr = slots;
  b->pub.server_addr = ns > 0 ? slots + nw : NULL;
  *strs = (char *)(slots + nw + ns);
  return &b->pub;
}

/* Copy n bytes of s as a string at *strs into slot *slot; advances *strs. */
static void dt__cluster_put(char **slot, char **strs, const char *s, size_t n) {
  memcpy(*strs, s, n);
  (*strs)[n] = '\0';
  *slot = *strs;
  *strs += n + 1;
}

DTRAIN_API void dt_cluster_destroy(dt_cluster *c) {
  if (!c) return;
  dt__cluster_block *b = (dt__cluster_block *)(void *)c;
  dt__free(b, b->bytes);
}

/* ---- addresses --------------------------------------------------------------------------- */

static int dt__cluster_alnum(int ch) {
  return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}
static int dt__cluster_hex(int ch) {
  return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

/* "host:port" (host name or IPv4) or "[v6]:port" (optionally "[v6%zone]:port"),
 * port 0..65535. 1 when valid; otherwise 0 and the reason in why. */
static int dt__cluster_addr_ok(const char *a, size_t n, char *why, size_t cap) {
  const char *port;
  if (n == 0) {
    snprintf(why, cap, "is empty");
    return 0;
  }
  if (n > DT__CLUSTER_ADDR_MAX) {
    snprintf(why, cap, "is longer than %d bytes", DT__CLUSTER_ADDR_MAX);
    return 0;
  }
  if (memchr(a, '\0', n)) {
    snprintf(why, cap, "contains a NUL character");
    return 0;
  }
  if (a[0] == '[') {
    const char *end = (const char *)memchr(a, ']', n);
    if (!end || end + 1 >= a + n || end[1] != ':') {
      snprintf(why, cap, "expected [v6]:port");
      return 0;
    }
    int colons = 0, zone = 0;
    for (const char *q = a + 1; q < end; q++) {
      int ch = (unsigned char)*q;
      if (zone) {
        if (!dt__cluster_alnum(ch) && ch != '_' && ch != '.' && ch != '-') zone = -1;
      } else if (ch == '%' && q > a + 1 && q + 1 < end) {
        zone = 1;
      } else if (ch == ':') {
        colons++;
      } else if (!dt__cluster_hex(ch) && ch != '.') {
        zone = -1;
      }
      if (zone < 0) break;
    }
    if (zone < 0 || colons < 2) {
      snprintf(why, cap, "has a bad IPv6 address between [ and ]");
      return 0;
    }
    port = end + 2;
  } else {
    const char *colon = NULL;
    for (const char *q = a; q < a + n; q++)
      if (*q == ':') {
        if (colon) {
          snprintf(why, cap, "has more than one ':' (write an IPv6 address as [v6]:port)");
          return 0;
        }
        colon = q;
      }
    if (!colon) {
      snprintf(why, cap, "expected host:port");
      return 0;
    }
    if (colon == a) {
      snprintf(why, cap, "has no host before ':'");
      return 0;
    }
    for (const char *q = a; q < colon; q++) {
      int ch = (unsigned char)*q;
      if (!dt__cluster_alnum(ch) && ch != '.' && ch != '-' && ch != '_') {
        snprintf(why, cap, "has a character not allowed in a host name (byte 0x%02x)", (unsigned)ch);
        return 0;
      }
    }
    port = colon + 1;
  }
  size_t pl = (size_t)(a + n - port);
  long v = 0;
  if (pl == 0 || pl > 5) {
    snprintf(why, cap, pl == 0 ? "has no port after ':'" : "has a port out of range (0..65535)");
    return 0;
  }
  for (size_t i = 0; i < pl; i++) {
    if (port[i] < '0' || port[i] > '9') {
      snprintf(why, cap, "has a port that is not a number");
      return 0;
    }
    v = v * 10 + (port[i] - '0');
  }
  if (v > 65535) {
    snprintf(why, cap, "has a port out of range (0..65535)");
    return 0;
  }
  return 1;
}

/* Addresses equal ignoring ASCII case (host names and hex digits). */
static int dt__cluster_same(const char *a, const char *b) {
  for (;; a++, b++) {
    int x = (unsigned char)*a, y = (unsigned char)*b;
    if (x >= 'A' && x <= 'Z') x += 'a' - 'A';
    if (y >= 'A' && y <= 'Z') y += 'a' - 'A';
    if (x != y) return 0;
    if (!x) return 1;
  }
}

static const char *dt__cluster_role_name(dt_role r) { return r == DTRAIN_ROLE_PS ? "ps" : "worker"; }

/* Everything a dt_cluster promises: counts, addresses, no duplicates, this
 * process inside it. src names the origin in messages. */
static dt_result dt__cluster_check(const dt_cluster *c, const char *src) {
  char why[96];
  if (c->workers < 1 || c->workers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d workers (need 1..%d)", src, c->workers, DTRAIN_MAX_PEERS);
  if (c->servers < 0 || c->servers > DTRAIN_MAX_PEERS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %d parameter servers (need 0..%d)", src, c->servers, DTRAIN_MAX_PEERS);
  if (!c->worker_addr || (c->servers > 0 && !c->server_addr))
    return dt__error(DTRAIN_ERR_NULL_ARG, "%s: address array is NULL", src);
  int total = c->workers + c->servers;
  for (int k = 0; k < total; k++) {
    dt_role r = k < c->workers ? DTRAIN_ROLE_WORKER : DTRAIN_ROLE_PS;
    int i = k < c->workers ? k : k - c->workers;
    const char *a = r == DTRAIN_ROLE_WORKER ? c->worker_addr[i] : c->server_addr[i];
    if (!a) return dt__error(DTRAIN_ERR_NULL_ARG, "%s: %s %d has no address", src, dt__cluster_role_name(r), i);
    if (!dt__cluster_addr_ok(a, strlen(a), why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s %d address '%.*s' %s", src, dt__cluster_role_name(r), i,
                       DT__CLUSTER_ADDR_MAX, a, why);
    for (int m = 0; m < k; m++) {
      dt_role r2 = m < c->workers ? DTRAIN_ROLE_WORKER : DTRAIN_ROLE_PS;
      int j = m < c->workers ? m : m - c->workers;
      const char *b = r2 == DTRAIN_ROLE_WORKER ? c->worker_addr[j] : c->server_addr[j];
      if (dt__cluster_same(a, b))
        return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: %s %d and %s %d have the same address '%.*s'", src,
                         dt__cluster_role_name(r2), j, dt__cluster_role_name(r), i, DT__CLUSTER_ADDR_MAX, a);
    }
  }
  if (c->role != DTRAIN_ROLE_WORKER && c->role != DTRAIN_ROLE_PS)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: role %d is neither worker nor ps", src, (int)c->role);
  {
    int P = c->pipeline > 0 ? c->pipeline : 1, T = c->tensor > 0 ? c->tensor : 1;
    if (c->pipeline < 0 || c->tensor < 0 || P > c->workers || c->workers % P != 0 || (c->workers / P) % T != 0)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: layout of %d pipeline stages x %d tensor-parallel ranks does not "
                       "divide the %d workers", src, c->pipeline, c->tensor, c->workers);
  }
  int limit = c->role == DTRAIN_ROLE_PS ? c->servers : c->workers;
  if (c->index < 0 || c->index >= limit)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: task %s %d is out of range (the cluster has %d %s%s)", src,
                     dt__cluster_role_name(c->role), c->index, limit,
                     c->role == DTRAIN_ROLE_PS ? "parameter server" : "worker", limit == 1 ? "" : "s");
  return DTRAIN_OK;
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* What the walk over the parsed text found (node ids into the reader's values). */
typedef struct dt__cluster_doc {
  const dt__json *j;
  const char *src;      /* origin for messages */
  int32_t list[2];      /* the "worker" and "ps" arrays (-1: absent) */
  int count[2];         /* addresses per role */
  size_t str_bytes;     /* string bytes the addresses need */
  int have_cluster, have_task, have_type, have_index, have_layout;
  dt_role role;
  int index;
  int pipeline, tensor; /* the "layout" object's (1 when absent) */
} dt__cluster_doc;

/* What this file expects as the value of member `key` (a key's id) of
 * object `in`, or as an element of array `in` (key -1); NULL: any value.
 * The walk's type checks and a value the reader found missing or malformed
 * there both say it ("expected an address string ..."). A container's own
 * key is the value just before it (dt_json.h). */
static const char *dt__cluster_want(const dt__json *j, int32_t in, int32_t key) {
  int32_t up = j->v[in].parent;
  if (in == 0) {
    if (dt__json_eq(j, key, "cluster")) return "'{' (the \"cluster\" object)";
    if (dt__json_eq(j, key, "task")) return "'{' (the \"task\" object)";
    if (dt__json_eq(j, key, "layout")) return "'{' (the \"layout\" object)";
  } else if (up == 0 && j->v[in].type == DT__JSON_OBJ && dt__json_eq(j, in - 1, "layout")) {
    if (dt__json_eq(j, key, "pipeline")) return "a number (pipeline stages)";
    if (dt__json_eq(j, key, "tensor")) return "a number (tensor-parallel ranks)";
  } else if (up == 0 && j->v[in].type == DT__JSON_OBJ && dt__json_eq(j, in - 1, "cluster")) {
    if (dt__json_eq(j, key, "worker") || dt__json_eq(j, key, "ps")) return "'['";
  } else if (up == 0 && j->v[in].type == DT__JSON_OBJ && dt__json_eq(j, in - 1, "task")) {
    if (dt__json_eq(j, key, "type")) return "a string (task type \"worker\" or \"ps\")";
    if (dt__json_eq(j, key, "index")) return "a number (task index)";
  } else if (up > 0 && j->v[in].type == DT__JSON_ARR && j->v[up].parent == 0 && dt__json_eq(j, up - 1, "cluster") &&
             (dt__json_eq(j, in - 1, "worker") || dt__json_eq(j, in - 1, "ps"))) {
    return "an address string \"host:port\"";
  }
  return NULL;
}

/* "<src>: byte N: expected <what>, found <what is there>", the reader's style. */
static dt_result dt__cluster_expected_at(const dt__json *j, const char *src, size_t pos, const char *what) {
  char f[16];
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: expected %s, found %s", src, pos, what,
                   dt__json_found(j->s, j->n, pos, f, sizeof f));
}

/* Value val (member key of object in, or an element of array in when key is -1) is not what dt__cluster_want says. */
static dt_result dt__cluster_expected(const dt__cluster_doc *d, int32_t in, int32_t key, int32_t val) {
  return dt__cluster_expected_at(d->j, d->src, d->j->v[val].pos, dt__cluster_want(d->j, in, key));
}

static dt_result dt__cluster_dup_key(const dt__cluster_doc *d, int32_t key) {
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: duplicate key \"%s\"", d->src, d->j->v[key].pos,
                   dt__json_str(d->j, key));
}

/* "worker": [...] or "ps": [...]: every address checked and counted. */
static dt_result dt__cluster_list(dt__cluster_doc *d, int32_t arr, dt_role role) {
  const dt__json *j = d->j;
  int r = (int)role;
  if (j->v[arr].type != DT__JSON_ARR) return dt__cluster_expected(d, j->v[arr].parent, arr - 1, arr);
  d->list[r] = arr;
  for (int32_t e = j->v[arr].child; e >= 0; e = j->v[e].next) {
    char why[96];
    if (j->v[e].type != DT__JSON_STR) return dt__cluster_expected(d, arr, -1, e);
    const char *a = dt__json_str(j, e);
    size_t len = j->v[e].len;
    if (d->count[r] >= DTRAIN_MAX_PEERS)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: more than %d %s addresses", d->src, j->v[e].pos,
                       DTRAIN_MAX_PEERS, dt__cluster_role_name(role));
    if (!dt__cluster_addr_ok(a, len, why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: %s %d address '%.*s' %s", d->src, j->v[e].pos,
                       dt__cluster_role_name(role), d->count[r], 64, a, why);
    d->str_bytes += len + 1;
    d->count[r]++;
  }
  return DTRAIN_OK;
}

/* The members of object obj, key and value, in order. */
#define DT__CLUSTER_MEMBERS(j, obj, k, val) \
  for (int32_t k = (j)->v[obj].child, val = k >= 0 ? (j)->v[k].next : -1; k >= 0; \
       k = (j)->v[val].next, val = k >= 0 ? (j)->v[k].next : -1)

static dt_result dt__cluster_cluster_obj(dt__cluster_doc *d, int32_t obj) {
  dt_result rc = DTRAIN_OK;
  int have[2] = {0, 0};
  DT__CLUSTER_MEMBERS(d->j, obj, k, val) {
    int which = dt__json_eq(d->j, k, "worker") ? 0 : dt__json_eq(d->j, k, "ps") ? 1 : -1;
    if (which < 0) continue; /* other jobs ("chief", ...) are not ours */
    if (have[which]) return dt__cluster_dup_key(d, k);
    have[which] = 1;
    if ((rc = dt__cluster_list(d, val, which ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER)) != DTRAIN_OK) return rc;
  }
  return rc;
}

static dt_result dt__cluster_task_obj(dt__cluster_doc *d, int32_t obj) {
  const dt__json *j = d->j;
  DT__CLUSTER_MEMBERS(j, obj, k, val) {
    if (dt__json_eq(j, k, "type")) {
      if (d->have_type) return dt__cluster_dup_key(d, k);
      d->have_type = 1;
      if (j->v[val].type != DT__JSON_STR) return dt__cluster_expected(d, obj, k, val);
      if (dt__json_eq(j, val, "worker")) {
        d->role = DTRAIN_ROLE_WORKER;
      } else if (dt__json_eq(j, val, "ps")) {
        d->role = DTRAIN_ROLE_PS;
      } else {
        return dt__error(DTRAIN_ERR_INVALID_ARG,
                         "%s: byte %zu: task type \"%.*s\" is not supported (expected \"worker\" or \"ps\")", d->src,
                         j->v[val].pos, 15, dt__json_str(j, val));
      }
    } else if (dt__json_eq(j, k, "index")) {
      if (d->have_index) return dt__cluster_dup_key(d, k);
      d->have_index = 1;
      if (j->v[val].type != DT__JSON_NUM) return dt__cluster_expected(d, obj, k, val);
      /* An integer in 0..INT_MAX; "-0" is 0 (the JSON grammar allows it). */
      uint64_t v = 0;
      const dt__json_val *x = &j->v[val];
      int minus_zero = x->len == 2 && memcmp(j->s + x->off, "-0", 2) == 0;
      if (!minus_zero && (!dt__json_uint(j, val, &v) || v > (uint64_t)INT_MAX))
        return dt__cluster_expected_at(j, d->src, x->pos, "a non-negative integer (task index)");
      d->index = (int)v;
    }
  }
  return DTRAIN_OK;
}

/* "layout": {"pipeline": P, "tensor": T}: integers in 1..DTRAIN_MAX_PEERS. */
static dt_result dt__cluster_layout_obj(dt__cluster_doc *d, int32_t obj) {
  const dt__json *j = d->j;
  int have[2] = {0, 0};
  DT__CLUSTER_MEMBERS(j, obj, k, val) {
    int which = dt__json_eq(j, k, "pipeline") ? 0 : dt__json_eq(j, k, "tensor") ? 1 : -1;
    if (which < 0) continue;
    if (have[which]) return dt__cluster_dup_key(d, k);
    have[which] = 1;
    uint64_t v = 0;
    if (j->v[val].type != DT__JSON_NUM) return dt__cluster_expected(d, obj, k, val);
    if (!dt__json_uint(j, val, &v) || v < 1 || v > (uint64_t)DTRAIN_MAX_PEERS)
      return dt__cluster_expected_at(j, d->src, j->v[val].pos,
                                     which ? "an integer >= 1 (tensor-parallel ranks)" : "an integer >= 1 (pipeline stages)");
    if (which) d->tensor = (int)v;
    else d->pipeline = (int)v;
  }
  return DTRAIN_OK;
}

static dt_result dt__cluster_top(dt__cluster_doc *d) {
  const dt__json *j = d->j;
  dt_result rc = DTRAIN_OK;
  DT__CLUSTER_MEMBERS(j, 0, k, val) {
    if (dt__json_eq(j, k, "cluster")) {
      if (d->have_cluster) return dt__cluster_dup_key(d, k);
      d->have_cluster = 1;
      if (j->v[val].type != DT__JSON_OBJ) return dt__cluster_expected(d, 0, k, val);
      rc = dt__cluster_cluster_obj(d, val);
    } else if (dt__json_eq(j, k, "task")) {
      if (d->have_task) return dt__cluster_dup_key(d, k);
      d->have_task = 1;
      if (j->v[val].type != DT__JSON_OBJ) return dt__cluster_expected(d, 0, k, val);
      rc = dt__cluster_task_obj(d, val);
    } else if (dt__json_eq(j, k, "layout")) {
      if (d->have_layout) return dt__cluster_dup_key(d, k);
      d->have_layout = 1;
      if (j->v[val].type != DT__JSON_OBJ) return dt__cluster_expected(d, 0, k, val);
      rc = dt__cluster_layout_obj(d, val);
    }
    if (rc != DTRAIN_OK) return rc;
  }
  if (!d->have_cluster) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"cluster\"", d->src);
  if (!d->have_task) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"task\"", d->src);
  if (!d->have_type) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"type\" in \"task\"", d->src);
  if (!d->have_index) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"index\" in \"task\"", d->src);
  if (d->count[0] == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: \"cluster\" lists no \"worker\" addresses", d->src);
  return DTRAIN_OK;
}

/* The whole text is checked by the shared reader first (dt_json.c), then
 * the values are walked for the keys this file knows. */
static dt_result dt__cluster_parse(const char *json, const char *src, dt_cluster **out) {
  const unsigned char *s = (const unsigned char *)json;
  size_t n = strlen(json), i = 0;
  char f[16];
  while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
  if (i >= n || s[i] != '{')
    return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: expected '{' (a JSON object), found %s", src, i,
                     dt__json_found(s, n, i, f, sizeof f));
  dt__json j;
  dt_result rc;
  if (!dt__json_parse(&j, json, n, DT__CLUSTER_MAX_DEPTH, 1)) {
    /* No value where this file wants a particular one: say which. */
    const char *want = NULL;
    if (j.err_value && j.err_in >= 0)
      want = dt__cluster_want(&j, j.err_in, j.v[j.err_in].type == DT__JSON_OBJ ? (int32_t)j.nv - 1 : -1);
    if (want)
      rc = dt__cluster_expected_at(&j, src, j.err_pos, want);
    else
      rc = dt__error(j.nomem ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_FORMAT, "%s: %s", src, j.err);
    dt__json_free(&j);
    return rc;
  }
  dt__cluster_doc d;
  memset(&d, 0, sizeof d);
  d.j = &j;
  d.src = src;
  d.list[0] = d.list[1] = -1;
  d.pipeline = d.tensor = 1;
  rc = dt__cluster_top(&d);
  dt_cluster *c = NULL;
  if (rc == DTRAIN_OK) {
    char *strs;
    c = dt__cluster_new(d.count[0], d.count[1], d.str_bytes, &strs);
    if (!c) rc = DTRAIN_ERR_NOMEM;
    for (int r = 0; c && r < 2; r++) {
      char **slots = r ? c->server_addr : c->worker_addr;
      int k = 0;
      for (int32_t e = d.list[r] >= 0 ? j.v[d.list[r]].child : -1; e >= 0; e = j.v[e].next)
        dt__cluster_put(&slots[k++], &strs, dt__json_str(&j, e), j.v[e].len);
    }
  }
  if (c) {
    c->role = d.role;
    c->index = d.index;
    c->pipeline = d.pipeline;
    c->tensor = d.tensor;
    rc = dt__cluster_check(c, src);
  }
  dt__json_free(&j);
  if (rc != DTRAIN_OK) {
    dt_cluster_destroy(c);
    return rc;
  }
  *out = c;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_cluster_parse_json(const char *json, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_parse_json: out is NULL");
  *out = NULL;
  if (!json) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_parse_json: json is NULL");
  return dt__cluster_parse(json, "cluster JSON", out);
}

/* quiet: NOT_FOUND without an error message (for dt_cluster_discover). */
static dt_result dt__cluster_env(dt_cluster **out, int quiet) {
  const char *e = getenv("DTRAIN_CONFIG");
  if (!e || !*e) {
    if (quiet) return DTRAIN_ERR_NOT_FOUND;
    return dt__error(DTRAIN_ERR_NOT_FOUND, "dt_cluster_from_env: DTRAIN_CONFIG is not set");
  }
  return dt__cluster_parse(e, "DTRAIN_CONFIG", out);
}

DTRAIN_API dt_result dt_cluster_from_env(dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_env: out is NULL");
  *out = NULL;
  return dt__cluster_env(out, 0);
}

/* ---- flags ---------------------------------------------------------------------------------- */

enum { DT__CF_RANK, DT__CF_WORLD, DT__CF_PEERS, DT__CF_PS, DT__CF_ROLE, DT__CF_PORT, DT__CF_N };
static const char *const dt__cluster_flags[DT__CF_N] = {"--rank", "--world", "--peers", "--ps", "--role", "--port"};

/* A whole decimal number in 0..max, or -1. */
static long dt__cluster_uint(const char *s, long max) {
  long v = 0;
  if (!*s) return -1;
  for (; *s; s++) {
    if (*s < '0' || *s > '9') return -1;
    v = v * 10 + (*s - '0');
    if (v > max) return -1;
  }
  return v;
}

/* Validate a comma-separated address list; *n items, *bytes string bytes. */
static dt_result dt__cluster_csv(const char *flag, const char *list, int *n, size_t *bytes) {
  char why[96];
  *n = 0;
  *bytes = 0;
  for (const char *s = list;;) {
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    if (!dt__cluster_addr_ok(s, len, why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: address %d '%.*s' %s", flag, *n,
                       (int)(len < 64 ? len : 64), s, why);
    if (++*n > DTRAIN_MAX_PEERS) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: more than %d addresses", flag, DTRAIN_MAX_PEERS);
    *bytes += len + 1;
    if (!e) return DTRAIN_OK;
    s = e + 1;
  }
}

static void dt__cluster_csv_fill(char **slots, char **strs, const char *list) {
  for (int k = 0;; k++) {
    const char *e = strchr(list, ',');
    size_t len = e ? (size_t)(e - list) : strlen(list);
    dt__cluster_put(&slots[k], strs, list, len);
    if (!e) return;
    list = e + 1;
  }
}

static dt_result dt__cluster_args(int *argc, char **argv, dt_cluster **out, int quiet) {
  const char *val[DT__CF_N] = {NULL, NULL, NULL, NULL, NULL, NULL};
  int at[DT__CF_N][2]; /* argv slots used by each flag (-1: none) */
  int any = 0, n = *argc;
  for (int f = 0; f < DT__CF_N; f++) at[f][0] = at[f][1] = -1;
  for (int k = 1; k < n && argv[k]; k++) {
    const char *a = argv[k];
    if (strcmp(a, "--") == 0) break; /* the rest belongs to the program */
    for (int f = 0; f < DT__CF_N; f++) {
      size_t fl = strlen(dt__cluster_flags[f]);
      if (strncmp(a, dt__cluster_flags[f], fl) != 0 || (a[fl] != '\0' && a[fl] != '=')) continue;
      if (val[f]) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: %s given twice", dt__cluster_flags[f]);
      at[f][0] = k;
      if (a[fl] == '=') {
        val[f] = a + fl + 1;
      } else {
        if (k + 1 >= n || !argv[k + 1])
          return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: %s needs a value", dt__cluster_flags[f]);
        val[f] = argv[++k];
        at[f][1] = k;
      }
      if (f != DT__CF_PORT) any = 1;
      break;
    }
  }
  if (!any) {
    if (quiet) return DTRAIN_ERR_NOT_FOUND;
    return dt__error(DTRAIN_ERR_NOT_FOUND, "dt_cluster_from_args: none of --rank --world --peers --ps --role given");
  }

  /* Check the values. */
  long rank = -1, world = -1, port = DT__CLUSTER_DEFAULT_PORT, nps = -1;
  dt_role role = DTRAIN_ROLE_WORKER;
  int nw = 0, ns = 0;
  size_t wbytes = 0, sbytes = 0;
  dt_result rc;
  if (!val[DT__CF_RANK]) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --rank is missing");
  if ((rank = dt__cluster_uint(val[DT__CF_RANK], DTRAIN_MAX_PEERS)) < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --rank '%.32s' is not a number in 0..%d",
                     val[DT__CF_RANK], DTRAIN_MAX_PEERS);
  if (val[DT__CF_WORLD] && (world = dt__cluster_uint(val[DT__CF_WORLD], DTRAIN_MAX_PEERS)) < 1)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --world '%.32s' is not a number in 1..%d",
                     val[DT__CF_WORLD], DTRAIN_MAX_PEERS);
  if (val[DT__CF_ROLE]) {
    if (strcmp(val[DT__CF_ROLE], "worker") == 0)
      role = DTRAIN_ROLE_WORKER;
    else if (strcmp(val[DT__CF_ROLE], "ps") == 0)
      role = DTRAIN_ROLE_PS;
    else
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --role '%.32s' is not worker or ps", val[DT__CF_ROLE]);
  }
  if (val[DT__CF_PORT] && (port = dt__cluster_uint(val[DT__CF_PORT], 65535)) < 0)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --port '%.32s' is not a number in 0..65535",
                     val[DT__CF_PORT]);
  if (val[DT__CF_PEERS]) {
    if (val[DT__CF_PORT])
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --port applies to --world without --peers");
    if ((rc = dt__cluster_csv("--peers", val[DT__CF_PEERS], &nw, &wbytes)) != DTRAIN_OK) return rc;
    if (world >= 0 && world != nw)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --world %ld but --peers lists %d address%s", world, nw,
                       nw == 1 ? "" : "es");
  } else {
    if (world < 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: need --peers or --world");
    nw = (int)world;
    wbytes = (size_t)nw * 16;
  }
  if (val[DT__CF_PS]) {
    const char *s = val[DT__CF_PS];
    if (!strchr(s, ':') && (nps = dt__cluster_uint(s, DTRAIN_MAX_PEERS)) >= 0) {
      /* --ps M: M servers on 127.0.0.1 after the workers' ports */
      if (val[DT__CF_PEERS])
        return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: --ps %ld (a count) needs --world instead of --peers; "
                         "with --peers, list the servers' addresses", nps);
      ns = (int)nps;
      sbytes = (size_t)ns * 16;
    } else if ((rc = dt__cluster_csv("--ps", s, &ns, &sbytes)) != DTRAIN_OK) {
      return rc;
    }
  }
  if (!val[DT__CF_PEERS] && port + nw + ns - 1 > 65535)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "cluster flags: ports %ld..%ld go past 65535", port, port + nw + ns - 1);

  char *strs;
  dt_cluster *c = dt__cluster_new(nw, ns, wbytes + sbytes, &strs);
  if (!c) return DTRAIN_ERR_NOMEM;
  if (val[DT__CF_PEERS]) {
    dt__cluster_csv_fill(c->worker_addr, &strs, val[DT__CF_PEERS]);
  } else {
    for (int k = 0; k < nw; k++) {
      char a[16];
      int len = snprintf(a, sizeof a, "127.0.0.1:%ld", port + k);
      dt__cluster_put(&c->worker_addr[k], &strs, a, (size_t)len);
    }
  }
  if (nps >= 0) {
    for (int k = 0; k < ns; k++) {
      char a[16];
      int len = snprintf(a, sizeof a, "127.0.0.1:%ld", port + nw + k);
      dt__cluster_put(&c->server_addr[k], &strs, a, (size_t)len);
    }
  } else if (ns > 0) {
    dt__cluster_csv_fill(c->server_addr, &strs, val[DT__CF_PS]);
  }
  c->role = role;
  c->index = (int)rank;
  if ((rc = dt__cluster_check(c, "cluster flags")) != DTRAIN_OK) {
    dt_cluster_destroy(c);
    return rc;
  }

  /* Remove the used flags, keeping the order of the rest. */
  int w = 1;
  for (int k = 1; k < n; k++) {
    int used = 0;
    for (int f = 0; f < DT__CF_N; f++) used |= (at[f][0] == k || at[f][1] == k);
    if (!used) argv[w++] = argv[k];
  }
  if (w < n) argv[w] = NULL;
  *argc = w;
  *out = c;
  return DTRAIN_OK;
}

DTRAIN_API dt_result dt_cluster_from_args(int *argc, char **argv, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_args: out is NULL");
  *out = NULL;
  if (!argc || !argv) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_from_args: argc or argv is NULL");
  return dt__cluster_args(argc, argv, out, 0);
}

DTRAIN_API dt_result dt_cluster_discover(int *argc, char **argv, dt_cluster **out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_discover: out is NULL");
  *out = NULL;
  dt_result rc = DTRAIN_ERR_NOT_FOUND;
  if (argc && argv) rc = dt__cluster_args(argc, argv, out, 1);
  if (rc == DTRAIN_ERR_NOT_FOUND) rc = dt__cluster_env(out, 1);
  if (rc != DTRAIN_ERR_NOT_FOUND) return rc;
  static const char one[] = "127.0.0.1:0";
  char *strs;
  dt_cluster *c = dt__cluster_new(1, 0, sizeof one, &strs);
  if (!c) return DTRAIN_ERR_NOMEM;
  dt__cluster_put(&c->worker_addr[0], &strs, one, sizeof one - 1);
  c->role = DTRAIN_ROLE_WORKER;
  c->index = 0;
  *out = c;
  return DTRAIN_OK;
}

/* ---- copies and text ---------------------------------------------------------------------------- */

DTRAIN_API dt_cluster *dt_cluster_clone(const dt_cluster *c) {
  if (!c) {
    dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_clone: cluster is NULL");
    return NULL;
  }
  if (dt__cluster_check(c, "dt_cluster_clone") != DTRAIN_OK) return NULL;
  size_t bytes = 0;
  for (int k = 0; k < c->workers; k++) bytes += strlen(c->worker_addr[k]) + 1;
  for (int k = 0; k < c->servers; k++) bytes += strlen(c->server_addr[k]) + 1;
  char *strs;
  dt_cluster *d = dt__cluster_new(c->workers, c->servers, bytes, &strs);
  if (!d) return NULL;
  for (int k = 0; k < c->workers; k++) dt__cluster_put(&d->worker_addr[k], &strs, c->worker_addr[k], strlen(c->worker_addr[k]));
  for (int k = 0; k < c->servers; k++) dt__cluster_put(&d->server_addr[k], &strs, c->server_addr[k], strlen(c->server_addr[k]));
  d->role = c->role;
  d->index = c->index;
  d->pipeline = c->pipeline;
  d->tensor = c->tensor;
  return d;
}

DTRAIN_API dt_result dt_layout_from_cluster(dt_comm *c, int rank, const dt_cluster *cl, dt_layout *out) {
  if (!cl) {
    if (out) memset(out, 0, sizeof *out);
    return dt__error(DTRAIN_ERR_NULL_ARG, "dt_layout_from_cluster: cluster is NULL");
  }
  return dt_layout_create(c, rank, cl->pipeline > 1 ? cl->pipeline : 1, cl->tensor > 1 ? cl->tensor : 1, out);
}

DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap) {
  if (!buf) dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_describe: buf is NULL");
  if (!buf || cap == 0) return buf;
  const char *addr = NULL;
  if (c && role == DTRAIN_ROLE_WORKER && index >= 0 && index < c->workers && c->worker_addr) addr = c->worker_addr[index];
  if (c && role == DTRAIN_ROLE_PS && index >= 0 && index < c->servers && c->server_addr) addr = c->server_addr[index];
  if (addr)
    snprintf(buf, cap, "%s %d (%s)", dt__cluster_role_name(role), index, addr);
  else
    snprintf(buf, cap, "%s %d", dt__cluster_role_name(role), index);
  return buf;
}

typedef struct dt__cluster_out {
  char *buf;
  size_t cap, n; /* n: bytes the whole text needs (without NUL) */
} dt__cluster_out;

static void dt__cluster_w(dt__cluster_out *o, const char *s, size_t len) {
  for (size_t k = 0; k < len; k++, o->n++)
    if (o->n + 1 < o->cap) o->buf[o->n] = s[k];
}
static void dt__cluster_wstr(dt__cluster_out *o, const char *s) { dt__cluster_w(o, s, strlen(s)); }

static void dt__cluster_wq(dt__cluster_out *o, const char *s) {
  static const char hx[] = "0123456789abcdef";
  dt__cluster_w(o, "\"", 1);
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') {
      char e[2] = {'\\', (char)ch};
      dt__cluster_w(o, e, 2);
    } else if (ch < 0x20) {
      char e[6] = {'\\', 'u', '0', '0', hx[ch >> 4], hx[ch & 15]};
      dt__cluster_w(o, e, 6);
    } else {
      dt__cluster_w(o, (const char *)&ch, 1);
    }
  }
  dt__cluster_w(o, "\"", 1);
}

static void dt__cluster_wlist(dt__cluster_out *o, char **a, int n) {
  dt__cluster_w(o, "[", 1);
  for (int k = 0; k < n; k++) {
    if (k) dt__cluster_w(o, ",", 1);
    dt__cluster_wq(o, a[k]);
  }
  dt__cluster_w(o, "]", 1);
}

DTRAIN_API dt_result dt_cluster_to_json(const dt_cluster *c, char *buf, size_t cap) {
  if (!c || (!buf && cap > 0)) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_to_json: cluster or buf is NULL");
  if (cap > 0) buf[0] = '\0';
  dt_result rc = dt__cluster_check(c, "dt_cluster_to_json");
  if (rc != DTRAIN_OK) return rc;
  dt__cluster_out o;
  char num[16];
  o.buf = buf;
  o.cap = cap;
  o.n = 0;
  dt__cluster_wstr(&o, "{\"cluster\":{\"worker\":");
  dt__cluster_wlist(&o, c->worker_addr, c->workers);
  dt__cluster_wstr(&o, ",\"ps\":");
  dt__cluster_wlist(&o, c->server_addr, c->servers);
  dt__cluster_wstr(&o, "},\"task\":{\"type\":\"");
  dt__cluster_wstr(&o, dt__cluster_role_name(c->role));
  snprintf(num, sizeof num, "%d", c->index);
  dt__cluster_wstr(&o, "\",\"index\":");
  dt__cluster_wstr(&o, num);
  dt__cluster_wstr(&o, "}");
  if (c->pipeline > 1 || c->tensor > 1) {
    snprintf(num, sizeof num, "%d", c->pipeline > 1 ? c->pipeline : 1);
    dt__cluster_wstr(&o, ",\"layout\":{\"pipeline\":");
    dt__cluster_wstr(&o, num);
    snprintf(num, sizeof num, "%d", c->tensor > 1 ? c->tensor : 1);
    dt__cluster_wstr(&o, ",\"tensor\":");
    dt__cluster_wstr(&o, num);
    dt__cluster_wstr(&o, "}");
  }
  dt__cluster_wstr(&o, "}");
  if (o.n + 1 > cap) {
    if (cap > 0) buf[0] = '\0';
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_cluster_to_json: the text needs %zu bytes, buffer has %zu", o.n + 1, cap);
  }
  buf[o.n] = '\0';
  return DTRAIN_OK;
}

#undef DT__CLUSTER_MAX_DEPTH
#undef DT__CLUSTER_MEMBERS
#undef DT__CLUSTER_ADDR_MAX
#undef DT__CLUSTER_DEFAULT_PORT

#else /* DTRAIN_NO_DIST: every entry point says so */

DTRAIN_API void dt_cluster_destroy(dt_cluster *c) { (void)c; }
DTRAIN_API dt_result dt_cluster_parse_json(const char *json, dt_cluster **out) {
  (void)json;
  if (out) *out = NULL;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_parse_json: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_cluster_from_env(dt_cluster **out) {
  if (out) *out = NULL;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_from_env: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_cluster_from_args(int *argc, char **argv, dt_cluster **out) {
  (void)argc; (void)argv;
  if (out) *out = NULL;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_from_args: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_cluster_discover(int *argc, char **argv, dt_cluster **out) {
  (void)argc; (void)argv;
  if (out) *out = NULL;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_discover: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_cluster *dt_cluster_clone(const dt_cluster *c) {
  (void)c;
  dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_clone: compiled out (DTRAIN_NO_DIST)");
  return NULL;
}
DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap) {
  (void)c; (void)role; (void)index;
  if (!buf) dt__error(DTRAIN_ERR_NULL_ARG, "dt_cluster_describe: buf is NULL");
  if (buf && cap) buf[0] = 0;
  return buf;
}
DTRAIN_API dt_result dt_layout_from_cluster(dt_comm *c, int rank, const dt_cluster *cl, dt_layout *out) {
  (void)c; (void)rank; (void)cl;
  if (out) memset(out, 0, sizeof *out);
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_layout_from_cluster: compiled out (DTRAIN_NO_DIST)");
}
DTRAIN_API dt_result dt_cluster_to_json(const dt_cluster *c, char *buf, size_t cap) {
  (void)c;
  if (buf && cap) buf[0] = 0;
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "dt_cluster_to_json: compiled out (DTRAIN_NO_DIST)");
}

#endif /* DTRAIN_NO_DIST */
