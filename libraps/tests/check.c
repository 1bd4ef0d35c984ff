/* A rank for the tests: "roundtrip" protects two regions, checkpoints twice (changing
 * one region between), scribbles over both, restores and compares the bytes; "older"
 * does the same but lists the labels and restores the first generation by its label,
 * then reports progress for steps 0..5; "init" only registers. Prints one JSON line per
 * result; exits 0 when the calls succeeded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "raps.h"

static int report(const char *call, int rc) {
  printf("{\"call\":\"%s\",\"rc\":%d,\"name\":\"%s\",\"kind\":\"%s\",\"error\":\"", call, rc,
         raps_strerror(rc), raps_last_kind());
  for (const char *p = raps_last_error(); *p; p++)
    if (*p != '"' && *p != '\\') putchar(*p);
  printf("\"}\n");
  fflush(stdout);
  return rc;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "roundtrip";
  if (report("init", raps_init())) return 1;
  if (strcmp(mode, "init") == 0) return report("finalize", raps_finalize()) ? 1 : 0;
  size_t n = 3 << 17; /* 3 MiB of doubles: several chunks */
  double *field = malloc(n * sizeof *field);
  int counts[1000];
  for (size_t i = 0; i < n; i++) field[i] = (double)i * 0.5;
  for (int i = 0; i < 1000; i++) counts[i] = i * 7;
  if (report("protect", raps_mem_protect(1, field, n, sizeof *field)) ||
      report("protect", raps_mem_protect(2, counts, 1000, sizeof(int))) ||
      report("checkpoint", raps_checkpoint(1)))
    return 1;
  int older = strcmp(mode, "older") == 0;
  double *first = malloc(n * sizeof *field);
  int first_counts[1000];
  memcpy(first, field, n * sizeof *field);
  memcpy(first_counts, counts, sizeof counts);
  for (size_t i = 0; i < 1000; i++) field[i] += 1.0; /* one chunk changes */
  counts[5] = -1;
  if (report("checkpoint", raps_checkpoint(2))) return 1;
  double *want = malloc(n * sizeof *field);
  int want_counts[1000];
  memcpy(want, field, n * sizeof *field);
  memcpy(want_counts, counts, sizeof counts);
  memset(field, 0xab, n * sizeof *field);
  memset(counts, 0, sizeof counts);
  long version = -1, restored = -1;
  if (older) {
    long labels[RAPS_MAX_LABELS];
    int count = 0;
    if (report("restart_labels", raps_restart_labels(labels, RAPS_MAX_LABELS, &count)) ||
        report("restore_version", raps_restore_version(1)))
      return 1;
    int same = memcmp(first, field, n * sizeof *field) == 0 &&
               memcmp(first_counts, counts, sizeof counts) == 0;
    printf("{\"labels\":[");
    for (int i = 0; i < count; i++) printf("%s%ld", i ? "," : "", labels[i]);
    printf("],\"same\":%s}\n", same ? "true" : "false");
    for (long step = 0; step <= 5; step++)
      if (report("progress", raps_progress(step))) return 1;
    return report("finalize", raps_finalize()) || !same;
  }
  if (report("restart_test", raps_restart_test(&version)) ||
      report("restore", raps_restore(&restored)))
    return 1;
  int same = memcmp(want, field, n * sizeof *field) == 0 &&
             memcmp(want_counts, counts, sizeof counts) == 0;
  printf("{\"version\":%ld,\"restored\":%ld,\"same\":%s}\n", version, restored,
         same ? "true" : "false");
  return report("finalize", raps_finalize()) || !same;
}
