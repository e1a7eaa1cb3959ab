/* ===========================================================================
 * dt_json.c -- the strict JSON reader (see dt_json.h)
 * ===========================================================================
 * Recursive descent over the text, one function per grammar rule. Every
 * failure goes through dt__json_fail, which keeps the first message: "byte N:
 * <what was expected>, found <what is there>". The depth limit bounds the
 * recursion, so no input can overflow the stack.
 */
#include "dt_internal.h"
#include "dt_json.h"

static int dt__json_isdigit(int c) { return c >= '0' && c <= '9'; }

DTRAIN_PRIVATE const char *dt__json_found(const unsigned char *s, size_t n, size_t pos, char *buf, size_t cap) {
  if (pos >= n) return "end of text";
  unsigned ch = s[pos];
  if (ch >= 0x20 && ch < 0x7f)
    snprintf(buf, cap, "'%c'", (char)ch);
  else
    snprintf(buf, cap, "byte 0x%02x", ch);
  return buf;
}

/* Records "byte <at>: <what>[, found ...]" unless a failure is already
 * recorded. Returns -1 (the failed node id) for the callers' convenience. */
static int dt__json_fail_at(dt__json *j, size_t at, const char *what, int found) {
  if (!j->err[0]) {
    char f[16];
    j->err_pos = at;
    j->err_in = j->open;
    if (found)
      snprintf(j->err, sizeof j->err, "byte %zu: %s, found %s", at, what, dt__json_found(j->s, j->n, at, f, sizeof f));
    else
      snprintf(j->err, sizeof j->err, "byte %zu: %s", at, what);
  }
  return -1;
}

static int dt__json_fail(dt__json *j, const char *what) { return dt__json_fail_at(j, j->pos, what, 1); }

static int32_t dt__json_node(dt__json *j, int type, size_t pos) {
  if (j->nv == j->cap) {
    size_t ncap = j->cap ? j->cap * 2 : 64;
    if (ncap > (size_t)INT32_MAX) return dt__json_fail_at(j, pos, "too many JSON values", 0);
    dt__json_val *nv = (dt__json_val *)dt__realloc(j->v, j->cap * sizeof(dt__json_val), ncap * sizeof(dt__json_val));
    if (!nv) {
      j->nomem = 1;
      return dt__json_fail_at(j, pos, "out of memory", 0);
    }
    j->v = nv;
    j->cap = ncap;
  }
  dt__json_val *x = &j->v[j->nv];
  memset(x, 0, sizeof *x);
  x->type = type;
  x->child = x->next = -1;
  x->parent = j->open;
  x->pos = pos;
  return (int32_t)j->nv++;
}

