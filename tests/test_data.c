/* Data: CRC-32, the inflater (hand-made stored/fixed/dynamic blocks, files made
 * by the system gzip), gzip corruption, IDX (the shipped Fashion-MNIST split and
 * broken files), CSV, NPY (round trips, NumPy cross-check), text corpora,
 * datasets, and the loader (order, resume, shards, split, no allocation). */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------------- */

static long alloc_calls, free_calls;
static size_t alloc_max;              /* the largest single allocation */
static size_t alloc_now, alloc_peak;  /* bytes outstanding, and their peak */
static void *count_alloc(size_t size, size_t align, void *user) {
  (void)user;
  if (size > alloc_max) alloc_max = size;
  size_t rounded = (size + align - 1) / align * align;
  void *p = th_aligned_alloc(align, rounded);
  if (p) {
    alloc_calls++;
    alloc_now += size;
    if (alloc_now > alloc_peak) alloc_peak = alloc_now;
  }
  return p;
}
static void count_free(void *p, size_t size, void *user) {
  (void)user;
  if (!p) return;
  free_calls++;
  alloc_now -= size;
  th_aligned_free(p);
}
static void counting_on(void) {
  dt_allocator al = {count_alloc, count_free, NULL};
  dt_set_allocator(&al);
  alloc_calls = free_calls = 0;
  alloc_max = alloc_now = alloc_peak = 0;
}

static char tmpdir[256];
static char root[512]; /* the repository root (where data/ lives) */

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dtrain_test_data_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    exit(1);
  }
}
static void tmp_path(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", tmpdir, name); }
static void root_path(char *buf, size_t cap, const char *rel) { snprintf(buf, cap, "%s/%s", root, rel); }

static void find_root(void) {
  /* Tests run from the repository root; fall back to this file's directory. */
  FILE *f = fopen("data/fashion-mnist/t10k-labels-idx1-ubyte.gz", "rb");
  if (f) {
    fclose(f);
    snprintf(root, sizeof root, ".");
    return;
  }
  const char *file = __FILE__, *slash = strrchr(file, '/');
  if (slash) snprintf(root, sizeof root, "%.*s/..", (int)(slash - file), file);
  else snprintf(root, sizeof root, "..");
}

static int write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  int ok = fwrite(data, 1, n, f) == n;
  return fclose(f) == 0 && ok;
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, len = 0;
  unsigned char *b = (unsigned char *)malloc(cap);
  for (;;) {
    if (len == cap) b = (unsigned char *)realloc(b, cap *= 2);
    size_t got = fread(b + len, 1, cap - len, f);
    if (got == 0) break;
    len += got;
  }
  fclose(f);
  *n = len;
  return b;
}

static int have_gzip(void) { return system("gzip --version >/dev/null 2>&1") == 0; }

/* Test data: text-like with a skewed alphabet (long Huffman codes), runs,
 * repeats at many distances, and a stretch of random bytes. */
static unsigned char *make_sample(size_t n) {
  unsigned char *d = (unsigned char *)malloc(n);
  th_seed(7);
  size_t i = 0;
  while (i < n) {
    double r = th_rand();
    if (r < 0.6) { /* skewed letters */
      double u = th_rand();
      int k = (int)(u * u * u * 60);
      d[i++] = (unsigned char)(' ' + k);
    } else if (r < 0.8 && i > 300) { /* copy from far back */
      size_t dist = 1 + (size_t)(th_rand() * (i < 32768 ? i - 1 : 32767));
      size_t len = 3 + (size_t)(th_rand() * 255);
      for (size_t k = 0; k < len && i < n; k++, i++) d[i] = d[i - dist];
    } else if (r < 0.9) { /* run */
      unsigned char c = (unsigned char)(th_rand() * 256);
      size_t len = 1 + (size_t)(th_rand() * 400);
      for (size_t k = 0; k < len && i < n; k++) d[i++] = c;
    } else { /* random */
      size_t len = 1 + (size_t)(th_rand() * 2000);
      for (size_t k = 0; k < len && i < n; k++) d[i++] = (unsigned char)(th_rand() * 256);
    }
  }
  return d;
}

/* LSB-first bit writer for hand-made deflate streams. */
typedef struct bitw { unsigned char buf[4096]; size_t n; int bit; } bitw;
static void bw_init(bitw *w) { memset(w, 0, sizeof *w); }
static void bw_bits(bitw *w, unsigned v, int n) { /* value, LSB first */
  for (int i = 0; i < n; i++) {
    if (w->bit == 0) w->buf[w->n++] = 0;
    w->buf[w->n - 1] |= (unsigned char)(((v >> i) & 1u) << w->bit);
    w->bit = (w->bit + 1) & 7;
  }
}
static void bw_code(bitw *w, unsigned code, int n) { /* Huffman code, MSB first */
  for (int i = n - 1; i >= 0; i--) bw_bits(w, (code >> i) & 1u, 1);
}
/* Fixed Huffman literal/length symbol. */
static void bw_fixed_sym(bitw *w, unsigned sym) {
  if (sym < 144) bw_code(w, 0x30 + sym, 8);
  else if (sym < 256) bw_code(w, 0x190 + (sym - 144), 9);
  else if (sym < 280) bw_code(w, sym - 256, 7);
  else bw_code(w, 0xC0 + (sym - 280), 8);
}
/* A match with length 3..10 (codes 257..264, no extra bits) and distance 1..4 (codes 0..3). */
static void bw_fixed_match(bitw *w, unsigned len, unsigned dist) {
  bw_fixed_sym(w, 257 + (len - 3));
  bw_code(w, dist - 1, 5);
}

/* A gzip member around stored blocks, built by hand (CRC from dt_crc32). */
static unsigned char *gzip_stored(const unsigned char *data, size_t n, size_t *outn) {
  size_t blocks = n / 65535 + 1, cap = 18 + n + 5 * blocks;
  unsigned char *g = (unsigned char *)malloc(cap), *p = g;
  const unsigned char hdr[10] = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3};
  memcpy(p, hdr, 10);
  p += 10;
  size_t left = n, off = 0;
  do {
    size_t k = left > 65535 ? 65535 : left;
    *p++ = (unsigned char)(k == left ? 1 : 0);
    *p++ = (unsigned char)(k & 0xFF);
    *p++ = (unsigned char)(k >> 8);
    *p++ = (unsigned char)(~k & 0xFF);
    *p++ = (unsigned char)((~k >> 8) & 0xFF);
    memcpy(p, data + off, k);
    p += k;
    off += k;
    left -= k;
  } while (left);
  uint32_t crc = dt_crc32(0, data, n);
  for (int i = 0; i < 4; i++) *p++ = (unsigned char)(crc >> (8 * i));
  for (int i = 0; i < 4; i++) *p++ = (unsigned char)((uint32_t)n >> (8 * i));
  *outn = (size_t)(p - g);
  return g;
}

static int zlib_build(void) { return (dt_build_features() & DTRAIN_FEATURE_ZLIB) != 0; }

/* ---- CRC-32 and hand-made deflate streams -------------------------------------------- */

static void test_crc32(void) {
  CHECK(dt_crc32(0, "123456789", 9) == 0xCBF43926u);
  CHECK(dt_crc32(0, "", 0) == 0);
  /* Incremental equals one shot. */
  uint32_t c = dt_crc32(0, "1234", 4);
  CHECK(dt_crc32(c, "56789", 5) == 0xCBF43926u);
}

static void test_inflate_stored_blocks(void) {
  /* Two stored blocks, the first not final, then an empty final one. */
  const unsigned char s[] = {0x00, 3, 0, 0xFC, 0xFF, 'a', 'b', 'c', 0x00, 2, 0, 0xFD, 0xFF, 'd', 'e',
                             0x01, 0, 0, 0xFF, 0xFF};
  dt_bytes o;
  CHECK(dt_inflate(s, sizeof s, 0, &o) == DTRAIN_OK);
  CHECK(o.size == 5 && memcmp(o.data, "abcde", 5) == 0 && o.data[5] == 0);
  dt_bytes_free(&o);
  CHECK(o.data == NULL && o.size == 0);
  /* LEN/NLEN disagree. */
  unsigned char bad[sizeof s];
  memcpy(bad, s, sizeof s);
  bad[3] = 0xFB;
  CHECK_ERR(dt_inflate(bad, sizeof bad, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "LEN/NLEN") != NULL);
  CHECK(o.data == NULL);
  /* Stored block longer than the input. */
  const unsigned char shortb[] = {0x01, 10, 0, 0xF5, 0xFF, 'a', 'b'};
  CHECK_ERR(dt_inflate(shortb, sizeof shortb, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  /* Every truncation of the good stream fails cleanly. */
  for (size_t n = 0; n < sizeof s; n++) CHECK(dt_inflate(s, n, 0, &o) == DTRAIN_ERR_CORRUPT);
}

static void test_inflate_fixed_blocks(void) {
  bitw w;
  dt_bytes o;
  /* "abcabcabcabc": 3 literals, then length 9 at distance 3 (overlapping copy). */
  bw_init(&w);
  bw_bits(&w, 1, 1); /* BFINAL */
  bw_bits(&w, 1, 2); /* BTYPE 01: fixed Huffman */
  bw_fixed_sym(&w, 'a');
  bw_fixed_sym(&w, 'b');
  bw_fixed_sym(&w, 'c');
  bw_fixed_match(&w, 9, 3);
  bw_fixed_sym(&w, 0xE9); /* a 9-bit literal */
  bw_fixed_sym(&w, 256);
  CHECK(dt_inflate(w.buf, w.n, 0, &o) == DTRAIN_OK);
  CHECK(o.size == 13 && memcmp(o.data, "abcabcabcabc\xE9", 13) == 0);
  dt_bytes_free(&o);
  /* Run-length: one literal then distance 1. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'z');
  bw_fixed_match(&w, 10, 1);
  bw_fixed_sym(&w, 256);
  CHECK(dt_inflate(w.buf, w.n, 0, &o) == DTRAIN_OK);
  CHECK(o.size == 11 && memcmp(o.data, "zzzzzzzzzzz", 11) == 0);
  dt_bytes_free(&o);
  /* Distance further back than the output so far. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'a');
  bw_fixed_sym(&w, 'b');
  bw_fixed_match(&w, 3, 3);
  bw_fixed_sym(&w, 256);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "too far back") != NULL);
  /* Literal/length symbol 286 is invalid. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'a');
  bw_fixed_sym(&w, 286);
  bw_fixed_sym(&w, 256);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  /* Distance symbol 30 is invalid. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'a');
  bw_fixed_sym(&w, 257);
  bw_code(&w, 30, 5);
  bw_fixed_sym(&w, 256);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  /* Block type 3. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 3, 2);
  bw_bits(&w, 0, 16);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "block type") != NULL);
  /* No end-of-block: truncated. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'a');
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  /* Output limit. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 1, 2);
  bw_fixed_sym(&w, 'z');
  for (int i = 0; i < 10; i++) bw_fixed_match(&w, 10, 1);
  bw_fixed_sym(&w, 256);
  CHECK(dt_inflate(w.buf, w.n, 0, &o) == DTRAIN_OK && o.size == 101);
  dt_bytes_free(&o);
  CHECK_ERR(dt_inflate(w.buf, w.n, 50, &o), DTRAIN_ERR_OVERFLOW, "exceeds the limit");
  CHECK(o.data == NULL);
}

static void test_inflate_dynamic_errors(void) {
  bitw w;
  dt_bytes o;
  /* HLIT = 287 codes is more than deflate allows. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 2, 2); /* dynamic */
  bw_bits(&w, 30, 5);
  bw_bits(&w, 0, 5);
  bw_bits(&w, 15, 4);
  for (int i = 0; i < 19; i++) bw_bits(&w, 4, 3);
  bw_bits(&w, 0, 32);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "HLIT") != NULL);
  /* Code-length code with 19 codes of length 1: over-subscribed. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 2, 2);
  bw_bits(&w, 0, 5);
  bw_bits(&w, 0, 5);
  bw_bits(&w, 15, 4);
  for (int i = 0; i < 19; i++) bw_bits(&w, 1, 3);
  bw_bits(&w, 0, 32);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "over-subscribed") != NULL);
  /* A repeat (16) as the very first code length. Code-length code: symbols
   * 16 and 0 with 1-bit codes (complete); 16 is the first in the order. */
  bw_init(&w);
  bw_bits(&w, 1, 1);
  bw_bits(&w, 2, 2);
  bw_bits(&w, 0, 5);
  bw_bits(&w, 0, 5);
  bw_bits(&w, 0, 4);   /* HCLEN 4: lengths for 16, 17, 18, 0 */
  bw_bits(&w, 1, 3);   /* 16: length 1 */
  bw_bits(&w, 0, 3);   /* 17: none */
  bw_bits(&w, 0, 3);   /* 18: none */
  bw_bits(&w, 1, 3);   /* 0: length 1 */
  bw_code(&w, 1, 1);   /* canonical: 0 -> code 0, 16 -> code 1 */
  bw_bits(&w, 0, 32);
  CHECK_ERR(dt_inflate(w.buf, w.n, 0, &o), DTRAIN_ERR_CORRUPT, "corrupt");
  if (!zlib_build()) CHECK(strstr(dt_last_error(), "repeat") != NULL);
}

