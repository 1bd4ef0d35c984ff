/* Saves and restores of the protected regions (ckpt_begin/put/commit, ckpt_restore), as
 * raps_slurm/runtime/checkpoint.py and checkpoint/writer.py do them for a Python rank.
 *
 * A generation holds one item "raps.c" (the header: magic, version, then id and size of
 * each region) and one item "r<id>" per region, in id order; so a restore, which gets
 * the items' bytes one after the other, finds every region without reading the manifest. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <unistd.h>

#include "raps.h"
#include "raps_int.h"

#define PACK_BYTES (32u << 20)
#define HEADER_MAGIC "RAPSC001"
#define SAVE_TIMEOUT 600.0
#define MAX_MANIFEST (256u << 20)

/* A growing text buffer. */
struct buf {
  char *p;
  size_t n, cap;
  int oom;
};

static void bprintf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bprintf(struct buf *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = b->oom ? 0 : vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (b->oom) return;
    if (b->p && (size_t)k < b->cap - b->n) {
      b->n += (size_t)k;
      return;
    }
    size_t cap = (b->cap + (size_t)k + 1) * 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p, b->cap = cap;
  }
}

/* Open addressing over chunk names: slots hold an index + 1 into a chunk array given at
 * each call (the array of this save moves as it grows). */
struct dset {
  size_t *slot; /* 0: empty */
  size_t mask, used;
};

static uint64_t key64(const uint8_t *d) {
  uint64_t k;
  memcpy(&k, d, 8);
  return k;
}

static int dset_has(const struct dset *s, const struct raps_chunk *chunks, const uint8_t *d) {
  if (!s->slot) return 0;
  for (size_t h = key64(d) & s->mask; s->slot[h]; h = (h + 1) & s->mask)
    if (memcmp(chunks[s->slot[h] - 1].digest, d, RAPS_DIGEST) == 0) return 1;
  return 0;
}

/* Add chunks[i] (kept at most half full); -1 when out of memory. */
static int dset_add(struct dset *s, const struct raps_chunk *chunks, size_t i) {
  if (2 * (s->used + 1) > (s->slot ? s->mask + 1 : 0)) {
    size_t cap = s->slot ? 2 * (s->mask + 1) : 1024, *old = s->slot, oldcap = s->mask + 1;
    s->slot = calloc(cap, sizeof(size_t));
    if (!s->slot) {
      s->slot = old;
      return -1;
    }
    s->mask = cap - 1;
    for (size_t k = 0; old && k < oldcap; k++)
      if (old[k]) {
        size_t h = key64(chunks[old[k] - 1].digest) & s->mask;
        while (s->slot[h]) h = (h + 1) & s->mask;
        s->slot[h] = old[k];
      }
    free(old);
  }
  size_t h = key64(chunks[i].digest) & s->mask;
  while (s->slot[h]) h = (h + 1) & s->mask;
  s->slot[h] = i + 1;
  s->used++;
  return 0;
}

static void drop_cached(void) {
  if (S.cached) munmap(S.cached, S.cached_size);
  S.cached = NULL;
}

static void set_blocked(long peer) {
  pthread_mutex_lock(&S.mu);
  S.blocked_on = peer; /* a rank in its checkpoint waits on itself: not hung */
  pthread_mutex_unlock(&S.mu);
}

static int put_pack(const char *sid, int fd) {
  char req[96];
  snprintf(req, sizeof req, "{\"op\":\"ckpt_put\",\"session\":\"%s\"}", sid);
  int rc = raps__seal(fd);
  struct raps_reply r;
  if (rc == RAPS_OK) rc = raps__call(&S.ck, req, &fd, 1, SAVE_TIMEOUT, &r);
  if (rc == RAPS_OK) raps__reply_free(&r);
  close(fd);
  return rc;
}

struct save {
  struct raps_params p;
  char sid[40];
  struct dset known, sent;
  struct raps_chunk *chunks;
  size_t n, cap;
  int pack;
  size_t pack_size;
  struct prev_item items[MAX_REGIONS]; /* this save's regions, for the next pre-pass */
  int nitems;
};

