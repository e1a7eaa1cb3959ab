/* ===========================================================================
 * dt_inflate.c -- gzip (RFC 1952) and a small inflater (RFC 1951), CRC-32
 * ===========================================================================
 * The inflater decodes the three block types of deflate:
 *   stored (copy LEN bytes), fixed Huffman (the RFC's fixed codes) and
 *   dynamic Huffman (code lengths sent, themselves Huffman coded).
 * A Huffman code is canonical: it is fully described by each symbol's code
 * length. Decoding uses a 9-bit lookup table for short codes and walks the
 * canonical code bit by bit for longer ones. Every read is bounds-checked;
 * every malformed stream ends in DTRAIN_ERR_CORRUPT naming what was wrong
 * and where.
 *
 * With DTRAIN_USE_ZLIB the raw deflate decoding goes through zlib instead;
 * the gzip wrapper (header, CRC-32, ISIZE, members) is the same code.
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
#include "dt_device.h"
#include "dt_tensor_internal.h"
#include "dt_ops_internal.h"
#include "dt_params_internal.h"
#include "dt_data_core.h"

#if !defined(DTRAIN_NO_DATA) /* the whole file; the stubs at the end stand in without it */

#ifdef DTRAIN_USE_ZLIB
#  include <zlib.h>
#endif

#define DT__INFLATE_FAST 9           /* bits resolved by one table lookup */
#define DT__INFLATE_MAXBITS 15       /* longest deflate code */
#define DT__INFLATE_DEFAULT_MAX ((size_t)1 << (sizeof(size_t) >= 8 ? 32 : 30))

/* ---- byte buffers ---------------------------------------------------------------- */

DTRAIN_API void dt_bytes_free(dt_bytes *b) {
  if (!b) return;
  dt__free(b->data, b->cap);
  b->data = NULL;
  b->size = b->cap = 0;
}

/* Make room for `need` bytes plus a terminating 0 (cap > need), growing
 * geometrically but never past limit + 1. Returns 0 when that is impossible. */
static int dt__inflate_reserve(dt_bytes *b, size_t need, size_t limit) {
  if (need < b->cap) return 1;
  if (need > limit) return 0;
  size_t cap = b->cap ? b->cap : 4096;
  while (cap <= need) cap = cap > (SIZE_MAX - 1) / 2 ? need + 1 : cap * 2;
  if (cap > limit + 1) cap = limit + 1;
  unsigned char *p = (unsigned char *)dt__realloc(b->data, b->cap, cap);
  if (!p) return 0;
  b->data = p;
  b->cap = cap;
  return 1;
}

/* ---- CRC-32 ------------------------------------------------------------------------
 * Reflected polynomial 0xEDB88320. The 1 KiB table is built on the stack per
 * call (cheap next to any real input) so there is no shared state to race on. */
typedef struct dt__crc_table { uint32_t t[256]; } dt__crc_table;

static void dt__inflate_crc_init(dt__crc_table *c) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t v = n;
    for (int k = 0; k < 8; k++) v = (v & 1) ? 0xEDB88320u ^ (v >> 1) : v >> 1;
    c->t[n] = v;
  }
}

static uint32_t dt__inflate_crc(const dt__crc_table *c, uint32_t crc, const unsigned char *p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; i++) crc = c->t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

DTRAIN_API uint32_t dt_crc32(uint32_t crc, const void *data, size_t len) {
  if (!data || len == 0) return crc;
  dt__crc_table c;
  dt__inflate_crc_init(&c);
  return dt__inflate_crc(&c, crc, (const unsigned char *)data, len);
}

/* ---- input ---------------------------------------------------------------------------
 * The compressed bytes come through a window: either a whole buffer in
 * memory (the window is the buffer, nothing to refill) or a file read in
 * chunks of DT__INFLATE_CHUNK as the decoder asks for them, so a .gz is never
 * held whole in memory. A refill keeps the last 8 bytes already taken in the
 * window: the bit reader buffers up to 8 bytes ahead and hands the unused
 * ones back at a byte boundary (stored blocks, the end of a stream). */
#define DT__INFLATE_CHUNK 65536
#define DT__INFLATE_KEEP 8

typedef struct dt__gz_src {
  const unsigned char *p; /* the window */
  size_t len, pos;        /* bytes in the window, the next unread one */
  uint64_t off;           /* stream offset of p[0] */
  uint64_t total;         /* the stream's length (a file's size when it was opened) */
#ifndef DTRAIN_NO_STDIO
  FILE *f;                /* NULL: the window is the whole input */
  unsigned char *buf;     /* the file's window (DT__INFLATE_KEEP + DT__INFLATE_CHUNK bytes) */
  int io_error;           /* a read failed (not the end of the file) */
#endif
} dt__gz_src;