/* ---- gzip files made by the system gzip -------------------------------------------------- */

static void check_gunzip_file(const char *gzpath, const unsigned char *want, size_t n, const char *what) {
  size_t gn = 0;
  unsigned char *g = slurp(gzpath, &gn);
  CHECK_MSG(g != NULL, "%s: %s missing", what, gzpath);
  if (!g) return;
  dt_bytes o;
  dt_result r = dt_gunzip(g, gn, 0, &o);
  CHECK_MSG(r == DTRAIN_OK, "%s: %s", what, dt_last_error());
  CHECK_MSG(r == DTRAIN_OK && o.size == n && memcmp(o.data, want, n) == 0, "%s: output differs (%zu vs %zu bytes)", what,
            o.size, n);
  dt_bytes_free(&o);
  /* The same through the file reader. */
  r = dt_read_file_gz(gzpath, &o);
  CHECK_MSG(r == DTRAIN_OK && o.size == n && memcmp(o.data, want, n) == 0, "%s (dt_read_file_gz): %s", what,
            dt_last_error());
  dt_bytes_free(&o);
  free(g);
}

static void test_gunzip_system_gzip(void) {
  if (!have_gzip()) TH_SKIP("no gzip command");
  char raw[512], gz[512], cmd[2048];
  const size_t n = 700000;
  unsigned char *d = make_sample(n);
  tmp_path(raw, sizeof raw, "sample.bin");
  CHECK(write_file(raw, d, n));
  const char *modes[][2] = {{"-1 -n", "l1.gz"}, {"-9 -n", "l9.gz"}, {"-6", "named.gz"}, {"-9", "named9.gz"}};
  for (int m = 0; m < 4; m++) {
    tmp_path(gz, sizeof gz, modes[m][1]);
    snprintf(cmd, sizeof cmd, "gzip %s -c '%s' > '%s'", modes[m][0], raw, gz);
    CHECK(system(cmd) == 0);
    check_gunzip_file(gz, d, n, modes[m][0]);
  }
  /* gzip (without -n) really stored the name: FNAME is set. */
  size_t gn = 0;
  tmp_path(gz, sizeof gz, "named.gz");
  unsigned char *g = slurp(gz, &gn);
  CHECK(g && gn > 10 && (g[3] & 0x08));
  free(g);
  /* Two members concatenated are one stream. */
  char gz2[512];
  tmp_path(gz2, sizeof gz2, "two.gz");
  snprintf(cmd, sizeof cmd, "cat '%s/l1.gz' '%s/l9.gz' > '%s'", tmpdir, tmpdir, gz2);
  CHECK(system(cmd) == 0);
  unsigned char *dd = (unsigned char *)malloc(2 * n);
  memcpy(dd, d, n);
  memcpy(dd + n, d, n);
  check_gunzip_file(gz2, dd, 2 * n, "two members");
  free(dd);
  /* Small and empty inputs. */
  const char *small[] = {"", "a", "hello hello hello hello"};
  for (int i = 0; i < 3; i++) {
    tmp_path(raw, sizeof raw, "small.txt");
    CHECK(write_file(raw, small[i], strlen(small[i])));
    tmp_path(gz, sizeof gz, "small.gz");
    snprintf(cmd, sizeof cmd, "gzip -9 -c '%s' > '%s'", raw, gz);
    CHECK(system(cmd) == 0);
    check_gunzip_file(gz, (const unsigned char *)small[i], strlen(small[i]), small[i]);
  }
  /* Incompressible data (gzip falls back to stored blocks). */
  unsigned char *rnd = (unsigned char *)malloc(200000);
  for (int i = 0; i < 200000; i++) rnd[i] = (unsigned char)(th_rand() * 256);
  tmp_path(raw, sizeof raw, "random.bin");
  CHECK(write_file(raw, rnd, 200000));
  tmp_path(gz, sizeof gz, "random.gz");
  snprintf(cmd, sizeof cmd, "gzip -6 -c '%s' > '%s'", raw, gz);
  CHECK(system(cmd) == 0);
  check_gunzip_file(gz, rnd, 200000, "random");
  free(rnd);
  free(d);
}

static void test_gunzip_header_fields(void) {
  /* Rebuild a member with FEXTRA, FNAME, FCOMMENT and FHCRC around the deflate
   * data of a hand-made stored member. */
  const char *text = "header fields test";
  size_t sn = 0;
  unsigned char *s = gzip_stored((const unsigned char *)text, strlen(text), &sn);
  unsigned char g[512];
  size_t n = 0;
  memcpy(g, s, 10);
  g[3] = 0x02 | 0x04 | 0x08 | 0x10 | 0x01; /* FHCRC FEXTRA FNAME FCOMMENT FTEXT */
  n = 10;
  g[n++] = 5;
  g[n++] = 0; /* XLEN 5 */
  memcpy(g + n, "AB\x01\x00Z", 5);
  n += 5;
  memcpy(g + n, "name.txt", 9);
  n += 9;
  memcpy(g + n, "a comment", 10);
  n += 10;
  uint32_t hc = dt_crc32(0, g, n);
  g[n++] = (unsigned char)(hc & 0xFF);
  g[n++] = (unsigned char)(hc >> 8);
  memcpy(g + n, s + 10, sn - 10);
  n += sn - 10;
  dt_bytes o;
  CHECK_MSG(dt_gunzip(g, n, 0, &o) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(o.size == strlen(text) && memcmp(o.data, text, o.size) == 0);
  dt_bytes_free(&o);
  /* Wrong header CRC. */
  size_t hpos = 10 + 2 + 5 + 9 + 10;
  g[hpos] ^= 0x40;
  CHECK_ERR(dt_gunzip(g, n, 0, &o), DTRAIN_ERR_CORRUPT, "header CRC");
  g[hpos] ^= 0x40;
  /* Name without its terminating zero: truncated header. */
  CHECK_ERR(dt_gunzip(g, 10 + 2 + 5 + 4, 0, &o), DTRAIN_ERR_CORRUPT, "truncated");
  /* Reserved flag bits. */
  g[3] |= 0x80;
  CHECK_ERR(dt_gunzip(g, n, 0, &o), DTRAIN_ERR_CORRUPT, "reserved");
  g[3] &= 0x7F;
  /* Not deflate. */
  g[2] = 7;
  CHECK_ERR(dt_gunzip(g, n, 0, &o), DTRAIN_ERR_CORRUPT, "not deflate");
  g[2] = 8;
  CHECK(dt_gunzip(g, n, 0, &o) == DTRAIN_OK);
  dt_bytes_free(&o);
  free(s);
}

static void test_gunzip_corrupt(void) {
  const size_t n = 5000; /* small: every flipped bit below is one full decode */
  unsigned char *d = make_sample(n);
  unsigned char *g = NULL;
  size_t gn = 0;
  char raw[512], gz[512], cmd[1200];
  if (have_gzip()) {
    tmp_path(raw, sizeof raw, "c.bin");
    tmp_path(gz, sizeof gz, "c.gz");
    CHECK(write_file(raw, d, n));
    snprintf(cmd, sizeof cmd, "gzip -9 -n -c '%s' > '%s'", raw, gz);
    CHECK(system(cmd) == 0);
    g = slurp(gz, &gn);
  } else {
    printf("test_gunzip_corrupt: no gzip command, using a stored-block member\n");
    g = gzip_stored(d, n, &gn);
  }
  if (!g) return;
  dt_bytes o;
  CHECK(dt_gunzip(g, gn, 0, &o) == DTRAIN_OK && o.size == n);
  dt_bytes_free(&o);
  /* Bad magic. */
  g[0] ^= 0xFF;
  CHECK_ERR(dt_gunzip(g, gn, 0, &o), DTRAIN_ERR_FORMAT, "not gzip");
  g[0] ^= 0xFF;
  /* Bad CRC, bad ISIZE. */
  g[gn - 8] ^= 0x01;
  CHECK_ERR(dt_gunzip(g, gn, 0, &o), DTRAIN_ERR_CORRUPT, "CRC-32 mismatch");
  g[gn - 8] ^= 0x01;
  g[gn - 2] ^= 0x10;
  CHECK_ERR(dt_gunzip(g, gn, 0, &o), DTRAIN_ERR_CORRUPT, "ISIZE mismatch");
  g[gn - 2] ^= 0x10;
  /* Trailing garbage after the member. */
  unsigned char *gt = (unsigned char *)malloc(gn + 3);
  memcpy(gt, g, gn);
  memcpy(gt + gn, "xyz", 3);
  CHECK_ERR(dt_gunzip(gt, gn + 3, 0, &o), DTRAIN_ERR_CORRUPT, "trailing garbage");
  free(gt);
  /* Every truncation is refused. */
  int bad = 0;
  for (size_t k = 0; k < gn; k += (k < 64 || gn - k < 64) ? 1 : 97) {
    dt_result r = dt_gunzip(g, k, 0, &o);
    if (r != DTRAIN_ERR_CORRUPT && !(k < 2 && r == DTRAIN_ERR_FORMAT)) bad++;
    if (o.data) bad++;
  }
  CHECK_MSG(bad == 0, "%d truncations not refused", bad);
  /* Flipped bits anywhere after the fixed header fields (MTIME/XFL/OS are not
   * protected) are refused, never crash, never pass with other data. (Some
   * bits are unused padding, e.g. before a stored block's LEN: a flip there
   * changes nothing and the data still checks out.) */
  bad = 0;
  int tried = 0;
  for (size_t k = 10; k < gn; k += 1 + k % 3) {
    for (int bit = 0; bit < 8; bit += 3) {
      g[k] ^= (unsigned char)(1u << bit);
      dt_result r = dt_gunzip(g, gn, 0, &o);
      if (r == DTRAIN_OK) {
        if (o.size != n || memcmp(o.data, d, n) != 0) bad++;
        dt_bytes_free(&o);
      } else if (r != DTRAIN_ERR_CORRUPT) {
        bad++;
      }
      g[k] ^= (unsigned char)(1u << bit);
      tried++;
    }
  }
  CHECK_MSG(bad == 0, "%d of %d bit flips not refused", bad, tried);
  /* Output limit. */
  CHECK_ERR(dt_gunzip(g, gn, 1000, &o), DTRAIN_ERR_OVERFLOW, "exceeds the limit");
  /* A forged ISIZE of 4 GiB does not make us allocate it. */
  counting_on();
  size_t sn = 0;
  unsigned char *s = gzip_stored((const unsigned char *)"tiny", 4, &sn);
  s[sn - 4] = s[sn - 3] = s[sn - 2] = s[sn - 1] = 0xFF;
  CHECK_ERR(dt_gunzip(s, sn, 0, &o), DTRAIN_ERR_CORRUPT, "ISIZE mismatch");
  CHECK_MSG(alloc_max < (1u << 20), "allocated %zu bytes for a 4-byte stream", alloc_max);
  CHECK(alloc_calls == free_calls);
  dt_set_allocator(NULL);
  free(s);
  free(g);
  free(d);
}

/* ---- IDX and Fashion-MNIST ----------------------------------------------------------------- */

static void test_shipped_fashion_mnist(void) {
  char ip[1024], lp[1024];
  root_path(ip, sizeof ip, "data/fashion-mnist/t10k-images-idx3-ubyte.gz");
  root_path(lp, sizeof lp, "data/fashion-mnist/t10k-labels-idx1-ubyte.gz");
  dt_dataset *ds = NULL;
  dt_result r = TH_RESULT(ds = dt_dataset_load_idx(ip, lp, 0));
  CHECK_MSG(r == DTRAIN_OK, "%s", dt_last_error());
  if (r != DTRAIN_OK) return;
  CHECK(ds->n == 10000);
  CHECK(ds->ndim == 2 && ds->shape[0] == 28 && ds->shape[1] == 28 && ds->sample_size == 784);
  CHECK(ds->num_classes == 10);
  const int32_t first[12] = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5};
  for (int i = 0; i < 12; i++) CHECK(ds->y[i] == first[i]);
  int counts[10] = {0};
  for (int64_t i = 0; i < ds->n; i++) counts[ds->y[i]]++;
  for (int c = 0; c < 10; c++) CHECK(counts[c] == 1000);
  double sum = 0, s0 = 0;
  float mn = 1, mx = 0;
  for (int64_t i = 0; i < ds->n * 784; i++) {
    float v = ds->x[i];
    if (v < mn) mn = v;
    if (v > mx) mx = v;
    double byte = floor((double)v * 255.0 + 0.5);
    sum += byte;
    if (i < 784) s0 += byte;
  }
  CHECK(mn == 0.0f && mx == 1.0f);
  CHECK(sum == 573469082.0); /* sum of the raw bytes, from NumPy */
  CHECK(s0 == 33456.0);
  dt_dataset_destroy(ds);
  /* Raw values and the plain IDX API agree. */
  dt_idx a;
  CHECK(dt_idx_read(ip, &a) == DTRAIN_OK);
  CHECK(a.ndim == 3 && a.shape[0] == 10000 && a.shape[1] == 28 && a.shape[2] == 28 && a.size == 7840000);
  CHECK((ds = dt_dataset_load_idx(ip, NULL, DTRAIN_DATA_RAW)) != NULL);
  CHECK(ds && ds->y == NULL && ds->num_classes == 0);
  int same = 1;
  for (int64_t i = 0; ds && i < a.size; i += 997) same &= ds->x[i] == (float)a.data[i];
  CHECK(same);
  dt_dataset_destroy(ds);
  dt_idx_free(&a);
  CHECK(a.data == NULL);
}

