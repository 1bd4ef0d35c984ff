/* Chunks as raps_slurm/checkpoint/codec.py and pack.py define them: content-defined cuts,
 * chunk names (blake3 or sha256 of the raw bytes), stored form (codec byte: 0 raw, 1 zstd,
 * 2 shuffle+zstd with the element size next) and the pack a rank hands to its agent. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zstd.h>

#include "blake3/blake3.h"
#include "raps.h"
#include "raps_int.h"

#define RAW 0
#define ZSTD 1
#define SHUF 2
/* Stored raw when zstd saves less than 3 % (codec.py MIN_SAVING). */
#define MIN_SAVING 0.03

static uint64_t gear[256];
static int gear_ready;

static void gear_init(void) {
  /* splitmix64 from a fixed seed: the table is part of where C ranks cut, so it never
   * changes (a change would make the next save rewrite every chunk once). */
  uint64_t x = 0x52415053u;
  for (int i = 0; i < 256; i++) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    gear[i] = z ^ (z >> 31);
  }
  gear_ready = 1;
}

static uint64_t top_bits(int bits) { return bits <= 0 ? 0 : ~0ull << (64 - bits); }

size_t raps__cut(const uint8_t *data, size_t n, int avg_chunk_kb) {
  /* FastCDC with normalized chunking: a harder mask before the average size, an easier
   * one after; min avg/4 and max avg*4 as the Python side. */
  if (!gear_ready) gear_init();
  size_t avg = (size_t)avg_chunk_kb * 1024 < 256 ? 256 : (size_t)avg_chunk_kb * 1024;
  size_t min = avg / 4 < 64 ? 64 : avg / 4, max = avg * 4 < 1024 ? 1024 : avg * 4;
  if (n <= min) return n;
  if (n > max) n = max;
  int bits = 0;
  while (((size_t)1 << (bits + 1)) <= avg) bits++;
  uint64_t hard = top_bits(bits + 1), easy = top_bits(bits - 1), h = 0;
  size_t i = min, normal = avg < n ? avg : n;
  for (; i < normal; i++) {
    h = (h << 1) + gear[data[i]];
    if (!(h & hard)) return i + 1;
  }
  for (; i < n; i++) {
    h = (h << 1) + gear[data[i]];
    if (!(h & easy)) return i + 1;
  }
  return n;
}

struct hasher {
  int sha256;
  blake3_hasher b3;
  EVP_MD_CTX *md;
};

static void h_init(struct hasher *h, int sha256) {
  h->sha256 = sha256;
  h->md = NULL;
  if (sha256) {
    h->md = EVP_MD_CTX_new();
    EVP_DigestInit_ex(h->md, EVP_sha256(), NULL);
  } else {
    blake3_hasher_init(&h->b3);
  }
}

static void h_update(struct hasher *h, const void *d, size_t n) {
  if (h->sha256) EVP_DigestUpdate(h->md, d, n);
  else blake3_hasher_update(&h->b3, d, n);
}

static void h_final(struct hasher *h, uint8_t out[RAPS_DIGEST]) {
  if (h->sha256) {
    unsigned len = RAPS_DIGEST;
    EVP_DigestFinal_ex(h->md, out, &len);
    EVP_MD_CTX_free(h->md);
  } else {
    blake3_hasher_finalize(&h->b3, out, RAPS_DIGEST);
  }
}

void raps__digest(const struct raps_params *p, const void *data, size_t n,
                  uint8_t out[RAPS_DIGEST]) {
  struct hasher h;
  h_init(&h, p->sha256);
  h_update(&h, data, n);
  h_final(&h, out);
}

void raps__hex(const uint8_t *d, size_t n, char *out) {
  static const char x[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) out[2 * i] = x[d[i] >> 4], out[2 * i + 1] = x[d[i] & 15];
  out[2 * n] = 0;
}

static void be64(uint64_t v, uint8_t out[8]) {
  for (int i = 7; i >= 0; i--, v >>= 8) out[i] = (uint8_t)v;
}

