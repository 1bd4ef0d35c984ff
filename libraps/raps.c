/* libraps: a rank's session with its node's raps-agent (register, heartbeat, fencing) and
 * its checkpoints (save, restore), speaking the agent's local API as the Python runtime
 * does (raps_slurm/runtime/agent_client.py and checkpoint.py). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "raps.h"
#include "raps_int.h"

#define REGISTER_WAIT 10.0 /* seconds a starting rank waits for a fenced node, as Python's */
#define EXIT_FENCED 75 /* EX_TEMPFAIL, as a fenced Python rank */

struct raps_state S = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
                       .blocked_on = -1, .chosen = -1, .resume_step = -1};

static __thread char last_error[640];
static __thread char last_kind[64];

double raps__mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int raps__fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  last_kind[0] = 0;
  return code;
}

void raps__set_kind(const char *kind) { snprintf(last_kind, sizeof last_kind, "%s", kind); }

static int ok(void) {
  last_error[0] = last_kind[0] = 0;
  return RAPS_OK;
}

const char *raps_strerror(int code) {
  static const char *names[] = {
      "success", "bad argument", "bad environment", "no agent", "refused by the agent",
      "permission denied", "wrong job, rank or epoch", "over quota", "no checkpoint",
      "checkpoint lost", "wrong call order", "system error", "protocol error",
      "restored data does not fit the protected regions"};
  if (code < 0 || code >= (int)(sizeof names / sizeof names[0])) return "unknown error code";
  return names[code];
}

const char *raps_last_error(void) { return last_error; }
const char *raps_last_kind(void) { return last_kind; }

/* --- session: register, heartbeat, fencing ----------------------------------------------- */

static int do_register(struct raps_conn *c, double timeout, double *valid_for) {
  char req[256];
  snprintf(req, sizeof req, "{\"op\":\"register\",\"job\":\"%s\",\"rank\":%d,\"epoch\":%ld,"
           "\"pid\":%d}", S.job, S.rank, S.epoch, (int)getpid());
  struct raps_reply r;
  double sent = raps__mono();
  int rc = raps__call(c, req, NULL, 0, timeout, &r);
  if (rc != RAPS_OK) return rc;
  int good = raps__json_double(r.body, r.len, "valid_for", valid_for) && isfinite(*valid_for);
  raps__reply_free(&r);
  if (!good) return raps__fail(RAPS_ERR_PROTOCOL, "malformed reply: no valid_for");
  if (*valid_for <= 0) {
    raps__fail(RAPS_ERR_REFUSED, "the agent says this node is fenced (valid_for <= 0)");
    raps__set_kind("fenced");
    return RAPS_ERR_REFUSED;
  }
  S.valid_until = sent + *valid_for;
  return RAPS_OK;
}

static void fence(const char *reason) {
  fprintf(stderr, "raps: rank %d of job %s stops: %s\n", S.rank, S.job, reason);
  _exit(EXIT_FENCED); /* no cleanup: atexit handlers could still write job state */
}

/* One heartbeat (or registration again); a reason to stop, or NULL. */
static const char *beat(double timeout) {
  static __thread char why[700];
  struct raps_reply r;
  double sent = raps__mono(), valid_for = 0;
  int rc;
  if (S.need_register) {
    rc = do_register(&S.hb, timeout, &valid_for);
    if (rc == RAPS_OK) S.need_register = 0;
  } else {
    char req[256];
    pthread_mutex_lock(&S.mu);
    long step = S.step, blocked = S.blocked_on;
    pthread_mutex_unlock(&S.mu);
    char peer[24] = "null";
    if (blocked >= 0) snprintf(peer, sizeof peer, "%ld", blocked);
    snprintf(req, sizeof req, "{\"op\":\"heartbeat\",\"job\":\"%s\",\"rank\":%d,\"step\":%ld,"
             "\"items\":0,\"blocked_on\":%s}", S.job, S.rank, step, peer);
    rc = raps__call(&S.hb, req, NULL, 0, timeout, &r);
    if (rc == RAPS_OK) {
      long long epoch = S.epoch;
      raps__json_long(r.body, r.len, "epoch", &epoch);
      int good = raps__json_double(r.body, r.len, "valid_for", &valid_for);
      raps__reply_free(&r);
      if (epoch > S.epoch) {
        snprintf(why, sizeof why, "replaced by epoch %lld (this is epoch %ld)", epoch, S.epoch);
        return why;
      }
      if (!good) return NULL; /* validity not renewed; the watchdog decides */
      if (valid_for <= 0) return "the agent says this node is fenced (valid_for <= 0)";
      S.valid_until = sent + valid_for;
    }
  }
  if (rc == RAPS_OK) return NULL;
  if (rc == RAPS_ERR_NO_AGENT || rc == RAPS_ERR_PROTOCOL) {
    S.need_register = 1; /* a restarted agent has forgotten this rank */
    return NULL;
  }
  if (strcmp(last_kind, "not_registered") == 0) S.need_register = 1;
  if (strcmp(last_kind, "epoch") == 0 || strcmp(last_kind, "permission") == 0) {
    snprintf(why, sizeof why, "%s", last_error);
    return why;
  }
  return NULL;
}

