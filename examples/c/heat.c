/* A 2-D heat stencil that checkpoints through libraps.
 *
 * The NX x NY plate is cut into bands of rows, one per rank; each step swaps halo rows
 * with the neighbours (MPI_Sendrecv), relaxes every interior point (Jacobi) and sums the
 * squared change over all ranks (MPI_Allreduce). Every EVERY steps the ranks checkpoint
 * their band and the step count (raps_checkpoint_all); at start they restore the common
 * generation if there is one. At the end rank 0 prints the residual and a hash of the
 * whole plate: a run that crashed and restarted prints the line of a run that did not.
 *
 *   mpirun -np 4 ./heat [NX NY STEPS EVERY]        (defaults 256 256 400 50)
 *   RAPS_HEAT_CRASH_AT=K: the last rank exits at the start of step K, as a lost node.
 *   RAPS_HEAT_LOG=1: rank 0 prints "progress STEP TIME" (wall clock) after every step.
 *   RAPS_HEAT_FILE_CKPT=DIR: no libraps at all; each rank writes its band and the step to
 *     DIR/heat-RANK.bin instead (what a plain job restarted by a Slurm requeue reads back). */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <raps.h>

static void check(int rc, const char *what) {
  if (rc != RAPS_OK) {
    fprintf(stderr, "heat: %s: %s: %s\n", what, raps_strerror(rc), raps_last_error());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

/* The plain alternative to libraps: DIR/heat-RANK.bin holds the step, then the band. */
static void file_save(const char *dir, int rank, const double *u, size_t cells, long step) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/heat-%d.bin", dir, rank);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (!f || fwrite(&step, sizeof step, 1, f) != 1 || fwrite(u, sizeof *u, cells, f) != cells ||
      fflush(f) != 0 || fsync(fileno(f)) != 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
    perror(path);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

static long file_load(const char *dir, int rank, double *u, size_t cells) {
  char path[4096];
  long step = -1;
  snprintf(path, sizeof path, "%s/heat-%d.bin", dir, rank);
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  if (fread(&step, sizeof step, 1, f) != 1 || fread(u, sizeof *u, cells, f) != cells) step = -1;
  fclose(f);
  return step;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int nx = argc > 1 ? atoi(argv[1]) : 256, ny = argc > 2 ? atoi(argv[2]) : 256;
  long steps = argc > 3 ? atol(argv[3]) : 400, every = argc > 4 ? atol(argv[4]) : 50;
  const char *crash = getenv("RAPS_HEAT_CRASH_AT");
  long crash_at = crash && *crash ? atol(crash) : -1;
  if (nx % size || nx < size || ny < 3 || steps < 1 || every < 1) {
    if (rank == 0) fprintf(stderr, "heat: NX must be a multiple of the ranks, NY >= 3\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int rows = nx / size, up = rank ? rank - 1 : MPI_PROC_NULL;
  int down = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;
  size_t cells = (size_t)(rows + 2) * (size_t)ny;
  double *u = calloc(cells, sizeof *u), *v = calloc(cells, sizeof *v);
  if (rank == 0)
    for (int j = 0; j < ny; j++) u[j] = v[j] = 100.0; /* the hot edge (a fixed halo row) */
  long step = 0;
  const char *log = getenv("RAPS_HEAT_LOG"), *files = getenv("RAPS_HEAT_FILE_CKPT");
  int logging = log && *log && strcmp(log, "0") != 0, plain = files && *files;
  struct timespec now;

  if (plain) {
    long mine = file_load(files, rank, u, cells), lo, hi;
    MPI_Allreduce(&mine, &lo, 1, MPI_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &hi, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
    if (lo >= 0 && lo == hi) {
      step = lo;
      if (rank == 0) printf("restored step %ld\n", step);
    } else { /* none, or not the same step everywhere: from the start */
      memset(u, 0, cells * sizeof *u);
      if (rank == 0)
        for (int j = 0; j < ny; j++) u[j] = 100.0;
    }
    memcpy(v, u, cells * sizeof *u);
  } else {
  check(raps_init(), "raps_init");
  check(raps_mem_protect(0, u, cells, sizeof *u), "protect the band");
  check(raps_mem_protect(1, &step, 1, sizeof step), "protect the step");
  long common = -1;
  int rc = raps_restart_test_all(MPI_COMM_WORLD, &common);
  if (rc == RAPS_OK) {
    check(raps_restore(&common), "raps_restore");
    if (rank == 0) printf("restored step %ld\n", step);
  } else if (rc != RAPS_ERR_NO_CHECKPOINT) {
    check(rc, "raps_restart_test_all");
  }
  }

  double residual = 0;
  for (; step < steps;) {
    if (step == crash_at && rank == size - 1) _exit(3); /* no MPI_Finalize: a lost rank */
    MPI_Sendrecv(&u[(size_t)rows * ny], ny, MPI_DOUBLE, down, 0, &u[0], ny, MPI_DOUBLE, up,
                 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Sendrecv(&u[(size_t)ny], ny, MPI_DOUBLE, up, 1, &u[(size_t)(rows + 1) * ny], ny,
                 MPI_DOUBLE, down, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (rank == 0)
      for (int j = 0; j < ny; j++) u[j] = 100.0;
    double local = 0;
    for (int i = 1; i <= rows; i++)
      for (int j = 1; j < ny - 1; j++) {
        size_t k = (size_t)i * ny + j;
        v[k] = u[k] + 0.2 * (u[k - ny] + u[k + ny] + u[k - 1] + u[k + 1] - 4 * u[k]);
        local += (v[k] - u[k]) * (v[k] - u[k]);
      }
    for (int i = 1; i <= rows; i++)
      memcpy(&u[(size_t)i * ny + 1], &v[(size_t)i * ny + 1], (size_t)(ny - 2) * sizeof *u);
    MPI_Allreduce(&local, &residual, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    step++;
    if (logging && rank == 0) {
      clock_gettime(CLOCK_REALTIME, &now);
      printf("progress %ld %.3f\n", step, (double)now.tv_sec + now.tv_nsec / 1e9);
      fflush(stdout);
    }
    if (plain) {
      if (step % every == 0) {
        file_save(files, rank, u, cells, step);
        MPI_Barrier(MPI_COMM_WORLD); /* every band written before any rank goes on */
      }
      continue;
    }
    check(raps_progress(step), "raps_progress");
    if (step % every == 0) check(raps_checkpoint_all(MPI_COMM_WORLD, step), "checkpoint");
  }

  double *plate = rank == 0 ? malloc((size_t)nx * ny * sizeof *plate) : NULL;
  MPI_Gather(&u[ny], rows * ny, MPI_DOUBLE, plate, rows * ny, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a over the plate's bytes */
    const unsigned char *b = (const unsigned char *)plate;
    for (size_t i = 0; i < (size_t)nx * ny * sizeof *plate; i++) h = (h ^ b[i]) * 1099511628211ull;
    printf("final step %ld residual %.17g hash %016llx\n", step, residual,
           (unsigned long long)h);
  }
  if (!plain) check(raps_finalize(), "raps_finalize");
  free(plate), free(u), free(v);
  MPI_Finalize();
  return 0;
}