void raps__whole_digest(const struct raps_params *p, const char *items_json, size_t items_len,
                        const struct raps_chunk *chunks, size_t n, char out[65]) {
  struct hasher h;
  uint8_t num[8], d[RAPS_DIGEST];
  h_init(&h, p->sha256);
  h_update(&h, "raps-whole-v1", 14); /* with its NUL, as b"raps-whole-v1\0" */
  be64(items_len, num);
  h_update(&h, num, 8);
  h_update(&h, items_json, items_len);
  for (size_t i = 0; i < n; i++) {
    h_update(&h, chunks[i].digest, RAPS_DIGEST);
    be64(chunks[i].size, num);
    h_update(&h, num, 8);
  }
  h_final(&h, d);
  raps__hex(d, RAPS_DIGEST, out);
}

int raps__memfd(const char *name, int pack, size_t *size) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return raps__fail(RAPS_ERR_SYSTEM, "memfd_create: %s", strerror(errno)) * -1;
  *size = 0;
  if (pack) {
    if (write(fd, "RAPSPAK1", 8) != 8) {
      close(fd);
      return -raps__fail(RAPS_ERR_SYSTEM, "pack write: %s", strerror(errno));
    }
    *size = 8;
  }
  return fd;
}

int raps__seal(int fd) {
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return raps__fail(RAPS_ERR_SYSTEM, "sealing a memory file: %s", strerror(errno));
  return RAPS_OK;
}

static int write_parts(int fd, struct iovec *iov, int n) {
  while (n > 0) {
    ssize_t k = writev(fd, iov, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return raps__fail(RAPS_ERR_SYSTEM, "pack write: %s", strerror(errno));
    }
    while (n > 0 && (size_t)k >= iov->iov_len) k -= (ssize_t)iov->iov_len, iov++, n--;
    if (n > 0) iov->iov_base = (char *)iov->iov_base + k, iov->iov_len -= (size_t)k;
  }
  return RAPS_OK;
}

int raps__pack_add(int fd, size_t *pack_size, const struct raps_params *p,
                   const struct raps_chunk *c, const uint8_t *raw, size_t elem) {
  size_t n = c->size, bound = ZSTD_compressBound(n);
  uint8_t *packed = malloc(bound), *shuf = NULL, head[2];
  size_t headn = 1;
  if (!packed) return raps__fail(RAPS_ERR_SYSTEM, "out of memory (%zu bytes)", bound);
  const uint8_t *src = raw;
  if (p->shuffle && elem > 1 && elem <= 255 && n >= 2 * elem) {
    /* byte k of every element together; a tail shorter than one element stays as is */
    size_t whole = n / elem * elem, rows = whole / elem;
    shuf = malloc(n);
    if (!shuf) {
      free(packed);
      return raps__fail(RAPS_ERR_SYSTEM, "out of memory (%zu bytes)", n);
    }
    for (size_t e = 0; e < rows; e++)
      for (size_t k = 0; k < elem; k++) shuf[k * rows + e] = raw[e * elem + k];
    memcpy(shuf + whole, raw + whole, n - whole);
    src = shuf;
    head[0] = SHUF, head[1] = (uint8_t)elem, headn = 2;
  } else {
    head[0] = ZSTD;
  }
  size_t z = ZSTD_compress(packed, bound, src, n, p->zstd_level);
  const uint8_t *payload = packed;
  size_t payn = z;
  if (ZSTD_isError(z) || (double)(z + headn) > (double)n * (1 - MIN_SAVING)) {
    head[0] = RAW, headn = 1, payload = raw, payn = n;
  }
  uint8_t rec[RAPS_DIGEST + 8];
  memcpy(rec, c->digest, RAPS_DIGEST);
  uint32_t stored = (uint32_t)(headn + payn);
  for (int i = 0; i < 4; i++) {
    rec[RAPS_DIGEST + i] = (uint8_t)(n >> (24 - 8 * i));
    rec[RAPS_DIGEST + 4 + i] = (uint8_t)(stored >> (24 - 8 * i));
  }
  struct iovec iov[3] = {{rec, sizeof rec}, {head, headn}, {(void *)payload, payn}};
  int rc = write_parts(fd, iov, 3);
  free(packed);
  free(shuf);
  if (rc == RAPS_OK) *pack_size += sizeof rec + stored;
  return rc;
}