static void test_system_fashion_mnist_train(void) {
  const char *dir = "/usr/share/datasets/fashion-mnist";
  char ip[512], lp[512];
  snprintf(ip, sizeof ip, "%s/train-images-idx3-ubyte.gz", dir);
  snprintf(lp, sizeof lp, "%s/train-labels-idx1-ubyte.gz", dir);
  FILE *f = fopen(ip, "rb");
  if (!f) TH_SKIP("no %s (apt-get install dataset-fashion-mnist)", ip);
  fclose(f);
  dt_dataset *tr = NULL, *te = NULL;
  double t0 = dt_time_now();
  dt_result r = dt_fashion_mnist_load(dir, &tr, &te);
  double t1 = dt_time_now();
  CHECK_MSG(r == DTRAIN_OK, "%s", dt_last_error());
  if (r != DTRAIN_OK) return;
  CHECK(tr && tr->n == 60000 && tr->sample_size == 784 && tr->num_classes == 10);
  CHECK(te && te->n == 10000);
  const int32_t first[12] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9};
  for (int i = 0; i < 12; i++) CHECK(tr->y[i] == first[i]);
  double sum = 0;
  for (int64_t i = 0; i < tr->n * 784; i++) sum += floor((double)tr->x[i] * 255.0 + 0.5);
  CHECK(sum == 3431114169.0);
  printf("test_system_fashion_mnist_train: loaded 60000 + 10000 images in %.2f s\n", t1 - t0);
  dt_dataset_destroy(tr);
  dt_dataset_destroy(te);
}

static void test_fashion_find(void) {
  char dir[1024], out[1024];
  int has_train = -1;
  root_path(dir, sizeof dir, "data/fashion-mnist");
  CHECK(dt_fashion_mnist_find(dir, out, sizeof out, &has_train) == DTRAIN_OK);
  CHECK(strcmp(out, dir) == 0 && has_train == 0);
  /* Default search: the Debian package if installed, else the shipped split
   * (when run from the repository root). */
  dt_result r = dt_fashion_mnist_find(NULL, out, sizeof out, &has_train);
  FILE *f = fopen("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz", "rb");
  if (f) {
    fclose(f);
    CHECK(r == DTRAIN_OK && strcmp(out, "/usr/share/datasets/fashion-mnist") == 0 && has_train == 1);
  } else if (strcmp(root, ".") == 0) {
    CHECK(r == DTRAIN_OK && strcmp(out, "data/fashion-mnist") == 0 && has_train == 0);
  }
  CHECK_ERR(dt_fashion_mnist_find("/nonexistent/fm", out, sizeof out, NULL), DTRAIN_ERR_NOT_FOUND, "/nonexistent/fm");
  CHECK_ERR(dt_fashion_mnist_find(dir, out, 4, NULL), DTRAIN_ERR_INVALID_ARG, "too small");
  CHECK_ERR(dt_fashion_mnist_find(dir, NULL, 4, NULL), DTRAIN_ERR_NULL_ARG, "out");
  /* Load from the shipped directory: test split only. */
  dt_dataset *tr = (dt_dataset *)1, *te = NULL;
  CHECK(dt_fashion_mnist_load(dir, &tr, &te) == DTRAIN_OK);
  CHECK(tr == NULL && te && te->n == 10000);
  dt_dataset_destroy(te);
}

/* An IDX image in memory: magic, dims, then bytes 0, 1, 2, ... */
static size_t make_idx(unsigned char *buf, int type, int ndim, const uint32_t *dims, size_t nbytes) {
  buf[0] = 0;
  buf[1] = 0;
  buf[2] = (unsigned char)type;
  buf[3] = (unsigned char)ndim;
  size_t p = 4;
  for (int d = 0; d < ndim; d++) {
    buf[p++] = (unsigned char)(dims[d] >> 24);
    buf[p++] = (unsigned char)(dims[d] >> 16);
    buf[p++] = (unsigned char)(dims[d] >> 8);
    buf[p++] = (unsigned char)dims[d];
  }
  for (size_t i = 0; i < nbytes; i++) buf[p++] = (unsigned char)(i * 37 % 256);
  return p;
}

static void test_idx_errors(void) {
  unsigned char im[256], lb[64];
  uint32_t idims[3] = {3, 2, 2}, ldims[1] = {3};
  size_t in = make_idx(im, 8, 3, idims, 12), ln = make_idx(lb, 8, 1, ldims, 3);
  lb[8] = 2; /* labels 2, 0, 5 */
  lb[9] = 0;
  lb[10] = 5;
  dt_dataset *ds = NULL;
  CHECK((ds = dt_dataset_from_idx(im, in, lb, ln, 0)) != NULL);
  CHECK(ds && ds->n == 3 && ds->ndim == 2 && ds->shape[0] == 2 && ds->shape[1] == 2);
  CHECK(ds && ds->y[0] == 2 && ds->y[1] == 0 && ds->y[2] == 5 && ds->num_classes == 6);
  CHECK(ds && fabsf(ds->x[1] - 37.0f / 255.0f) < 1e-7f);
  dt_dataset_destroy(ds);
  CHECK((ds = dt_dataset_from_idx(im, in, lb, ln, DTRAIN_DATA_RAW)) != NULL);
  CHECK(ds && ds->x[1] == 37.0f);
  dt_dataset_destroy(ds);
  CHECK((ds = dt_dataset_from_idx(im, in, lb, 0, 0)) != NULL && ds && ds->y == NULL); /* 0 label bytes: none */
  dt_dataset_destroy(ds);
  dt_idx a0;
  CHECK(dt_idx_parse(im, in, &a0) == DTRAIN_OK && a0.ndim == 3 && a0.shape[2] == 2 && a0.shape[3] == 1 &&
        a0.shape[5] == 1 && a0.data[1] == 37);
  dt_idx_free(&a0);
  /* The same from gzip data in memory. */
  size_t gn = 0;
  unsigned char *g = gzip_stored(im, in, &gn);
  CHECK((ds = dt_dataset_from_idx(g, gn, lb, ln, 0)) != NULL && ds && ds->n == 3);
  dt_dataset_destroy(ds);
  g[gn - 5] ^= 1; /* CRC */
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(g, gn, lb, ln, 0)), DTRAIN_ERR_CORRUPT, "dt_dataset_from_idx: images");
  free(g);

  dt_idx a;
  unsigned char bad[256];
  memcpy(bad, im, in);
  bad[0] = 1;
  CHECK_ERR(dt_idx_parse(bad, in, &a), DTRAIN_ERR_FORMAT, "bad magic");
  memcpy(bad, im, in);
  bad[2] = 0x0D;
  CHECK_ERR(dt_idx_parse(bad, in, &a), DTRAIN_ERR_FORMAT, "0x0d is not supported");
  bad[2] = 8;
  bad[3] = 0;
  CHECK_ERR(dt_idx_parse(bad, in, &a), DTRAIN_ERR_FORMAT, "0 dimensions");
  bad[3] = 9;
  CHECK_ERR(dt_idx_parse(bad, in, &a), DTRAIN_ERR_FORMAT, "9 dimensions");
  CHECK_ERR(dt_idx_parse(im, 3, &a), DTRAIN_ERR_CORRUPT, "truncated");
  CHECK_ERR(dt_idx_parse(im, 10, &a), DTRAIN_ERR_CORRUPT, "truncated IDX header");
  CHECK_ERR(dt_idx_parse(im, in - 1, &a), DTRAIN_ERR_CORRUPT, "only 11 data bytes");
  memcpy(bad, im, in);
  bad[in] = 9;
  CHECK_ERR(dt_idx_parse(bad, in + 1, &a), DTRAIN_ERR_CORRUPT, "1 bytes after");
  uint32_t zd[3] = {3, 0, 2};
  size_t zn = make_idx(bad, 8, 3, zd, 0);
  CHECK_ERR(dt_idx_parse(bad, zn, &a), DTRAIN_ERR_FORMAT, "dimension 1 is 0");
  CHECK(a.data == NULL && a.size == 0);
  /* A header claiming 2^40 elements is refused before any allocation. */
  uint32_t huge[3] = {1u << 20, 1u << 10, 1u << 10};
  size_t hn = make_idx(bad, 8, 3, huge, 100);
  counting_on();
  CHECK_ERR(dt_idx_parse(bad, hn, &a), DTRAIN_ERR_CORRUPT, "[1048576,1024,1024]");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(bad, hn, lb, ln, 0)), DTRAIN_ERR_CORRUPT, "only 100 data bytes");
  uint32_t huge4[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}; /* product overflows */
  hn = make_idx(bad, 8, 4, huge4, 10);
  CHECK_ERR(dt_idx_parse(bad, hn, &a), DTRAIN_ERR_CORRUPT, "IDX header claims");
  CHECK_MSG(alloc_max < 4096, "allocated %zu bytes", alloc_max);
  CHECK(alloc_calls == free_calls);
  dt_set_allocator(NULL);
  /* Images and labels that do not match. */
  uint32_t l4[1] = {4};
  size_t l4n = make_idx(lb, 8, 1, l4, 4);
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(im, in, lb, l4n, 0)), DTRAIN_ERR_MISMATCH, "3 images but 4 labels");
  CHECK(ds == NULL);
  uint32_t l2d[2] = {3, 1};
  size_t l2n = make_idx(lb, 8, 2, l2d, 3);
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(im, in, lb, l2n, 0)), DTRAIN_ERR_FORMAT, "must be 1-D");
  ln = make_idx(lb, 8, 1, ldims, 3);
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(lb, ln, NULL, 0, 0)), DTRAIN_ERR_FORMAT, "at least 2 dimensions");
  /* Files: missing, with the path and the system's reason. */
  CHECK_ERR(dt_idx_read("/nonexistent/dir/x.idx", &a), DTRAIN_ERR_IO, "'/nonexistent/dir/x.idx': No such file");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_load_idx("/nonexistent/i.gz", "/nonexistent/l.gz", 0)), DTRAIN_ERR_IO, "/nonexistent/i.gz");
  /* A truncated .gz file on disk. */
  char ip[1024], tp[512];
  root_path(ip, sizeof ip, "data/fashion-mnist/t10k-labels-idx1-ubyte.gz");
  size_t n = 0;
  unsigned char *lab = slurp(ip, &n);
  CHECK(lab != NULL);
  if (lab) {
    tmp_path(tp, sizeof tp, "trunc-labels.gz");
    CHECK(write_file(tp, lab, n / 2));
    CHECK_ERR(dt_idx_read(tp, &a), DTRAIN_ERR_CORRUPT, "trunc-labels.gz");
    free(lab);
  }
  /* A directory is not a file. */
  CHECK_ERR(dt_idx_read(tmpdir, &a), DTRAIN_ERR_IO, tmpdir);
  /* NULL arguments. */
  CHECK_ERR(dt_idx_parse(NULL, 5, &a), DTRAIN_ERR_NULL_ARG, "buf");
  CHECK_ERR(dt_idx_parse(im, in, NULL), DTRAIN_ERR_NULL_ARG, "out");
  CHECK_ERR(dt_idx_read(NULL, &a), DTRAIN_ERR_NULL_ARG, "path");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_idx(NULL, 0, NULL, 0, 0)), DTRAIN_ERR_NULL_ARG, "images");
  dt_idx_free(NULL);
  dt_idx_free(&a);
}

