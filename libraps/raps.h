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
/* Restore every protected region from the newest generation; *version its label. */
int raps_restore(long *version);
/* Report progress (a step that grows while the rank works); sent with the next
 * heartbeat. A rank whose step stands still while it heartbeats is taken for hung. */
int raps_progress(long step);
/* *due = 1 once the checkpoint interval passed since init or the last checkpoint. */
int raps_checkpoint_due(int *due);
/* Stop heartbeating and unregister the rank. */
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
/* Collective forms: the same result on every rank of comm. */

/* raps_checkpoint on every rank; RAPS_OK only if every rank committed version. */
static inline int raps_checkpoint_all(MPI_Comm comm, long version) {
  int rc = raps_checkpoint(version), worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, comm);
  return rc != RAPS_OK ? rc : worst;
}

/* The common version: the one every rank's newest generation carries. *version = -1 and
 * RAPS_ERR_NO_CHECKPOINT when some rank has none; RAPS_ERR_MISMATCH when the ranks'
 * newest differ (a checkpoint that did not complete on every rank). */
static inline int raps_restart_test_all(MPI_Comm comm, long *version) {
  long mine = -1, lo = -1, hi = -1;
  int rc = raps_restart_test(&mine);
  if (rc != RAPS_OK && rc != RAPS_ERR_NO_CHECKPOINT) mine = -2;
  if (rc == RAPS_ERR_NO_CHECKPOINT) mine = -1;
  MPI_Allreduce(&mine, &lo, 1, MPI_LONG, MPI_MIN, comm);
  MPI_Allreduce(&mine, &hi, 1, MPI_LONG, MPI_MAX, comm);
  *version = lo;
  if (lo == -2) return rc != RAPS_OK ? rc : RAPS_ERR_REFUSED;
  if (hi == -1) return RAPS_ERR_NO_CHECKPOINT;
  if (lo != hi) return RAPS_ERR_MISMATCH;
  return RAPS_OK;
}
#endif

#endif /* RAPS_H */