/* Name one chunk of len bytes at data and pack it unless the agent holds it. */
static int save_chunk(struct save *sv, const uint8_t *data, size_t len, size_t elem,
                      const uint8_t *digest) {
  if (sv->n == sv->cap) {
    size_t cap = sv->cap ? 2 * sv->cap : 1024;
    struct raps_chunk *c = realloc(sv->chunks, cap * sizeof *c);
    if (!c) return raps__fail(RAPS_ERR_SYSTEM, "out of memory (chunk list)");
    sv->chunks = c, sv->cap = cap;
  }
  struct raps_chunk *c = &sv->chunks[sv->n];
  c->size = (uint32_t)len;
  if (digest) memcpy(c->digest, digest, RAPS_DIGEST);
  else raps__digest(&sv->p, data, len, c->digest);
  /* held by the agent (the base), or already sent in this save */
  int known = digest || dset_has(&sv->known, S.prev, c->digest) ||
              dset_has(&sv->sent, sv->chunks, c->digest);
  if (!known) {
    if (dset_add(&sv->sent, sv->chunks, sv->n) != 0)
      return raps__fail(RAPS_ERR_SYSTEM, "out of memory (chunk names)");
    if (sv->pack < 0) {
      sv->pack = raps__memfd("raps-pack", 1, &sv->pack_size);
      if (sv->pack < 0) return -sv->pack;
    }
    int rc = raps__pack_add(sv->pack, &sv->pack_size, &sv->p, c, data, elem);
    if (rc == RAPS_OK && sv->pack_size >= PACK_BYTES) {
      rc = put_pack(sv->sid, sv->pack);
      sv->pack = -1;
    }
    if (rc != RAPS_OK) return rc;
  }
  sv->n++;
  return RAPS_OK;
}

/* Cut data[0..n) anew and save its chunks. */
static int save_cut(struct save *sv, const uint8_t *data, size_t n, size_t elem) {
  for (size_t off = 0; off < n;) {
    size_t len = raps__cut(data + off, n - off, sv->p.avg_chunk_kb);
    int rc = save_chunk(sv, data + off, len, elem, NULL);
    if (rc != RAPS_OK) return rc;
    off += len;
  }
  return RAPS_OK;
}

/* Save one item; its chunk count in *count. With the previous generation's chunks of the
 * same region (same size, base held by the agent), each old chunk whose bytes still have
 * its name is referenced as it is; only the runs that changed are cut again. */
static int save_item(struct save *sv, int id, const uint8_t *data, size_t n, size_t elem,
                     size_t *count) {
  size_t start = sv->n;
  const struct prev_item *old = NULL;
  for (int i = 0; sv->known.slot && id >= 0 && i < S.nprev_items; i++)
    if (S.prev_items[i].id == id && S.prev_items[i].nbytes == n) old = &S.prev_items[i];
  int rc = RAPS_OK;
  if (!old) {
    rc = save_cut(sv, data, n, elem);
  } else {
    size_t off = 0, run = 0; /* run: start of the changed bytes not yet saved */
    for (size_t k = 0; rc == RAPS_OK && k < old->count; k++) {
      const struct raps_chunk *c = &S.prev[old->first + k];
      uint8_t d[RAPS_DIGEST];
      raps__digest(&sv->p, data + off, c->size, d);
      if (memcmp(d, c->digest, RAPS_DIGEST) == 0) {
        rc = save_cut(sv, data + run, off - run, elem);
        if (rc == RAPS_OK) rc = save_chunk(sv, data + off, c->size, elem, d);
        run = off + c->size;
      }
      off += c->size;
    }
    if (rc == RAPS_OK) rc = save_cut(sv, data + run, n - run, elem);
  }
  *count = sv->n - start;
  if (rc == RAPS_OK && id >= 0 && sv->nitems < MAX_REGIONS)
    sv->items[sv->nitems++] = (struct prev_item){id, n, start, *count};
  return rc;
}

static void item_json(struct buf *b, const char *name, size_t nbytes, size_t chunks, int first) {
  /* json.dumps(..., sort_keys=True) of Item.to_dict(): the whole digest hashes this text */
  bprintf(b, "%s{\"chunks\": %zu, \"dtype\": \"\", \"kind\": \"bytes\", \"name\": \"%s\", "
          "\"nbytes\": %zu, \"shape\": []}", first ? "" : ", ", chunks, name, nbytes);
}

