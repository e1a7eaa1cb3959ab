/* tests/test_cluster.c -- the cluster description: DTRAIN_CONFIG JSON (valid
 * configs, every error path, truncation at every length, bad escapes and
 * UTF-8, the nesting limit, random garbage and mutations), the JSON round
 * trip, flags (both spellings, removal from argv), the environment, discover,
 * clone and describe. Needs no networking: runs in every build. */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

static const char *k_valid =
    "{\"cluster\": {\"worker\": [\"127.0.0.1:7000\", \"127.0.0.1:7001\"], \"ps\": [\"[::1]:7100\"]},\n"
    " \"task\": {\"type\": \"worker\", \"index\": 1}}";

static void test_parse_valid(void) {
  dt_cluster *c = NULL;
  CHECK(dt_cluster_parse_json(k_valid, &c) == DTRAIN_OK);
  if (!c) return;
  CHECK(c->workers == 2 && c->servers == 1);
  CHECK(strcmp(c->worker_addr[0], "127.0.0.1:7000") == 0);
  CHECK(strcmp(c->worker_addr[1], "127.0.0.1:7001") == 0);
  CHECK(strcmp(c->server_addr[0], "[::1]:7100") == 0);
  CHECK(c->role == DTRAIN_ROLE_WORKER && c->index == 1);
  dt_cluster_destroy(c);

  /* A server, no whitespace, keys in another order, unknown keys of every kind ignored. */
  c = NULL;
  CHECK(dt_cluster_parse_json("{\"task\":{\"index\":0,\"type\":\"ps\",\"x\":[1,2.5e3,-0.5E-2]},\"extra\":{\"a\":[true,false,"
                              "null,{\"b\":\"\\u00e9\\ud83d\\ude00\"}]},\"cluster\":{\"chief\":[\"h:1\"],\"ps\":[\"h:2\"],"
                              "\"worker\":[\"host-a.example.com:1\"]}}",
                              &c) == DTRAIN_OK);
  if (c) {
    CHECK(c->role == DTRAIN_ROLE_PS && c->index == 0);
    CHECK(c->workers == 1 && c->servers == 1);
    CHECK(strcmp(c->worker_addr[0], "host-a.example.com:1") == 0);
    CHECK(strcmp(c->server_addr[0], "h:2") == 0);
    dt_cluster_destroy(c);
  }
  /* Escapes inside an address decode; tabs/CR/LF are whitespace; "ps" may be empty; UTF-8 in ignored keys. */
  c = NULL;
  CHECK(dt_cluster_parse_json("\t\r\n{ \"cluster\" : { \"worker\" : [ \"127.0.0.1:70\\u0030\\u0030\" ] , \"ps\" : [ ] } ,"
                              " \"note\" : \"caf\xc3\xa9 \xf0\x9f\x98\x80\" , \"task\" : { \"type\" : \"worker\" , "
                              "\"index\" : 0 } }\n",
                              &c) == DTRAIN_OK);
  if (c) {
    CHECK(strcmp(c->worker_addr[0], "127.0.0.1:7000") == 0);
    CHECK(c->servers == 0);
    dt_cluster_destroy(c);
  }
  /* IPv6 with a zone, port 0 and 65535, upper-case host. */
  c = NULL;
  CHECK(dt_cluster_parse_json("{\"cluster\":{\"worker\":[\"[fe80::1%eth0]:0\",\"LOCALHOST:65535\",\"10.0.0.1:00080\"]},"
                              "\"task\":{\"type\":\"worker\",\"index\":2}}",
                              &c) == DTRAIN_OK);
  if (c) {
    CHECK(c->workers == 3 && c->index == 2);
    dt_cluster_destroy(c);
  }
  dt_cluster_destroy(NULL); /* a no-op */
}

typedef struct bad_case {
  const char *json;
  dt_result code;
  const char *needle;
} bad_case;

