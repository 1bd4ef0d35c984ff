/* An MPI test rank for the common generation. "save": rank 0 checkpoints labels 10 and
 * 20, every other rank label 10 only (a checkpoint that committed on rank 0 alone).
 * "restore": the ranks agree on the common label (raps_restart_test_all), restore it and
 * check every byte, report progress for steps 0..STEPS-1 and finalize. Prints one JSON
 * line per rank; exits 0 when every call succeeded. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "raps.h"

#define N (1 << 17) /* 1 MiB of longs: several chunks */

static long data[N], got[N];

static void fill(int rank, long label) {
  for (long i = 0; i < N; i++) data[i] = rank * 1000003L + label * 7 + i;
}

static int fail(int rank, const char *call, int rc) {
  printf("{\"rank\":%d,\"call\":\"%s\",\"rc\":%d,\"error\":\"", rank, call, rc);
  for (const char *p = raps_last_error(); *p; p++)
    if (*p != '"' && *p != '\\') putchar(*p);
  printf("\"}\n");
  fflush(stdout);
  return 1;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "save";
  long steps = argc > 2 ? atol(argv[2]) : 0;
  int rank, rc;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if ((rc = raps_init())) return fail(rank, "init", rc);
  if ((rc = raps_mem_protect(0, data, N, sizeof data[0]))) return fail(rank, "protect", rc);
  if (strcmp(mode, "save") == 0) {
    for (long label = 10; label <= (rank == 0 ? 20 : 10); label += 10) {
      fill(rank, label);
      if ((rc = raps_checkpoint(label))) return fail(rank, "checkpoint", rc);
    }
    printf("{\"rank\":%d,\"saved\":true}\n", rank);
  } else {
    long common = -1, restored = -1;
    memset(data, 0xab, sizeof data);
    if ((rc = raps_restart_test_all(MPI_COMM_WORLD, &common)))
      return fail(rank, "restart_test_all", rc);
    if ((rc = raps_restore(&restored))) return fail(rank, "restore", rc);
    memcpy(got, data, sizeof data);
    fill(rank, common);
    int same = memcmp(got, data, sizeof data) == 0;
    memset(data, 0xcd, sizeof data); /* and again, by label */
    if ((rc = raps_restore_version(common))) return fail(rank, "restore_version", rc);
    same = same && memcmp(got, data, sizeof data) == 0;
    for (long step = 0; step < steps; step++)
      if ((rc = raps_progress(step))) return fail(rank, "progress", rc);
    printf("{\"rank\":%d,\"common\":%ld,\"restored\":%ld,\"same\":%s}\n", rank, common,
           restored, same ? "true" : "false");
  }
  fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);
  if ((rc = raps_finalize())) return fail(rank, "finalize", rc);
  MPI_Finalize();
  return 0;
}