static int do_save(struct save *sv, long version) {
  char req[256];
  char base[24] = "null";
  if (S.prev_gen > 0) snprintf(base, sizeof base, "%lld", S.prev_gen);
  snprintf(req, sizeof req, "{\"op\":\"ckpt_begin\",\"job\":\"%s\",\"rank\":%d,\"epoch\":%ld,"
           "\"base\":%s}", S.job, S.rank, S.epoch, base);
  struct raps_reply r;
  int rc = raps__call(&S.ck, req, NULL, 0, SAVE_TIMEOUT, &r);
  if (rc != RAPS_OK) return rc;
  const char *pv;
  size_t pn;
  char digest[16] = "";
  long long avg = 0, level = 0;
  int base_ok = 0, shuffle = 0;
  int good = raps__json_str(r.body, r.len, "session", sv->sid, sizeof sv->sid) &&
             raps__json_get(r.body, r.len, "params", &pv, &pn) &&
             raps__json_long(pv, pn, "avg_chunk_kb", &avg) &&
             raps__json_str(pv, pn, "digest", digest, sizeof digest) &&
             raps__json_long(pv, pn, "zstd_level", &level) &&
             raps__json_bool(pv, pn, "shuffle", &shuffle) &&
             raps__json_bool(r.body, r.len, "base_ok", &base_ok);
  raps__reply_free(&r);
  if (!good || avg < 1 || avg > 4096 || (strcmp(digest, "blake3") && strcmp(digest, "sha256")))
    return raps__fail(RAPS_ERR_PROTOCOL, "malformed ckpt_begin reply");
  sv->p = (struct raps_params){(int)avg, strcmp(digest, "sha256") == 0, (int)level, shuffle};
  for (size_t i = 0; base_ok && i < S.nprev; i++)
    if (dset_add(&sv->known, S.prev, i) != 0)
      return raps__fail(RAPS_ERR_SYSTEM, "out of memory (previous chunks)");

  size_t hsize = 24 + 16 * (size_t)S.nregions, total = 0, count = 0;
  uint8_t *head = calloc(1, hsize);
  if (!head) return raps__fail(RAPS_ERR_SYSTEM, "out of memory");
  int64_t v = version, nr = S.nregions;
  memcpy(head, HEADER_MAGIC, 8);
  memcpy(head + 8, &v, 8);
  memcpy(head + 16, &nr, 8);
  for (int i = 0; i < S.nregions; i++) {
    int64_t id = S.regions[i].id, size = (int64_t)S.regions[i].nbytes;
    memcpy(head + 24 + 16 * i, &id, 8);
    memcpy(head + 32 + 16 * i, &size, 8);
  }
  struct buf items = {0};
  bprintf(&items, "[");
  rc = save_item(sv, -1, head, hsize, 1, &count);
  free(head);
  item_json(&items, "raps.c", hsize, count, 1);
  total += hsize;
  for (int i = 0; rc == RAPS_OK && i < S.nregions; i++) {
    struct region *g = &S.regions[i];
    rc = save_item(sv, g->id, g->ptr, g->nbytes, g->elem, &count);
    char name[24];
    snprintf(name, sizeof name, "r%d", g->id);
    item_json(&items, name, g->nbytes, count, 0);
    total += g->nbytes;
  }
  bprintf(&items, "]");
  if (rc == RAPS_OK && sv->pack >= 0) {
    rc = put_pack(sv->sid, sv->pack);
    sv->pack = -1;
  }
  if (rc == RAPS_OK && items.oom) rc = raps__fail(RAPS_ERR_SYSTEM, "out of memory (items)");
  char whole[65], hex[65];
  struct buf m = {0};
  if (rc == RAPS_OK) {
    raps__whole_digest(&sv->p, items.p, items.n, sv->chunks, sv->n, whole);
    struct timeval tv;
    gettimeofday(&tv, NULL);
    bprintf(&m, "{\"version\":1,\"job\":\"%s\",\"rank\":%d,\"generation\":0,\"epoch\":%ld,"
            "\"digest_algo\":\"%s\",\"items\":%.*s,\"chunks\":[", S.job, S.rank, S.epoch,
            digest, (int)items.n, items.p);
    for (size_t i = 0; i < sv->n; i++) {
      raps__hex(sv->chunks[i].digest, RAPS_DIGEST, hex);
      bprintf(&m, "%s[\"%s\",%u]", i ? "," : "", hex, sv->chunks[i].size);
    }
    bprintf(&m, "],\"total_size\":%zu,\"whole_digest\":\"%s\",\"created\":%ld.%06ld,"
            "\"extra\":{\"libraps\":{\"version\":%ld}}}", total, whole, (long)tv.tv_sec,
            (long)tv.tv_usec, version);
    if (m.oom || m.n > MAX_MANIFEST)
      rc = raps__fail(RAPS_ERR_QUOTA, "manifest of %zu bytes: at most %u", m.n, MAX_MANIFEST);
  }
  free(items.p);
  if (rc == RAPS_OK) {
    size_t dummy;
    int fd = raps__memfd("raps-manifest", 0, &dummy);
    if (fd < 0) rc = -fd;
    else {
      size_t done = 0;
      while (rc == RAPS_OK && done < m.n) {
        ssize_t k = write(fd, m.p + done, m.n - done);
        if (k < 0 && errno != EINTR) rc = raps__fail(RAPS_ERR_SYSTEM, "manifest write: %s",
                                                     strerror(errno));
        if (k > 0) done += (size_t)k;
      }
      if (rc == RAPS_OK) rc = raps__seal(fd);
      snprintf(req, sizeof req, "{\"op\":\"ckpt_commit\",\"session\":\"%s\"}", sv->sid);
      if (rc == RAPS_OK) rc = raps__call(&S.ck, req, &fd, 1, SAVE_TIMEOUT, &r);
      close(fd);
      sv->sid[0] = 0; /* the agent ends the session at a commit, refused or not */
      long long gen = 0;
      if (rc == RAPS_OK) {
        if (!raps__json_long(r.body, r.len, "generation", &gen) || gen < 1)
          rc = raps__fail(RAPS_ERR_PROTOCOL, "malformed ckpt_commit reply");
        raps__reply_free(&r);
      }
      if (rc == RAPS_OK) {
        free(S.prev);
        S.prev = sv->chunks, S.nprev = sv->n, S.prev_gen = gen;
        memcpy(S.prev_items, sv->items, sizeof(struct prev_item) * (size_t)sv->nitems);
        S.nprev_items = sv->nitems;
        sv->chunks = NULL;
      }
    }
  }
  free(m.p);
  return rc;
}

