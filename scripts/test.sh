#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs
# ruff, mypy and pytest (unit, contract on memory + real etcd, integration on a real
# local Slurm cluster that the tests start and stop themselves).
#   scripts/test.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/setup.sh
source scripts/lib/setup.sh

ensure_apt slurm-wlm slurmctld slurmd munge libslurm-dev etcd-server etcd-client curl gcc make binutils git procps openssl iproute2 \
  systemd prometheus \
  python3-dev libssl-dev \
  python3 python3-venv \
  openmpi-bin python3-mpi4py python3-numpy \
  libopenmpi-dev gfortran libzstd-dev pkg-config \
  e2fsprogs mount
ensure_venv dev
"$PY" -c "import raps_slurm, raps_slurm.wire._udp, raps_slurm.wire._datapath, etcd3gw, ClusterShell, zstandard, pyfastcdc.cy, blake3, crc32c, numpy, rich, hypothesis, pytest_timeout, prometheus_client, atheris" \
  || { echo "test.sh: the Python package or its test extra did not install" >&2; exit 1; }

if [ -f spank/Makefile ]; then
  echo "test.sh: building the SPANK shim"
  make -s -C spank
fi
if [ -f libraps/Makefile ]; then
  echo "test.sh: building libraps"
  make -s -C libraps
fi

echo "test.sh: ruff"
"$PY" -m ruff check raps_slurm tests
echo "test.sh: mypy"
"$PY" -m mypy
echo "test.sh: pytest"
pytest=("$PY" -m pytest -q -p no:cacheprovider --durations=25)
if [ $# -gt 0 ] || [ "${RAPS_TEST_SERIAL:-0}" = 1 ]; then
  exec "${pytest[@]}" "$@"
fi
# The tests that need a Slurm cluster (tests/ha, then tests/integration, in this order:
# the two clusters must not overlap) wait on it most of their time; the rest (CPU-bound,
# seconds each) runs beside them in a second pytest, its report printed after, at the
# lowest CPU priority: the cluster's daemons and ranks take a core whenever they need one
# (its timing tests failed when the two competed as equals).
side_log=$(mktemp)
side=""
# interrupted, the side pytest goes too (a background job ignores the terminal's SIGINT)
trap '[ -z "$side" ] || kill "$side" 2>/dev/null; rm -f "$side_log"' EXIT
nice -n 19 "${pytest[@]}" tests --ignore=tests/ha --ignore=tests/integration >"$side_log" 2>&1 &
side=$!
rc=0
"${pytest[@]}" tests/ha tests/integration || rc=$?
side_rc=0
wait "$side" || side_rc=$?
side=""
echo "test.sh: pytest of the tests that need no cluster (run beside them)"
cat "$side_log"
if [ "$rc" -ne 0 ] || [ "$side_rc" -ne 0 ]; then
  echo "test.sh: pytest failed (cluster tests: exit $rc; the others: exit $side_rc)" >&2
  exit 1
fi