static void dt__gz_src_mem(dt__gz_src *s, const unsigned char *in, size_t len) {
  memset(s, 0, sizeof *s);
  s->p = in;
  s->len = len;
  s->total = len;
}

/* The stream offset of the next unread byte. */
static uint64_t dt__gz_src_at(const dt__gz_src *s) { return s->off + s->pos; }

/* Makes up to n (<= DT__INFLATE_CHUNK) unread bytes available in the window,
 * reading the file when there are fewer; returns how many there are (fewer
 * than n only at the end of the input or on a read error). */
static size_t dt__gz_src_more(dt__gz_src *s, size_t n) {
  size_t have = s->len - s->pos;
#ifndef DTRAIN_NO_STDIO
  if (have >= n || !s->f || s->io_error) return have;
  size_t keep = s->pos < DT__INFLATE_KEEP ? s->pos : DT__INFLATE_KEEP;
  memmove(s->buf, s->p + s->pos - keep, keep + have);
  s->off += s->pos - keep;
  s->p = s->buf;
  s->pos = keep;
  s->len = keep + have;
  while (s->len - s->pos < n) {
    size_t got = fread(s->buf + s->len, 1, DT__INFLATE_KEEP + DT__INFLATE_CHUNK - s->len, s->f);
    s->len += got;
    if (got == 0) {
      if (ferror(s->f)) s->io_error = 1;
      break;
    }
  }
  return s->len - s->pos;
#else
  (void)n;
  return have;
#endif
}

/* ---- raw deflate ----------------------------------------------------------------------
 * dt__inflate_raw appends the decoded bytes of one deflate stream from src
 * to `out` (whose existing bytes are not a valid back-reference target) and
 * leaves src at the byte after the stream. On error it returns the code and
 * sets *why to a static description; *where is the stream offset near the
 * error. */

#ifndef DTRAIN_USE_ZLIB

typedef struct dt__huff {
  uint16_t count[DT__INFLATE_MAXBITS + 1]; /* number of codes of each length */
  uint16_t symbol[288];                    /* symbols ordered by (length, value) */
  uint16_t fast[1 << DT__INFLATE_FAST];    /* next 9 bits -> symbol | len << 9; 0: slow path */
} dt__huff;

typedef struct dt__inflater {
  dt__gz_src *in;
  uint64_t bits;            /* bit buffer: the next bits of the stream, LSB first */
  int nbits;
  dt_bytes *out;
  size_t base;              /* out->size when this stream began */
  size_t limit;             /* max out->size */
  const char *why;          /* error description (static string) */
  dt_result code;
} dt__inflater;

static int dt__inflate_fail(dt__inflater *s, dt_result code, const char *why) {
  if (!s->why) {
    s->why = why;
    s->code = code;
  }
  return 0;
}

static void dt__inflate_refill(dt__inflater *s) {
  dt__gz_src *in = s->in;
  while (s->nbits <= 56) {
    if (in->pos == in->len && dt__gz_src_more(in, DT__INFLATE_KEEP) == 0) break;
    s->bits |= (uint64_t)in->p[in->pos++] << s->nbits;
    s->nbits += 8;
  }
}

/* Take n (0..16) bits; 0 if the input ends first. */
static int dt__inflate_bits(dt__inflater *s, int n, unsigned *v) {
  if (s->nbits < n) dt__inflate_refill(s);
  if (s->nbits < n) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream");
  *v = (unsigned)(s->bits & ((1u << n) - 1u));
  s->bits >>= n;
  s->nbits -= n;
  return 1;
}

/* Drop the bits of a partly used byte and hand whole buffered bytes back to
 * the input, so that pos is the next byte of the stream. */
static void dt__inflate_align(dt__inflater *s) {
  int drop = s->nbits & 7;
  s->bits >>= drop;
  s->nbits -= drop;
  s->in->pos -= (size_t)(s->nbits / 8); /* still in the window (DT__INFLATE_KEEP) */
  s->bits = 0;
  s->nbits = 0;
}

/* Build a canonical code from lengths[0..n). Over-subscribed sets are
 * refused; an incomplete set only when allow_incomplete (deflate permits one
 * for literal/length and distance codes made of a single 1-bit code, and an
 * empty distance code). Returns 0 (with s->why set) on a bad set. */
