#!/usr/bin/env bash
# Write the four Slurm hook wrappers into DEST (default /usr/local/lib/raps):
# prolog-slurmctld, epilog-slurmctld, prolog, epilog. Each is two lines that exec
# the interpreter raps-slurm is installed in (an absolute path: Slurm runs hooks with
# an almost empty environment) with -I -m raps_slurm.hooks: isolated mode, so no
# PYTHON* variable, user site or current directory of the job's user steers what a hook
# running as root or SlurmUser imports. Point slurm.conf at them
# (slurm/slurm.conf.d/raps.conf).
#   scripts/install-hooks.sh [--python PY] [--config FILE] [DEST]
# PY defaults to the python3 on PATH; FILE to the normal lookup (/etc/raps/raps.yaml).
# PrologSlurmctld runs as SlurmUser: PY, the package, FILE and the etcd credentials must
# be readable by that user (checked below when it exists).
set -euo pipefail

py=$(command -v python3 || true)
config=""
dest=/usr/local/lib/raps
while (($#)); do
  case $1 in
    --python) py=${2:?--python needs a path}; shift 2 ;;
    --config) config=${2:?--config needs a file}; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "install-hooks.sh: unknown option $1 (allowed: --python PY, --config FILE)" >&2; exit 2 ;;
    *) dest=$1; shift ;;
  esac
done
[ -n "$py" ] || { echo "install-hooks.sh: no python3 on PATH; pass --python" >&2; exit 2; }
py=$(realpath -s "$py")
"$py" -I -c 'import raps_slurm.hooks' 2>/dev/null \
  || { echo "install-hooks.sh: $py -I cannot import raps_slurm (install the package into it, not through PYTHONPATH)" >&2; exit 1; }
[ -z "$config" ] || config=$(realpath -m "$config")  # -m: it may exist only on the target

mkdir -p "$dest"
for hook in prolog-slurmctld epilog-slurmctld prolog epilog; do
  {
    echo "#!/bin/sh"
    echo "# raps-slurm $hook hook (written by scripts/install-hooks.sh): logic in raps_slurm.hooks"
    echo "exec '$py' -I -m raps_slurm.hooks $hook${config:+ --config '$config'}"
  } >"$dest/$hook.tmp"
  chmod 0755 "$dest/$hook.tmp"
  mv -f "$dest/$hook.tmp" "$dest/$hook"
done

slurm_user=$( (sed -n 's/^SlurmUser=//p' "${SLURM_CONF:-/etc/slurm/slurm.conf}" 2>/dev/null || true) | head -1)
slurm_user=${slurm_user:-slurm}
if id "$slurm_user" >/dev/null 2>&1 && [ "$slurm_user" != root ]; then
  runuser -u "$slurm_user" -- "$py" -I -c 'import raps_slurm.hooks.run' 2>/dev/null \
    || echo "install-hooks.sh: warning: $slurm_user cannot run $py with raps_slurm (PrologSlurmctld runs as $slurm_user)" >&2
fi
echo "install-hooks.sh: hooks in $dest"