/* ---- CSV ------------------------------------------------------------------------------------ */

static void test_csv_good(void) {
  const char *t = "\xEF\xBB\xBF" "a,b,c,label\r\n"
                  "1.5, 2, -3e2 ,1\r\n"
                  "\r\n"
                  "  4,5,6,0\r\n"
                  "7,8,9,3\n\n";
  dt_csv_options d;
  memset(&d, 0, sizeof d);
  d.header = 1;
  d.has_labels = 1;
  d.label_column = -1;
  dt_dataset *ds = NULL;
  CHECK_MSG((ds = dt_dataset_from_csv(t, strlen(t), &d)) != NULL, "%s", dt_last_error());
  if (!ds) return;
  CHECK(ds->n == 3 && ds->ndim == 1 && ds->shape[0] == 3 && ds->num_classes == 4);
  const float want[9] = {1.5f, 2, -300, 4, 5, 6, 7, 8, 9};
  for (int i = 0; i < 9; i++) CHECK(ds->x[i] == want[i]);
  CHECK(ds->y[0] == 1 && ds->y[1] == 0 && ds->y[2] == 3);
  dt_dataset_destroy(ds);
  /* Label in the first column, tab separated, no trailing newline. */
  const char *t2 = "2\t0.25\t0.5\n0\t1\t2";
  d.header = 0;
  d.label_column = 0;
  d.delimiter = '\t';
  CHECK((ds = dt_dataset_from_csv(t2, strlen(t2), &d)) != NULL);
  CHECK(ds && ds->n == 2 && ds->shape[0] == 2 && ds->y[0] == 2 && ds->y[1] == 0 && ds->x[1] == 0.5f && ds->x[3] == 2.0f);
  dt_dataset_destroy(ds);
  /* A middle label column; no labels at all (NULL desc). */
  const char *t3 = "1,7,2\n3,8,4\n";
  d.delimiter = 0;
  d.label_column = 1;
  CHECK((ds = dt_dataset_from_csv(t3, strlen(t3), &d)) != NULL);
  CHECK(ds && ds->x[0] == 1 && ds->x[1] == 2 && ds->x[2] == 3 && ds->x[3] == 4 && ds->y[0] == 7 && ds->y[1] == 8);
  dt_dataset_destroy(ds);
  CHECK((ds = dt_dataset_from_csv(t3, strlen(t3), NULL)) != NULL);
  CHECK(ds && ds->y == NULL && ds->shape[0] == 3 && ds->num_classes == 0);
  dt_dataset_destroy(ds);
  /* From a file. */
  char p[512];
  tmp_path(p, sizeof p, "d.csv");
  CHECK(write_file(p, t3, strlen(t3)));
  CHECK((ds = dt_dataset_load_csv(p, NULL)) != NULL && ds && ds->n == 2);
  dt_dataset_destroy(ds);
}

static void test_csv_bad(void) {
  dt_dataset *ds = NULL;
  dt_csv_options d;
  memset(&d, 0, sizeof d);
  const char *t1 = "1,2,3\n4,5,6\n7,abc,9\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t1, strlen(t1), &d)), DTRAIN_ERR_FORMAT, "line 3, column 2: 'abc' is not a");
  const char *t2 = "1,2,3\n\n4,5,6\n7,8\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t2, strlen(t2), &d)), DTRAIN_ERR_FORMAT, "line 4 has 2 fields, expected 3 (as on line 1)");
  const char *t3 = "x,y\n1,2\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t3, strlen(t3), &d)), DTRAIN_ERR_FORMAT, "set dt_csv_options.header");
  const char *t4 = "1,,3\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t4, strlen(t4), &d)), DTRAIN_ERR_FORMAT, "column 2: empty field");
  const char *t5 = "1,nan\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t5, strlen(t5), &d)), DTRAIN_ERR_FORMAT, "'nan' is not a finite number");
  const char *t6 = "1,2.5\n";
  d.has_labels = 1;
  d.label_column = 1;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t6, strlen(t6), &d)), DTRAIN_ERR_FORMAT, "label '2.5' is not an integer");
  const char *t7 = "1,-1\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t7, strlen(t7), &d)), DTRAIN_ERR_FORMAT, "label '-1'");
  d.label_column = 5;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t6, strlen(t6), &d)), DTRAIN_ERR_INVALID_ARG, "label_column 5");
  d.label_column = 0;
  const char *t8 = "1\n2\n";
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(t8, strlen(t8), &d)), DTRAIN_ERR_FORMAT, "none is left for features");
  d.has_labels = 0;
  d.header = 1;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv("a,b\n\n", 5, &d)), DTRAIN_ERR_EMPTY, "no data rows");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv("", 0, NULL)), DTRAIN_ERR_EMPTY, "no data rows");
  d.header = 0;
  d.delimiter = '.';
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv("1.5", 3, &d)), DTRAIN_ERR_INVALID_ARG, "delimiter");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_csv(NULL, 1, NULL)), DTRAIN_ERR_NULL_ARG, "text");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_load_csv("/nonexistent.csv", NULL)), DTRAIN_ERR_IO, "'/nonexistent.csv'");
  /* The file name is in the message. */
  char p[512];
  tmp_path(p, sizeof p, "bad.csv");
  CHECK(write_file(p, t1, strlen(t1)));
  CHECK_ERR(TH_RESULT(ds = dt_dataset_load_csv(p, NULL)), DTRAIN_ERR_FORMAT, "bad.csv': line 3, column 2");
  CHECK(ds == NULL);
}

/* ---- NPY ------------------------------------------------------------------------------------ */

static void test_npy_roundtrip(void) {
  float f[24];
  unsigned char u[24];
  int32_t i4[24];
  int64_t i8[24];
  for (int i = 0; i < 24; i++) {
    f[i] = (float)i * 0.5f - 3.25f;
    u[i] = (unsigned char)(i * 11);
    i4[i] = -1000000 + i * 99991;
    i8[i] = (int64_t)i * 1000000000007LL - 5;
  }
  const void *datas[4] = {f, u, i4, i8};
  const dt_npy_dtype types[4] = {DTRAIN_NPY_F32, DTRAIN_NPY_U8, DTRAIN_NPY_I32, DTRAIN_NPY_I64};
  const int64_t shapes[3][3] = {{24, 1, 1}, {2, 3, 4}, {1, 1, 1}};
  const int ndims[3] = {1, 3, 0};
  for (int t = 0; t < 4; t++) {
    for (int s = 0; s < 3; s++) {
      size_t len = 0;
      CHECK(dt_npy_encode(NULL, 0, &len, types[t], ndims[s], shapes[s], datas[t]) == DTRAIN_OK);
      unsigned char *buf = (unsigned char *)malloc(len);
      CHECK(dt_npy_encode(buf, len, &len, types[t], ndims[s], shapes[s], datas[t]) == DTRAIN_OK);
      size_t hl = (size_t)buf[8] | (size_t)buf[9] << 8;
      CHECK((10 + hl) % 64 == 0 && buf[10 + hl - 1] == '\n');
      dt_npy a;
      CHECK(dt_npy_parse(buf, len, &a) == DTRAIN_OK);
      CHECK(a.dtype == types[t] && a.ndim == ndims[s]);
      int64_t count = ndims[s] == 0 ? 1 : 24;
      CHECK(a.size == count);
      for (int d = 0; d < ndims[s]; d++) CHECK(a.shape[d] == shapes[s][d]);
      CHECK(memcmp(a.data, datas[t], (size_t)count * dt_npy_dtype_size(types[t])) == 0);
      dt_npy_free(&a);
      CHECK(dt_npy_encode(buf, len - 1, &len, types[t], ndims[s], shapes[s], datas[t]) == DTRAIN_ERR_INVALID_ARG);
      free(buf);
    }
    /* Through a file. */
    char p[512];
    tmp_path(p, sizeof p, "rt.npy");
    CHECK(dt_npy_write(p, types[t], 3, shapes[1], datas[t]) == DTRAIN_OK);
    dt_npy a;
    CHECK(dt_npy_read(p, &a) == DTRAIN_OK && a.size == 24 && a.dtype == types[t]);
    CHECK(a.data && memcmp(a.data, datas[t], 24 * dt_npy_dtype_size(types[t])) == 0);
    dt_npy_free(&a);
    /* Gzipped, it reads the same. */
    size_t rn = 0, gn = 0;
    unsigned char *rawf = slurp(p, &rn);
    unsigned char *g = rawf ? gzip_stored(rawf, rn, &gn) : NULL;
    tmp_path(p, sizeof p, "rt.npy.gz");
    CHECK(g && write_file(p, g, gn));
    CHECK(dt_npy_read(p, &a) == DTRAIN_OK && a.size == 24 && a.data &&
          memcmp(a.data, datas[t], 24 * dt_npy_dtype_size(types[t])) == 0);
    dt_npy_free(&a);
    free(g);
    free(rawf);
  }
  /* The header text is what NumPy writes. */
  unsigned char buf[256];
  size_t len = 0;
  int64_t sh1 = 3;
  CHECK(dt_npy_encode(buf, sizeof buf, &len, DTRAIN_NPY_F32, 1, &sh1, f) == DTRAIN_OK);
  CHECK(memcmp(buf + 10, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 57) == 0);
  /* An empty array. */
  int64_t sh0 = 0;
  CHECK(dt_npy_encode(buf, sizeof buf, &len, DTRAIN_NPY_I64, 1, &sh0, NULL) == DTRAIN_OK);
  dt_npy a;
  CHECK(dt_npy_parse(buf, len, &a) == DTRAIN_OK && a.size == 0 && a.ndim == 1 && a.shape[0] == 0);
  dt_npy_free(&a);
  /* Encode argument errors. */
  CHECK_ERR(dt_npy_encode(buf, sizeof buf, &len, (dt_npy_dtype)9, 1, &sh1, f), DTRAIN_ERR_INVALID_ARG, "dtype");
  CHECK_ERR(dt_npy_encode(buf, sizeof buf, &len, DTRAIN_NPY_F32, 7, shapes[1], f), DTRAIN_ERR_RANK, "ndim 7");
  CHECK_ERR(dt_npy_encode(buf, sizeof buf, &len, DTRAIN_NPY_F32, 1, &sh1, NULL), DTRAIN_ERR_NULL_ARG, "data");
  int64_t neg = -2;
  CHECK_ERR(dt_npy_encode(buf, sizeof buf, &len, DTRAIN_NPY_F32, 1, &neg, f), DTRAIN_ERR_SHAPE, "negative");
  CHECK_ERR(dt_npy_write("/nonexistent/dir/a.npy", DTRAIN_NPY_F32, 1, &sh1, f), DTRAIN_ERR_IO, "/nonexistent/dir/a.npy");
}