static int dt__inflate_build(dt__inflater *s, dt__huff *h, const uint8_t *lengths, int n, int allow_incomplete) {
  uint16_t offs[DT__INFLATE_MAXBITS + 2];
  memset(h->count, 0, sizeof h->count);
  memset(h->fast, 0, sizeof h->fast);
  for (int i = 0; i < n; i++) h->count[lengths[i]]++;
  int used = n - h->count[0]; /* symbols that have a code */
  /* Kraft: each length doubles the code space; every code uses up one slot. */
  int left = 1, maxlen = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) {
    left = left * 2 - h->count[len];
    if (left < 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "over-subscribed Huffman code");
    if (h->count[len]) maxlen = len;
  }
  if (left > 0 && used > 0 && !(allow_incomplete && maxlen == 1))
    return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "incomplete Huffman code");
  if (used == 0 && !allow_incomplete) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "empty Huffman code");
  /* Symbols sorted by length, then value. */
  offs[1] = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) offs[len + 1] = (uint16_t)(offs[len] + h->count[len]);
  for (int i = 0; i < n; i++)
    if (lengths[i]) h->symbol[offs[lengths[i]]++] = (uint16_t)i;
  /* Fast table: walk the codes in canonical order. Code bits are sent most
   * significant first, so the table index is the code bit-reversed. */
  unsigned code = 0;
  int k = 0;
  for (int len = 1; len <= DT__INFLATE_FAST; len++) {
    for (int j = 0; j < h->count[len]; j++, k++, code++) {
      unsigned rev = 0;
      for (int b = 0; b < len; b++) rev |= ((code >> b) & 1u) << (len - 1 - b);
      uint16_t entry = (uint16_t)(h->symbol[k] | (unsigned)len << 9);
      for (unsigned i = rev; i < (1u << DT__INFLATE_FAST); i += 1u << len) h->fast[i] = entry;
    }
    code <<= 1;
  }
  return 1;
}

/* Decode one symbol; -1 on error. */
static int dt__inflate_decode(dt__inflater *s, const dt__huff *h) {
  if (s->nbits < DT__INFLATE_MAXBITS) dt__inflate_refill(s);
  unsigned e = h->fast[s->bits & ((1u << DT__INFLATE_FAST) - 1u)];
  if (e) {
    int len = (int)(e >> 9);
    if (len > s->nbits) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream"), -1;
    s->bits >>= len;
    s->nbits -= len;
    return (int)(e & 0x1FF);
  }
  /* Slow path: the codes of length len are the integers first..first+count-1
   * (in canonical order); extend the code one bit at a time. */
  int code = 0, first = 0, index = 0;
  for (int len = 1; len <= DT__INFLATE_MAXBITS; len++) {
    if (len > s->nbits) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated deflate stream"), -1;
    code |= (int)((s->bits >> (len - 1)) & 1u);
    int count = h->count[len];
    if (code - first < count) {
      s->bits >>= len;
      s->nbits -= len;
      return h->symbol[index + (code - first)];
    }
    index += count;
    first = (first + count) << 1;
    code <<= 1;
  }
  return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid Huffman code"), -1;
}

static int dt__inflate_stored(dt__inflater *s) {
  dt__gz_src *in = s->in;
  dt__inflate_align(s);
  if (dt__gz_src_more(in, 4) < 4) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated stored block header");
  unsigned n = dt__get_le16(in->p + in->pos), nc = dt__get_le16(in->p + in->pos + 2);
  if ((n ^ 0xFFFFu) != nc) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "stored block length check (LEN/NLEN) fails");
  in->pos += 4;
  /* The stream's length says so before any output is reserved (a file
   * that shrinks as it is read ends in the copy below). */
  if (in->total - dt__gz_src_at(in) < n) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated stored block");
  if (!dt__inflate_reserve(s->out, s->out->size + n, s->limit))
    return dt__inflate_fail(s, s->out->size + n > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                            "output does not fit (size limit or out of memory)");
  while (n) {
    size_t k = dt__gz_src_more(in, n);
    if (k == 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "truncated stored block");
    if (k > n) k = n;
    memcpy(s->out->data + s->out->size, in->p + in->pos, k);
    s->out->size += k;
    in->pos += k;
    n -= (unsigned)k;
  }
  return 1;
}

