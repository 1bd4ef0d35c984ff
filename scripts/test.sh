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
"$PY" -c "import raps_slurm, raps_slurm.wire._udp, raps_slurm.wire._datapath, etcd3gw, ClusterShell, zstandard, pyfastcdc.cy, blake3, crc32c, numpy, rich, hypothesis, pytest_timeout, xdist, prometheus_client, atheris" \
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
# Two workers: the cluster's tests in order on one, the others beside them (tests/conftest.py).
"$PY" -m pytest -q -p no:cacheprovider --durations=25 -n "${RAPS_TEST_WORKERS:-2}" --dist loadgroup "$@"