int raps_checkpoint(long version) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_checkpoint: raps_init first");
  if (version < 0)
    return raps__fail(RAPS_ERR_ARG, "version %ld: expected an integer >= 0", version);
  struct save sv = {.pack = -1};
  set_blocked(S.rank);
  int rc = do_save(&sv, version);
  set_blocked(-1);
  if (sv.pack >= 0) close(sv.pack);
  if (rc != RAPS_OK && sv.sid[0]) {
    char req[96];
    snprintf(req, sizeof req, "{\"op\":\"ckpt_abort\",\"session\":\"%s\"}", sv.sid);
    struct raps_reply r;
    char err[640], kind[64];
    snprintf(err, sizeof err, "%s", raps_last_error());
    snprintf(kind, sizeof kind, "%s", raps_last_kind());
    if (raps__call(&S.ck, req, NULL, 0, 10.0, &r) == RAPS_OK) raps__reply_free(&r);
    raps__fail(rc, "%s", err);
    raps__set_kind(kind);
  }
  free(sv.known.slot);
  free(sv.sent.slot);
  free(sv.chunks);
  if (rc != RAPS_OK) return rc;
  S.listed = 0; /* a new generation: the labels and a generation fetched are old news */
  drop_cached();
  S.last_ckpt = raps__mono();
  pthread_mutex_lock(&S.mu);
  if (S.step < version) S.step = version;
  pthread_mutex_unlock(&S.mu);
  return RAPS_OK;
}

/* Parse the restored manifest's chunk list: the base of the next save. */
static void take_chunks(int fd) {
  off_t size = lseek(fd, 0, SEEK_END);
  if (size <= 0 || size > MAX_MANIFEST) return;
  char *text = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (text == MAP_FAILED) return;
  const char *v;
  size_t vn, n = 0, cap = 0;
  struct raps_chunk *chunks = NULL;
  if (raps__json_get(text, (size_t)size, "chunks", &v, &vn)) {
    for (const char *p = v, *end = v + vn; (p = memchr(p, '"', (size_t)(end - p)));) {
      if (end - p < 70 || p[65] != '"' || p[66] != ',') break;
      if (n == cap) {
        cap = cap ? 2 * cap : 1024;
        struct raps_chunk *c = realloc(chunks, cap * sizeof *c);
        if (!c) break;
        chunks = c;
      }
      for (int i = 0; i < RAPS_DIGEST; i++) {
        unsigned x;
        sscanf(p + 1 + 2 * i, "%2x", &x);
        chunks[n].digest[i] = (uint8_t)x;
      }
      chunks[n++].size = (uint32_t)strtoul(p + 67, NULL, 10);
      p += 67;
    }
  }
  munmap(text, (size_t)size);
  free(S.prev);
  S.prev = chunks, S.nprev = n;
  S.nprev_items = 0; /* where each region's chunks are is not parsed: no pre-pass */
}