static const uint16_t dt__inflate_len_base[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                                  31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
static const uint8_t dt__inflate_len_extra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                                  2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
static const uint16_t dt__inflate_dist_base[30] = {1,    2,    3,    4,    5,    7,     9,     13,    17,  25,
                                                   33,   49,   65,   97,   129,  193,   257,   385,   513, 769,
                                                   1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
static const uint8_t dt__inflate_dist_extra[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                                   6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

/* Decode literal/length + distance symbols until end-of-block (256). */
static int dt__inflate_codes(dt__inflater *s, const dt__huff *lit, const dt__huff *dist) {
  dt_bytes *o = s->out;
  for (;;) {
    int sym = dt__inflate_decode(s, lit);
    if (sym < 0) return 0;
    if (sym < 256) {
      if (o->size + 1 >= o->cap && !dt__inflate_reserve(o, o->size + 1, s->limit))
        return dt__inflate_fail(s, o->size + 1 > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                                "output does not fit (size limit or out of memory)");
      o->data[o->size++] = (unsigned char)sym;
      continue;
    }
    if (sym == 256) return 1;
    sym -= 257;
    if (sym >= 29) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid literal/length symbol (286 or 287)");
    unsigned extra, len, d;
    if (!dt__inflate_bits(s, dt__inflate_len_extra[sym], &extra)) return 0;
    len = dt__inflate_len_base[sym] + extra;
    int ds = dt__inflate_decode(s, dist);
    if (ds < 0) return 0;
    if (ds >= 30) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "invalid distance symbol (30 or 31)");
    if (!dt__inflate_bits(s, dt__inflate_dist_extra[ds], &extra)) return 0;
    d = dt__inflate_dist_base[ds] + extra;
    if (d > o->size - s->base) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "distance too far back");
    if (o->size + len >= o->cap && !dt__inflate_reserve(o, o->size + len, s->limit))
      return dt__inflate_fail(s, o->size + len > s->limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM,
                              "output does not fit (size limit or out of memory)");
    /* Byte by byte: the source may overlap the bytes being written (d < len). */
    unsigned char *dst = o->data + o->size;
    const unsigned char *src = dst - d;
    for (unsigned i = 0; i < len; i++) dst[i] = src[i];
    o->size += len;
  }
}

static int dt__inflate_fixed(dt__inflater *s, dt__huff *lit, dt__huff *dist) {
  uint8_t l[288];
  int i = 0;
  for (; i < 144; i++) l[i] = 8;
  for (; i < 256; i++) l[i] = 9;
  for (; i < 280; i++) l[i] = 7;
  for (; i < 288; i++) l[i] = 8;
  if (!dt__inflate_build(s, lit, l, 288, 0)) return 0;
  for (i = 0; i < 32; i++) l[i] = 5; /* 30 and 31 are in the code but invalid */
  if (!dt__inflate_build(s, dist, l, 32, 0)) return 0;
  return dt__inflate_codes(s, lit, dist);
}

static int dt__inflate_dynamic(dt__inflater *s, dt__huff *lit, dt__huff *dist) {
  static const uint8_t order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
  uint8_t lengths[288 + 32];
  unsigned hlit, hdist, hclen, v;
  if (!dt__inflate_bits(s, 5, &hlit) || !dt__inflate_bits(s, 5, &hdist) || !dt__inflate_bits(s, 4, &hclen)) return 0;
  hlit += 257;
  hdist += 1;
  hclen += 4;
  if (hlit > 286) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "too many literal/length codes (HLIT > 286)");
  if (hdist > 30) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "too many distance codes (HDIST > 30)");
  /* The code-length code: 3 bits per length, in the RFC's order. */
  memset(lengths, 0, sizeof lengths);
  for (unsigned i = 0; i < hclen; i++) {
    if (!dt__inflate_bits(s, 3, &v)) return 0;
    lengths[order[i]] = (uint8_t)v;
  }
  for (unsigned i = hclen; i < 19; i++) lengths[order[i]] = 0;
  dt__huff *clen = lit; /* reuse the literal table's storage for the code-length code */
  if (!dt__inflate_build(s, clen, lengths, 19, 0)) return 0;
  /* Literal/length and distance code lengths, one sequence with repeats. */
  unsigned n = 0, total = hlit + hdist;
  while (n < total) {
    int sym = dt__inflate_decode(s, clen);
    if (sym < 0) return 0;
    if (sym < 16) {
      lengths[n++] = (uint8_t)sym;
      continue;
    }
    uint8_t val = 0;
    unsigned rep;
    if (sym == 16) {
      if (n == 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "repeat of a code length with none before it");
      val = lengths[n - 1];
      if (!dt__inflate_bits(s, 2, &rep)) return 0;
      rep += 3;
    } else if (sym == 17) {
      if (!dt__inflate_bits(s, 3, &rep)) return 0;
      rep += 3;
    } else {
      if (!dt__inflate_bits(s, 7, &rep)) return 0;
      rep += 11;
    }
    if (n + rep > total) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "code length repeat runs past the end");
    while (rep--) lengths[n++] = val;
  }
  if (lengths[256] == 0) return dt__inflate_fail(s, DTRAIN_ERR_CORRUPT, "no end-of-block code");
  if (!dt__inflate_build(s, lit, lengths, (int)hlit, 1)) return 0;
  if (!dt__inflate_build(s, dist, lengths + hlit, (int)hdist, 1)) return 0;
  return dt__inflate_codes(s, lit, dist);
}

