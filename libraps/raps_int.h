/* libraps internals shared by its source files (not installed). */
#ifndef RAPS_INT_H
#define RAPS_INT_H

#include <stddef.h>
#include <pthread.h>
#include <stdint.h>

#define RAPS_MAX_REQUEST 65536 /* the agent's frame limit (MAX_REQUEST) */
#define RAPS_DIGEST 32

/* --- errors (raps.c) --- */
int raps__fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void raps__set_kind(const char *kind);

/* --- one connection to the agent (wire.c) --- */
struct raps_conn {
  int fd;
  char path[108];
};
/* A reply: its JSON body (NUL-terminated) and the descriptors that came with it. */
struct raps_reply {
  char *body;
  size_t len;
  int fds[4];
  int nfds;
};
void raps__conn_init(struct raps_conn *c, const char *path);
void raps__conn_close(struct raps_conn *c);
/* Send one JSON request (with fds passed by SCM_RIGHTS) and read the reply, waiting at
 * most timeout_s; on success the reply's "ok" is true. On a refusal sets the last error
 * from "error"/"kind" and returns its code; the reply is freed on any error. */
int raps__call(struct raps_conn *c, const char *json, const int *fds, int nfds,
               double timeout_s, struct raps_reply *out);
void raps__reply_free(struct raps_reply *r);
/* The code for an agent error kind. */
int raps__kind_code(const char *kind);

/* --- a minimal reader of the agent's JSON replies (wire.c) --- */
/* The value of key in the object text[0..n) (top level), as a span; 0 if absent. */
int raps__json_get(const char *text, size_t n, const char *key, const char **v, size_t *vn);
int raps__json_long(const char *text, size_t n, const char *key, long long *out);
int raps__json_double(const char *text, size_t n, const char *key, double *out);
int raps__json_bool(const char *text, size_t n, const char *key, int *out);
/* A string value unescaped into out (at most cap-1 bytes, NUL-terminated). */
int raps__json_str(const char *text, size_t n, const char *key, char *out, size_t cap);
int raps__json_is_null(const char *text, size_t n, const char *key);

/* --- chunks and packs (codec.c) --- */
struct raps_params {
  int avg_chunk_kb;
  int sha256; /* 0: blake3 */
  int zstd_level;
  int shuffle;
};
struct raps_chunk {
  uint8_t digest[RAPS_DIGEST];
  uint32_t size;
};
/* Next cut of data[0..n): the length of the chunk that starts at data (FastCDC). */
size_t raps__cut(const uint8_t *data, size_t n, int avg_chunk_kb);
void raps__digest(const struct raps_params *p, const void *data, size_t n,
                  uint8_t out[RAPS_DIGEST]);
/* Append one chunk to the pack in memfd fd (its size in *pack_size); RAPS_OK or error. */
int raps__pack_add(int fd, size_t *pack_size, const struct raps_params *p,
                   const struct raps_chunk *c, const uint8_t *raw, size_t elem);
/* A new memory file that can be sealed (with the pack magic when pack is true). */
int raps__memfd(const char *name, int pack, size_t *size);
int raps__seal(int fd);
/* whole_digest of the manifest, hex in out[65]. */
void raps__whole_digest(const struct raps_params *p, const char *items_json, size_t items_len,
                        const struct raps_chunk *chunks, size_t n, char out[65]);
void raps__hex(const uint8_t *d, size_t n, char *out);

/* --- the rank's one session (raps.c), its saves and restores (ckpt.c) --- */
#define MAX_REGIONS 1024 /* below the manifest's 4096 items */
struct region {
  int id;
  void *ptr;
  size_t nbytes, elem;
};

struct raps_state {
  int ready;
  struct raps_conn ck, hb; /* a save may take seconds: heartbeats have their own */
  char job[24];
  int rank;
  long epoch;
  double interval, ckpt_interval, last_ckpt, valid_until;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop, need_register;
  long step, blocked_on;
  struct region regions[MAX_REGIONS];
  int nregions;
  struct raps_chunk *prev; /* the last generation's chunks: the base of the next save */
  size_t nprev;
  long long prev_gen;
  /* where each region's chunks were in prev (id, size, first chunk, count): the pre-pass */
  struct prev_item { int id; size_t nbytes, first, count; } prev_items[MAX_REGIONS];
  int nprev_items;
  uint8_t *cached; /* a generation restart_test fetched, for raps_restore */
  size_t cached_size;
  long cached_version;
  long long cached_gen;
  /* the rank's generations (newest first) and their labels, from ckpt_generations */
  long long gens[RAPS_MAX_LABELS];
  long labels[RAPS_MAX_LABELS];
  int ngens, listed;
  long chosen; /* the label raps_restore restores (raps_restart_choose), -1: the newest */
  /* recovery progress of a relaunched rank (epoch > 1): the step it had reached before
   * the fault (-1: unknown) and which phases it reported */
  long resume_step;
  int sent_running, sent_caught_up;
};
extern struct raps_state raps__state;
#define S raps__state

double raps__mono(void);

#endif
