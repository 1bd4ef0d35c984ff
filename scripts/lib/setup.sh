# Shared set-up of scripts/test.sh and scripts/demo.sh (sourced, not run).
# ensure_apt PKG...: install the Debian packages that are missing.
# ensure_venv EXTRA: the virtualenv ($RAPS_VENV, default /opt/raps/venv) on Debian's
# python3 with raps-slurm installed (pip extra EXTRA, '' for none); sets PY to its
# interpreter and exports RAPS_PYTHON. One interpreter serves the tests, the daemons and
# the Slurm hooks: PrologSlurmctld runs as SlurmUser, which cannot run a Python under /root.

ensure_apt() {
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

_pip() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | grep -v -e "^WARNING: Running pip as the 'root' user" -e "^WARNING: Location" || true
}

ensure_venv() {
  local extra=${1:-} venv=${RAPS_VENV:-/opt/raps/venv}
  [ -x "$venv/bin/python" ] || { echo "setup: creating $venv"; /usr/bin/python3 -m venv "$venv"; }
  PY=$venv/bin/python
  echo "setup: installing raps-slurm${extra:+[$extra]} into $venv"
  _pip -e ".${extra:+[$extra]}"
  if id slurm >/dev/null 2>&1 && ! runuser -u slurm -- "$PY" -c 'import raps_slurm.hooks.run' 2>/dev/null; then
    # The checkout is not readable by SlurmUser: install a copy instead of a link.
    echo "setup: SlurmUser cannot read $(pwd): installing a copy of the package"
    _pip --force-reinstall --no-deps .
  fi
  export RAPS_PYTHON=$PY PATH="$venv/bin:$PATH"
}
