/* ===========================================================================
 * dt_cluster.c -- the cluster description: DTRAIN_CONFIG (JSON in the style
 * of TF_CONFIG), command-line flags, and back to JSON (see dt_net.h)
 * ===========================================================================
 * The JSON parser is small and strict (RFC 8259): it checks the whole text,
 * including keys it ignores, decodes string escapes (\uXXXX with surrogate
 * pairs), checks UTF-8, and limits nesting, so a bad DTRAIN_CONFIG fails
 * loudly with the byte offset and what was expected instead of being half
 * read. It runs twice over the text: the first pass checks everything and
 * counts the bytes, the second (which cannot fail) fills one allocation.
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
  int limit = c->role == DTRAIN_ROLE_PS ? c->servers : c->workers;
  if (c->index < 0 || c->index >= limit)
    return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: task %s %d is out of range (the cluster has %d %s%s)", src,
                     dt__cluster_role_name(c->role), c->index, limit,
                     c->role == DTRAIN_ROLE_PS ? "parameter server" : "worker", limit == 1 ? "" : "s");
  return DTRAIN_OK;
}

/* ---- JSON ----------------------------------------------------------------------------------- */

typedef struct dt__cluster_json {
  const unsigned char *s;
  size_t n, i;         /* length, position */
  const char *src;     /* origin for messages */
  dt_cluster *fill;    /* second pass: the cluster being filled; NULL in the first */
  char *strs;          /* second pass: next free string byte */
  int count[2];        /* addresses seen per role */
  size_t str_bytes;    /* first pass: string bytes needed */
  int have_cluster, have_task, have_list[2], have_type, have_index;
  dt_role role;
  int index;
} dt__cluster_json;

/* What stands at the current position, for messages. */
static const char *dt__cluster_found(const dt__cluster_json *p, char *buf, size_t cap) {
  if (p->i >= p->n) return "end of text";
  int ch = p->s[p->i];
  if (ch >= 0x20 && ch < 0x7f)
    snprintf(buf, cap, "'%c'", ch);
  else
    snprintf(buf, cap, "byte 0x%02x", (unsigned)ch);
  return buf;
}

static dt_result dt__cluster_expected(const dt__cluster_json *p, const char *what) {
  char f[16];
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: expected %s, found %s", p->src, p->i, what,
                   dt__cluster_found(p, f, sizeof f));
}

static int dt__cluster_peek(const dt__cluster_json *p) { return p->i < p->n ? p->s[p->i] : -1; }

static void dt__cluster_ws(dt__cluster_json *p) {
  while (p->i < p->n) {
    int ch = p->s[p->i];
    if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r') break;
    p->i++;
  }
}

static int dt__cluster_hexval(int ch) {
  if (ch >= '0' && ch <= '9') return ch - '0';
  if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
  if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
  return -1;
}

/* Four hex digits at p->i (advanced past them), or -1 and an error. */
static long dt__cluster_u4(dt__cluster_json *p) {
  long v = 0;
  for (int k = 0; k < 4; k++) {
    int h = p->i < p->n ? dt__cluster_hexval(p->s[p->i]) : -1;
    if (h < 0) {
      dt__cluster_expected(p, "a hex digit in \\u escape");
      return -1;
    }
    v = v * 16 + h;
    p->i++;
  }
  return v;
}