static void test_parse_errors(void) {
  static const bad_case cases[] = {
      {"", DTRAIN_ERR_FORMAT, "byte 0: expected '{'"},
      {"[]", DTRAIN_ERR_FORMAT, "expected '{'"},
      {"{}", DTRAIN_ERR_FORMAT, "missing key \"cluster\""},
      {"{\"cluster\":{\"worker\":[\"a:1\"]}}", DTRAIN_ERR_FORMAT, "missing key \"task\""},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"index\":0}}", DTRAIN_ERR_FORMAT, "missing key \"type\""},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\"}}", DTRAIN_ERR_FORMAT, "missing key \"index\""},
      {"{\"cluster\":{},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG, "no \"worker\""},
      {"{\"cluster\":{\"worker\":[]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG, "no \"worker\""},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"chief\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "task type \"chief\" is not supported"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":0,\"index\":0}}", DTRAIN_ERR_FORMAT, "expected a string"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":1}}", DTRAIN_ERR_INVALID_ARG,
       "out of range"},
      /* The model-parallel layout: integers >= 1 whose product divides the workers. */
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:2\",\"a:3\"]},\"task\":{\"type\":\"worker\",\"index\":0},"
       "\"layout\":{\"pipeline\":2}}", DTRAIN_ERR_INVALID_ARG, "does not divide the 3 workers"},
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:2\"]},\"task\":{\"type\":\"worker\",\"index\":0},"
       "\"layout\":{\"tensor\":0}}", DTRAIN_ERR_FORMAT, "expected an integer >= 1 (tensor-parallel ranks)"},
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:2\"]},\"task\":{\"type\":\"worker\",\"index\":0},"
       "\"layout\":{\"pipeline\":\"2\"}}", DTRAIN_ERR_FORMAT, "expected a number (pipeline stages)"},
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:2\"]},\"task\":{\"type\":\"worker\",\"index\":0},"
       "\"layout\":{\"pipeline\":2,\"pipeline\":1}}", DTRAIN_ERR_FORMAT, "duplicate key \"pipeline\""},
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:2\"]},\"task\":{\"type\":\"worker\",\"index\":0},\"layout\":[2]}",
       DTRAIN_ERR_FORMAT, "expected '{' (the \"layout\" object)"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"ps\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "0 parameter servers"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":-1}}", DTRAIN_ERR_FORMAT,
       "non-negative integer"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":0.5}}", DTRAIN_ERR_FORMAT,
       "non-negative integer"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":1e0}}", DTRAIN_ERR_FORMAT,
       "non-negative integer"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":99999999999999999999}}",
       DTRAIN_ERR_FORMAT, "non-negative integer"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":\"0\"}}", DTRAIN_ERR_FORMAT,
       "expected a number"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":01}}", DTRAIN_ERR_FORMAT,
       "expected ',' or '}'"},
      {"{\"cluster\":{\"worker\":\"a:1\"},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_FORMAT, "expected '['"},
      {"{\"cluster\":[],\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_FORMAT, "the \"cluster\" object"},
      {"{\"cluster\":{\"worker\":[1]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_FORMAT,
       "an address string"},
      {"{\"cluster\":{\"worker\":[\"a:1\",]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_FORMAT,
       "an address string"},
      {"{\"cluster\":{\"worker\":[\"a:1\"],},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_FORMAT,
       "object key"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]} \"task\":{}}", DTRAIN_ERR_FORMAT, "expected ',' or '}'"},
      {"{\"cluster\" {}}", DTRAIN_ERR_FORMAT, "expected ':'"},
      {"{cluster:{}}", DTRAIN_ERR_FORMAT, "object key"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}} x", DTRAIN_ERR_FORMAT,
       "end of text"},
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}{}", DTRAIN_ERR_FORMAT,
       "end of text"},
      {"{\"a\":tru}", DTRAIN_ERR_FORMAT, "expected 'true'"},
      {"{\"a\":nul}", DTRAIN_ERR_FORMAT, "expected 'null'"},
      {"{\"a\":+1}", DTRAIN_ERR_FORMAT, "expected a value"},
      {"{\"a\":-}", DTRAIN_ERR_FORMAT, "expected a digit"},
      {"{\"a\":1.}", DTRAIN_ERR_FORMAT, "digit after '.'"},
      {"{\"a\":1e}", DTRAIN_ERR_FORMAT, "digit in the exponent"},
      {"{\"a\":'x'}", DTRAIN_ERR_FORMAT, "expected a value"},
      {"{\"a\":[1 2]}", DTRAIN_ERR_FORMAT, "expected ',' or ']'"},
      /* duplicate keys */
      {"{\"cluster\":{\"worker\":[\"a:1\"]},\"cluster\":{}}", DTRAIN_ERR_FORMAT, "duplicate key \"cluster\""},
      {"{\"cluster\":{\"worker\":[\"a:1\"],\"worker\":[\"b:1\"]}}", DTRAIN_ERR_FORMAT, "duplicate key \"worker\""},
      {"{\"task\":{\"type\":\"ps\",\"type\":\"ps\"}}", DTRAIN_ERR_FORMAT, "duplicate key \"type\""},
      /* bad addresses */
      {"{\"cluster\":{\"worker\":[\"a\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "expected host:port"},
      {"{\"cluster\":{\"worker\":[\":1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "no host"},
      {"{\"cluster\":{\"worker\":[\"a:\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "no port"},
      {"{\"cluster\":{\"worker\":[\"a:65536\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "out of range"},
      {"{\"cluster\":{\"worker\":[\"a:123456\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "out of range"},
      {"{\"cluster\":{\"worker\":[\"a:1x\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "not a number"},
      {"{\"cluster\":{\"worker\":[\"a:-1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "not a number"},
      {"{\"cluster\":{\"worker\":[\"::1:7000\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "[v6]:port"},
      {"{\"cluster\":{\"worker\":[\"[::1]7000\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "expected [v6]:port"},
      {"{\"cluster\":{\"worker\":[\"[zz]:7000\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "bad IPv6"},
      {"{\"cluster\":{\"worker\":[\"a b:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "not allowed in a host name"},
      {"{\"cluster\":{\"worker\":[\"a\\u0000:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "NUL"},
      {"{\"cluster\":{\"worker\":[\"\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG, "empty"},
      /* duplicates, also across roles and ignoring case */
      {"{\"cluster\":{\"worker\":[\"a:1\",\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}", DTRAIN_ERR_INVALID_ARG,
       "worker 0 and worker 1 have the same address 'a:1'"},
      {"{\"cluster\":{\"worker\":[\"a:1\"],\"ps\":[\"b:1\",\"A:1\"]},\"task\":{\"type\":\"worker\",\"index\":0}}",
       DTRAIN_ERR_INVALID_ARG, "worker 0 and ps 1 have the same address"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    dt_cluster *c = (dt_cluster *)&k; /* must be reset to NULL */
    dt_result rc = dt_cluster_parse_json(cases[k].json, &c);
    CHECK_MSG(rc == cases[k].code, "case %zu (%s): got %s, expected %s (%s)", k, cases[k].json, dt_result_name(rc),
              dt_result_name(cases[k].code), dt_last_error());
    CHECK_MSG(strstr(dt_last_error(), cases[k].needle) != NULL, "case %zu (%s): message '%s' lacks '%s'", k,
              cases[k].json, dt_last_error(), cases[k].needle);
    CHECK(c == NULL);
  }
  /* Messages name the origin and the byte offset. */
  dt_cluster *c = NULL;
  CHECK_ERR(dt_cluster_parse_json("{\"cluster\" {}}", &c), DTRAIN_ERR_FORMAT, "cluster JSON: byte 11: expected ':'");
  CHECK_ERR(dt_cluster_parse_json("{\"a\":\x01}", &c), DTRAIN_ERR_FORMAT, "found byte 0x01");
  CHECK_ERR(dt_cluster_parse_json(NULL, &c), DTRAIN_ERR_NULL_ARG, "NULL");
  CHECK_ERR(dt_cluster_parse_json(k_valid, NULL), DTRAIN_ERR_NULL_ARG, "NULL");
  /* Over DTRAIN_MAX_PEERS addresses; exactly the maximum is fine. */
  size_t cap = (size_t)(DTRAIN_MAX_PEERS + 1) * 24 + 128;
  char *big = (char *)malloc(cap);
  if (!big) return;
  for (int count = DTRAIN_MAX_PEERS; count <= DTRAIN_MAX_PEERS + 1; count++) {
    size_t n = (size_t)sprintf(big, "{\"cluster\":{\"worker\":[");
    for (int k = 0; k < count; k++) n += (size_t)sprintf(big + n, "%s\"10.0.0.1:%d\"", k ? "," : "", 1000 + k);
    sprintf(big + n, "]},\"task\":{\"type\":\"worker\",\"index\":1023}}");
    c = NULL;
    if (count > DTRAIN_MAX_PEERS) {
      CHECK_ERR(dt_cluster_parse_json(big, &c), DTRAIN_ERR_INVALID_ARG, "more than 1024 worker addresses");
    } else {
      CHECK(dt_cluster_parse_json(big, &c) == DTRAIN_OK);
      if (c) CHECK(c->workers == DTRAIN_MAX_PEERS && c->index == 1023);
    }
    dt_cluster_destroy(c);
  }
  free(big);
}

/* Every proper prefix of a valid config is a FORMAT error naming a byte. */
static void test_truncated(void) {
  const char *texts[] = {
      k_valid,
      "{\"cluster\":{\"worker\":[\"a:1\"]},\"x\":[{\"y\":\"\\ud83d\\ude00\\n\"},-1.5e+3,true,null],"
      "\"task\":{\"type\":\"worker\",\"index\":0}}",
  };
  for (size_t t = 0; t < 2; t++) {
    size_t n = strlen(texts[t]);
    char *buf = (char *)malloc(n + 1);
    if (!buf) return;
    int bad = 0;
    for (size_t len = 0; len < n; len++) {
      memcpy(buf, texts[t], len);
      buf[len] = '\0';
      dt_cluster *c = NULL;
      dt_result rc = dt_cluster_parse_json(buf, &c);
      if (rc != DTRAIN_ERR_FORMAT || c != NULL || !strstr(dt_last_error(), "byte")) {
        if (bad++ < 5)
          CHECK_MSG(0, "prefix of %zu bytes: %s (%s)", len, dt_result_name(rc), dt_last_error());
      }
      dt_cluster_destroy(c);
    }
    CHECK(bad == 0);
    dt_cluster *c = NULL;
    CHECK(dt_cluster_parse_json(texts[t], &c) == DTRAIN_OK);
    dt_cluster_destroy(c);
    free(buf);
  }
}

static dt_result parse_worker_addr(const char *addr_json, char *out, size_t cap) {
  char text[512];
  snprintf(text, sizeof text, "{\"cluster\":{\"worker\":[\"%s\"]},\"task\":{\"type\":\"worker\",\"index\":0}}",
           addr_json);
  dt_cluster *c = NULL;
  dt_result rc = dt_cluster_parse_json(text, &c);
  if (c) {
    snprintf(out, cap, "%s", c->worker_addr[0]);
    dt_cluster_destroy(c);
  }
  return rc;
}

static void test_escapes_and_utf8(void) {
  char got[64];
  CHECK(parse_worker_addr("\\u0061\\u003A\\u0031", got, sizeof got) == DTRAIN_OK && strcmp(got, "a:1") == 0);
  CHECK(parse_worker_addr("a\\/b:1", got, sizeof got) == DTRAIN_ERR_INVALID_ARG); /* decodes to "a/b:1" */
  CHECK(strstr(dt_last_error(), "'a/b:1'") != NULL);
  CHECK_ERR(parse_worker_addr("a\\x:1", got, sizeof got), DTRAIN_ERR_FORMAT, "expected an escape");
  CHECK_ERR(parse_worker_addr("a\\u12:1", got, sizeof got), DTRAIN_ERR_FORMAT, "hex digit");
  CHECK_ERR(parse_worker_addr("a\\uD800:1", got, sizeof got), DTRAIN_ERR_FORMAT, "surrogate pair");
  CHECK_ERR(parse_worker_addr("a\\uD800\\u0041:1", got, sizeof got), DTRAIN_ERR_FORMAT, "low surrogate");
  CHECK_ERR(parse_worker_addr("a\\uDC00:1", got, sizeof got), DTRAIN_ERR_FORMAT, "lone low surrogate");
  CHECK_ERR(parse_worker_addr("a\tb:1", got, sizeof got), DTRAIN_ERR_FORMAT, "control characters must be escaped");
  /* Escaped control characters decode, then fail as a host name. */
  CHECK_ERR(parse_worker_addr("a\\tb:1", got, sizeof got), DTRAIN_ERR_INVALID_ARG, "host name (byte 0x09)");
  /* UTF-8: valid non-ASCII decodes (then is no host name); invalid forms are FORMAT errors. */
  CHECK_ERR(parse_worker_addr("caf\xc3\xa9:1", got, sizeof got), DTRAIN_ERR_INVALID_ARG, "host name (byte 0xc3)");
  CHECK_ERR(parse_worker_addr("\\u00e9:1", got, sizeof got), DTRAIN_ERR_INVALID_ARG, "host name (byte 0xc3)");
  CHECK_ERR(parse_worker_addr("\xc3:1", got, sizeof got), DTRAIN_ERR_FORMAT, "continuation");
  CHECK_ERR(parse_worker_addr("\xc0\x80:1", got, sizeof got), DTRAIN_ERR_FORMAT, "valid UTF-8");      /* overlong NUL */
  CHECK_ERR(parse_worker_addr("\xe0\x80\x80:1", got, sizeof got), DTRAIN_ERR_FORMAT, "overlong");     /* overlong */
  CHECK_ERR(parse_worker_addr("\xed\xa0\x80:1", got, sizeof got), DTRAIN_ERR_FORMAT, "surrogate");    /* U+D800 */
  CHECK_ERR(parse_worker_addr("\xf4\x90\x80\x80:1", got, sizeof got), DTRAIN_ERR_FORMAT, "too large"); /* > U+10FFFF */
  CHECK_ERR(parse_worker_addr("\xff:1", got, sizeof got), DTRAIN_ERR_FORMAT, "valid UTF-8");
  CHECK_ERR(parse_worker_addr("\x80:1", got, sizeof got), DTRAIN_ERR_FORMAT, "valid UTF-8");
  /* A very long address is refused, not truncated. */
  char longa[300];
  memset(longa, 'a', 280);
  strcpy(longa + 280, ":1");
  CHECK_ERR(parse_worker_addr(longa, got, sizeof got), DTRAIN_ERR_INVALID_ARG, "longer than 255");
}

static void test_nesting(void) {
  char buf[400];
  /* Inside an ignored key: 30 levels are fine, 40 are refused. */
  for (int depth = 30; depth <= 40; depth += 10) {
    int n = sprintf(buf, "{\"cluster\":{\"worker\":[\"a:1\"]},\"task\":{\"type\":\"worker\",\"index\":0},\"x\":");
    for (int k = 0; k < depth; k++) buf[n++] = k % 2 ? '[' : '{', n += k % 2 ? 0 : sprintf(buf + n, "\"k\":");
    for (int k = depth - 1; k >= 0; k--) buf[n++] = k % 2 ? ']' : '}';
    buf[n++] = '}';
    buf[n] = '\0';
    dt_cluster *c = NULL;
    dt_result rc = dt_cluster_parse_json(buf, &c);
    if (depth == 30)
      CHECK_MSG(rc == DTRAIN_OK, "%s", dt_last_error());
    else
      CHECK_ERR(rc, DTRAIN_ERR_FORMAT, "nesting deeper than 32");
    dt_cluster_destroy(c);
  }
  /* A hundred thousand '[' does not overflow the stack. */
  size_t n = 100000;
  char *deep = (char *)malloc(n + 16);
  if (!deep) return;
  strcpy(deep, "{\"x\":");
  memset(deep + 5, '[', n);
  deep[5 + n] = '\0';
  dt_cluster *c = NULL;
  CHECK_ERR(dt_cluster_parse_json(deep, &c), DTRAIN_ERR_FORMAT, "nesting deeper");
  free(deep);
}

static uint64_t rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int same_cluster(const dt_cluster *a, const dt_cluster *b) {
  if (a->workers != b->workers || a->servers != b->servers || a->role != b->role || a->index != b->index) return 0;
  for (int k = 0; k < a->workers; k++)
    if (strcmp(a->worker_addr[k], b->worker_addr[k]) != 0) return 0;
  for (int k = 0; k < a->servers; k++)
    if (strcmp(a->server_addr[k], b->server_addr[k]) != 0) return 0;
  return 1;
}

/* Random bytes and random mutations of a valid config: an error code or a
 * cluster that round-trips, never a crash (ASan checks the reads). */
static void test_garbage(void) {
  uint64_t s = 12345;
  char buf[256];
  int odd = 0, accepted = 0;
  const char *alphabet = "{}[]\":,0123456789.eE+-\\u tfnrlsa ";
  for (int it = 0; it < 20000; it++) {
    size_t len = (size_t)(rng_next(&s) % 200);
    int mode = it % 3;
    if (mode == 0) { /* raw bytes */
      for (size_t k = 0; k < len; k++) buf[k] = (char)(1 + rng_next(&s) % 255);
      buf[len] = '\0';
    } else if (mode == 1) { /* JSON-ish alphabet */
      size_t an = strlen(alphabet);
      for (size_t k = 0; k < len; k++) buf[k] = alphabet[rng_next(&s) % an];
      buf[len] = '\0';
    } else { /* mutate a valid config in 1..3 places */
      strcpy(buf, k_valid);
      size_t n = strlen(buf);
      int m = 1 + (int)(rng_next(&s) % 3);
      for (int j = 0; j < m; j++) buf[rng_next(&s) % n] = (char)(1 + rng_next(&s) % 255);
    }
    dt_cluster *c = NULL;
    dt_result rc = dt_cluster_parse_json(buf, &c);
    if (rc == DTRAIN_OK) {
      accepted++;
      char json[512];
      dt_cluster *d = NULL;
      if (!c || dt_cluster_to_json(c, json, sizeof json) != DTRAIN_OK || dt_cluster_parse_json(json, &d) != DTRAIN_OK ||
          !same_cluster(c, d))
        odd++;
      dt_cluster_destroy(d);
    } else if ((rc != DTRAIN_ERR_FORMAT && rc != DTRAIN_ERR_INVALID_ARG) || c != NULL || !dt_last_error()[0]) {
      odd++;
    }
    dt_cluster_destroy(c);
  }
  CHECK_MSG(odd == 0, "%d odd results", odd);
  CHECK(accepted > 0); /* some mutations (inside addresses' digits, say) stay valid */
}

static void test_to_json_round_trip(void) {
  dt_cluster *c = NULL, *d = NULL;
  CHECK(dt_cluster_parse_json(k_valid, &c) == DTRAIN_OK);
  if (!c) return;
  char json[512];
  CHECK(dt_cluster_to_json(c, json, sizeof json) == DTRAIN_OK);
  CHECK(strcmp(json, "{\"cluster\":{\"worker\":[\"127.0.0.1:7000\",\"127.0.0.1:7001\"],\"ps\":[\"[::1]:7100\"]},"
                     "\"task\":{\"type\":\"worker\",\"index\":1}}") == 0);
  CHECK(dt_cluster_parse_json(json, &d) == DTRAIN_OK);
  if (d) CHECK(same_cluster(c, d));
  dt_cluster_destroy(d);
  d = NULL;
  /* A layout survives the round trip; absent, it reads as 1 x 1. */
  CHECK(c->pipeline == 1 && c->tensor == 1);
  {
    dt_cluster *e = NULL, *f = NULL;
    const char *lj = "{\"cluster\":{\"worker\":[\"a:1\",\"a:2\",\"a:3\",\"a:4\"]},\"task\":{\"type\":\"worker\","
                     "\"index\":3},\"layout\":{\"tensor\":2,\"pipeline\":2}}";
    CHECK(dt_cluster_parse_json(lj, &e) == DTRAIN_OK);
    if (e) {
      CHECK(e->pipeline == 2 && e->tensor == 2);
      char lb[512];
      CHECK(dt_cluster_to_json(e, lb, sizeof lb) == DTRAIN_OK && strstr(lb, ",\"layout\":{\"pipeline\":2,\"tensor\":2}}") != NULL);
      CHECK(dt_cluster_parse_json(lb, &f) == DTRAIN_OK && f && f->pipeline == 2 && f->tensor == 2);
      dt_cluster *g = dt_cluster_clone(e);
      CHECK(g && g->pipeline == 2 && g->tensor == 2);
      dt_cluster_destroy(g);
    }
    dt_cluster_destroy(e);
    dt_cluster_destroy(f);
  }
  /* Exactly enough room, one byte less, none. */
  size_t need = strlen(json) + 1;
  char small[512];
  memset(small, 'x', sizeof small);
  CHECK(dt_cluster_to_json(c, small, need) == DTRAIN_OK && strcmp(small, json) == 0);
  CHECK_ERR(dt_cluster_to_json(c, small, need - 1), DTRAIN_ERR_OVERFLOW, "needs");
  CHECK(small[0] == '\0');
  CHECK(dt_cluster_to_json(c, NULL, 0) == DTRAIN_ERR_OVERFLOW);
  CHECK(dt_cluster_to_json(NULL, small, sizeof small) == DTRAIN_ERR_NULL_ARG);
  /* A server's config round-trips too. */
  c->role = DTRAIN_ROLE_PS;
  c->index = 0;
  CHECK(dt_cluster_to_json(c, json, sizeof json) == DTRAIN_OK);
  d = NULL;
  CHECK(dt_cluster_parse_json(json, &d) == DTRAIN_OK);
  if (d) CHECK(same_cluster(c, d) && d->role == DTRAIN_ROLE_PS);
  dt_cluster_destroy(d);
  /* A hand-made invalid cluster is refused, not written. */
  c->index = 5;
  CHECK_ERR(dt_cluster_to_json(c, json, sizeof json), DTRAIN_ERR_INVALID_ARG, "out of range");
  dt_cluster_destroy(c);
}

static void test_clone_describe(void) {
  dt_cluster *c = NULL;
  CHECK(dt_cluster_parse_json(k_valid, &c) == DTRAIN_OK);
  if (!c) return;
  dt_cluster *d = dt_cluster_clone(c);
  CHECK(d != NULL);
  if (d) {
    CHECK(same_cluster(c, d));
    CHECK(d->worker_addr[0] != c->worker_addr[0]); /* its own strings */
  }
  dt_cluster_destroy(c);
  char buf[64];
  if (d) {
    CHECK(strcmp(dt_cluster_describe(d, DTRAIN_ROLE_WORKER, 1, buf, sizeof buf), "worker 1 (127.0.0.1:7001)") == 0);
    CHECK(strcmp(dt_cluster_describe(d, DTRAIN_ROLE_PS, 0, buf, sizeof buf), "ps 0 ([::1]:7100)") == 0);
    CHECK(strcmp(dt_cluster_describe(d, DTRAIN_ROLE_PS, 3, buf, sizeof buf), "ps 3") == 0);
    CHECK(strcmp(dt_cluster_describe(d, DTRAIN_ROLE_WORKER, 0, buf, 9), "worker 0") == 0); /* truncated */
  }
  CHECK(strcmp(dt_cluster_describe(NULL, DTRAIN_ROLE_WORKER, 2, buf, sizeof buf), "worker 2") == 0);
  dt_cluster_destroy(d);
  /* A hand-made cluster clones; an invalid one does not. */
  char *w[2] = {(char *)"h:1", (char *)"h:2"};
  dt_cluster hand;
  memset(&hand, 0, sizeof hand);
  hand.workers = 2;
  hand.worker_addr = w;
  hand.index = 1;
  d = dt_cluster_clone(&hand);
  CHECK(d && same_cluster(&hand, d));
  dt_cluster_destroy(d);
  w[1] = (char *)"h:1";
  CHECK(dt_cluster_clone(&hand) == NULL);
  CHECK(strstr(dt_last_error(), "same address") != NULL);
  CHECK(dt_cluster_clone(NULL) == NULL);
}

/* argv from words; argv[argc] is NULL like main's. */
typedef struct args {
  int argc;
  char *argv[16];
} args;

static void args_set(args *a, const char *const *words) {
  a->argc = 0;
  for (; *words; words++) a->argv[a->argc++] = (char *)*words;
  a->argv[a->argc] = NULL;
}

static int args_are(const args *a, const char *const *words) {
  int k = 0;
  for (; words[k]; k++)
    if (k >= a->argc || strcmp(a->argv[k], words[k]) != 0) return 0;
  return k == a->argc && a->argv[a->argc] == NULL;
}

static void test_args(void) {
  args a;
  dt_cluster *c = NULL;
  {
    const char *in[] = {"prog", "--epochs", "3", "--rank", "1", "--peers=a:1,b:2,[::1]:3", "--lr=0.1", "--ps", "c:4", NULL};
    const char *rest[] = {"prog", "--epochs", "3", "--lr=0.1", NULL};
    args_set(&a, in);
    CHECK(dt_cluster_from_args(&a.argc, a.argv, &c) == DTRAIN_OK);
    CHECK(args_are(&a, rest));
    if (c) {
      CHECK(c->workers == 3 && c->servers == 1 && c->role == DTRAIN_ROLE_WORKER && c->index == 1);
      CHECK(strcmp(c->worker_addr[2], "[::1]:3") == 0 && strcmp(c->server_addr[0], "c:4") == 0);
    }
    dt_cluster_destroy(c);
  }
  {
    /* --world alone: 127.0.0.1 from --port; --ps M servers after the workers; flags after "--" stay. */
    const char *in[] = {"prog", "--world", "2", "--port=7000", "--role=ps", "--rank", "0", "--ps", "2", "--", "--rank", "9", NULL};
    const char *rest[] = {"prog", "--", "--rank", "9", NULL};
    args_set(&a, in);
    c = NULL;
    CHECK(dt_cluster_from_args(&a.argc, a.argv, &c) == DTRAIN_OK);
    CHECK(args_are(&a, rest));
    if (c) {
      CHECK(c->workers == 2 && c->servers == 2 && c->role == DTRAIN_ROLE_PS && c->index == 0);
      CHECK(strcmp(c->worker_addr[0], "127.0.0.1:7000") == 0 && strcmp(c->worker_addr[1], "127.0.0.1:7001") == 0);
      CHECK(strcmp(c->server_addr[0], "127.0.0.1:7002") == 0 && strcmp(c->server_addr[1], "127.0.0.1:7003") == 0);
    }
    dt_cluster_destroy(c);
  }
  {
    /* Default base port 29500; --world agreeing with --peers is fine. */
    const char *in[] = {"prog", "--rank=2", "--world=3", NULL};
    args_set(&a, in);
    c = NULL;
    CHECK(dt_cluster_from_args(&a.argc, a.argv, &c) == DTRAIN_OK && a.argc == 1 && a.argv[1] == NULL);
    if (c) CHECK(strcmp(c->worker_addr[2], "127.0.0.1:29502") == 0 && c->index == 2);
    dt_cluster_destroy(c);
    const char *in2[] = {"prog", "--rank=0", "--world=2", "--peers=a:1,b:1", NULL};
    args_set(&a, in2);
    c = NULL;
    CHECK(dt_cluster_from_args(&a.argc, a.argv, &c) == DTRAIN_OK && a.argc == 1);
    dt_cluster_destroy(c);
  }
  {
    /* None of ours (--port alone, look-alikes): NOT_FOUND, argv untouched. */
    const char *in[] = {"prog", "--port", "80", "--ranks", "1", "--rank-x", "-rank", "1", NULL};
    args_set(&a, in);
    c = NULL;
    CHECK_ERR(dt_cluster_from_args(&a.argc, a.argv, &c), DTRAIN_ERR_NOT_FOUND, "none of");
    CHECK(args_are(&a, in) && c == NULL);
  }
  /* Errors leave argv untouched. */
  static const struct {
    const char *w[8];
    const char *needle;
  } bad[] = {
      {{"prog", "--world", "2", NULL}, "--rank is missing"},
      {{"prog", "--rank", NULL}, "--rank needs a value"},
      {{"prog", "--rank", "0", "--rank=1", "--world=2", NULL}, "--rank given twice"},
      {{"prog", "--rank", "x", "--world=2", NULL}, "--rank 'x' is not a number"},
      {{"prog", "--rank", "-1", "--world=2", NULL}, "is not a number"},
      {{"prog", "--rank", "2", "--world=2", NULL}, "out of range"},
      {{"prog", "--rank", "0", "--world=0", NULL}, "--world '0'"},
      {{"prog", "--rank", "0", NULL}, "need --peers or --world"},
      {{"prog", "--rank", "0", "--world=3", "--peers=a:1,b:1", NULL}, "--world 3 but --peers lists 2 addresses"},
      {{"prog", "--rank", "0", "--peers=a:1,,b:1", NULL}, "--peers: address 1 '' is empty"},
      {{"prog", "--rank", "0", "--peers=a:1,a:1", NULL}, "same address"},
      {{"prog", "--rank", "0", "--peers=a:1", "--port=5", NULL}, "--port applies to --world"},
      {{"prog", "--rank", "0", "--peers=a:1", "--ps=2", NULL}, "(a count) needs --world"},
      {{"prog", "--rank", "0", "--peers=a:1", "--ps=b", NULL}, "--ps: address 0 'b' expected host:port"},
      {{"prog", "--rank", "0", "--world=2", "--role=chief", NULL}, "--role 'chief' is not worker or ps"},
      {{"prog", "--rank", "0", "--world=2", "--port=65535", NULL}, "go past 65535"},
      {{"prog", "--rank", "0", "--world=2", "--port=70000", NULL}, "--port '70000'"},
      {{"prog", "--rank", "0", "--world=1", "--role=ps", NULL}, "0 parameter servers"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    args_set(&a, bad[k].w);
    c = NULL;
    dt_result rc = dt_cluster_from_args(&a.argc, a.argv, &c);
    CHECK_MSG(rc == DTRAIN_ERR_INVALID_ARG && strstr(dt_last_error(), bad[k].needle), "bad args %zu: %s '%s' (want '%s')",
              k, dt_result_name(rc), dt_last_error(), bad[k].needle);
    CHECK(args_are(&a, bad[k].w) && c == NULL);
  }
  int n = 1;
  CHECK(dt_cluster_from_args(&n, NULL, &c) == DTRAIN_ERR_NULL_ARG);
  CHECK(dt_cluster_from_args(NULL, a.argv, &c) == DTRAIN_ERR_NULL_ARG);
}

static void test_env_and_discover(void) {
  dt_cluster *c = NULL;
  unsetenv("DTRAIN_CONFIG");
  CHECK_ERR(dt_cluster_from_env(&c), DTRAIN_ERR_NOT_FOUND, "DTRAIN_CONFIG is not set");
  setenv("DTRAIN_CONFIG", "", 1);
  CHECK(dt_cluster_from_env(&c) == DTRAIN_ERR_NOT_FOUND);
  setenv("DTRAIN_CONFIG", "{\"cluster\":{\"worker\":[\"a:1\"]}", 1);
  CHECK_ERR(dt_cluster_from_env(&c), DTRAIN_ERR_FORMAT, "DTRAIN_CONFIG: byte 29: expected ',' or '}', found end of text");
  setenv("DTRAIN_CONFIG", k_valid, 1);
  CHECK(dt_cluster_from_env(&c) == DTRAIN_OK && c && c->index == 1);
  dt_cluster_destroy(c);

  /* discover: flags win over the environment ... */
  args a;
  const char *in[] = {"prog", "--rank", "0", "--world", "1", "x", NULL};
  const char *rest[] = {"prog", "x", NULL};
  args_set(&a, in);
  c = NULL;
  CHECK(dt_cluster_discover(&a.argc, a.argv, &c) == DTRAIN_OK && c && c->workers == 1);
  CHECK(args_are(&a, rest));
  dt_cluster_destroy(c);
  /* ... the environment when there are no flags ... */
  c = NULL;
  CHECK(dt_cluster_discover(&a.argc, a.argv, &c) == DTRAIN_OK && c && c->workers == 2 && c->index == 1);
  dt_cluster_destroy(c);
  /* ... and bad flags or a bad environment are errors, not a fallback. */
  const char *badf[] = {"prog", "--rank", "0", NULL};
  args_set(&a, badf);
  c = NULL;
  CHECK(dt_cluster_discover(&a.argc, a.argv, &c) == DTRAIN_ERR_INVALID_ARG && c == NULL);
  setenv("DTRAIN_CONFIG", "{", 1);
  CHECK(dt_cluster_discover(NULL, NULL, &c) == DTRAIN_ERR_FORMAT && c == NULL);
  /* Neither: one worker at 127.0.0.1:0. */
  unsetenv("DTRAIN_CONFIG");
  CHECK(dt_cluster_discover(NULL, NULL, &c) == DTRAIN_OK);
  if (c) {
    CHECK(c->workers == 1 && c->servers == 0 && c->index == 0 && c->role == DTRAIN_ROLE_WORKER);
    CHECK(strcmp(c->worker_addr[0], "127.0.0.1:0") == 0);
    char json[128];
    CHECK(dt_cluster_to_json(c, json, sizeof json) == DTRAIN_OK);
    dt_cluster_destroy(c);
  }
}

int main(void) {
  if (!(dt_build_features() & DTRAIN_FEATURE_DIST)) {
    th_skip_item("test_cluster", "the cluster parser is compiled out (DTRAIN_NO_DIST)");
    return th_summary("test_cluster");
  }
  TH_RUN(test_parse_valid);
  TH_RUN(test_parse_errors);
  TH_RUN(test_truncated);
  TH_RUN(test_escapes_and_utf8);
  TH_RUN(test_nesting);
  TH_RUN(test_garbage);
  TH_RUN(test_to_json_round_trip);
  TH_RUN(test_clone_describe);
  TH_RUN(test_args);
  TH_RUN(test_env_and_discover);
  return th_summary("test_cluster");
}