/* The step this rank had reached before the fault that relaunched it (-1: unknown; an
 * older agent's reply has none): caught up once raps_progress reaches it. */
static void take_resume_step(const struct raps_reply *r) {
  long long resume = -1;
  if (raps__json_long(r->body, r->len, "resume_step", &resume) && resume >= 0)
    S.resume_step = (long)resume;
}

/* Fetch generation gen (0: the newest) into S.cached (RAPS_ERR_NO_CHECKPOINT if none). */
static int fetch(long long gen) {
  if (S.cached && (gen == 0 || S.cached_gen == gen)) return RAPS_OK;
  drop_cached();
  char req[192], which[40] = "";
  if (gen > 0) snprintf(which, sizeof which, ",\"generation\":%lld", gen);
  snprintf(req, sizeof req, "{\"op\":\"ckpt_restore\",\"job\":\"%s\",\"rank\":%d%s}", S.job,
           S.rank, which);
  struct raps_reply r;
  int rc = raps__call(&S.ck, req, NULL, 0, SAVE_TIMEOUT, &r);
  if (rc != RAPS_OK) return rc;
  long long size = 0;
  take_resume_step(&r);
  if (raps__json_is_null(r.body, r.len, "generation")) {
    raps__reply_free(&r);
    return raps__fail(RAPS_ERR_NO_CHECKPOINT, "rank %d of job %s has no committed generation",
                      S.rank, S.job);
  }
  long long got = 0;
  if (!raps__json_long(r.body, r.len, "generation", &got) ||
      !raps__json_long(r.body, r.len, "size", &size) || r.nfds != 2 || size < 24 ||
      (gen > 0 && got != gen)) {
    raps__reply_free(&r);
    return raps__fail(RAPS_ERR_PROTOCOL, "malformed ckpt_restore reply");
  }
  uint8_t *data = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, r.fds[0], 0);
  if (data != MAP_FAILED) take_chunks(r.fds[1]);
  raps__reply_free(&r);
  if (data == MAP_FAILED) return raps__fail(RAPS_ERR_SYSTEM, "mmap: %s", strerror(errno));
  int64_t version;
  memcpy(&version, data + 8, 8);
  if (memcmp(data, HEADER_MAGIC, 8) != 0) {
    munmap(data, (size_t)size);
    return raps__fail(RAPS_ERR_MISMATCH, "generation %lld of rank %d was not saved by "
                      "libraps", got, S.rank);
  }
  S.cached = data, S.cached_size = (size_t)size, S.cached_version = (long)version;
  S.cached_gen = got, S.prev_gen = got;
  return RAPS_OK;
}

/* The rank's generations and their labels (ckpt_generations), once per session. */
static int list_generations(void) {
  if (S.listed) return RAPS_OK;
  char req[128];
  snprintf(req, sizeof req, "{\"op\":\"ckpt_generations\",\"job\":\"%s\",\"rank\":%d}", S.job,
           S.rank);
  struct raps_reply r;
  int rc = raps__call(&S.ck, req, NULL, 0, SAVE_TIMEOUT, &r);
  if (rc != RAPS_OK) return rc;
  const char *v;
  size_t vn;
  int n = 0;
  take_resume_step(&r);
  if (!raps__json_get(r.body, r.len, "generations", &v, &vn) || vn < 2 || v[0] != '[') {
    raps__reply_free(&r);
    return raps__fail(RAPS_ERR_PROTOCOL, "malformed ckpt_generations reply");
  }
  /* flat objects {"generation": G, "label": L|null}: no braces inside */
  for (const char *p = v, *end = v + vn; n < RAPS_MAX_LABELS && (p = memchr(p, '{',
                                                                           (size_t)(end - p)));) {
    const char *close = memchr(p, '}', (size_t)(end - p));
    if (!close) break;
    long long gen = 0, label = -1;
    size_t on = (size_t)(close - p + 1);
    if (raps__json_long(p, on, "generation", &gen) && gen >= 1 &&
        !raps__json_is_null(p, on, "label") && raps__json_long(p, on, "label", &label) &&
        label >= 0)
      S.gens[n] = gen, S.labels[n++] = (long)label;
    p = close + 1;
  }
  raps__reply_free(&r);
  S.ngens = n, S.listed = 1;
  return RAPS_OK;
}