/* Append code point cp as UTF-8 to out (only the bytes that fit in cap-1). */
static void dt__cluster_emit(char *out, size_t cap, size_t *len, unsigned long cp) {
  unsigned char u[4];
  int k;
  if (cp < 0x80) {
    u[0] = (unsigned char)cp;
    k = 1;
  } else if (cp < 0x800) {
    u[0] = (unsigned char)(0xC0 | (cp >> 6));
    u[1] = (unsigned char)(0x80 | (cp & 0x3F));
    k = 2;
  } else if (cp < 0x10000) {
    u[0] = (unsigned char)(0xE0 | (cp >> 12));
    u[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    u[2] = (unsigned char)(0x80 | (cp & 0x3F));
    k = 3;
  } else {
    u[0] = (unsigned char)(0xF0 | (cp >> 18));
    u[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    u[3] = (unsigned char)(0x80 | (cp & 0x3F));
    k = 4;
  }
  for (int j = 0; j < k; j++) {
    if (out && *len + 1 < cap) out[*len] = (char)u[j];
    (*len)++;
  }
}

/* A string at p->i (which must be '"'): decoded into out (cap bytes, NUL
 * terminated, truncated if longer; out may be NULL); *len gets the whole
 * decoded length. */
static dt_result dt__cluster_string(dt__cluster_json *p, char *out, size_t cap, size_t *len) {
  *len = 0;
  if (dt__cluster_peek(p) != '"') return dt__cluster_expected(p, "'\"'");
  p->i++;
  for (;;) {
    if (p->i >= p->n) return dt__cluster_expected(p, "'\"' to close the string");
    int ch = p->s[p->i];
    if (ch == '"') {
      p->i++;
      break;
    }
    if (ch < 0x20) return dt__cluster_expected(p, "a string character (control characters must be escaped)");
    if (ch == '\\') {
      p->i++;
      int e = dt__cluster_peek(p);
      unsigned long cp;
      switch (e) {
        case '"': cp = '"'; break;
        case '\\': cp = '\\'; break;
        case '/': cp = '/'; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u': {
          p->i++;
          long hi = dt__cluster_u4(p);
          if (hi < 0) return DTRAIN_ERR_FORMAT;
          if (hi >= 0xDC00 && hi <= 0xDFFF) {
            p->i -= 4;
            return dt__cluster_expected(p, "a \\u escape that is not a lone low surrogate");
          }
          if (hi >= 0xD800 && hi <= 0xDBFF) {
            if (p->i + 1 >= p->n || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u')
              return dt__cluster_expected(p, "'\\u' with the low half of a surrogate pair");
            p->i += 2;
            long lo = dt__cluster_u4(p);
            if (lo < 0) return DTRAIN_ERR_FORMAT;
            if (lo < 0xDC00 || lo > 0xDFFF) {
              p->i -= 4;
              return dt__cluster_expected(p, "a low surrogate (DC00..DFFF)");
            }
            cp = 0x10000ul + (((unsigned long)hi - 0xD800ul) << 10) + ((unsigned long)lo - 0xDC00ul);
          } else {
            cp = (unsigned long)hi;
          }
          dt__cluster_emit(out, cap, len, cp);
          continue;
        }
        default: return dt__cluster_expected(p, "an escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
      }
      p->i++;
      dt__cluster_emit(out, cap, len, cp);
      continue;
    }
    if (ch < 0x80) {
      dt__cluster_emit(out, cap, len, (unsigned long)ch);
      p->i++;
      continue;
    }
    /* UTF-8: the sequence's length from the lead byte; no overlong forms,
     * no surrogates, nothing above U+10FFFF. */
    int k;
    unsigned long cp, min;
    if (ch >= 0xC2 && ch <= 0xDF) {
      k = 1;
      cp = (unsigned long)(ch & 0x1F);
      min = 0x80;
    } else if (ch >= 0xE0 && ch <= 0xEF) {
      k = 2;
      cp = (unsigned long)(ch & 0x0F);
      min = 0x800;
    } else if (ch >= 0xF0 && ch <= 0xF4) {
      k = 3;
      cp = (unsigned long)(ch & 0x07);
      min = 0x10000;
    } else {
      return dt__cluster_expected(p, "valid UTF-8 in a string");
    }
    size_t start = p->i;
    p->i++;
    for (int j = 0; j < k; j++) {
      if (p->i >= p->n || (p->s[p->i] & 0xC0) != 0x80) return dt__cluster_expected(p, "a UTF-8 continuation byte");
      cp = (cp << 6) | (p->s[p->i] & 0x3Fu);
      p->i++;
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      p->i = start;
      return dt__cluster_expected(p, "valid UTF-8 in a string (overlong, surrogate or too large)");
    }
    dt__cluster_emit(out, cap, len, cp);
  }
  if (out && cap > 0) out[*len < cap ? *len : cap - 1] = '\0';
  return DTRAIN_OK;
}

/* A number (RFC 8259 grammar). *ival gets its value when it is an integer
 * in 0..INT_MAX (no fraction or exponent), else -1. */
static dt_result dt__cluster_number(dt__cluster_json *p, long *ival) {
  int neg = 0, integral = 1;
  int64_t v = 0; /* saturates just above INT_MAX */
  if (dt__cluster_peek(p) == '-') {
    neg = 1;
    p->i++;
  }
  int ch = dt__cluster_peek(p);
  if (ch == '0') {
    p->i++;
  } else if (ch >= '1' && ch <= '9') {
    while ((ch = dt__cluster_peek(p)) >= '0' && ch <= '9') {
      v = v * 10 + (ch - '0');
      if (v > INT_MAX) v = (int64_t)INT_MAX + 1;
      p->i++;
    }
  } else {
    return dt__cluster_expected(p, "a digit");
  }
  if (dt__cluster_peek(p) == '.') {
    integral = 0;
    p->i++;
    if ((ch = dt__cluster_peek(p)) < '0' || ch > '9') return dt__cluster_expected(p, "a digit after '.'");
    while ((ch = dt__cluster_peek(p)) >= '0' && ch <= '9') p->i++;
  }
  ch = dt__cluster_peek(p);
  if (ch == 'e' || ch == 'E') {
    integral = 0;
    p->i++;
    ch = dt__cluster_peek(p);
    if (ch == '+' || ch == '-') p->i++;
    if ((ch = dt__cluster_peek(p)) < '0' || ch > '9') return dt__cluster_expected(p, "a digit in the exponent");
    while ((ch = dt__cluster_peek(p)) >= '0' && ch <= '9') p->i++;
  }
  *ival = (integral && !(neg && v != 0) && v <= INT_MAX) ? (long)v : -1;
  return DTRAIN_OK;
}

static dt_result dt__cluster_value(dt__cluster_json *p, int depth);

static dt_result dt__cluster_open(dt__cluster_json *p, int depth, int ch) {
  if (depth >= DT__CLUSTER_MAX_DEPTH)
    return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: nesting deeper than %d levels", p->src, p->i,
                     DT__CLUSTER_MAX_DEPTH);
  if (dt__cluster_peek(p) != ch) return dt__cluster_expected(p, ch == '{' ? "'{'" : "'['");
  p->i++;
  return DTRAIN_OK;
}

/* The next member of an object whose '{' was consumed: *more = 0 at its '}'
 * (consumed); otherwise the key is decoded into key (cap bytes; *klen its
 * whole length), the ':' consumed and the position is at the value. */
static dt_result dt__cluster_member(dt__cluster_json *p, int *members, char *key, size_t cap, size_t *klen,
                                    int *more) {
  dt__cluster_ws(p);
  if (dt__cluster_peek(p) == '}' ) {
    p->i++;
    *more = 0;
    return DTRAIN_OK;
  }
  if (*members > 0) {
    if (dt__cluster_peek(p) != ',') return dt__cluster_expected(p, "',' or '}'");
    p->i++;
    dt__cluster_ws(p);
  }
  if (dt__cluster_peek(p) != '"')
    return dt__cluster_expected(p, *members > 0 ? "a string (object key)" : "a string (object key) or '}'");
  dt_result rc = dt__cluster_string(p, key, cap, klen);
  if (rc != DTRAIN_OK) return rc;
  dt__cluster_ws(p);
  if (dt__cluster_peek(p) != ':') return dt__cluster_expected(p, "':' after the object key");
  p->i++;
  dt__cluster_ws(p);
  (*members)++;
  *more = 1;
  return DTRAIN_OK;
}

static int dt__cluster_key_is(const char *key, size_t klen, const char *name) {
  return klen == strlen(name) && memcmp(key, name, klen) == 0;
}

static dt_result dt__cluster_literal(dt__cluster_json *p, const char *word) {
  size_t n = strlen(word);
  for (size_t k = 0; k < n; k++) {
    if (p->i >= p->n || p->s[p->i] != (unsigned char)word[k]) {
      char what[16];
      snprintf(what, sizeof what, "'%s'", word);
      return dt__cluster_expected(p, what);
    }
    p->i++;
  }
  return DTRAIN_OK;
}

/* Any value, checked and skipped. */
static dt_result dt__cluster_value(dt__cluster_json *p, int depth) {
  dt_result rc;
  char key[8];
  size_t klen;
  long iv;
  int ch = dt__cluster_peek(p), n = 0, more = 1;
  switch (ch) {
    case '{':
      if ((rc = dt__cluster_open(p, depth, '{')) != DTRAIN_OK) return rc;
      for (;;) {
        if ((rc = dt__cluster_member(p, &n, key, sizeof key, &klen, &more)) != DTRAIN_OK) return rc;
        if (!more) return DTRAIN_OK;
        if ((rc = dt__cluster_value(p, depth + 1)) != DTRAIN_OK) return rc;
      }
    case '[':
      if ((rc = dt__cluster_open(p, depth, '[')) != DTRAIN_OK) return rc;
      dt__cluster_ws(p);
      if (dt__cluster_peek(p) == ']') {
        p->i++;
        return DTRAIN_OK;
      }
      for (;;) {
        dt__cluster_ws(p);
        if ((rc = dt__cluster_value(p, depth + 1)) != DTRAIN_OK) return rc;
        dt__cluster_ws(p);
        if (dt__cluster_peek(p) == ']') {
          p->i++;
          return DTRAIN_OK;
        }
        if (dt__cluster_peek(p) != ',') return dt__cluster_expected(p, "',' or ']'");
        p->i++;
      }
    case '"': return dt__cluster_string(p, NULL, 0, &klen);
    case 't': return dt__cluster_literal(p, "true");
    case 'f': return dt__cluster_literal(p, "false");
    case 'n': return dt__cluster_literal(p, "null");
    default:
      if (ch == '-' || (ch >= '0' && ch <= '9')) return dt__cluster_number(p, &iv);
      return dt__cluster_expected(p, "a value (object, array, string, number, true, false or null)");
  }
}

/* "worker": [...] or "ps": [...] at depth 2. */
static dt_result dt__cluster_list(dt__cluster_json *p, dt_role role) {
  int r = (int)role;
  dt_result rc = dt__cluster_open(p, 2, '[');
  if (rc != DTRAIN_OK) return rc;
  dt__cluster_ws(p);
  if (dt__cluster_peek(p) == ']') {
    p->i++;
    return DTRAIN_OK;
  }
  for (;;) {
    char a[DT__CLUSTER_ADDR_MAX + 2], why[96];
    size_t len, at;
    dt__cluster_ws(p);
    at = p->i;
    if (dt__cluster_peek(p) != '"') return dt__cluster_expected(p, "an address string \"host:port\"");
    if ((rc = dt__cluster_string(p, a, sizeof a, &len)) != DTRAIN_OK) return rc;
    if (p->count[r] >= DTRAIN_MAX_PEERS)
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: more than %d %s addresses", p->src, at,
                       DTRAIN_MAX_PEERS, dt__cluster_role_name(role));
    if (!dt__cluster_addr_ok(a, len, why, sizeof why))
      return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: byte %zu: %s %d address '%.*s' %s", p->src, at,
                       dt__cluster_role_name(role), p->count[r], 64, a, why);
    if (p->fill) {
      char **slots = role == DTRAIN_ROLE_PS ? p->fill->server_addr : p->fill->worker_addr;
      dt__cluster_put(&slots[p->count[r]], &p->strs, a, len);
    } else {
      p->str_bytes += len + 1;
    }
    p->count[r]++;
    dt__cluster_ws(p);
    if (dt__cluster_peek(p) == ']') {
      p->i++;
      return DTRAIN_OK;
    }
    if (dt__cluster_peek(p) != ',') return dt__cluster_expected(p, "',' or ']'");
    p->i++;
  }
}