/* An NPY image with a given version and header text, then `data`. */
static size_t make_npy(unsigned char *buf, int major, const char *header, const void *data, size_t n) {
  size_t hl = strlen(header), p;
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (unsigned char)major;
  buf[7] = 0;
  if (major == 1) {
    buf[8] = (unsigned char)hl;
    buf[9] = (unsigned char)(hl >> 8);
    p = 10;
  } else {
    buf[8] = (unsigned char)hl;
    buf[9] = (unsigned char)(hl >> 8);
    buf[10] = buf[11] = 0;
    p = 12;
  }
  memcpy(buf + p, header, hl);
  p += hl;
  memcpy(buf + p, data, n);
  return p + n;
}

static void test_npy_headers(void) {
  unsigned char buf[512];
  dt_npy a;
  /* Version 2.0 and double quotes / no trailing comma / odd spacing. */
  const unsigned char f2[8] = {0, 0, 0xC0, 0x3F, 0, 0, 0, 0xC0}; /* 1.5f, -2.0f little-endian, as '<f4' says */
  size_t n = make_npy(buf, 2, "{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":( 2 , )}\n", f2, 8);
  CHECK_MSG(dt_npy_parse(buf, n, &a) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(a.dtype == DTRAIN_NPY_F32 && a.ndim == 1 && a.shape[0] == 2 && ((float *)a.data)[1] == -2.0f);
  dt_npy_free(&a);
  /* Big-endian float32 and int64 are converted. */
  const unsigned char bef[8] = {0x3F, 0xC0, 0, 0, 0xC0, 0, 0, 0}; /* 1.5, -2 */
  n = make_npy(buf, 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }\n", bef, 8);
  CHECK(dt_npy_parse(buf, n, &a) == DTRAIN_OK && ((float *)a.data)[0] == 1.5f && ((float *)a.data)[1] == -2.0f);
  dt_npy_free(&a);
  const unsigned char bei[16] = {0, 0, 0, 0x01, 0x02, 0x03, 0x04, 0x05, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFE};
  n = make_npy(buf, 1, "{'descr': '>i8', 'fortran_order': False, 'shape': (2,), }\n", bei, 16);
  CHECK(dt_npy_parse(buf, n, &a) == DTRAIN_OK && a.dtype == DTRAIN_NPY_I64);
  CHECK(a.data && ((int64_t *)a.data)[0] == 0x0102030405LL && ((int64_t *)a.data)[1] == -2);
  dt_npy_free(&a);
  const unsigned char bei4[4] = {0xFF, 0xFF, 0xFF, 0xFD};
  n = make_npy(buf, 1, "{'descr': '>i4', 'fortran_order': False, 'shape': (), }\n", bei4, 4);
  CHECK(dt_npy_parse(buf, n, &a) == DTRAIN_OK && a.ndim == 0 && ((int32_t *)a.data)[0] == -3);
  dt_npy_free(&a);
  /* Refusals. */
  const unsigned char z[64] = {0};
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n", z, 16);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "Fortran order");
  n = make_npy(buf, 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\n", z, 16);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "'<f8' is not supported");
  n = make_npy(buf, 1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "descr");
  n = make_npy(buf, 1, "{'descr': '<f4', 'shape': (2,), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "no 'fortran_order'");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "unexpected key 'extra'");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "shape");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1), }\n", z, 4);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "more than 6 dimensions");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_CORRUPT, "only 8 data bytes");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_CORRUPT, "4 bytes after");
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n", z, 8);
  buf[6] = 4;
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_FORMAT, "version 4.0");
  buf[6] = 1;
  buf[8] = 0xFF;
  buf[9] = 0x7F; /* header length past the end */
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_CORRUPT, "truncated NPY");
  CHECK_ERR(dt_npy_parse(buf, 7, &a), DTRAIN_ERR_CORRUPT, "truncated NPY");
  CHECK_ERR(dt_npy_parse("PK\x03\x04xxxxxxxx", 12, &a), DTRAIN_ERR_FORMAT, "not an NPY file");
  /* An absurd shape is refused before allocating. */
  counting_on();
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_CORRUPT, "[1048576,1048576]");
  n = make_npy(buf, 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296), }\n", z, 8);
  CHECK_ERR(dt_npy_parse(buf, n, &a), DTRAIN_ERR_CORRUPT, "NPY header claims");
  CHECK_MSG(alloc_max < 4096, "allocated %zu bytes", alloc_max);
  CHECK(alloc_calls == free_calls);
  dt_set_allocator(NULL);
  CHECK(a.data == NULL);
  CHECK_ERR(dt_npy_read("/nonexistent.npy", &a), DTRAIN_ERR_IO, "No such file");
  CHECK_ERR(dt_npy_parse(NULL, 4, &a), DTRAIN_ERR_NULL_ARG, "buf");
  dt_npy_free(NULL);
}

static int have_numpy(void) { return system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0; }

static void test_npy_numpy_crosscheck(void) {
  if (!have_numpy()) TH_SKIP("no /usr/bin/python3 with numpy (apt-get install python3-numpy)");
  /* Files written here load in NumPy with the right dtype, shape and values. */
  float f[6] = {0.5f, -1.25f, 3, 4, 5e-3f, 6e6f};
  unsigned char u[6] = {0, 1, 2, 127, 128, 255};
  int32_t i4[6] = {-2147483647 - 1, -1, 0, 1, 7, 2147483647};
  int64_t i8[6] = {-9000000000000000000LL, -1, 0, 1, 1LL << 40, 9000000000000000000LL};
  int64_t sh[2] = {2, 3};
  char p[4][512], cmd[4096];
  const char *names[4] = {"f.npy", "u.npy", "i4.npy", "i8.npy"};
  for (int k = 0; k < 4; k++) tmp_path(p[k], sizeof p[k], names[k]);
  CHECK(dt_npy_write(p[0], DTRAIN_NPY_F32, 2, sh, f) == DTRAIN_OK);
  CHECK(dt_npy_write(p[1], DTRAIN_NPY_U8, 2, sh, u) == DTRAIN_OK);
  CHECK(dt_npy_write(p[2], DTRAIN_NPY_I32, 2, sh, i4) == DTRAIN_OK);
  CHECK(dt_npy_write(p[3], DTRAIN_NPY_I64, 1, sh + 1, i8) == DTRAIN_OK);
  snprintf(cmd, sizeof cmd,
           "/usr/bin/python3 -c \"\n"
           "import numpy as np, sys\n"
           "d = '%s'\n"
           "f = np.load(d + '/f.npy'); u = np.load(d + '/u.npy'); i4 = np.load(d + '/i4.npy'); i8 = np.load(d + '/i8.npy')\n"
           "ok = f.dtype == np.float32 and f.shape == (2, 3) and f.tolist() == [[0.5, -1.25, 3.0], [4.0, np.float32(5e-3).item(), 6e6]]\n"
           "ok = ok and u.dtype == np.uint8 and u.shape == (2, 3) and u.ravel().tolist() == [0, 1, 2, 127, 128, 255]\n"
           "ok = ok and i4.dtype == np.int32 and i4.ravel().tolist() == [-2**31, -1, 0, 1, 7, 2**31 - 1]\n"
           "ok = ok and i8.dtype == np.int64 and i8.shape == (3,) and i8.tolist() == [-9000000000000000000, -1, 0]\n"
           "np.save(d + '/py_f.npy', np.arange(12, dtype='<f4').reshape(3, 4) / 4)\n"
           "np.save(d + '/py_be.npy', np.arange(5, dtype='>f4') - 2)\n"
           "np.save(d + '/py_bei8.npy', np.array([1, -2, 2**40], dtype='>i8'))\n"
           "np.save(d + '/py_u8.npy', np.arange(256, dtype=np.uint8).reshape(2, 8, 16))\n"
           "np.save(d + '/py_fortran.npy', np.asfortranarray(np.ones((2, 3), dtype='<f4')))\n"
           "np.save(d + '/py_f8.npy', np.ones(3))\n"
           "sys.exit(0 if ok else 3)\n\"",
           tmpdir);
  int rc = system(cmd);
  CHECK_MSG(rc == 0, "numpy rejected files written by dt_npy_write (rc %d)", rc);
  if (rc != 0) return;
  /* Files written by NumPy load here. */
  char q[512];
  dt_npy a;
  tmp_path(q, sizeof q, "py_f.npy");
  CHECK(dt_npy_read(q, &a) == DTRAIN_OK && a.dtype == DTRAIN_NPY_F32 && a.ndim == 2 && a.shape[0] == 3 && a.shape[1] == 4);
  CHECK(a.data && ((float *)a.data)[11] == 2.75f);
  dt_npy_free(&a);
  tmp_path(q, sizeof q, "py_be.npy");
  CHECK(dt_npy_read(q, &a) == DTRAIN_OK && a.size == 5 && a.data && ((float *)a.data)[0] == -2.0f && ((float *)a.data)[4] == 2.0f);
  dt_npy_free(&a);
  tmp_path(q, sizeof q, "py_bei8.npy");
  CHECK(dt_npy_read(q, &a) == DTRAIN_OK && a.size == 3 && a.data && ((int64_t *)a.data)[1] == -2 &&
        ((int64_t *)a.data)[2] == (1LL << 40));
  dt_npy_free(&a);
  tmp_path(q, sizeof q, "py_u8.npy");
  CHECK(dt_npy_read(q, &a) == DTRAIN_OK && a.dtype == DTRAIN_NPY_U8 && a.ndim == 3 && a.data &&
        ((unsigned char *)a.data)[200] == 200);
  /* ... and become a dataset. */
  dt_dataset *ds = NULL;
  CHECK((ds = dt_dataset_from_arrays(&a, NULL, 0)) != NULL && ds && ds->n == 2 && ds->ndim == 2 && ds->shape[1] == 16);
  CHECK(ds && fabsf(ds->x[255] - 1.0f) < 1e-7f);
  dt_dataset_destroy(ds);
  dt_npy_free(&a);
  tmp_path(q, sizeof q, "py_fortran.npy");
  CHECK_ERR(dt_npy_read(q, &a), DTRAIN_ERR_FORMAT, "Fortran order");
  tmp_path(q, sizeof q, "py_f8.npy");
  CHECK_ERR(dt_npy_read(q, &a), DTRAIN_ERR_FORMAT, "'<f8' is not supported");
}

/* ---- datasets from arrays ------------------------------------------------------------------------ */