static void dt__json_ws(dt__json *j) {
  while (j->pos < j->n) {
    unsigned char c = j->s[j->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    j->pos++;
  }
}

DTRAIN_PRIVATE int dt__json_utf8(const unsigned char *p, size_t avail, size_t *bad) {
  unsigned c = p[0];
  int k;
  uint32_t cp, min;
  if (c >= 0xc2 && c <= 0xdf) {
    k = 1, cp = c & 0x1f, min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    k = 2, cp = c & 0x0f, min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    k = 3, cp = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  for (int i = 1; i <= k; i++) {
    if ((size_t)i >= avail || (p[i] & 0xc0) != 0x80) {
      *bad = (size_t)i;
      return -1;
    }
    cp = (cp << 6) | (p[i] & 0x3fu);
  }
  /* Each code point has one encoding, UTF-16's surrogates are no characters. */
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return -2;
  return k + 1;
}

/* The pool holds at most n + 1 bytes of strings: a string's decoded bytes
 * and its NUL never outnumber its source bytes with the quotes. */
static void dt__json_put(dt__json *j, unsigned char c) { j->pool[j->pool_used++] = (char)c; }

static void dt__json_put_cp(dt__json *j, uint32_t cp) {
  if (cp < 0x80) {
    dt__json_put(j, (unsigned char)cp);
  } else if (cp < 0x800) {
    dt__json_put(j, (unsigned char)(0xc0 | (cp >> 6)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    dt__json_put(j, (unsigned char)(0xe0 | (cp >> 12)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 6) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  } else {
    dt__json_put(j, (unsigned char)(0xf0 | (cp >> 18)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 12) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | ((cp >> 6) & 0x3f)));
    dt__json_put(j, (unsigned char)(0x80 | (cp & 0x3f)));
  }
}

/* Four hex digits at j->pos into *out (advanced past them); -1 at a non-digit. */
static int dt__json_hex4(dt__json *j, uint32_t *out) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    int c = j->pos < j->n ? j->s[j->pos] : -1;
    int d = dt__json_isdigit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
    if (d < 0) return dt__json_fail(j, "expected a hex digit in \\u escape");
    v = (v << 4) | (uint32_t)d;
    j->pos++;
  }
  *out = v;
  return 0;
}

/* The \u escape whose 'u' is at j->pos - 1; esc: where its '\' is. */
static int dt__json_unicode(dt__json *j, size_t esc) {
  uint32_t cp, lo;
  if (dt__json_hex4(j, &cp) < 0) return -1;
  if (cp >= 0xdc00 && cp <= 0xdfff) {
    j->pos -= 4;
    return dt__json_fail(j, "expected a \\u escape that is not a lone low surrogate");
  }
  if (cp >= 0xd800 && cp <= 0xdbff) {
    if (j->n - j->pos < 2 || j->s[j->pos] != '\\' || j->s[j->pos + 1] != 'u')
      return dt__json_fail(j, "expected '\\u' with the low half of a surrogate pair");
    j->pos += 2;
    if (dt__json_hex4(j, &lo) < 0) return -1;
    if (lo < 0xdc00 || lo > 0xdfff) {
      j->pos -= 4;
      return dt__json_fail(j, "expected a low surrogate (DC00..DFFF)");
    }
    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
  }
  if (cp == 0 && !j->allow_nul) return dt__json_fail_at(j, esc, "\\u0000 in a string is not supported", 0);
  dt__json_put_cp(j, cp);
  return 0;
}

static int32_t dt__json_string(dt__json *j) {
  int32_t id = dt__json_node(j, DT__JSON_STR, j->pos);
  if (id < 0) return -1;
  j->pos++; /* the opening quote */
  size_t start = j->pool_used;
  for (;;) {
    if (j->pos >= j->n) return dt__json_fail(j, "expected '\"' to close the string (unterminated string)");
    unsigned char c = j->s[j->pos];
    if (c == '"') {
      j->pos++;
      break;
    }
    if (c < 0x20) return dt__json_fail(j, "expected a string character (control characters must be escaped)");
    if (c == '\\') {
      size_t esc = j->pos++;
      int e = j->pos < j->n ? j->s[j->pos] : -1;
      static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
      const char *k = e > 0 ? strchr(from, e) : NULL;
      j->pos++;
      if (k) {
        dt__json_put(j, (unsigned char)to[k - from]);
      } else if (e == 'u') {
        if (dt__json_unicode(j, esc) < 0) return -1;
      } else {
        j->pos--;
        return dt__json_fail(j, "bad escape: expected an escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
      }
      continue;
    }
    if (c < 0x80) {
      dt__json_put(j, c);
      j->pos++;
      continue;
    }
    size_t bad = 0;
    int len = dt__json_utf8(j->s + j->pos, j->n - j->pos, &bad);
    if (len == 0) return dt__json_fail(j, "expected valid UTF-8 in a string");
    if (len == -1) return dt__json_fail_at(j, j->pos + bad, "expected a UTF-8 continuation byte", 1);
    if (len < 0) return dt__json_fail(j, "expected valid UTF-8 in a string (overlong, surrogate or too large)");
    for (int i = 0; i < len; i++) dt__json_put(j, j->s[j->pos + (size_t)i]);
    j->pos += (size_t)len;
  }
  j->pool[j->pool_used++] = '\0';
  j->v[id].off = start;
  j->v[id].len = j->pool_used - 1 - start;
  return id;
}

static int dt__json_digits(dt__json *j, const char *what) {
  if (j->pos >= j->n || !dt__json_isdigit(j->s[j->pos])) return dt__json_fail(j, what);
  while (j->pos < j->n && dt__json_isdigit(j->s[j->pos])) j->pos++;
  return 0;
}

static int32_t dt__json_number(dt__json *j) {
  size_t start = j->pos;
  if (j->s[j->pos] == '-') j->pos++;
  if (j->pos < j->n && j->s[j->pos] == '0') {
    j->pos++; /* "0" followed by a digit: the caller refuses what follows */
  } else if (dt__json_digits(j, "expected a digit") < 0) {
    return -1;
  }
  if (j->pos < j->n && j->s[j->pos] == '.') {
    j->pos++;
    if (dt__json_digits(j, "expected a digit after '.'") < 0) return -1;
  }
  if (j->pos < j->n && (j->s[j->pos] == 'e' || j->s[j->pos] == 'E')) {
    j->pos++;
    if (j->pos < j->n && (j->s[j->pos] == '+' || j->s[j->pos] == '-')) j->pos++;
    if (dt__json_digits(j, "expected a digit in the exponent") < 0) return -1;
  }
  int32_t id = dt__json_node(j, DT__JSON_NUM, start);
  if (id < 0) return -1;
  j->v[id].off = start;
  j->v[id].len = j->pos - start;
  return id;
}

/* true, false, null: the message names the word and points at the first byte that differs. */
static int32_t dt__json_literal(dt__json *j, const char *word, int type) {
  size_t start = j->pos;
  for (const char *w = word; *w; w++, j->pos++) {
    if (j->pos >= j->n || j->s[j->pos] != (unsigned char)*w) {
      char what[24];
      snprintf(what, sizeof what, "expected '%s'", word);
      return dt__json_fail(j, what);
    }
  }
  return dt__json_node(j, type, start);
}

static int32_t dt__json_value(dt__json *j, int depth);

/* Whether value id is the number 0 (or -0) with a digit right after it. */
static int dt__json_lone_zero(const dt__json *j, int32_t id) {
  const dt__json_val *x = &j->v[id];
  size_t end = x->off + x->len;
  return x->type == DT__JSON_NUM && x->len <= 2 && j->s[end - 1] == '0' && end < j->n && dt__json_isdigit(j->s[end]);
}

/* An object or an array at j->pos; children linked in order. */
static int32_t dt__json_container(dt__json *j, int depth, int is_obj) {
  if (depth >= j->max_depth) {
    char what[64];
    snprintf(what, sizeof what, "nested too deeply: nesting deeper than %d levels", j->max_depth);
    return dt__json_fail_at(j, j->pos, what, 0);
  }
  int32_t id = dt__json_node(j, is_obj ? DT__JSON_OBJ : DT__JSON_ARR, j->pos);
  if (id < 0) return -1;
  unsigned char close = is_obj ? '}' : ']';
  int32_t last = -1, outer = j->open;
  j->open = id;
  j->pos++;
  dt__json_ws(j);
  if (j->pos < j->n && j->s[j->pos] == close) {
    j->pos++;
    j->open = outer;
    return id;
  }
  for (;;) {
    int32_t k = -1, val;
    dt__json_ws(j);
    if (is_obj) {
      if (j->pos >= j->n || j->s[j->pos] != '"')
        return dt__json_fail(j, last < 0 ? "expected a string (object key) or '}'" : "expected a string (object key)");
      k = dt__json_string(j);
      if (k < 0) return -1;
      dt__json_ws(j);
      if (j->pos >= j->n || j->s[j->pos] != ':') return dt__json_fail(j, "expected ':' after the object key");
      j->pos++;
    }
    val = dt__json_value(j, depth + 1);
    if (val < 0) return -1;
    if (k >= 0) j->v[k].next = val;
    if (last < 0) j->v[id].child = k >= 0 ? k : val;
    else j->v[last].next = k >= 0 ? k : val;
    j->v[id].count += k >= 0 ? 2 : 1;
    last = val;
    dt__json_ws(j);
    if (j->pos < j->n && j->s[j->pos] == ',') {
      j->pos++;
      continue;
    }
    if (j->pos < j->n && j->s[j->pos] == close) {
      j->pos++;
      j->open = outer;
      return id;
    }
    /* The grammar's own way to refuse "01": a number ends after a lone 0. */
    if (dt__json_lone_zero(j, val))
      return dt__json_fail(j, is_obj ? "expected ',' or '}' (no leading zeros in a number)"
                                     : "expected ',' or ']' (no leading zeros in a number)");
    return dt__json_fail(j, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
  }
}

static int32_t dt__json_value(dt__json *j, int depth) {
  dt__json_ws(j);
  int c = j->pos < j->n ? j->s[j->pos] : -1;
  switch (c) {
    case '{': return dt__json_container(j, depth, 1);
    case '[': return dt__json_container(j, depth, 0);
    case '"': return dt__json_string(j);
    case 't': return dt__json_literal(j, "true", DT__JSON_TRUE);
    case 'f': return dt__json_literal(j, "false", DT__JSON_FALSE);
    case 'n': return dt__json_literal(j, "null", DT__JSON_NULL);
    default:
      if (c == '-' || dt__json_isdigit(c)) return dt__json_number(j);
      j->err_value = !j->err[0];
      return dt__json_fail(j, "expected a value (object, array, string, number, true, false or null)");
  }
}

DTRAIN_PRIVATE void dt__json_free(dt__json *j) {
  dt__free(j->v, j->cap * sizeof(dt__json_val));
  dt__free(j->pool, j->pool_cap);
  j->v = NULL;
  j->pool = NULL;
  j->cap = j->pool_cap = j->nv = 0;
}

DTRAIN_PRIVATE int dt__json_parse(dt__json *j, const void *text, size_t n, int max_depth, int allow_nul) {
  memset(j, 0, sizeof *j);
  j->s = (const unsigned char *)text;
  j->n = n;
  j->max_depth = max_depth;
  j->allow_nul = allow_nul;
  j->open = j->err_in = -1;
  j->pool_cap = n + 1;
  j->pool = (char *)dt__alloc(j->pool_cap);
  if (!j->pool) {
    j->pool_cap = 0;
    j->nomem = 1;
    snprintf(j->err, sizeof j->err, "out of memory for %zu bytes of JSON", n);
    return 0;
  }
  if (dt__json_value(j, 0) < 0) return 0;
  dt__json_ws(j);
  if (j->pos != n) {
    dt__json_fail(j, dt__json_lone_zero(j, 0) ? "expected end of text after the JSON value (no leading zeros in a number)"
                                              : "expected end of text after the JSON value");
    return 0;
  }
  return 1;
}

DTRAIN_PRIVATE const char *dt__json_str(const dt__json *j, int32_t id) { return j->pool + j->v[id].off; }

DTRAIN_PRIVATE int dt__json_eq(const dt__json *j, int32_t id, const char *word) {
  const dt__json_val *x = &j->v[id];
  return x->type == DT__JSON_STR && x->len == strlen(word) && memcmp(j->pool + x->off, word, x->len) == 0;
}

DTRAIN_PRIVATE int dt__json_uint(const dt__json *j, int32_t id, uint64_t *out) {
  const dt__json_val *x = &j->v[id];
  if (x->type != DT__JSON_NUM) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < x->len; i++) {
    unsigned char c = j->s[x->off + i];
    if (!dt__json_isdigit(c)) return 0;
    if (v > (UINT64_MAX - (uint64_t)(c - '0')) / 10) return 0;
    v = v * 10 + (uint64_t)(c - '0');
  }
  *out = v;
  return x->len > 0;
}
