#!/usr/bin/env bash
# The demo, on a local cluster: installs what it needs, brings up 6 Slurm nodes in 3
# racks with etcd, the RAPS hooks, the agents and a raps-coordinator; submits
#   sbatch --raps --raps-spares=2 --no-kill -N6   with   raps-run -- python examples/heat_ring.py
# (a 1-D heat stencil over 4 ranks exchanging halos through the runtime, 2 spare nodes);
# crashes the node of one rank in the middle of the run; shows that only that rank came
# back, on a spare, restored and replayed, with the recovery's timeline; and checks the
# final field against a failure-free run. Then the same with an mpi4py program
# (examples/mpi_master_worker.py under raps-run --mpi4py), checked against Open MPI's
# mpirun. Then a C MPI program (examples/c/heat.c with libraps, under
# raps-run --restart-mode step) loses a node: its step starts again on a spare within the
# allocation, checked against the same program run by mpirun without a failure. Exit 0
# only when all three results match. Then takes the cluster down (--keep leaves it up).
#   scripts/demo.sh [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/setup.sh
source scripts/lib/setup.sh
keep=0
[ "${1:-}" = "--keep" ] && keep=1

ensure_apt slurm-wlm slurmctld slurmd munge libslurm-dev etcd-server etcd-client curl gcc make procps \
  python3-dev libssl-dev \
  python3 python3-venv \
  openmpi-bin python3-mpi4py python3-numpy libopenmpi-dev libzstd-dev
ensure_venv ""
make -s -C spank

export RAPS_CLUSTER_DIR=${RAPS_CLUSTER_DIR:-/tmp/raps-demo}
if ((keep == 0)); then trap 'scripts/cluster.sh down' EXIT; fi
STEPS=300
HEAT=(examples/heat_ring.py --steps "$STEPS" --every 20 --step-sec 0.05)
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

step() { printf '\n== %s\n' "$*"; }
wait_mapped() { # JOB: until the leader has mapped its ranks
  for _ in $(seq 1 100); do
    [ "$(rapsctl show job "$1" --json 2>/dev/null | json 'd["state"]' 2>/dev/null || true)" = mapped ] && return
    sleep 0.2
  done
}
victim() { # JOB: "RANK NODE" of the highest rank > 0 not on the batch host
  local batch
  batch=$(scontrol -o show job "$1" | tr ' ' '\n' | sed -n 's/^BatchHost=//p')
  rapsctl show job "$1" --json | json \
    "' '.join(max(([str(r['rank']), r['node']] for r in d['ranks'] if r['node'] != '$batch' and r['rank'] > 0), key=lambda x: int(x[0])))"
}
wait_committed() { # JOB RANK N: until N generations of RANK are committed on its group
  local n
  for _ in $(seq 1 300); do
    n=$(rapsctl show checkpoints "$1" --json | json "sum(1 for r in d if r['rank'] == $2 and r['state'] == 'committed')")
    ((n >= $3)) && return
    sleep 0.2
  done
}
wait_end() { # JOB: prints its final state
  local state
  for _ in $(seq 1 900); do
    state=$(scontrol -o show job "$1" | tr ' ' '\n' | sed -n 's/^JobState=//p')
    case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
    sleep 0.2
  done
  echo "$state"
}
step "bringing up 6 nodes in 3 racks + etcd + agents + raps-coordinator in $RAPS_CLUSTER_DIR"
scripts/cluster.sh up
# shellcheck disable=SC1090
source <(scripts/cluster.sh env)
scripts/cluster.sh coordinator-start
for _ in $(seq 1 50); do rapsctl ping >/dev/null 2>&1 && break; sleep 0.2; done
rapsctl ping

step "nodes and racks as raps-slurm sees them (rapsctl show nodes)"
rapsctl show nodes

step "the failure-free reference: the same program, 4 ranks, no failure"
rm -rf "$RAPS_CLUSTER_DIR/reference" # a directory left by an earlier demo would resume it
reference=$("$PY" -m raps_slurm.runtime.local -n 4 --dir "$RAPS_CLUSTER_DIR/reference" -- \
  "$PY" "${HEAT[@]:0:5}" | grep '^final ')
echo "$reference"

step "the job: sbatch --raps --raps-spares=2 --no-kill -N6, its script runs raps-run"
out=$RAPS_CLUSTER_DIR/demo-job.out
cat >"$RAPS_CLUSTER_DIR/demo-job.sh" <<EOF
#!/bin/bash
exec $(command -v raps-run) -- $PY $(pwd)/${HEAT[0]} ${HEAT[*]:1}
EOF
job=$(sbatch --parsable --raps --raps-spares=2 --no-kill -N6 -J raps-demo -o "$out" \
  "$RAPS_CLUSTER_DIR/demo-job.sh")