int raps_restart_labels(long *labels, int cap, int *count) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_restart_labels: raps_init first");
  if (!count || cap < 0 || (cap > 0 && !labels))
    return raps__fail(RAPS_ERR_ARG, "labels, cap, count: expected an array of cap >= 0 "
                      "longs and a pointer");
  *count = 0;
  int rc = list_generations();
  if (rc != RAPS_OK) return rc;
  for (int i = 0; i < S.ngens && i < cap; i++) labels[i] = S.labels[i];
  *count = S.ngens < cap ? S.ngens : cap;
  if (S.ngens == 0)
    return raps__fail(RAPS_ERR_NO_CHECKPOINT, "rank %d of job %s has no generation saved by "
                      "libraps", S.rank, S.job);
  raps__fail(RAPS_OK, "%s", "");
  return RAPS_OK;
}

int raps_restart_choose(long version) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_restart_choose: raps_init first");
  if (version < -1) return raps__fail(RAPS_ERR_ARG, "version %ld: expected an integer >= 0, "
                                      "or -1 for the newest", version);
  S.chosen = version;
  raps__fail(RAPS_OK, "%s", "");
  return RAPS_OK;
}

int raps_restart_test(long *version) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_restart_test: raps_init first");
  if (!version) return raps__fail(RAPS_ERR_ARG, "version: expected a pointer");
  *version = -1;
  int rc = fetch(0);
  if (rc != RAPS_OK) return rc;
  *version = S.cached_version;
  raps__fail(RAPS_OK, "%s", "");
  return RAPS_OK;
}

/* Copy the cached generation into the protected regions. */
static int copy_back(void) {
  const uint8_t *d = S.cached;
  int rc = RAPS_OK;
  int64_t nr;
  memcpy(&nr, d + 16, 8);
  size_t hsize = 24 + 16 * (size_t)nr;
  if (nr != S.nregions || hsize > S.cached_size) {
    rc = raps__fail(RAPS_ERR_MISMATCH, "the checkpoint holds %lld regions, %d are protected",
                    (long long)nr, S.nregions);
  }
  size_t off = hsize;
  for (int i = 0; rc == RAPS_OK && i < S.nregions; i++) {
    int64_t id, size;
    memcpy(&id, d + 24 + 16 * i, 8);
    memcpy(&size, d + 32 + 16 * i, 8);
    if (id != S.regions[i].id || (size_t)size != S.regions[i].nbytes ||
        off + (size_t)size > S.cached_size)
      rc = raps__fail(RAPS_ERR_MISMATCH, "checkpoint region %lld of %lld bytes does not fit "
                      "protected region %d of %zu bytes", (long long)id, (long long)size,
                      S.regions[i].id, S.regions[i].nbytes);
    else if (size) memcpy(S.regions[i].ptr, d + off, (size_t)size);
    off += (size_t)size;
  }
  return rc;
}

int raps_restore_version(long version) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_restore_version: raps_init first");
  if (version < 0) return raps__fail(RAPS_ERR_ARG, "version %ld: expected an integer >= 0",
                                     version);
  int rc = list_generations();
  if (rc != RAPS_OK) return rc;
  long long gen = 0;
  for (int i = 0; !gen && i < S.ngens; i++)
    if (S.labels[i] == version) gen = S.gens[i]; /* the newest so labelled */
  if (!gen)
    return raps__fail(RAPS_ERR_NO_CHECKPOINT, "rank %d of job %s holds no generation "
                      "labelled %ld", S.rank, S.job, version);
  rc = fetch(gen);
  if (rc == RAPS_OK && S.cached_version != version)
    rc = raps__fail(RAPS_ERR_MISMATCH, "generation %lld is labelled %ld, not %ld", gen,
                    S.cached_version, version);
  if (rc == RAPS_OK) rc = copy_back();
  drop_cached();
  if (rc != RAPS_OK) return rc;
  raps__fail(RAPS_OK, "%s", "");
  return RAPS_OK;
}

int raps_restore(long *version) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_restore: raps_init first");
  if (S.chosen >= 0) {
    int rc = raps_restore_version(S.chosen);
    if (rc == RAPS_OK && version) *version = S.chosen;
    return rc;
  }
  int rc = fetch(0);
  if (rc != RAPS_OK) return rc;
  rc = copy_back();
  if (rc == RAPS_OK && version) *version = S.cached_version;
  drop_cached();
  if (rc != RAPS_OK) return rc;
  raps__fail(RAPS_OK, "%s", "");
  return RAPS_OK;
}