static void test_dataset_basics(void) {
  dt_dataset *ds = NULL;
  int64_t sh[2] = {2, 3};
  CHECK((ds = dt_dataset_new(4, 2, sh, 1)) != NULL);
  CHECK(ds && ds->n == 4 && ds->sample_size == 6 && ds->y && ds->x[23] == 0.0f && ds->shape[2] == 1);
  int64_t r3[3] = {1, 3, 2};
  CHECK(dt_dataset_reshape(ds, 3, r3) == DTRAIN_OK && ds->ndim == 3 && ds->shape[1] == 3);
  int64_t bad[1] = {5};
  CHECK_ERR(dt_dataset_reshape(ds, 1, bad), DTRAIN_ERR_SHAPE, "[5] does not hold the 6 values of [1,3,2]");
  for (int i = 0; i < 4; i++) {
    ds->x[i * 6] = (float)i;
    ds->y[i] = i;
  }
  ds->num_classes = 4;
  int64_t idx[3] = {3, 0, 3};
  dt_dataset *s = NULL;
  CHECK((s = dt_dataset_select(ds, idx, 3)) != NULL);
  CHECK(s && s->n == 3 && s->x[0] == 3 && s->x[6] == 0 && s->y[2] == 3 && s->num_classes == 4 && s->ndim == 3);
  dt_dataset_destroy(s);
  int64_t oob[1] = {4};
  CHECK_ERR(TH_RESULT(s = dt_dataset_select(ds, oob, 1)), DTRAIN_ERR_INDEX, "idx[0] = 4 is out of range [0, 4)");
  dt_dataset_destroy(ds);
  CHECK_ERR(TH_RESULT(ds = dt_dataset_new(0, 2, sh, 0)), DTRAIN_ERR_EMPTY, "at least 1 sample");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_new(3, 0, sh, 0)), DTRAIN_ERR_RANK, "0 dims");
  CHECK_ERR(TH_RESULT(ds = dt_dataset_new(3, 6, sh, 0)), DTRAIN_ERR_RANK, "6 dims");
  int64_t z[2] = {2, 0};
  CHECK_ERR(TH_RESULT(ds = dt_dataset_new(3, 2, z, 0)), DTRAIN_ERR_SHAPE, "dim 1 is 0");
  int64_t big[2] = {INT64_MAX / 2, 4};
  CHECK_ERR(TH_RESULT(ds = dt_dataset_new(3, 2, big, 0)), DTRAIN_ERR_OVERFLOW, "overflow");
  dt_dataset_destroy(NULL);
  /* From NPY arrays: uint8 scaled (or raw), int64 labels. */
  unsigned char px[6] = {0, 51, 255, 10, 20, 30};
  int64_t lab[2] = {1, 4};
  dt_npy x, y;
  memset(&x, 0, sizeof x);
  memset(&y, 0, sizeof y);
  x.data = px; x.dtype = DTRAIN_NPY_U8; x.ndim = 2; x.shape[0] = 2; x.shape[1] = 3; x.size = 6;
  y.data = lab; y.dtype = DTRAIN_NPY_I64; y.ndim = 1; y.shape[0] = 2; y.size = 2;
  CHECK((ds = dt_dataset_from_arrays(&x, &y, 0)) != NULL);
  CHECK(ds && fabsf(ds->x[1] - 0.2f) < 1e-7f && ds->x[2] == 1.0f && ds->y[1] == 4 && ds->num_classes == 5);
  dt_dataset_destroy(ds);
  CHECK((ds = dt_dataset_from_arrays(&x, NULL, DTRAIN_DATA_RAW)) != NULL && ds && ds->x[2] == 255.0f);
  dt_dataset_destroy(ds);
  lab[1] = -3;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_arrays(&x, &y, 0)), DTRAIN_ERR_INDEX, "label -3 of sample 1");
  y.shape[0] = 3;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_arrays(&x, &y, 0)), DTRAIN_ERR_MISMATCH, "do not match");
  y.shape[0] = 2;
  y.dtype = DTRAIN_NPY_F32;
  CHECK_ERR(TH_RESULT(ds = dt_dataset_from_arrays(&x, &y, 0)), DTRAIN_ERR_FORMAT, "must be integers");
  CHECK(ds == NULL);
}

/* ---- text ------------------------------------------------------------------------------------------- */

static void test_text(void) {
  dt_text t;
  const char *s = "hello world";
  CHECK(dt_text_parse(s, strlen(s), &t) == DTRAIN_OK);
  CHECK(t.n == 11 && t.vocab_size == 8);
  CHECK(memcmp(t.vocab, " dehlorw", 8) == 0);
  CHECK(t.ids[0] == 3 && t.ids[5] == 0 && t.id_of['z'] == -1);
  int32_t ids[16];
  char back[32];
  CHECK(dt_text_encode(&t, "world", 5, ids) == DTRAIN_OK && ids[0] == 7);
  CHECK(dt_text_decode(&t, ids, 5, back, sizeof back) == DTRAIN_OK && strcmp(back, "world") == 0);
  CHECK_ERR(dt_text_encode(&t, "wz", 2, ids), DTRAIN_ERR_INVALID_ARG, "0x7a ('z') at offset 1");
  ids[1] = 8;
  CHECK_ERR(dt_text_decode(&t, ids, 2, back, sizeof back), DTRAIN_ERR_INDEX, "id 8 at 1");
  CHECK_ERR(dt_text_decode(&t, ids, 5, back, 5), DTRAIN_ERR_INVALID_ARG, "need 6 bytes");
  dt_text_free(&t);
  CHECK(t.ids == NULL && t.n == 0);
  CHECK_ERR(dt_text_parse("", 0, &t), DTRAIN_ERR_EMPTY, "empty");
  CHECK_ERR(dt_text_read("/nonexistent.txt", &t), DTRAIN_ERR_IO, "'/nonexistent.txt'");
  /* The shipped corpus. */
  char p[1024];
  root_path(p, sizeof p, "data/text/devils_dictionary.txt");
  dt_result r = dt_text_read(p, &t);
  CHECK_MSG(r == DTRAIN_OK, "%s", dt_last_error());
  if (r != DTRAIN_OK) return;
  CHECK(t.n == 383069 && t.vocab_size == 84);
  CHECK(t.vocab[0] == '\n' && t.vocab[1] == ' ');
  size_t n = 0;
  unsigned char *raw = slurp(p, &n);
  char *dec = (char *)malloc((size_t)t.n + 1);
  CHECK(dt_text_decode(&t, t.ids, t.n, dec, (size_t)t.n + 1) == DTRAIN_OK);
  CHECK(raw && n == (size_t)t.n && memcmp(raw, dec, n) == 0);
  int32_t *enc = (int32_t *)malloc(n * sizeof(int32_t));
  CHECK(dt_text_encode(&t, (const char *)raw, n, enc) == DTRAIN_OK && memcmp(enc, t.ids, n * sizeof(int32_t)) == 0);
  /* Random windows: next-character targets, inside the range, seeded. */
  int32_t x[4 * 32], y[4 * 32], x2[4 * 32], y2[4 * 32];
  dt_rng g1, g2;
  dt_rng_seed(&g1, 9);
  dt_rng_seed(&g2, 9);
  CHECK(dt_text_sample(&t, 1000, 2000, &g1, 4, 32, x, y) == DTRAIN_OK);
  CHECK(dt_text_sample(&t, 1000, 2000, &g2, 4, 32, x2, y2) == DTRAIN_OK);
  CHECK(memcmp(x, x2, sizeof x) == 0 && memcmp(y, y2, sizeof y) == 0);
  for (int b = 0; b < 4; b++) {
    for (int k = 0; k < 31; k++) CHECK(y[b * 32 + k] == x[b * 32 + k + 1]);
    /* Find the window in the text. */
    int found = 0;
    for (int64_t s0 = 1000; s0 + 33 <= 2000 && !found; s0++)
      found = memcmp(t.ids + s0, x + b * 32, 32 * sizeof(int32_t)) == 0 && t.ids[s0 + 32] == y[b * 32 + 31];
    CHECK(found);
  }
  CHECK_ERR(dt_text_sample(&t, 0, 32, &g1, 1, 32, x, y), DTRAIN_ERR_INDEX, "cannot hold a window");
  CHECK_ERR(dt_text_sample(&t, 0, 100, NULL, 1, 32, x, y), DTRAIN_ERR_NULL_ARG, "rng");
  free(enc);
  free(dec);
  free(raw);
  dt_text_free(&t);
}

/* ---- loader --------------------------------------------------------------------------------------------- */

/* n samples of shape [2]: x = (i, -i), y = i % 7. */
static dt_dataset *make_ds(int64_t n) {
  dt_dataset *ds = NULL;
  int64_t sh[1] = {2};
  if (!(ds = dt_dataset_new(n, 1, sh, 1))) return NULL;
  for (int64_t i = 0; i < n; i++) {
    ds->x[2 * i] = (float)i;
    ds->x[2 * i + 1] = (float)-i;
    ds->y[i] = (int32_t)(i % 7);
  }
  ds->num_classes = 7;
  return ds;
}

static dt_loader_options ldesc(int64_t bs, uint64_t seed, int shuffle, int drop_last, int shard, int shards) {
  dt_loader_options d;
  memset(&d, 0, sizeof d);
  d.batch_size = bs;
  d.seed = seed;
  d.shuffle = shuffle;
  d.drop_last = drop_last;
  d.shard_index = shard;
  d.shard_count = shards;
  return d;
}

/* One epoch's sample order into out (returns the count; -1 on a bad batch). */
static int64_t epoch_order(dt_loader *l, int64_t *out, int64_t cap, int64_t *nbatches) {
  dt_batch b;
  int64_t n = 0, nb = 0;
  int r;
  while ((r = dt_loader_next(l, &b)) > 0) {
    nb++;
    for (int64_t j = 0; j < b.size; j++) {
      int64_t s = b.index[j];
      if (n >= cap || b.x[2 * j] != (float)s || b.x[2 * j + 1] != (float)-s || b.y[j] != (int32_t)(s % 7)) return -1;
      out[n++] = s;
    }
    if (b.ndim != 2 || b.shape[0] != b.size || b.shape[1] != 2) return -1;
  }
  if (nbatches) *nbatches = nb;
  return r < 0 ? -1 : n;
}

static void test_loader_order(void) {
  dt_dataset *ds = make_ds(103);
  dt_loader *a = NULL, *b = NULL, *c = NULL;
  dt_loader_options d = ldesc(10, 5, 1, 0, 0, 0);
  CHECK((a = dt_loader_new(ds, &d)) != NULL);
  CHECK((b = dt_loader_new(ds, &d)) != NULL);
  d.seed = 6;
  CHECK((c = dt_loader_new(ds, &d)) != NULL);
  CHECK(dt_loader_num_samples(a) == 103 && dt_loader_num_batches(a) == 11);
  int64_t oa[3][103], ob[103], oc[103], nb = 0;
  for (int e = 0; e < 3; e++) {
    CHECK(epoch_order(a, oa[e], 103, &nb) == 103 && nb == 11);
    /* Every sample exactly once. */
    int seen[103] = {0}, ok = 1;
    for (int i = 0; i < 103; i++) seen[oa[e][i]]++;
    for (int i = 0; i < 103; i++) ok &= seen[i] == 1;
    CHECK(ok);
    CHECK(epoch_order(b, ob, 103, NULL) == 103 && memcmp(ob, oa[e], sizeof ob) == 0); /* same seed, same order */
    CHECK(epoch_order(c, oc, 103, NULL) == 103 && memcmp(oc, oa[e], sizeof oc) != 0); /* another seed */
    int64_t ep, ix;
    dt_loader_position(a, &ep, &ix);
    CHECK(ep == e + 1 && ix == 0);
  }
  CHECK(memcmp(oa[0], oa[1], sizeof oa[0]) != 0 && memcmp(oa[1], oa[2], sizeof oa[0]) != 0);
  /* The order of an epoch depends on (seed, epoch) only: jump straight to epoch 2. */
  dt_loader_destroy(b);
  d.seed = 5;
  CHECK((b = dt_loader_new(ds, &d)) != NULL);
  CHECK(dt_loader_set_position(b, 2, 0) == DTRAIN_OK);
  CHECK(epoch_order(b, ob, 103, NULL) == 103 && memcmp(ob, oa[2], sizeof ob) == 0);
  for (int i = 0; i < 103; i += 17) CHECK(dt_loader_sample_at(b, 1, i) == oa[1][i]);
  CHECK(dt_loader_sample_at(b, 1, 103) == -1);
  /* No shuffle: identity; drop_last: 10 full batches. */
  dt_loader_destroy(c);
  d = ldesc(10, 5, 0, 1, 0, 0);
  CHECK((c = dt_loader_new(ds, &d)) != NULL);
  CHECK(dt_loader_num_batches(c) == 10);
  CHECK(epoch_order(c, oc, 103, &nb) == 100 && nb == 10);
  int ident = 1;
  for (int i = 0; i < 100; i++) ident &= oc[i] == i;
  CHECK(ident);
  /* The last partial batch without drop_last. */
  dt_loader_destroy(c);
  d.drop_last = 0;
  CHECK((c = dt_loader_new(ds, &d)) != NULL);
  dt_batch bt;
  int64_t last = 0;
  while (dt_loader_next(c, &bt) > 0) last = bt.size;
  CHECK(last == 3);
  /* Errors. */
  dt_loader *x = NULL;
  d.batch_size = 0;
  CHECK_ERR(TH_RESULT(x = dt_loader_new(ds, &d)), DTRAIN_ERR_INVALID_ARG, "batch_size 0");
  d.batch_size = 4;
  d.shard_count = 3;
  d.shard_index = 3;
  CHECK_ERR(TH_RESULT(x = dt_loader_new(ds, &d)), DTRAIN_ERR_INVALID_ARG, "shard 3 of 3");
  d.shard_count = 104;
  d.shard_index = 0;
  CHECK_ERR(TH_RESULT(x = dt_loader_new(ds, &d)), DTRAIN_ERR_INVALID_ARG, "104 shards of 103 samples");
  CHECK_ERR(TH_RESULT(x = dt_loader_new(NULL, &d)), DTRAIN_ERR_NULL_ARG, "ds");
  CHECK_ERR(dt_loader_set_position(a, 0, 104), DTRAIN_ERR_INDEX, "out of range");
  CHECK_ERR(dt_loader_set_position(a, -1, 0), DTRAIN_ERR_INDEX, "out of range");
  CHECK(dt_loader_next(NULL, &bt) == DTRAIN_ERR_NULL_ARG);
  CHECK(x == NULL);
  dt_loader_destroy(NULL);
  dt_loader_destroy(a);
  dt_loader_destroy(b);
  dt_loader_destroy(c);
  dt_dataset_destroy(ds);
}