static dt_result dt__cluster_dup_key(const dt__cluster_json *p, size_t at, const char *key) {
  return dt__error(DTRAIN_ERR_FORMAT, "%s: byte %zu: duplicate key \"%s\"", p->src, at, key);
}

static dt_result dt__cluster_cluster_obj(dt__cluster_json *p) {
  dt_result rc = dt__cluster_open(p, 1, '{');
  int n = 0, more = 1;
  char key[16];
  size_t klen;
  while (rc == DTRAIN_OK) {
    size_t at = p->i;
    if ((rc = dt__cluster_member(p, &n, key, sizeof key, &klen, &more)) != DTRAIN_OK || !more) break;
    int which = dt__cluster_key_is(key, klen, "worker") ? 0 : dt__cluster_key_is(key, klen, "ps") ? 1 : -1;
    if (which < 0) {
      rc = dt__cluster_value(p, 2);
    } else if (p->have_list[which]) {
      rc = dt__cluster_dup_key(p, at, key);
    } else {
      p->have_list[which] = 1;
      rc = dt__cluster_list(p, which ? DTRAIN_ROLE_PS : DTRAIN_ROLE_WORKER);
    }
  }
  return rc;
}

static dt_result dt__cluster_task_obj(dt__cluster_json *p) {
  dt_result rc = dt__cluster_open(p, 1, '{');
  int n = 0, more = 1;
  char key[16], type[16];
  size_t klen, tlen;
  long iv;
  while (rc == DTRAIN_OK) {
    size_t at = p->i;
    if ((rc = dt__cluster_member(p, &n, key, sizeof key, &klen, &more)) != DTRAIN_OK || !more) break;
    if (dt__cluster_key_is(key, klen, "type")) {
      if (p->have_type) return dt__cluster_dup_key(p, at, key);
      p->have_type = 1;
      at = p->i;
      if (dt__cluster_peek(p) != '"') return dt__cluster_expected(p, "a string (task type \"worker\" or \"ps\")");
      if ((rc = dt__cluster_string(p, type, sizeof type, &tlen)) != DTRAIN_OK) return rc;
      if (dt__cluster_key_is(type, tlen, "worker")) {
        p->role = DTRAIN_ROLE_WORKER;
      } else if (dt__cluster_key_is(type, tlen, "ps")) {
        p->role = DTRAIN_ROLE_PS;
      } else {
        return dt__error(DTRAIN_ERR_INVALID_ARG,
                         "%s: byte %zu: task type \"%.*s\" is not supported (expected \"worker\" or \"ps\")", p->src,
                         at, 15, type);
      }
    } else if (dt__cluster_key_is(key, klen, "index")) {
      if (p->have_index) return dt__cluster_dup_key(p, at, key);
      p->have_index = 1;
      at = p->i;
      int ch = dt__cluster_peek(p);
      if (ch != '-' && (ch < '0' || ch > '9')) return dt__cluster_expected(p, "a number (task index)");
      if ((rc = dt__cluster_number(p, &iv)) != DTRAIN_OK) return rc;
      if (iv < 0) {
        p->i = at;
        return dt__cluster_expected(p, "a non-negative integer (task index)");
      }
      p->index = (int)iv;
    } else {
      rc = dt__cluster_value(p, 2);
    }
  }
  return rc;
}