static dt_result dt__inflate_raw(dt__gz_src *in, dt_bytes *out, size_t limit, const char **why, uint64_t *where) {
  dt__inflater s;
  dt__huff *tables = (dt__huff *)dt__alloc(2 * sizeof(dt__huff));
  if (!tables) {
    *why = "out of memory";
    *where = 0;
    return DTRAIN_ERR_NOMEM;
  }
  memset(&s, 0, sizeof s);
  s.in = in;
  s.out = out;
  s.base = out->size;
  s.limit = limit;
  int ok = 1;
  unsigned last = 0, type;
  while (ok && !last) {
    ok = dt__inflate_bits(&s, 1, &last) && dt__inflate_bits(&s, 2, &type);
    if (!ok) break;
    if (type == 0) ok = dt__inflate_stored(&s);
    else if (type == 1) ok = dt__inflate_fixed(&s, &tables[0], &tables[1]);
    else if (type == 2) ok = dt__inflate_dynamic(&s, &tables[0], &tables[1]);
    else ok = dt__inflate_fail(&s, DTRAIN_ERR_CORRUPT, "invalid block type 3");
  }
  dt__free(tables, 2 * sizeof(dt__huff));
  if (!ok) {
    *why = s.why;
    *where = dt__gz_src_at(in);
    return s.code;
  }
  dt__inflate_align(&s);
  return DTRAIN_OK;
}

#else /* DTRAIN_USE_ZLIB */

static dt_result dt__inflate_raw(dt__gz_src *in, dt_bytes *out, size_t limit, const char **why, uint64_t *where) {
  z_stream z;
  memset(&z, 0, sizeof z);
  *where = dt__gz_src_at(in);
  if (inflateInit2(&z, -MAX_WBITS) != Z_OK) {
    *why = "zlib inflateInit2 failed";
    return DTRAIN_ERR_INTERNAL;
  }
  dt_result r = DTRAIN_OK;
  for (;;) {
    if (out->size + 1 >= out->cap) {
      size_t want = out->size + (out->size / 2 > 65536 ? out->size / 2 : 65536);
      if (want > limit) want = limit;
      if (want <= out->size || !dt__inflate_reserve(out, want, limit)) {
        r = out->size >= limit ? DTRAIN_ERR_OVERFLOW : DTRAIN_ERR_NOMEM;
        *why = "output does not fit (size limit or out of memory)";
        break;
      }
    }
    /* zlib copies what it needs into its own window: the input window may
     * move between calls. */
    size_t avail = in->len - in->pos;
    if (avail == 0) avail = dt__gz_src_more(in, DT__INFLATE_CHUNK);
    size_t chunk_in = DT__MIN(avail, (size_t)UINT_MAX);
    size_t chunk_out = DT__MIN(out->cap - 1 - out->size, (size_t)UINT_MAX);
    z.next_in = (Bytef *)(uintptr_t)(in->p + in->pos);
    z.avail_in = (uInt)chunk_in;
    z.next_out = (Bytef *)(out->data + out->size);
    z.avail_out = (uInt)chunk_out;
    int zr = inflate(&z, Z_NO_FLUSH);
    in->pos += chunk_in - z.avail_in;
    out->size += chunk_out - z.avail_out;
    if (zr == Z_STREAM_END) break;
    if (zr == Z_OK) continue;
    if (zr == Z_BUF_ERROR && z.avail_out == 0) continue; /* grow the output */
    if (zr == Z_BUF_ERROR) { /* no input left (a refill found none) */
      r = DTRAIN_ERR_CORRUPT;
      *why = "truncated deflate stream";
      break;
    }
    r = zr == Z_MEM_ERROR ? DTRAIN_ERR_NOMEM : DTRAIN_ERR_CORRUPT;
    *why = z.msg ? z.msg : "zlib reports a data error";
    break;
  }
  *where = dt__gz_src_at(in);
  inflateEnd(&z);
  return r;
}

#endif /* DTRAIN_USE_ZLIB */

/* ---- public raw inflate -------------------------------------------------------------- */

static size_t dt__inflate_limit(size_t max_out) {
  return max_out ? DT__MIN(max_out, SIZE_MAX - 2) : DT__MIN(DT__INFLATE_DEFAULT_MAX, SIZE_MAX - 2);
}

