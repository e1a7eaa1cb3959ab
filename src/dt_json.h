/* ===========================================================================
 * dt_json.h -- the strict JSON reader shared by checkpoints (the safetensors
 * header, its "optimizer" metadata) and the cluster description (DTRAIN_CONFIG)
 * ===========================================================================
 * dt__json_parse reads a whole text into a flat array of values (node 0 is
 * the top value) and a pool of decoded strings, or fails with one message
 * naming the byte: "byte 29: expected ',' or '}', found end of text". Callers
 * put their own context in front ("header JSON: ...", "DTRAIN_CONFIG: ...")
 * and report their own checks on the values with dt__json_found, so a
 * config's missing key reads like a syntax error.
 *
 * Strict RFC 8259: objects, arrays, strings (escapes checked, \u surrogate
 * pairs paired, raw bytes valid UTF-8, no raw control characters), numbers in
 * the JSON grammar (no leading zeros), true/false/null; whitespace is space,
 * tab, CR, LF; no trailing commas, comments, NaN or data after the value.
 * Nesting is limited (max_depth containers). Duplicate keys are the caller's
 * business: objects keep every member in order. The value of an object
 * member always directly follows its key in v (value id = key id + 1).
 */
#ifndef DTRAIN_JSON_H
#define DTRAIN_JSON_H

#include "dt_internal.h"

enum { DT__JSON_OBJ = 1, DT__JSON_ARR, DT__JSON_STR, DT__JSON_NUM, DT__JSON_TRUE, DT__JSON_FALSE, DT__JSON_NULL };

typedef struct dt__json_val {
  int type;            /* DT__JSON_* */
  int32_t child, next; /* first child, next sibling (-1: none); an object's children alternate key, value */
  int32_t parent;      /* the enclosing object or array (-1: the top value) */
  int32_t count;       /* children (objects: 2 per member) */
  size_t pos;          /* where the value starts in the text (for messages) */
  size_t off, len;     /* STR: pool offset and decoded length; NUM: text offset and length */
} dt__json_val;

typedef struct dt__json {
  const unsigned char *s; /* the text (not copied: it must outlive the reader's use of numbers) */
  size_t n, pos;
  int max_depth, allow_nul;
  dt__json_val *v;        /* the values; v[0] is the top one */
  size_t nv, cap;
  char *pool;             /* decoded strings, each NUL-terminated */
  size_t pool_used, pool_cap;
  int32_t open;           /* while parsing: the innermost open object or array (-1: none) */
  /* After a failure: why (err), where (err_pos), inside which object or
   * array (err_in, -1: none; its values so far are in v), and err_value
   * when no value started there at all ("expected a value"): then, inside
   * an object, the last value in v is the key whose value is missing. */
  int nomem;              /* the failure was out of memory */
  int err_value;
  int32_t err_in;
  size_t err_pos;
  char err[160];
} dt__json;

/* Parses text[0..n) as one JSON value. allow_nul: strings may hold U+0000
 * (written \u0000; their len counts it); otherwise that is an error. Returns
 * 1, or 0 with j->err set (and j->nomem when memory ran out). Either way
 * dt__json_free(j) releases what it holds. */
DTRAIN_PRIVATE int dt__json_parse(dt__json *j, const void *text, size_t n, int max_depth, int allow_nul);
DTRAIN_PRIVATE void dt__json_free(dt__json *j);
/* The decoded string of STR value id (NUL-terminated; see allow_nul). */
DTRAIN_PRIVATE const char *dt__json_str(const dt__json *j, int32_t id);
/* Whether STR value id is exactly word (an embedded U+0000 never matches). */
DTRAIN_PRIVATE int dt__json_eq(const dt__json *j, int32_t id, const char *word);
/* A non-negative JSON integer (digits only: no sign, fraction or exponent)
 * that fits in 64 bits into *out; 0 otherwise. */
DTRAIN_PRIVATE int dt__json_uint(const dt__json *j, int32_t id, uint64_t *out);
/* What stands at byte pos of the text, for messages: "'x'", "byte 0x01" or
 * "end of text". buf: at least 16 bytes. */
DTRAIN_PRIVATE const char *dt__json_found(const unsigned char *s, size_t n, size_t pos, char *buf, size_t cap);
/* The UTF-8 sequence at p (avail bytes, p[0] >= 0x80): its length when
 * valid; 0: p[0] cannot start one; -1: byte p[*bad] is not a continuation
 * byte; -2: overlong, a UTF-16 surrogate, or above U+10FFFF. */
DTRAIN_PRIVATE int dt__json_utf8(const unsigned char *p, size_t avail, size_t *bad);

#endif /* DTRAIN_JSON_H */