static dt_result dt__cluster_top(dt__cluster_json *p) {
  dt_result rc;
  int n = 0, more = 1;
  char key[16];
  size_t klen;
  dt__cluster_ws(p);
  if (dt__cluster_peek(p) != '{') return dt__cluster_expected(p, "'{' (a JSON object)");
  if ((rc = dt__cluster_open(p, 0, '{')) != DTRAIN_OK) return rc;
  for (;;) {
    size_t at = p->i;
    if ((rc = dt__cluster_member(p, &n, key, sizeof key, &klen, &more)) != DTRAIN_OK) return rc;
    if (!more) break;
    if (dt__cluster_key_is(key, klen, "cluster")) {
      if (p->have_cluster) return dt__cluster_dup_key(p, at, key);
      p->have_cluster = 1;
      if (dt__cluster_peek(p) != '{') return dt__cluster_expected(p, "'{' (the \"cluster\" object)");
      rc = dt__cluster_cluster_obj(p);
    } else if (dt__cluster_key_is(key, klen, "task")) {
      if (p->have_task) return dt__cluster_dup_key(p, at, key);
      p->have_task = 1;
      if (dt__cluster_peek(p) != '{') return dt__cluster_expected(p, "'{' (the \"task\" object)");
      rc = dt__cluster_task_obj(p);
    } else {
      rc = dt__cluster_value(p, 1);
    }
    if (rc != DTRAIN_OK) return rc;
  }
  dt__cluster_ws(p);
  if (p->i < p->n) return dt__cluster_expected(p, "end of text after the JSON object");
  if (!p->have_cluster) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"cluster\"", p->src);
  if (!p->have_task) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"task\"", p->src);
  if (!p->have_type) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"type\" in \"task\"", p->src);
  if (!p->have_index) return dt__error(DTRAIN_ERR_FORMAT, "%s: missing key \"index\" in \"task\"", p->src);
  if (p->count[0] == 0) return dt__error(DTRAIN_ERR_INVALID_ARG, "%s: \"cluster\" lists no \"worker\" addresses", p->src);
  return DTRAIN_OK;
}