DTRAIN_API dt_result dt_inflate(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_inflate: out is NULL");
  memset(out, 0, sizeof *out);
  if (!in && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_inflate: in is NULL");
  size_t limit = dt__inflate_limit(max_out);
  uint64_t where = 0;
  const char *why = "";
  dt__gz_src src;
  dt__gz_src_mem(&src, (const unsigned char *)in, len);
  if (!dt__inflate_reserve(out, 0, limit)) return dt__error(DTRAIN_ERR_NOMEM, "dt_inflate: out of memory");
  dt_result r = dt__inflate_raw(&src, out, limit, &why, &where);
  if (r != DTRAIN_OK) {
    dt_bytes_free(out);
    if (r == DTRAIN_ERR_OVERFLOW)
      return dt__error(r, "dt_inflate: decompressed data exceeds the limit of %zu bytes", limit);
    if (r == DTRAIN_ERR_NOMEM) return dt__error(r, "dt_inflate: out of memory while decompressing");
    return dt__error(r, "dt_inflate: corrupt deflate data: %s (near input byte %llu)", why, (unsigned long long)where);
  }
  out->data[out->size] = 0;
  return DTRAIN_OK;
}

/* ---- gzip ----------------------------------------------------------------------------
 * A gzip file is one or more members:
 *   1f 8b CM=8 FLG MTIME(4) XFL OS [XLEN(2) extra] [name\0] [comment\0] [HCRC(2)]
 *   deflate data, CRC-32 (4, little-endian) of the member's output, ISIZE (4) = its length mod 2^32. */
#define DT__GZ_FTEXT 0x01
#define DT__GZ_FHCRC 0x02
#define DT__GZ_FEXTRA 0x04
#define DT__GZ_FNAME 0x08
#define DT__GZ_FCOMMENT 0x10

/* Takes n header bytes, adding them to the header's CRC; 0 if the input ends first. */
static int dt__gz_take(dt__gz_src *in, const dt__crc_table *t, uint32_t *hcrc, size_t n) {
  while (n) {
    size_t k = dt__gz_src_more(in, DT__MIN(n, (size_t)DT__INFLATE_CHUNK));
    if (k == 0) return 0;
    if (k > n) k = n;
    *hcrc = dt__inflate_crc(t, *hcrc, in->p + in->pos, k);
    in->pos += k;
    n -= k;
  }
  return 1;
}

/* The members of in appended to out; ctx prefixes every message
 * ("dt_idx_read: 'f.gz'"); last_isize (the input's last 4 bytes) sizes out
 * first, bounded by what the input could expand to. */
static dt_result dt__gunzip_src(const char *ctx, dt__gz_src *in, uint32_t last_isize, size_t max_out, dt_bytes *out) {
  dt__crc_table crc;
  size_t limit = dt__inflate_limit(max_out);
  int member = 0;
  dt__inflate_crc_init(&crc);
  /* Size hint from the last ISIZE, bounded by what deflate can expand to
   * (at most 258 bytes per 2 bits, about 1032:1), so a forged value cannot
   * make us allocate much. */
  if (in->total >= 18 && out->cap == 0) {
    size_t hint = last_isize;
    size_t bound = in->total > (uint64_t)((SIZE_MAX - 1024) / 1032) ? SIZE_MAX - 1024 : (size_t)in->total * 1032 + 1024;
    hint = DT__MIN(DT__MIN(hint, bound), limit);
    /* Exactly that (a true ISIZE is the size): the output is then the only
     * large allocation, not the next power of two above it. */
    out->data = (unsigned char *)dt__alloc(hint + 1);
    if (!out->data) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory (%zu bytes)", ctx, hint);
    out->cap = hint + 1;
  }
  while (dt__gz_src_more(in, 1) > 0 || member == 0) {
    uint64_t start = dt__gz_src_at(in);
    size_t got = dt__gz_src_more(in, 18);
    const unsigned char *h = in->p + in->pos;
    uint64_t rest = got < 18 || in->total < start ? got : in->total - start;
    if (got < 2 || h[0] != 0x1f || h[1] != 0x8b) {
      if (member == 0) return dt__error(DTRAIN_ERR_FORMAT, "%s: not gzip data (no 1f 8b magic)", ctx);
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: %llu bytes of trailing garbage after member %d",
                       ctx, (unsigned long long)rest, member);
    }
    if (got < 18) return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated (member %d has %zu bytes, a member needs at least 18)", ctx, member + 1, got);
    if (h[2] != 8)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: compression method %u is not deflate (8)", ctx,
                       (unsigned)h[2]);
    unsigned flg = h[3];
    if (flg & 0xE0) return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: reserved header flags set (0x%02x)", ctx, flg);
    uint32_t hcrc = 0; /* of the header so far, for FHCRC */
    dt__gz_take(in, &crc, &hcrc, 10);
    if (flg & DT__GZ_FEXTRA) {
      if (dt__gz_src_more(in, 2) < 2) goto truncated_header;
      size_t xlen = dt__get_le16(in->p + in->pos);
      if (!dt__gz_take(in, &crc, &hcrc, 2) || !dt__gz_take(in, &crc, &hcrc, xlen)) goto truncated_header;
    }
    for (int f = 0; f < 2; f++) { /* zero-terminated name, then comment */
      if (!(flg & (f == 0 ? DT__GZ_FNAME : DT__GZ_FCOMMENT))) continue;
      for (;;) {
        if (dt__gz_src_more(in, 1) == 0) goto truncated_header;
        unsigned char c = in->p[in->pos];
        dt__gz_take(in, &crc, &hcrc, 1);
        if (c == 0) break;
      }
    }
    if (flg & DT__GZ_FHCRC) {
      if (dt__gz_src_more(in, 2) < 2) goto truncated_header;
      uint32_t want = dt__get_le16(in->p + in->pos);
      if (want != (hcrc & 0xFFFFu))
        return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: header CRC mismatch (stored 0x%04x, computed 0x%04x)",
                         ctx, (unsigned)want, (unsigned)(hcrc & 0xFFFFu));
      in->pos += 2;
    }
    size_t before = out->size;
    uint64_t where = 0;
    const char *why = "";
    dt_result r = dt__inflate_raw(in, out, limit, &why, &where);
    if (r == DTRAIN_ERR_OVERFLOW)
      return dt__error(r, "%s: decompressed data exceeds the limit of %zu bytes", ctx, limit);
    if (r == DTRAIN_ERR_NOMEM) return dt__error(r, "%s: out of memory while decompressing", ctx);
    if (r != DTRAIN_OK)
      return dt__error(r, "%s: corrupt gzip data: %s (near byte %llu of the file)", ctx, why, (unsigned long long)where);
    if (dt__gz_src_more(in, 8) < 8)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated (the CRC-32/ISIZE trailer is missing)", ctx);
    uint32_t want_crc = dt__get_le32(in->p + in->pos), want_size = dt__get_le32(in->p + in->pos + 4);
    uint32_t got_crc = dt__inflate_crc(&crc, 0, out->data + before, out->size - before);
    uint32_t got_size = (uint32_t)((out->size - before) & 0xFFFFFFFFu);
    if (want_crc != got_crc)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: CRC-32 mismatch (stored 0x%08x, computed 0x%08x)", ctx,
                       (unsigned)want_crc, (unsigned)got_crc);
    if (want_size != got_size)
      return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: ISIZE mismatch (stored %u, decompressed %u bytes)", ctx,
                       (unsigned)want_size, (unsigned)got_size);
    in->pos += 8;
    member++;
  }
  if (!dt__inflate_reserve(out, out->size, limit)) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", ctx);
  out->data[out->size] = 0;
  return DTRAIN_OK;