static void test_loader_resume(void) {
  dt_dataset *ds = make_ds(57);
  for (int shards = 1; shards <= 3; shards += 2) {
    for (int drop = 0; drop <= 1; drop++) {
      dt_loader_options d = ldesc(8, 123, 1, drop, shards - 1, shards);
      dt_loader *ref = NULL;
      CHECK((ref = dt_loader_new(ds, &d)) != NULL);
      /* The uninterrupted stream of 3 epochs, with the position and the
       * stream offset before each batch. */
      int64_t stream[400], pe[100], pi[100], poff[100];
      int64_t ns = 0, nbat = 0;
      dt_batch b;
      for (int e = 0; e < 3; e++) {
        for (;;) {
          dt_loader_position(ref, &pe[nbat], &pi[nbat]);
          poff[nbat] = ns;
          if (dt_loader_next(ref, &b) <= 0) break;
          for (int64_t j = 0; j < b.size; j++) stream[ns++] = b.index[j];
          nbat++;
        }
      }
      /* Resume a fresh loader from batch boundaries; the rest is identical. */
      int bad = 0;
      for (int64_t k = 0; k < nbat; k += 2) {
        dt_loader *l = NULL;
        CHECK((l = dt_loader_new(ds, &d)) != NULL);
        CHECK(dt_loader_set_position(l, pe[k], pi[k]) == DTRAIN_OK);
        int64_t got = poff[k];
        while (got < ns) {
          int r = dt_loader_next(l, &b);
          if (r < 0) {
            bad++;
            break;
          }
          for (int64_t j = 0; r > 0 && j < b.size; j++)
            if (got >= ns || stream[got++] != b.index[j]) bad++;
        }
        dt_loader_destroy(l);
      }
      CHECK_MSG(bad == 0, "shards %d drop %d: %d mismatches after resume", shards, drop, bad);
      dt_loader_destroy(ref);
    }
  }
  /* A position at the very end of an epoch resumes into the next epoch. */
  dt_loader_options d = ldesc(10, 1, 1, 0, 0, 0);
  dt_loader *l = NULL;
  CHECK((l = dt_loader_new(ds, &d)) != NULL);
  CHECK(dt_loader_set_position(l, 4, 57) == DTRAIN_OK);
  dt_batch b;
  CHECK(dt_loader_next(l, &b) == 0);
  CHECK(dt_loader_next(l, &b) == 1 && b.epoch == 5 && b.start == 0 && b.index[0] == dt_loader_sample_at(l, 5, 0));
  dt_loader_destroy(l);
  dt_dataset_destroy(ds);
}

static void test_loader_shards(void) {
  const int64_t sizes[3] = {103, 12, 7};
  for (int si = 0; si < 3; si++) {
    int64_t n = sizes[si];
    dt_dataset *ds = make_ds(n);
    for (int K = 1; K <= 7 && K <= n; K++) {
      for (int shuffle = 0; shuffle <= 1; shuffle++) {
        for (int e = 0; e < 2; e++) {
          int seen[103] = {0};
          int64_t total = 0;
          for (int k = 0; k < K; k++) {
            dt_loader_options d = ldesc(4, 77, shuffle, 0, k, K);
            dt_loader *l = NULL;
            CHECK((l = dt_loader_new(ds, &d)) != NULL);
            if (!l) continue;
            int64_t want = n / K + (k < n % K ? 1 : 0);
            CHECK(dt_loader_num_samples(l) == want);
            CHECK(dt_loader_set_position(l, e, 0) == DTRAIN_OK);
            int64_t order[103];
            int64_t got = epoch_order(l, order, 103, NULL);
            CHECK(got == want);
            for (int64_t i = 0; i < got; i++) seen[order[i]]++;
            /* Without shuffling shard k holds k, k+K, ... */
            if (!shuffle)
              for (int64_t i = 0; i < got; i++) CHECK(order[i] == k + i * K);
            total += got;
            dt_loader_destroy(l);
          }
          int ok = total == n;
          for (int64_t i = 0; i < n; i++) ok &= seen[i] == 1; /* disjoint and covering */
          CHECK_MSG(ok, "n %lld K %d shuffle %d epoch %d: shards are not a partition", (long long)n, K, shuffle, e);
        }
      }
    }
    dt_dataset_destroy(ds);
  }
}

static void test_split(void) {
  dt_dataset *ds = make_ds(100), *tr = NULL, *va = NULL, *tr2 = NULL, *va2 = NULL;
  CHECK(dt_dataset_split(ds, 0.2, 42, &tr, &va) == DTRAIN_OK);
  CHECK(tr && va && tr->n == 80 && va->n == 20 && tr->num_classes == 7);
  if (!tr || !va) return;
  int seen[100] = {0}, ok = 1;
  for (int64_t i = 0; i < tr->n; i++) {
    seen[(int)tr->x[2 * i]]++;
    ok &= tr->y[i] == (int32_t)tr->x[2 * i] % 7;
    if (i) ok &= tr->x[2 * i] > tr->x[2 * i - 2]; /* original order kept */
  }
  for (int64_t i = 0; i < va->n; i++) seen[(int)va->x[2 * i]]++;
  for (int i = 0; i < 100; i++) ok &= seen[i] == 1;
  CHECK(ok);
  CHECK(dt_dataset_split(ds, 0.2, 42, &tr2, &va2) == DTRAIN_OK);
  CHECK(tr2 && memcmp(tr->x, tr2->x, 160 * sizeof(float)) == 0);
  dt_dataset_destroy(tr2);
  dt_dataset_destroy(va2);
  CHECK(dt_dataset_split(ds, 0.2, 43, &tr2, &va2) == DTRAIN_OK);
  CHECK(va2 && memcmp(va->x, va2->x, 40 * sizeof(float)) != 0);
  dt_dataset_destroy(tr2);
  dt_dataset_destroy(va2);
  /* Tiny fractions still give one validation sample. */
  CHECK(dt_dataset_split(ds, 0.001, 1, &tr2, &va2) == DTRAIN_OK && va2 && va2->n == 1 && tr2->n == 99);
  dt_dataset_destroy(tr2);
  dt_dataset_destroy(va2);
  CHECK_ERR(dt_dataset_split(ds, 0.0, 1, &tr2, &va2), DTRAIN_ERR_INVALID_ARG, "not in (0, 1)");
  CHECK_ERR(dt_dataset_split(ds, 1.0, 1, &tr2, &va2), DTRAIN_ERR_INVALID_ARG, "not in (0, 1)");
  CHECK_ERR(dt_dataset_split(ds, NAN, 1, &tr2, &va2), DTRAIN_ERR_INVALID_ARG, "not in (0, 1)");
  dt_dataset *one = make_ds(1);
  CHECK_ERR(dt_dataset_split(one, 0.5, 1, &tr2, &va2), DTRAIN_ERR_INVALID_ARG, "cannot split 1");
  CHECK(tr2 == NULL && va2 == NULL);
  dt_dataset_destroy(one);
  dt_dataset_destroy(tr);
  dt_dataset_destroy(va);
  dt_dataset_destroy(ds);
}

static void test_loader_no_allocation(void) {
  counting_on();
  dt_dataset *ds = make_ds(1000);
  dt_loader_options d = ldesc(32, 3, 1, 0, 1, 2);
  dt_loader *l = NULL;
  CHECK((l = dt_loader_new(ds, &d)) != NULL);
  CHECK(alloc_calls > 0); /* the hook really is in use */
  long before = alloc_calls;
  dt_batch b;
  int64_t batches = 0;
  for (int e = 0; e < 4; e++)
    while (dt_loader_next(l, &b) > 0) batches++;
  CHECK(dt_loader_set_position(l, 9, 64) == DTRAIN_OK);
  while (dt_loader_next(l, &b) > 0) batches++;
  CHECK(batches == 4 * 16 + 14);
  CHECK_MSG(alloc_calls == before, "batches allocated %ld times", alloc_calls - before);
  dt_loader_destroy(l);
  dt_dataset_destroy(ds);
  CHECK_MSG(alloc_calls == free_calls, "%ld allocations, %ld frees", alloc_calls, free_calls);
  dt_set_allocator(NULL);
}

/* Error paths leave nothing behind. */
static void test_no_leaks_on_errors(void) {
  counting_on();
  dt_dataset *ds = NULL;
  dt_npy a;
  dt_idx x;
  dt_text t;
  dt_bytes o;
  const char *csv = "1,2\n3,x\n";
  ds = dt_dataset_from_csv(csv, strlen(csv), NULL);
  ds = dt_dataset_load_csv("/nonexistent", NULL);
  char p[1024];
  root_path(p, sizeof p, "data/fashion-mnist/t10k-labels-idx1-ubyte.gz");
  ds = dt_dataset_load_idx(p, p, 0); /* labels as images: 1-D, refused */
  CHECK(dt_last_result() == DTRAIN_ERR_FORMAT);
  dt_idx_read(tmpdir, &x);
  dt_npy_parse("\x93NUMPY\x01\x00\x05\x00{'a'}", 15, &a);
  dt_text_read("/nonexistent", &t);
  size_t sn = 0;
  unsigned char *s = gzip_stored((const unsigned char *)"abcdef", 6, &sn);
  s[sn - 8] ^= 1;
  dt_gunzip(s, sn, 0, &o);
  dt_read_file_gz(tmpdir, &o);
  free(s);
  CHECK(ds == NULL);
  CHECK_MSG(alloc_calls == free_calls, "%ld allocations, %ld frees", alloc_calls, free_calls);
  dt_set_allocator(NULL);
}

/* Tests that read or write files run only where the library has file I/O;
 * a DTRAIN_NO_STDIO build still runs the from-memory ones (and
 * tests/compile_checks.sh checks that its file readers refuse cleanly). */

/* ---- issue 17: hostile files -------------------------------------------------------------- */
static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL: a data loader blocked on a FIFO\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(2);
}

/* What is not a regular file is refused at once: a FIFO (the open would
 * block forever), /dev/zero (endless), a directory. */
static void test_hostile_special_files(void) {
#if defined(_WIN32)
  th_skip("Windows: no FIFOs or /dev/zero");
#else
  char fifo[512];
  dt_bytes b;
  dt_npy a;
  dt_idx x;
  tmp_path(fifo, sizeof fifo, "fifo.npy");
  CHECK(mkfifo(fifo, 0600) == 0);
  signal(SIGALRM, on_alarm);
  alarm(20);
  CHECK_ERR(dt_read_file(fifo, &b), DTRAIN_ERR_IO, "FIFO");
  CHECK_ERR(dt_npy_read(fifo, &a), DTRAIN_ERR_IO, "not a regular file");
  CHECK_ERR(dt_idx_read(fifo, &x), DTRAIN_ERR_IO, "not a regular file");
  CHECK(dt_dataset_load_idx(fifo, NULL, 0) == NULL && dt_last_result() == DTRAIN_ERR_IO);
  CHECK(dt_dataset_load_csv(fifo, NULL) == NULL && dt_last_result() == DTRAIN_ERR_IO);
  CHECK_ERR(dt_read_file_gz("/dev/zero", &b), DTRAIN_ERR_IO, "device");
  CHECK_ERR(dt_npy_read(tmpdir, &a), DTRAIN_ERR_IO, "directory");
  /* Fashion-MNIST's look-up probes files: FIFOs named like them are skipped. */
  char fm[512], f1[600], f2[600], out[600];
  tmp_path(fm, sizeof fm, "fm_fifo");
  CHECK(th_mkdir(fm, 0700) == 0);
  snprintf(f1, sizeof f1, "%s/t10k-images-idx3-ubyte.gz", fm);
  snprintf(f2, sizeof f2, "%s/t10k-labels-idx1-ubyte", fm);
  CHECK(mkfifo(f1, 0600) == 0 && mkfifo(f2, 0600) == 0);
  CHECK_ERR(dt_fashion_mnist_find(fm, out, sizeof out, NULL), DTRAIN_ERR_NOT_FOUND, "fm_fifo");
  remove(f1);
  remove(f2);
  rmdir(fm);
  alarm(0);
  remove(fifo);
#endif
}