wait_mapped "$job"
rapsctl show groups "$job"

read -r victim node < <(victim "$job")
echo "rank $victim runs on $node"
wait_committed "$job" "$victim" 2
rapsctl show checkpoints "$job" | awk -v r="$victim" 'NR == 1 || $1 == r'

step "a node dies mid-run: scripts/cluster.sh crash $node (its slurmd, rank and raps-agent at once)"
scripts/cluster.sh crash "$node"
state=$(wait_end "$job")
echo "job $job: $state"

step "what raps-run did (from the job's output)"
grep '^raps-run: ' "$out" || true

step "the recovery (rapsctl show recoveries $job; rapsctl show plan)"
rapsctl show recoveries "$job"
plan=$(rapsctl show recoveries "$job" --json | json 'd[0]["plan_id"] if d else ""')
[ -n "$plan" ] && rapsctl show plan "$plan"
running=$(rapsctl show recoveries "$job" --json | json 'd[0]["running_s"] if d else "none"')
caught=$(rapsctl show recoveries "$job" --json | json 'd[0]["caught_up_s"] if d else "none"')
slurmd_timeout=$(scontrol show config | sed -n 's/^SlurmdTimeout *= *\([0-9]*\).*/\1/p')

step "what Slurm alone would have done"
echo "Slurm notices the dead node after SlurmdTimeout (${slurmd_timeout}s here, 300s by default),"
echo "then kills the job (or requeues it whole with --requeue): all 4 ranks start again from"
echo "step 0 or from the last global checkpoint. raps-slurm relaunched rank $victim alone,"
echo "${running}s from the fault verdict to the rank running again, and ${caught}s to the rank"
echo "caught up (back at the progress it had when its node died: the lost steps redone);"
echo "the other ranks' steps never restarted."

scripts/cluster.sh restart "$node"
scontrol update NodeName="$node" State=RESUME

step "result: the final field against the failure-free run"
final=$(grep '^final ' "$out" || true)
echo "reference: $reference"
echo "with crash: ${final:-<no result>}"
rc=0
if [ "$state" = COMPLETED ] && [ "$final" = "$reference" ]; then
  echo "demo: checksums equal: the job survived the node loss with the same result"
else
  echo "demo: FAILED: job state $state, result differs or missing; see $out and $RAPS_CLUSTER_DIR/log" >&2
  rc=1
fi

# --- part 2: an mpi4py program, unchanged but for its two checkpoint lines ---------------
MW=(examples/mpi_master_worker.py --tasks 240)
step "part 2: an mpi4py master-worker (recv from ANY_SOURCE), first under Open MPI's mpirun"
# Debian's mpi4py is built for the system Python; as root, mpirun must be told it may run.
mpi_reference=$(mpirun --allow-run-as-root --oversubscribe --mca btl self,tcp -n 4 \
  /usr/bin/python3 "${MW[@]}" | grep '^tasks ')
echo "$mpi_reference"

step "the same program under raps-run --mpi4py (from mpi4py import MPI resolves to raps_slurm.mpi)"
mout=$RAPS_CLUSTER_DIR/demo-mpi.out
printf '#!/bin/bash\nexec %s --mpi4py -- %s %s %s --every 5 --work-sec 0.1\n' \
  "$(command -v raps-run)" "$PY" "$(pwd)/${MW[0]}" "${MW[*]:1}" >"$RAPS_CLUSTER_DIR/demo-mpi.sh"
mjob=$(sbatch --parsable --raps --raps-spares=1 --no-kill -N5 -J raps-demo-mpi -o "$mout" \
  "$RAPS_CLUSTER_DIR/demo-mpi.sh")
wait_mapped "$mjob"
read -r mvictim mnode < <(victim "$mjob")
echo "worker rank $mvictim runs on $mnode"
wait_committed "$mjob" "$mvictim" 1

step "its node dies: scripts/cluster.sh crash $mnode"
scripts/cluster.sh crash "$mnode"
mstate=$(wait_end "$mjob")
echo "job $mjob: $mstate"
grep '^raps-run: ' "$mout" | grep -v ' started on ' || true
rapsctl show recoveries "$mjob"
scripts/cluster.sh restart "$mnode"
scontrol update NodeName="$mnode" State=RESUME

