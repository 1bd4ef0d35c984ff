/* libraps: checkpoint and restore of MPI ranks through the node's raps-agent.
 *
 * Every call returns RAPS_OK (0) or an error code; raps_strerror() names the code and
 * raps_last_error() says what went wrong (the agent's own message when it refused).
 * The library has no MPI dependency: the collective helpers at the end of this header
 * are inline and exist only when <mpi.h> was included before it. See docs/c-api.md. */
#ifndef RAPS_H
#define RAPS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RAPS_VERSION "0.1.0"
#define RAPS_MAX_LABELS 64 /* raps_restart_labels gives at most this many */

enum raps_code {
  RAPS_OK = 0,
  RAPS_ERR_ARG = 1,           /* a bad argument (the message names it) */
  RAPS_ERR_ENV = 2,           /* RAPS_* / SLURM_* environment missing or malformed */
  RAPS_ERR_NO_AGENT = 3,      /* the agent's socket cannot be reached */
  RAPS_ERR_REFUSED = 4,       /* the agent refused (raps_last_kind() has its kind) */
  RAPS_ERR_PERMISSION = 5,    /* another user's job or rank */
  RAPS_ERR_WRONG_JOB = 6,     /* job, node or rank not this one's, or its epoch superseded */
  RAPS_ERR_QUOTA = 7,         /* over the job's disk, write or size quota */
  RAPS_ERR_NO_CHECKPOINT = 8, /* no generation committed yet */
  RAPS_ERR_LOST = 9,          /* generations exist but none could be restored whole */
  RAPS_ERR_STATE = 10,        /* call order: not initialised, regions changed, ... */
  RAPS_ERR_SYSTEM = 11,       /* a system call failed (errno in the message) */
  RAPS_ERR_PROTOCOL = 12,     /* a malformed reply from the agent */
  RAPS_ERR_MISMATCH = 13      /* restored data does not fit the protected regions */
};

/* Read RAPS_AGENT_SOCKET (%n = SLURMD_NODENAME), RAPS_JOB (or SLURM_JOB_ID), RAPS_RANK
 * (or SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK), RAPS_EPOCH (1) and
 * RAPS_EPOCHS (RANK=EPOCH,... overrides RAPS_EPOCH for the ranks it lists),
 * RAPS_APP_HEARTBEAT_SEC (10) and RAPS_CKPT_INTERVAL (600), register the rank with the
 * agent and start heartbeating. */
int raps_init(void);
/* The same with explicit values (epoch >= 1). */
int raps_init_with(const char *socket_path, const char *job, int rank, long epoch);
/* Protect count elements of elem_size bytes at ptr under id (>= 0); the same id again
 * replaces the region. elem_size lets the codec group the bytes of each element. */
int raps_mem_protect(int id, void *ptr, size_t count, size_t elem_size);
int raps_mem_unprotect(int id);
/* Save every protected region as this rank's next generation, labelled version (>= 0).
 * Only changed chunks are sent; the agent copies them to the rank's backup group. */
int raps_checkpoint(long version);
/* The version of this rank's newest committed generation; RAPS_ERR_NO_CHECKPOINT if none. */
int raps_restart_test(long *version);
/* Restore every protected region from the generation labelled as raps_restart_choose
 * (or raps_restart_test_all) chose, else from the newest; *version its label. */
int raps_restore(long *version);
/* The labels of this rank's generations, newest first (at most cap, and at most
 * RAPS_MAX_LABELS); RAPS_ERR_NO_CHECKPOINT and *count = 0 if it has none. */
int raps_restart_labels(long *labels, int cap, int *count);
/* Make raps_restore restore the newest generation labelled version (-1: the newest). */
int raps_restart_choose(long version);
/* Restore every protected region from this rank's newest generation labelled version;
 * RAPS_ERR_NO_CHECKPOINT if none is. */
int raps_restore_version(long version);
/* Report progress (a step that grows while the rank works); sent with the next
 * heartbeat. A rank whose step stands still while it heartbeats is taken for hung. */
int raps_progress(long step);
/* *due = 1 once the checkpoint interval passed since init or the last checkpoint. */
int raps_checkpoint_due(int *due);
/* Stop heartbeating, tell the agent the rank is done (its silence is then no hang) and
 * unregister the rank. */
int raps_finalize(void);

const char *raps_strerror(int code);
/* The message of the last failed call in this process ("" after success). */
const char *raps_last_error(void);
/* The agent's error kind of the last refusal ("" if the agent did not refuse). */
const char *raps_last_kind(void);

#ifdef __cplusplus
}
#endif

#if defined(MPI_VERSION) && !defined(RAPS_NO_MPI_HELPERS)
#include <limits.h>
/* Collective forms: the same result on every rank of comm. */

/* raps_checkpoint on every rank; RAPS_OK only if every rank committed version. */
static inline int raps_checkpoint_all(MPI_Comm comm, long version) {
  int rc = raps_checkpoint(version), worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, comm);
  return rc != RAPS_OK ? rc : worst;
}

/* The common version: the newest label a generation of every rank of comm carries;
 * raps_restore then restores it. *version = -1 and RAPS_ERR_NO_CHECKPOINT when no label is
 * held by every rank. Each round every rank offers its newest label at most the
 * candidate, and the minimum becomes the candidate, until every rank holds it. */
static inline int raps_restart_test_all(MPI_Comm comm, long *version) {
  long labels[RAPS_MAX_LABELS], candidate = LONG_MAX;
  int n = 0, rc = raps_restart_labels(labels, RAPS_MAX_LABELS, &n);
  long err = rc != RAPS_OK && rc != RAPS_ERR_NO_CHECKPOINT ? rc : 0;
  *version = -1;
  for (;;) {
    long mine[2] = {-1, -err}, got[2];
    for (int i = 0; i < n; i++)
      if (labels[i] <= candidate && labels[i] > mine[0]) mine[0] = labels[i];
    MPI_Allreduce(mine, got, 2, MPI_LONG, MPI_MIN, comm);
    if (got[1] < 0) return err ? (int)err : (int)-got[1];
    if (got[0] < 0) return RAPS_ERR_NO_CHECKPOINT;
    if (got[0] == candidate) break;
    candidate = got[0];
  }
  *version = candidate;
  return raps_restart_choose(candidate);
}
#endif

#endif /* RAPS_H */