truncated_header:
  return dt__error(DTRAIN_ERR_CORRUPT, "%s: corrupt gzip data: truncated header (member %d)", ctx, member + 1);
}

/* Appends to out. */
DTRAIN_PRIVATE dt_result dt__gunzip_ctx(const char *ctx, const unsigned char *in, size_t len, size_t max_out,
                                        dt_bytes *out) {
  dt__gz_src src;
  dt__gz_src_mem(&src, in, len);
  return dt__gunzip_src(ctx, &src, len >= 18 ? dt__get_le32(in + len - 4) : 0, max_out, out);
}

#ifndef DTRAIN_NO_STDIO
/* The gzip file f (a regular file of size bytes) inflated into out, read in
 * chunks: only the output and one chunk are in memory. */
DTRAIN_PRIVATE dt_result dt__gunzip_file(const char *ctx, FILE *f, uint64_t size, size_t max_out, dt_bytes *out) {
  unsigned char tail[4];
  uint32_t last = 0;
  if (size >= 18) { /* the last ISIZE sizes the output (dt__gunzip_src) */
    if (fseek(f, -4L, SEEK_END) != 0 || fread(tail, 1, 4, f) != 4)
      return dt__error(DTRAIN_ERR_IO, "%s: cannot read the gzip trailer", ctx);
    last = dt__get_le32(tail);
  }
  if (fseek(f, 0L, SEEK_SET) != 0) return dt__error(DTRAIN_ERR_IO, "%s: cannot seek to the start", ctx);
  dt__gz_src src;
  memset(&src, 0, sizeof src);
  src.f = f;
  src.total = size;
  src.buf = (unsigned char *)dt__alloc(DT__INFLATE_KEEP + DT__INFLATE_CHUNK);
  if (!src.buf) return dt__error(DTRAIN_ERR_NOMEM, "%s: out of memory", ctx);
  src.p = src.buf;
  dt_result r = dt__gunzip_src(ctx, &src, last, max_out, out);
  /* A read that failed looks like the end of the input to the decoder:
   * name the real cause. */
  if (src.io_error) r = dt__error(DTRAIN_ERR_IO, "%s: a read failed at byte %llu of the file", ctx,
                                  (unsigned long long)dt__gz_src_at(&src));
  dt__free(src.buf, DT__INFLATE_KEEP + DT__INFLATE_CHUNK);
  return r;
}
#endif