/* A small header in front of a huge (sparse) file: refused from the header,
 * without reading the rest. */
static void test_hostile_sparse(void) {
  char p[512];
  tmp_path(p, sizeof p, "sparse.idx");
  FILE *f = fopen(p, "wb");
  CHECK(f != NULL);
  if (!f) return;
  const unsigned char hdr[8] = {0, 0, 8, 1, 0, 0, 0, 16};
  fwrite(hdr, 1, 8, f);
  for (int i = 0; i < 16; i++) fputc(i, f);
  int sparse = fseek(f, (long)(1L << 30), SEEK_SET) == 0 && fputc(0, f) != EOF;
  fclose(f);
  if (!sparse) {
    remove(p);
    TH_SKIP("no 1 GiB sparse file here");
  }
  dt_idx x;
  double t0 = dt_time_now();
  CHECK_ERR(dt_idx_read(p, &x), DTRAIN_ERR_CORRUPT, "header describes 24");
  CHECK_MSG(dt_time_now() - t0 < 2.0, "refusing took %.2f s", dt_time_now() - t0);
  remove(p);
}

/* gz: a gzipped IDX file of one 16-byte image (its header: 1 image of 4x4
 * after a 2-D count; 24 bytes in all) followed by `extra` bytes the header
 * does not describe: zeros (a bomb: compresses ~1000:1) or, random, bytes
 * that do not compress. 0 when gzip failed. */
static int write_idx_gz(const char *name, char *gz, size_t cap, long extra, int random) {
  char raw[512], cmd[1200];
  tmp_path(raw, sizeof raw, name);
  snprintf(gz, cap, "%s.gz", raw);
  FILE *f = fopen(raw, "wb");
  CHECK(f != NULL);
  if (!f) return 0;
  const unsigned char hdr[8] = {0, 0, 8, 1, 0, 0, 0, 16};
  fwrite(hdr, 1, 8, f);
  uint32_t st = 12345u;
  for (long i = 0; i < 16 + extra; i++) {
    st = st * 1664525u + 1013904223u;
    fputc(random ? (int)(st >> 24) : 0, f);
  }
  fclose(f);
  snprintf(cmd, sizeof cmd, "gzip -1 -n -c '%s' > '%s'", raw, gz);
  int ok = system(cmd) == 0;
  CHECK(ok);
  remove(raw);
  return ok;
}

/* A .gz that inflates far past what its header describes stops there
 * (OVERFLOW at the header's size) instead of inflating it all: 8 MiB of
 * zeros, about 36 KB compressed (small enough to reach the inflater). */
static void test_hostile_gzip_bomb(void) {
  if (!have_gzip()) TH_SKIP("no gzip command");
  char gz[600];
  if (!write_idx_gz("bomb.idx", gz, sizeof gz, 8L << 20, 0)) return;
  counting_on();
  dt_idx x;
  CHECK_ERR(dt_idx_read(gz, &x), DTRAIN_ERR_OVERFLOW, "24 bytes");
  CHECK(dt_dataset_load_idx(gz, NULL, 0) == NULL && dt_last_result() == DTRAIN_ERR_OVERFLOW);
  CHECK_MSG(alloc_max < (4u << 20), "an allocation of %zu bytes for a 16-byte image", alloc_max);
  dt_set_allocator(NULL);
  remove(gz);
}

/* A .gz far larger than anything its header's size could compress to (here
 * 256 KiB of incompressible bytes behind a 16-byte image) is refused before
 * the rest of it is read or inflated. */
static void test_hostile_gzip_large(void) {
  if (!have_gzip()) TH_SKIP("no gzip command");
  char gz[600];
  if (!write_idx_gz("large.idx", gz, sizeof gz, 1L << 18, 1)) return;
  counting_on();
  dt_idx x;
  CHECK_ERR(dt_idx_read(gz, &x), DTRAIN_ERR_CORRUPT, "the compressed file has");
  CHECK_MSG(alloc_max < (1u << 18), "an allocation of %zu bytes before the refusal", alloc_max);
  dt_set_allocator(NULL);
  remove(gz);
}

/* A .gz is inflated as it is read: the compressed file (here 1 MiB of
 * incompressible pixels in stored blocks, a little more than 1 MiB) is never
 * in memory whole, only the output and a chunk of the input. Members, header
 * fields and the trailer check cross the chunks' edges the same way. */
static void test_gzip_streamed(void) {
  char gz[512];
  tmp_path(gz, sizeof gz, "stream.idx.gz");
  const size_t npix = (size_t)1 << 20, n = 16 + npix;
  unsigned char *raw = (unsigned char *)malloc(n);
  CHECK(raw != NULL);
  if (!raw) return;
  const unsigned char hdr[16] = {0, 0, 8, 3, 0, 0, 0, 16, 0, 0, 1, 0, 0, 0, 1, 0}; /* 16 x 256 x 256 */
  memcpy(raw, hdr, 16);
  uint32_t st = 777u;
  for (size_t i = 16; i < n; i++) {
    st = st * 1664525u + 1013904223u;
    raw[i] = (unsigned char)(st >> 24);
  }
  size_t sn = 0;
  unsigned char *g = gzip_stored(raw, n, &sn);
  FILE *f = fopen(gz, "wb");
  CHECK(f != NULL);
  if (!f) {
    free(g);
    free(raw);
    return;
  }
  CHECK(fwrite(g, 1, sn, f) == sn);
  fclose(f);
  counting_on();
  dt_bytes o;
  CHECK_MSG(dt_read_file_gz(gz, &o) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(o.size == n && memcmp(o.data, raw, n) == 0);
  dt_bytes_free(&o);
  CHECK_MSG(alloc_peak < n + (256u << 10), "%zu bytes outstanding at the peak for %zu compressed, %zu decompressed",
            alloc_peak, sn, n);
  alloc_max = alloc_peak = 0;
  dt_idx x;
  CHECK_MSG(dt_idx_read(gz, &x) == DTRAIN_OK, "%s", dt_last_error());
  CHECK(x.ndim == 3 && x.size == (int64_t)npix && memcmp(x.data, raw + 16, npix) == 0);
  dt_idx_free(&x);
  CHECK_MSG(alloc_max <= n + 4096, "an allocation of %zu bytes for %zu decompressed", alloc_max, n);
  CHECK_MSG(alloc_calls == free_calls, "%ld allocations, %ld frees", alloc_calls, free_calls);
  dt_set_allocator(NULL);
  /* Two members, the second with a long name and a header CRC, both
   * straddling the 64 KiB chunks; then the same file cut short. */
  size_t n1 = 65536 - 30, s1 = 0, s2 = 0;
  unsigned char *m1 = gzip_stored(raw, n1, &s1), *m2 = gzip_stored(raw + n1, 200000, &s2);
  const size_t namelen = 70000;
  size_t tn = s1 + 10 + namelen + 1 + 2 + (s2 - 10);
  unsigned char *t = (unsigned char *)malloc(tn), *q = t;
  CHECK(t != NULL);
  if (t) {
    memcpy(q, m1, s1);
    q += s1;
    memcpy(q, m2, 10);
    q[3] = 0x08 | 0x02; /* FNAME FHCRC */
    memset(q + 10, 'n', namelen);
    q[10 + namelen] = 0;
    uint32_t hc = dt_crc32(0, q, 10 + namelen + 1);
    q += 10 + namelen + 1;
    *q++ = (unsigned char)(hc & 0xFF);
    *q++ = (unsigned char)(hc >> 8);
    memcpy(q, m2 + 10, s2 - 10);
    for (int cut = 0; cut < 2; cut++) {
      f = fopen(gz, "wb");
      CHECK(f != NULL);
      if (!f) break;
      CHECK(fwrite(t, 1, cut ? tn - 3 : tn, f) == (cut ? tn - 3 : tn));
      fclose(f);
      if (cut) {
        CHECK_ERR(dt_read_file_gz(gz, &o), DTRAIN_ERR_CORRUPT, "trailer");
        continue;
      }
      CHECK_MSG(dt_read_file_gz(gz, &o) == DTRAIN_OK, "%s", dt_last_error());
      CHECK(o.size == n1 + 200000 && memcmp(o.data, raw, o.size) == 0);
      dt_bytes_free(&o);
    }
    free(t);
  }
  free(m1);
  free(m2);
  free(g);
  free(raw);
  remove(gz);
}

/* dt_npy_write replaces a link planted at its path; it never writes through it. */
static void test_npy_write_link(void) {
#if defined(_WIN32)
  th_skip("Windows: no symbolic links without privileges");
#else
  char victim[512], p[512];
  tmp_path(victim, sizeof victim, "victim.txt");
  tmp_path(p, sizeof p, "linked.npy");
  CHECK(write_file(victim, (const unsigned char *)"precious", 8));
  CHECK(symlink(victim, p) == 0);
  float v[3] = {1, 2, 3};
  int64_t sh = 3;
  CHECK(dt_npy_write(p, DTRAIN_NPY_F32, 1, &sh, v) == DTRAIN_OK);
  dt_bytes b;
  CHECK(dt_read_file(victim, &b) == DTRAIN_OK && b.size == 8 && memcmp(b.data, "precious", 8) == 0);
  dt_bytes_free(&b);
  dt_npy a;
  CHECK(dt_npy_read(p, &a) == DTRAIN_OK && a.size == 3);
  dt_npy_free(&a);
  remove(p);
  remove(victim);
#endif
}

#define TH_RUN_FILES(fn)                                                         \
  do {                                                                           \
    if (dt_build_features() & DTRAIN_FEATURE_STDIO) TH_RUN(fn);                  \
    else th_skip_item(#fn, "DTRAIN_NO_STDIO build has no file I/O");             \
  } while (0)

int main(void) {
  printf("%s\n", dt_build_info()); /* compile_checks.sh looks for zlib=yes in the zlib build */
  if (!(dt_build_features() & DTRAIN_FEATURE_DATA)) {
    th_skip_item("test_data", "the data loaders are compiled out (DTRAIN_NO_DATA)");
    return th_summary("test_data");
  }
  find_root();
  make_tmpdir();
  TH_RUN(test_crc32);
  TH_RUN(test_inflate_stored_blocks);
  TH_RUN(test_inflate_fixed_blocks);
  TH_RUN(test_inflate_dynamic_errors);
  TH_RUN_FILES(test_gunzip_system_gzip);
  TH_RUN(test_gunzip_header_fields);
  TH_RUN(test_gunzip_corrupt);
  TH_RUN_FILES(test_shipped_fashion_mnist);
  TH_RUN_FILES(test_system_fashion_mnist_train);
  TH_RUN_FILES(test_fashion_find);
  TH_RUN_FILES(test_idx_errors);
  TH_RUN_FILES(test_csv_good);
  TH_RUN_FILES(test_csv_bad);
  TH_RUN_FILES(test_npy_roundtrip);
  TH_RUN_FILES(test_npy_headers);
  TH_RUN_FILES(test_npy_numpy_crosscheck);
  TH_RUN_FILES(test_hostile_special_files);
  TH_RUN_FILES(test_hostile_sparse);
  TH_RUN_FILES(test_hostile_gzip_large);
  TH_RUN_FILES(test_hostile_gzip_bomb);
  TH_RUN_FILES(test_gzip_streamed);
  TH_RUN_FILES(test_npy_write_link);
  TH_RUN(test_dataset_basics);
  TH_RUN_FILES(test_text);
  TH_RUN(test_loader_order);
  TH_RUN(test_loader_resume);
  TH_RUN(test_loader_shards);
  TH_RUN(test_split);
  TH_RUN(test_loader_no_allocation);
  TH_RUN_FILES(test_no_leaks_on_errors);
  if (th_rm_rf(tmpdir) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
  return th_summary("test_data");
}
