#!/usr/bin/env bash
# The demo on a local cluster: installs what it needs, brings up a 6-node Slurm
# cluster in 3 racks with etcd, the RAPS hooks and a raps-coordinator, submits
# `sbatch --raps --raps-spares=2 --no-kill -N6` and shows what the coordinator made of
# it: 4 ranks, 2 spares spread over racks, a rack-disjoint backup group per rank; then
# crashes a node and shows raps-slurm's DEAD verdict and drain within a second or two.
# Then takes the cluster down (--keep leaves it up).
#   scripts/demo.sh [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/setup.sh
source scripts/lib/setup.sh
keep=0
[ "${1:-}" = "--keep" ] && keep=1

ensure_apt slurm-wlm slurmctld slurmd munge libslurm-dev etcd-server curl gcc make procps \
  python3 python3-venv
ensure_venv ""
make -s -C spank

export RAPS_CLUSTER_DIR=${RAPS_CLUSTER_DIR:-/tmp/raps-demo}
if ((keep == 0)); then trap 'scripts/cluster.sh down' EXIT; fi

step() { printf '\n== %s\n' "$*"; }
step "bringing up 6 nodes in 3 racks + etcd + raps-coordinator in $RAPS_CLUSTER_DIR"
scripts/cluster.sh up
# shellcheck disable=SC1090
source <(scripts/cluster.sh env)
scripts/cluster.sh coordinator-start
for _ in $(seq 1 50); do rapsctl ping >/dev/null 2>&1 && break; sleep 0.2; done
rapsctl ping

step "nodes and racks as raps-slurm sees them (rapsctl show nodes)"
rapsctl show nodes

step "a job that survives node loss: sbatch --raps --raps-spares=2 --no-kill -N6"
job=$(sbatch --parsable --raps --raps-spares=2 --no-kill -N6 -J raps-demo -o /dev/null --wrap 'sleep 300')
state=""
for _ in $(seq 1 50); do
  state=$(rapsctl show job "$job" --json 2>/dev/null | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || true)
  [ "$state" = mapped ] && break
  sleep 0.2
done
[ "$state" = mapped ] || { echo "demo: job $job was not mapped (state '$state'); see $RAPS_CLUSTER_DIR/log" >&2; exit 1; }

step "the job as the coordinator registered it (rapsctl show job $job)"
rapsctl show job "$job"
step "its backup groups: primary, log backup, checkpoint mirror in three racks (rapsctl show groups $job)"
rapsctl show groups "$job"
scancel "$job"

step "a node dies: scripts/cluster.sh crash n6 (its slurmd, steps and raps-agent at once)"
t0=$("$PY" -c 'import time; print(time.time())')
scripts/cluster.sh crash n6
for _ in $(seq 1 100); do
  rapsctl show nodes --json | "$PY" -c 'import json,sys; sys.exit(0 if any(n["node"] == "n6" and n["verdict"].startswith("DEAD") for n in json.load(sys.stdin)) else 1)' && break
  sleep 0.1
done
"$PY" -c "import time; print(f'raps-slurm: DEAD verdict and drain {time.time() - $t0:.1f} s after the crash (Slurm itself waits SlurmdTimeout)')"
rapsctl show nodes
scripts/cluster.sh restart n6
scontrol update NodeName=n6 State=RESUME

if ((keep)); then
  step "cluster left up: source <(scripts/cluster.sh env); scripts/cluster.sh down when done"
fi