static dt_result dt__cluster_parse(const char *json, const char *src, dt_cluster **out) {
  dt__cluster_json p;
  memset(&p, 0, sizeof p);
  p.s = (const unsigned char *)json;
  p.n = strlen(json);
  p.src = src;
  dt_result rc = dt__cluster_top(&p);
  if (rc != DTRAIN_OK) return rc;
  dt__cluster_json q;
  memset(&q, 0, sizeof q);
  q.s = p.s;
  q.n = p.n;
  q.src = src;
  q.fill = dt__cluster_new(p.count[0], p.count[1], p.str_bytes, &q.strs);
  if (!q.fill) return DTRAIN_ERR_NOMEM;
  rc = dt__cluster_top(&q); /* the text passed once: this pass only fills */
  if (rc == DTRAIN_OK) {
    q.fill->role = q.role;
    q.fill->index = q.index;
    rc = dt__cluster_check(q.fill, src);
  }
  if (rc != DTRAIN_OK) {
    dt_cluster_destroy(q.fill);
    return rc;
  }
  *out = q.fill;
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
  return d;
}

DTRAIN_API const char *dt_cluster_describe(const dt_cluster *c, dt_role role, int index, char *buf, size_t cap) {
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
  dt__cluster_wstr(&o, "}}");
  if (o.n + 1 > cap) {
    if (cap > 0) buf[0] = '\0';
    return dt__error(DTRAIN_ERR_OVERFLOW, "dt_cluster_to_json: the text needs %zu bytes, buffer has %zu", o.n + 1, cap);
  }
  buf[o.n] = '\0';
  return DTRAIN_OK;
}

#undef DT__CLUSTER_MAX_DEPTH
#undef DT__CLUSTER_ADDR_MAX
#undef DT__CLUSTER_DEFAULT_PORT