step "result: raps-run --mpi4py with a crash against mpirun without one"
mfinal=$(grep '^tasks ' "$mout" || true)
echo "mpirun:     $mpi_reference"
echo "with crash: ${mfinal:-<no result>}"
if [ "$mstate" = COMPLETED ] && [ -n "$mfinal" ] && [ "$mfinal" = "$mpi_reference" ]; then
  echo "demo: the mpi4py job survived the node loss and printed what Open MPI printed"
else
  echo "demo: FAILED: mpi4py job state $mstate, result differs or missing; see $mout" >&2
  rc=1
fi
# --- part 3: a C MPI program, restarted whole within its allocation -----------------------
step "part 3: a C heat stencil (examples/c/heat.c, checkpoints through libraps), first under mpirun"
make -s -C libraps
cbin=$RAPS_CLUSTER_DIR/cheat
mkdir -p "$cbin" && chmod 755 "$cbin" && cp libraps/libraps.so.0 "$cbin/"
mpicc -O2 -o "$cbin/heat" examples/c/heat.c -I libraps -L libraps -Wl,-rpath,"$cbin" -lraps
CARGS=(1024 1024 2400 200)
rm -rf "$cbin/files" && mkdir -p "$cbin/files"
# the same computation with the program's own file checkpoints, no RAPS: the reference
c_reference=$(RAPS_HEAT_FILE_CKPT="$cbin/files" mpirun --allow-run-as-root --oversubscribe \
  --mca btl self,tcp -n 4 "$cbin/heat" "${CARGS[@]}" | grep '^final ')
echo "$c_reference"

step "the same program: sbatch --raps --raps-spares=2 --no-kill -N6, raps-run --restart-mode step"
cout=$RAPS_CLUSTER_DIR/demo-c.out
printf '#!/bin/bash\nexec %s --restart-mode step -- %s %s\n' "$(command -v raps-run)" \
  "$cbin/heat" "${CARGS[*]}" >"$RAPS_CLUSTER_DIR/demo-c.sh"
# the fake nodes share this host: Open MPI's shared memory would join ranks of two of them
cjob=$(sbatch --parsable --raps --raps-spares=2 --no-kill -N6 -J raps-demo-c -o "$cout" \
  --export=ALL,OMPI_MCA_btl=^vader,OMPI_MCA_btl_tcp_if_include=lo,RAPS_HEAT_LOG=1 \
  "$RAPS_CLUSTER_DIR/demo-c.sh")
wait_mapped "$cjob"
read -r cvictim cnode < <(victim "$cjob")
echo "rank $cvictim runs on $cnode"
wait_committed "$cjob" "$cvictim" 1

step "its node dies: scripts/cluster.sh crash $cnode"
crashed_at=$(date +%s.%N)
scripts/cluster.sh crash "$cnode"
cstate=$(wait_end "$cjob")
echo "job $cjob: $cstate, Slurm restarts: $(scontrol -o show job "$cjob" | tr ' ' '\n' | sed -n 's/^Restarts=//p')"
grep '^raps-run: \|^restored ' "$cout" || true
rapsctl show recoveries "$cjob"
times=$("$PY" -c 'import json, sys; from raps_slurm.bench.restart import progress; print(json.dumps(progress(open(sys.argv[1]).read(), float(sys.argv[2]))))' "$cout" "$crashed_at" || echo '{}')
echo "from the crash: running again after $(echo "$times" | json 'd.get("running_s")')s, back at step $(echo "$times" | json 'd.get("pre_fault_step")') (its progress before the crash) after $(echo "$times" | json 'd.get("caught_up_s")')s"
echo "Slurm alone: the node is noticed after SlurmdTimeout (${slurmd_timeout}s here, 300s by"
echo "default), then the job fails, or with --requeue waits in the queue again and restarts"
echo "whole from what the program wrote to the shared file system (rapsctl bench restart"
echo "measures both)."
scripts/cluster.sh restart "$cnode"
scontrol update NodeName="$cnode" State=RESUME

step "result: raps-run --restart-mode step with a crash against mpirun without one"
cfinal=$(grep '^final ' "$cout" || true)
echo "mpirun:     $c_reference"
echo "with crash: ${cfinal:-<no result>}"
if [ "$cstate" = COMPLETED ] && [ -n "$cfinal" ] && [ "$cfinal" = "$c_reference" ]; then
  echo "demo: the C job survived the node loss with the failure-free result"
else
  echo "demo: FAILED: C job state $cstate, result differs or missing; see $cout" >&2
  rc=1
fi
if ((keep)); then
  step "cluster left up: source <(scripts/cluster.sh env); scripts/cluster.sh down when done"
fi
exit $rc