static void *heartbeat_loop(void *arg) {
  (void)arg;
  pthread_mutex_lock(&S.mu);
  while (!S.stop) {
    double now = raps__mono();
    if (now >= S.valid_until) {
      pthread_mutex_unlock(&S.mu);
      fence("no valid reply from the local agent in time");
    }
    /* every interval, but twice within what is left of validity */
    double wait = fmin(S.interval, (S.valid_until - now) / 2);
    if (wait < 0.05) wait = 0.05;
    double until = now + wait;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double abs_t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + wait;
    ts.tv_sec = (time_t)abs_t;
    ts.tv_nsec = (long)((abs_t - (double)ts.tv_sec) * 1e9);
    while (!S.stop && raps__mono() < until)
      if (pthread_cond_timedwait(&S.cv, &S.mu, &ts) == ETIMEDOUT) break;
    if (S.stop) break;
    pthread_mutex_unlock(&S.mu);
    /* wait for the reply as long as validity lasts, never past it */
    const char *why = beat(fmax(0.01, S.valid_until - raps__mono()));
    if (why) fence(why);
    pthread_mutex_lock(&S.mu);
  }
  pthread_mutex_unlock(&S.mu);
  return NULL;
}

static int parse_uint(const char *name, const char *text, long low, long *out) {
  char *e;
  errno = 0;
  long v = text && *text ? strtol(text, &e, 10) : -1;
  if (!text || !*text || *e || errno || v < low)
    return raps__fail(RAPS_ERR_ENV, "%s=%s: expected an integer >= %ld", name,
                      text ? text : "(unset)", low);
  *out = v;
  return RAPS_OK;
}

/* RAPS_EPOCHS: "RANK=EPOCH,RANK=EPOCH,..." gives ranks a relaunch moved their own epoch
 * (one srun step gives every task the same environment); the epoch of rank, if listed. */
static int epoch_of(const char *text, long rank, long *epoch) {
  static const char *allowed = "expected comma-separated RANK=EPOCH pairs of integers, "
                               "RANK >= 0 and EPOCH >= 1, each rank at most once "
                               "(e.g. 3=2,7=4)";
  int found = 0;
  for (const char *p = text;;) {
    char *e;
    long r = -1, ep = 0;
    errno = 0;
    if (*p >= '0' && *p <= '9') r = strtol(p, &e, 10);
    if (r < 0 || errno || *e != '=' || !(e[1] >= '0' && e[1] <= '9'))
      return raps__fail(RAPS_ERR_ENV, "RAPS_EPOCHS=%.200s: %s", text, allowed);
    ep = strtol(e + 1, &e, 10);
    if (errno || ep < 1 || (*e && *e != ','))
      return raps__fail(RAPS_ERR_ENV, "RAPS_EPOCHS=%.200s: %s", text, allowed);
    if (r == rank) {
      if (found)
        return raps__fail(RAPS_ERR_ENV, "RAPS_EPOCHS=%.200s: rank %ld is listed twice; %s",
                          text, rank, allowed);
      found = 1, *epoch = ep;
    }
    if (!*e) return RAPS_OK;
    p = e + 1;
  }
}

