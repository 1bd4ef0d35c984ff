#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs
# ruff, mypy and pytest (unit, contract on memory + real etcd, integration on a real
# local Slurm cluster that the tests start and stop themselves).
#   scripts/test.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

apt_packages=(slurm-wlm slurmctld slurmd munge libslurm-dev etcd-server curl gcc make procps)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "test.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "test.sh: installing raps-slurm with its dev extra"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Running pip as the 'root' user" || true
"$PY" -c "import raps_slurm, etcd3gw, ClusterShell, zstandard, hypothesis, pytest_timeout" \
  || { echo "test.sh: the Python package or its test extra did not install" >&2; exit 1; }

if [ -f spank/Makefile ]; then
  echo "test.sh: building the SPANK shim"
  make -s -C spank
fi

echo "test.sh: ruff"
"$PY" -m ruff check raps_slurm tests
echo "test.sh: mypy"
"$PY" -m mypy
echo "test.sh: pytest"
"$PY" -m pytest -q -p no:cacheprovider --durations=8 "$@"