/* The first bytes (at most max_out) that a gzip image decompresses to, from
 * as much of the image as is at hand (a file's first kilobytes): a loader
 * checks the header inside before it reads or inflates the rest. Errors
 * (truncated input, corrupt data) just end the prefix; the full decompression
 * reports them. DTRAIN_ERR_NOMEM is the only failure. */
DTRAIN_PRIVATE dt_result dt__gunzip_prefix(const unsigned char *in, size_t len, size_t max_out, dt_bytes *out) {
  size_t pos = 10;
  uint64_t where = 0;
  const char *why = "";
  dt__gz_src src;
  memset(out, 0, sizeof *out);
  if (!dt__inflate_reserve(out, DT__MIN(max_out, (size_t)65536), max_out)) return DTRAIN_ERR_NOMEM;
  if (len < 18 || in[0] != 0x1f || in[1] != 0x8b || in[2] != 8) return DTRAIN_OK;
  unsigned flg = in[3];
  if (flg & DT__GZ_FEXTRA) {
    if (len - pos < 2) return DTRAIN_OK;
    size_t xlen = dt__get_le16(in + pos);
    pos += 2;
    if (len - pos < xlen) return DTRAIN_OK;
    pos += xlen;
  }
  for (int f = 0; f < 2; f++) {
    if (!(flg & (f == 0 ? DT__GZ_FNAME : DT__GZ_FCOMMENT))) continue;
    const unsigned char *z = (const unsigned char *)memchr(in + pos, 0, len - pos);
    if (!z) return DTRAIN_OK;
    pos = (size_t)(z - in) + 1;
  }
  if (flg & DT__GZ_FHCRC) pos += 2;
  if (pos >= len) return DTRAIN_OK;
  dt__gz_src_mem(&src, in + pos, len - pos);
  dt_result r = dt__inflate_raw(&src, out, max_out, &why, &where);
  if (out->data) out->data[out->size < out->cap ? out->size : out->cap - 1] = 0;
  return r == DTRAIN_ERR_NOMEM && out->size == 0 ? r : DTRAIN_OK;
}

DTRAIN_API dt_result dt_gunzip(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  if (!out) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_gunzip: out is NULL");
  memset(out, 0, sizeof *out);
  if (!in && len) return dt__error(DTRAIN_ERR_NULL_ARG, "dt_gunzip: in is NULL");
  dt_result r = dt__gunzip_ctx("dt_gunzip", (const unsigned char *)in, len, max_out, out);
  if (r != DTRAIN_OK) dt_bytes_free(out);
  return r;
}

#undef DT__INFLATE_FAST
#undef DT__INFLATE_MAXBITS
#undef DT__INFLATE_DEFAULT_MAX
#undef DT__GZ_FTEXT
#undef DT__GZ_FHCRC
#undef DT__GZ_FEXTRA
#undef DT__GZ_FNAME
#undef DT__GZ_FCOMMENT
#undef DT__INFLATE_CHUNK
#undef DT__INFLATE_KEEP

#else /* DTRAIN_NO_DATA: every entry point says so */

/* One message for every entry point of the compiled-out loaders (declared in dt_data_core.h; here, in the lowest file of the data layer). */
DTRAIN_PRIVATE dt_result dt__data_compiled_out(const char *fn) {
  return dt__error(DTRAIN_ERR_UNSUPPORTED, "%s: the data loaders are compiled out (DTRAIN_NO_DATA)", fn);
}

DTRAIN_API void dt_bytes_free(dt_bytes *b) { (void)b; }
/* No error channel: 0, like an empty message's CRC. */
DTRAIN_API uint32_t dt_crc32(uint32_t crc, const void *data, size_t len) {
  (void)crc; (void)data; (void)len;
  return 0;
}
DTRAIN_API dt_result dt_inflate(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  (void)in; (void)len; (void)max_out; (void)out;
  return dt__data_compiled_out("dt_inflate");
}
DTRAIN_API dt_result dt_gunzip(const void *in, size_t len, size_t max_out, dt_bytes *out) {
  (void)in; (void)len; (void)max_out; (void)out;
  return dt__data_compiled_out("dt_gunzip");
}

#endif /* DTRAIN_NO_DATA */
