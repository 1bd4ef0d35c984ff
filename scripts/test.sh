#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs
# ruff, mypy and pytest (unit, contract on memory + real etcd, integration on a real
# local Slurm cluster that the tests start and stop themselves).
#   scripts/test.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
# One virtualenv on Debian's python3 for the tests, the daemons and the Slurm hooks:
# PrologSlurmctld runs as SlurmUser, which must be able to run the interpreter (a
# Python under /root is not reachable for it).
VENV=${RAPS_VENV:-/opt/raps/venv}

apt_packages=(slurm-wlm slurmctld slurmd munge libslurm-dev etcd-server curl gcc make procps
              python3 python3-venv)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "test.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | grep -v -e "^WARNING: Running pip as the 'root' user" -e "^WARNING: Location" || true
}
[ -x "$VENV/bin/python" ] || { echo "test.sh: creating $VENV"; /usr/bin/python3 -m venv "$VENV"; }
PY=$VENV/bin/python
echo "test.sh: installing raps-slurm with its dev extra into $VENV"
pip_install -e '.[dev]'
if ! runuser -u slurm -- "$PY" -c 'import raps_slurm.hooks.run' 2>/dev/null; then
  # The checkout is not readable by SlurmUser: install a copy instead of a link.
  echo "test.sh: SlurmUser cannot read $(pwd): installing a copy of the package"
  pip_install --force-reinstall --no-deps '.'
fi
"$PY" -c "import raps_slurm, etcd3gw, ClusterShell, zstandard, hypothesis, pytest_timeout, prometheus_client" \
  || { echo "test.sh: the Python package or its test extra did not install" >&2; exit 1; }
export RAPS_PYTHON=$PY

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