int raps_init(void) {
  const char *path = getenv("RAPS_AGENT_SOCKET");
  if (!path || !*path) return raps__fail(RAPS_ERR_ENV, "RAPS_AGENT_SOCKET is not set (run "
                                         "under raps-run or in a --raps job)");
  char expanded[256];
  const char *hole = strstr(path, "%n");
  if (hole) { /* one template for every node: the task's environment knows the node */
    const char *node = getenv("SLURMD_NODENAME");
    if (!node || !*node)
      return raps__fail(RAPS_ERR_ENV, "SLURMD_NODENAME is not set (needed for %%n in "
                        "RAPS_AGENT_SOCKET)");
    snprintf(expanded, sizeof expanded, "%.*s%s%s", (int)(hole - path), path, node, hole + 2);
    path = expanded;
  }
  const char *job = getenv("RAPS_JOB");
  if (!job || !*job) job = getenv("SLURM_JOB_ID");
  if (!job || !*job) return raps__fail(RAPS_ERR_ENV, "neither RAPS_JOB nor SLURM_JOB_ID is set");
  /* raps-run sets RAPS_RANK; under srun or mpirun alone the launcher's rank serves */
  static const char *rank_vars[] = {"RAPS_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                                    "PMIX_RANK", "PMI_RANK"};
  const char *rank_var = "RAPS_RANK";
  for (size_t i = 0; i < sizeof rank_vars / sizeof rank_vars[0]; i++)
    if (getenv(rank_vars[i]) && *getenv(rank_vars[i])) {
      rank_var = rank_vars[i];
      break;
    }
  long rank, epoch = 1;
  int rc = parse_uint(rank_var, getenv(rank_var), 0, &rank);
  if (rc == RAPS_OK && getenv("RAPS_EPOCH") && *getenv("RAPS_EPOCH"))
    rc = parse_uint("RAPS_EPOCH", getenv("RAPS_EPOCH"), 1, &epoch);
  const char *epochs = getenv("RAPS_EPOCHS");
  if (rc == RAPS_OK && epochs && *epochs) rc = epoch_of(epochs, rank, &epoch);
  if (rc != RAPS_OK) return rc;
  if (rank > 0x7fffffffL) return raps__fail(RAPS_ERR_ENV, "%s=%ld: expected below 2**31", rank_var, rank);
  return raps_init_with(path, job, (int)rank, epoch);
}

static double env_seconds(const char *name, double dflt) {
  const char *t = getenv(name);
  char *e;
  double v = t && *t ? strtod(t, &e) : dflt;
  return t && *t && (*e || !isfinite(v) || v <= 0) ? -1 : v;
}

int raps_init_with(const char *socket_path, const char *job, int rank, long epoch) {
  if (S.ready) return raps__fail(RAPS_ERR_STATE, "raps_init: already initialised");
  if (!socket_path || !*socket_path)
    return raps__fail(RAPS_ERR_ARG, "socket path: expected a path");
  size_t jn = job ? strlen(job) : 0;
  if (jn < 1 || jn > 20 || strspn(job, "0123456789") != jn)
    return raps__fail(RAPS_ERR_ARG, "job %s: expected a decimal job id", job ? job : "(null)");
  if (rank < 0) return raps__fail(RAPS_ERR_ARG, "rank %d: expected an integer >= 0", rank);
  if (epoch < 1) return raps__fail(RAPS_ERR_ARG, "epoch %ld: expected an integer >= 1", epoch);
  S.interval = env_seconds("RAPS_APP_HEARTBEAT_SEC", 10.0);
  if (S.interval < 0) return raps__fail(RAPS_ERR_ENV, "RAPS_APP_HEARTBEAT_SEC=%s: expected a "
                                        "number of seconds > 0", getenv("RAPS_APP_HEARTBEAT_SEC"));
  S.ckpt_interval = env_seconds("RAPS_CKPT_INTERVAL", 600.0);
  if (S.ckpt_interval < 0) return raps__fail(RAPS_ERR_ENV, "RAPS_CKPT_INTERVAL=%s: expected a "
                                             "number of seconds > 0", getenv("RAPS_CKPT_INTERVAL"));
  snprintf(S.job, sizeof S.job, "%s", job);
  S.rank = rank, S.epoch = epoch;
  raps__conn_init(&S.ck, socket_path);
  raps__conn_init(&S.hb, socket_path);
  double valid_for = 0;
  /* A fenced node (its heartbeats late for a moment) is asked again for up to
     REGISTER_WAIT s: a rank that has not started has sent nothing a fence must stop. */
  double give_up = raps__mono() + REGISTER_WAIT;
  int rc;
  while ((rc = do_register(&S.hb, S.interval, &valid_for)) == RAPS_ERR_REFUSED
         && strcmp(last_kind, "fenced") == 0 && raps__mono() < give_up) {
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  if (rc != RAPS_OK) {
    raps__conn_close(&S.hb);
    return rc;
  }
  S.stop = S.need_register = 0;
  S.last_ckpt = raps__mono();
  if (pthread_create(&S.thread, NULL, heartbeat_loop, NULL) != 0)
    return raps__fail(RAPS_ERR_SYSTEM, "cannot start the heartbeat thread");
  S.ready = 1;
  return ok();
}

int raps_finalize(void) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_finalize: raps_init first");
  pthread_mutex_lock(&S.mu);
  S.stop = 1;
  pthread_cond_broadcast(&S.cv);
  pthread_mutex_unlock(&S.mu);
  pthread_join(S.thread, NULL);
  /* done: the coordinator takes the silence that follows for the end of the program, not
   * for a hang (a HUNG verdict would relaunch it); a rank that serves no messages
   * publishes no address */
  char req[192];
  struct raps_reply r;
  snprintf(req, sizeof req, "{\"op\":\"peer_publish\",\"job\":\"%s\",\"rank\":%d,"
           "\"epoch\":%ld,\"host\":null,\"port\":null,\"done\":true}", S.job, S.rank,
           S.epoch);
  if (raps__call(&S.hb, req, NULL, 0, 2.0, &r) == RAPS_OK) raps__reply_free(&r);
  snprintf(req, sizeof req, "{\"op\":\"unregister\",\"job\":\"%s\",\"rank\":%d}", S.job, S.rank);
  if (raps__call(&S.hb, req, NULL, 0, 2.0, &r) == RAPS_OK) raps__reply_free(&r);
  raps__conn_close(&S.hb);
  raps__conn_close(&S.ck);
  free(S.prev);
  S.prev = NULL, S.nprev = 0, S.prev_gen = 0;
  if (S.cached) munmap(S.cached, S.cached_size);
  S.cached = NULL;
  S.nregions = 0;
  S.listed = S.ngens = 0, S.chosen = -1;
  S.resume_step = -1, S.sent_running = S.sent_caught_up = 0;
  S.ready = 0;
  return ok();
}

/* Report a phase of the recovery plan that relaunched this rank; what fails is ignored
 * (the leader times the plan out): it must never fail the program. */
static void recovery_event(const char *phase, long step) {
  char req[256];
  snprintf(req, sizeof req, "{\"op\":\"recovery_event\",\"job\":\"%s\",\"rank\":%d,"
           "\"epoch\":%ld,\"phase\":\"%s\",\"detail\":{\"step\":%ld}}", S.job, S.rank,
           S.epoch, phase, step);
  struct raps_reply r;
  if (raps__call(&S.ck, req, NULL, 0, 2.0, &r) == RAPS_OK) raps__reply_free(&r);
}

int raps_progress(long step) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_progress: raps_init first");
  if (step < 0) return raps__fail(RAPS_ERR_ARG, "step %ld: expected an integer >= 0", step);
  pthread_mutex_lock(&S.mu);
  S.step = step;
  pthread_mutex_unlock(&S.mu);
  if (S.epoch > 1 && !S.sent_caught_up) { /* relaunched by a plan: its last two phases */
    if (!S.sent_running) recovery_event("running", step);
    S.sent_running = 1;
    if (S.resume_step < 0 || step >= S.resume_step) {
      recovery_event("caught_up", step);
      S.sent_caught_up = 1;
    }
  }
  return ok();
}

