#!/usr/bin/env bash
# The demo on a local cluster: installs what it needs, brings up a 6-node Slurm
# cluster in 3 racks with etcd, shows what raps-slurm sees (nodes, racks), submits a
# --no-kill job of 6 nodes, and shows the backup groups and spare order its 4 ranks
# + 2 spares would get. Then takes the cluster down (--keep leaves it up).
#   scripts/demo.sh [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
keep=0
[ "${1:-}" = "--keep" ] && keep=1

apt_packages=(slurm-wlm slurmctld slurmd munge etcd-server curl)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$PY" -m pip install -q --disable-pip-version-check -e . 2>&1 | grep -v "^WARNING: Running pip as the 'root' user" || true

export RAPS_CLUSTER_DIR=${RAPS_CLUSTER_DIR:-/tmp/raps-demo}
export RAPS_CONFIG=$PWD/configs/test.yaml
if ((keep == 0)); then trap 'scripts/cluster.sh down' EXIT; fi

step() { printf '\n== %s\n' "$*"; }
step "bringing up 6 nodes in 3 racks + etcd in $RAPS_CLUSTER_DIR"
scripts/cluster.sh up
# shellcheck disable=SC1090
source <(scripts/cluster.sh env)

step "nodes as raps-slurm sees them (rapsctl show nodes)"
rapsctl show nodes
step "racks from Slurm's topology/tree (rapsctl show topology)"
rapsctl show topology

step "a job of 6 nodes that survives node loss (sbatch --no-kill -N6)"
job=$(sbatch --parsable --no-kill -N6 -J raps-demo -o /dev/null --wrap 'sleep 300')
for _ in $(seq 1 100); do
  [ "$(squeue -h -j "$job" -o %T)" = RUNNING ] && break
  sleep 0.2
done
nodes=$(squeue -h -j "$job" -o %N)
echo "job $job runs on $nodes"
ranks=$(scontrol show hostnames "$nodes" | head -4 | paste -sd,)
spares=$(scontrol show hostnames "$nodes" | tail -2 | paste -sd,)

step "backup groups for 4 ranks on $ranks with spares $spares (rapsctl show groups)"
rapsctl show groups --nodes "$ranks" --spares "$spares"
scancel "$job"

if ((keep)); then
  step "cluster left up: source <(scripts/cluster.sh env); scripts/cluster.sh down when done"
fi