int raps_checkpoint_due(int *due) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_checkpoint_due: raps_init first");
  if (!due) return raps__fail(RAPS_ERR_ARG, "due: expected a pointer");
  *due = raps__mono() - S.last_ckpt >= S.ckpt_interval;
  return ok();
}

/* --- regions ------------------------------------------------------------------------------ */

int raps_mem_protect(int id, void *ptr, size_t count, size_t elem_size) {
  if (!S.ready) return raps__fail(RAPS_ERR_STATE, "raps_mem_protect: raps_init first");
  if (id < 0) return raps__fail(RAPS_ERR_ARG, "region id %d: expected an integer >= 0", id);
  if (elem_size < 1 || (count && !ptr) || count > SIZE_MAX / elem_size)
    return raps__fail(RAPS_ERR_ARG, "region %d: expected a pointer, a count and an element "
                      "size >= 1 whose product fits in memory", id);
  int at = 0;
  while (at < S.nregions && S.regions[at].id < id) at++;
  if (at == S.nregions || S.regions[at].id != id) {
    if (S.nregions == MAX_REGIONS)
      return raps__fail(RAPS_ERR_ARG, "region %d: at most %d regions", id, MAX_REGIONS);
    memmove(&S.regions[at + 1], &S.regions[at], sizeof(struct region) * (size_t)(S.nregions - at));
    S.nregions++;
  }
  S.regions[at] = (struct region){id, ptr, count * elem_size, elem_size};
  return ok();
}

int raps_mem_unprotect(int id) {
  for (int i = 0; i < S.nregions; i++)
    if (S.regions[i].id == id) {
      memmove(&S.regions[i], &S.regions[i + 1], sizeof(struct region) * (size_t)(S.nregions - i - 1));
      S.nregions--;
      return ok();
    }
  return raps__fail(RAPS_ERR_ARG, "region %d is not protected", id);
}

