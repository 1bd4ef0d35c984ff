#!/usr/bin/env bash
# Put raps-slurm in place on one host of a Slurm cluster (docs/install.md), by role:
#   controller  Slurm hooks, slurm.conf snippet, SPANK plugin, RAPS config, cluster key
#               (created when there is none), raps-coordinator unit, rapsctl
#   compute     Slurm hooks, slurm.conf snippet, SPANK plugin, RAPS config, cluster key
#               (--key, or the one already there; none with transfer tickets), checkpoint root,
#               raps-agent unit, rapsctl, libraps
#   login       SPANK plugin and its plugstack snippet, RAPS config (rapsctl reads
#               coordinator.addresses there), rapsctl, libraps
# libraps (docs/c-api.md): raps.h and raps.mod in PREFIX/include, libraps.so and
# libraps_f.so (the Fortran module's) in PREFIX/lib, raps.pc in PREFIX/lib/pkgconfig.
# Idempotent: a file is written only when its content or mode differs, and a second run
# ends with "nothing changed". It never starts, stops, restarts or reloads a service and
# never edits slurm.conf; --enable runs `systemctl enable` (not --now) for the role's unit.
#
#   scripts/install.sh --role controller|compute|login [options]
#     --root DIR        write every file under DIR, a staging root (default /): the files
#                       name their final paths, without DIR
#     --prefix DIR      SPANK .so and hooks in DIR/lib/raps, rapsctl in DIR/bin (/usr/local)
#     --sysconfdir DIR  RAPS config in DIR/raps, Slurm snippets in DIR/slurm, units in
#                       DIR/systemd/system (default /etc)
#     --python PY       interpreter raps-slurm is installed in; the hooks and units run it
#                       (default /opt/raps/venv/bin/python, else python3 on PATH)
#     --config FILE     RAPS config to install (replaces an installed one that differs);
#                       without it an installed config is kept, else configs/raps.yaml
#     --key FILE        cluster key to install at detection.cluster_key_file (mode 0600);
#                       without it an installed key is kept, else the controller creates one
#                       and a compute node stops (every node must share the controller's)
#                       Node keys are not installed here: on the controller run
#                       `rapsctl config node-key NODE --out NODE.key` and copy it (0600) to
#                       NODE's detection.node_key_file (docs/install.md). A compute node
#                       of a config that sets detection.transfer_tickets_file gets no
#                       cluster key (--key is refused): install its node key and tickets
#                       (`rapsctl config transfer-tickets`) instead
#     --hooks-config FILE  (controller) the config PrologSlurmctld and EpilogSlurmctld use,
#                       naming the raps-hooks etcd identity (docs/store.md): installed as
#                       raps/hooks.yaml and named by those two hooks; without it an
#                       installed hooks.yaml is kept, else they use the RAPS config
#     --spank FILE      a built raps_spank.so (default: build spank/ with make)
#     --enable          systemctl enable the role's unit (needs systemd running here)
set -euo pipefail

REPO=$(realpath -m "$(dirname "$0")/..")
usage() { echo "install.sh: $* (scripts/install.sh --help)" >&2; exit 2; }
die() { echo "install.sh: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

role="" root=/ prefix=/usr/local sysconfdir=/etc py="" config="" key="" spank="" enable=""
hooks_config=""
need() { [ $# -ge 2 ] && [ -n "$2" ] || usage "$1 needs a value"; }
while (($#)); do
  case $1 in
    --role) need "$@"; role=$2; shift 2 ;;
    --root) need "$@"; root=$2; shift 2 ;;
    --prefix) need "$@"; prefix=$2; shift 2 ;;
    --sysconfdir) need "$@"; sysconfdir=$2; shift 2 ;;
    --python) need "$@"; py=$2; shift 2 ;;
    --config) need "$@"; config=$2; shift 2 ;;
    --key) need "$@"; key=$2; shift 2 ;;
    --spank) need "$@"; spank=$2; shift 2 ;;
    --hooks-config) need "$@"; hooks_config=$2; shift 2 ;;
    --enable) enable=1; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) usage "unknown argument '$1' (allowed: --role, --root, --prefix, --sysconfdir, --python, --config, --key, --hooks-config, --spank, --enable)" ;;
  esac
done
case $role in
  controller|compute|login) ;;
  "") usage "--role is required (controller, compute or login)" ;;
  *) usage "unknown role '$role' (allowed: controller, compute, login)" ;;
esac
for d in "$prefix" "$sysconfdir"; do
  [[ $d == /* ]] || usage "'$d' is not an absolute path (--prefix and --sysconfdir name final paths)"
done
[ -d "$root" ] || usage "--root $root is not a directory"
root=$(realpath "$root"); [ "$root" = / ] && root=""
[ -z "$hooks_config" ] || [ "$role" = controller ] || usage "--hooks-config is for --role controller (only its hooks reach etcd)"
for f in "$config" "$key" "$spank" "$hooks_config"; do
  [ -z "$f" ] || [ -f "$f" ] || usage "'$f' is not a file"
done
if [ -z "$py" ]; then
  if [ -x /opt/raps/venv/bin/python ]; then py=/opt/raps/venv/bin/python; else py=$(command -v python3 || true); fi
fi
[ -n "$py" ] || usage "no python3 on PATH; pass --python PY"
py=$(realpath -s "$py")
"$py" -I -c 'import raps_slurm.hooks' 2>/dev/null || die "$py cannot import raps_slurm (install the package into it, or pass --python)"

changed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# put SRC PATH MODE: the file PATH (under the root) gets SRC's bytes and MODE, unless it
# already has both; written beside PATH and renamed, so a reader never sees half a file.
put() {
  local src=$1 path=$2 mode=$3 dest=$root$2
  if [ -f "$dest" ] && [ ! -L "$dest" ] && cmp -s "$src" "$dest"; then
    [ "$(stat -c %a "$dest")" = "$mode" ] && return 0
    chmod "$mode" "$dest"
    say "mode $mode: $path"; changed=$((changed + 1)); return 0
  fi
  local what=installed
  [ -e "$dest" ] && what=updated
  mkdir -p "$(dirname "$dest")"
  local part
  part=$(mktemp "$dest.XXXXXX")
  cat "$src" >"$part"
  chmod "$mode" "$part"
  mv -f "$part" "$dest"
  say "$what $path"; changed=$((changed + 1))
}

# keep_dir PATH MODE [OWNER]: create the directory when it is missing; an existing one is
# left as the admin made it.
keep_dir() {
  [ -d "$root$1" ] && return 0
  mkdir -p "$root$1"
  chmod "$2" "$root$1"
  [ -z "${3:-}" ] || chown "$3" "$root$1"
  say "created $1/"; changed=$((changed + 1))
}

# --- RAPS config ---------------------------------------------------------------------
cfg=$sysconfdir/raps/raps.yaml
# The config this run installs (or keeps) is checked, and read, before anything is written.
if [ -n "$config" ]; then cfg_src=$config
elif [ -f "$root$cfg" ]; then cfg_src=$root$cfg
else cfg_src=$REPO/configs/raps.yaml; fi
"$py" - "$cfg_src" >"$tmp/values" 2>"$tmp/check" <<'EOF' || die "$cfg_src is not a valid RAPS config: $(head -3 "$tmp/check" | tr '\n' ' ')"
import sys
from raps_slurm.config import load_file
from raps_slurm.errors import RapsError
try:
    c = load_file(sys.argv[1])
except RapsError as exc:
    sys.exit(str(exc))
print(c.detection.cluster_key_file)
print(c.agent.socket_path)
print(",".join(c.coordinator.addresses))
print(c.checkpoint.local_dir.split("%n")[0].rstrip("/") or "/")
print(c.hooks.log_dir)
print(c.detection.transfer_tickets_file)
EOF
{ read -r key_file; read -r socket_path; read -r coordinators; read -r ckpt_root; read -r log_dir; read -r tickets; } <"$tmp/values"
# A compute node of a config with transfer tickets holds its node key and tickets only.
keyless=""
if [ "$role" = compute ] && [ -n "$tickets" ]; then keyless=1; fi
if [ -n "$keyless" ] && [ -n "$key" ]; then
  usage "--key: the config sets detection.transfer_tickets_file, so a compute node holds no cluster key (install its node key and tickets instead, docs/install.md)"
elif [ -n "$key" ]; then
  "$py" -c 'import sys; from raps_slurm.wire.heartbeat import load_key; load_key(sys.argv[1])' "$key" 2>"$tmp/key" \
    || usage "--key: $(tail -1 "$tmp/key" | sed 's/^[A-Za-z_.]*Error: //')"
elif [ "$role" = compute ] && [ -z "$keyless" ] && [ ! -f "$root$key_file" ]; then
  usage "no cluster key at $key_file: pass --key FILE (the controller's $key_file; every node shares it)"
fi
hooks_cfg=$sysconfdir/raps/hooks.yaml
if [ -n "$hooks_config" ]; then
  "$py" -c 'import sys; from raps_slurm.config import load_file; load_file(sys.argv[1])' \
    "$hooks_config" 2>"$tmp/hcheck" \
    || usage "--hooks-config: $hooks_config is not a valid RAPS config: $(tail -1 "$tmp/hcheck" | sed 's/^[A-Za-z_.]*Error: //')"
fi
[ "$cfg_src" = "$root$cfg" ] || put "$cfg_src" "$cfg" 644
if [ -n "$hooks_config" ]; then put "$hooks_config" "$hooks_cfg" 644; fi

# --- cluster key (signs heartbeats; the same on every node) ----------------------------
if [ -n "$keyless" ]; then
  if [ -f "$root$key_file" ]; then
    say "$key_file is not needed here (detection.transfer_tickets_file is set): remove it from this compute node"
  fi
elif [ "$role" != login ]; then
  if [ -n "$key" ]; then
    put "$key" "$key_file" 600
  elif [ -f "$root$key_file" ]; then
    mode=$(stat -c %a "$root$key_file")
    [ "$mode" = 600 ] || [ "$mode" = 400 ] || { chmod 600 "$root$key_file"; say "mode 600: $key_file"; changed=$((changed + 1)); }
  elif [ "$role" = controller ]; then
    mkdir -p "$(dirname "$root$key_file")"
    # What `rapsctl config create-key` does (64 random bytes, 0600, never over a key).
    "$py" -c 'import sys; from raps_slurm.wire.heartbeat import create_key; create_key(sys.argv[1])' "$root$key_file"
    say "created $key_file (copy it to every compute node: install.sh --role compute --key FILE)"
    changed=$((changed + 1))
  fi
fi

# --- SPANK plugin and its plugstack snippet ----------------------------------------------
libdir=$prefix/lib/raps
if [ -z "$spank" ]; then
  make -s -C "$REPO/spank" >/dev/null || die "building spank/ failed (Debian: apt-get install gcc make libslurm-dev)"
  spank=$REPO/spank/raps_spank.so
fi
put "$spank" "$libdir/raps_spank.so" 644
{
  grep '^#' "$REPO/slurm/plugstack.conf.d/raps.conf"
  echo "required $libdir/raps_spank.so agent_socket=$socket_path coordinator=$coordinators"
} >"$tmp/plugstack-raps.conf"
put "$tmp/plugstack-raps.conf" "$sysconfdir/slurm/plugstack.conf.d/raps.conf" 644
plugstack=$sysconfdir/slurm/plugstack.conf
if [ ! -e "$root$plugstack" ]; then
  echo "include $sysconfdir/slurm/plugstack.conf.d/*.conf" >"$tmp/plugstack.conf"
  put "$tmp/plugstack.conf" "$plugstack" 644
elif ! grep -q "plugstack.conf.d" "$root$plugstack"; then
  say "note: $plugstack does not include plugstack.conf.d; add: include $sysconfdir/slurm/plugstack.conf.d/*.conf"
fi

# --- libraps: programs are built on login nodes and run on compute nodes (docs/c-api.md) --
if [ "$role" != controller ]; then
  make -s -C "$REPO/libraps" PREFIX="$prefix" libraps.so raps.pc >/dev/null \
    || die "building libraps/ failed (Debian: apt-get install gcc make libzstd-dev libssl-dev)"
  put "$REPO/libraps/raps.h" "$prefix/include/raps.h" 644
  put "$REPO/libraps/libraps.so" "$prefix/lib/libraps.so.0" 755
  put "$REPO/libraps/raps.pc" "$prefix/lib/pkgconfig/raps.pc" 644
  links="libraps.so"
  if command -v gfortran >/dev/null && make -s -C "$REPO/libraps" libraps_f.so >/dev/null; then
    put "$REPO/libraps/raps.mod" "$prefix/include/raps.mod" 644
    put "$REPO/libraps/libraps_f.so" "$prefix/lib/libraps_f.so.0" 755
    links="$links libraps_f.so"
  else
    say "note: no gfortran: the Fortran module of libraps is not installed"
  fi
  for l in $links; do
    if [ "$(readlink "$root$prefix/lib/$l" 2>/dev/null)" != "$l.0" ]; then
      ln -sfn "$l.0" "$root$prefix/lib/$l"; say "linked: $prefix/lib/$l"; changed=$((changed + 1))
    fi
  done
fi

# --- Slurm hooks and the slurm.conf lines that name them ---------------------------------
if [ "$role" != login ]; then
  mkdir -p "$tmp/hooks" "$tmp/ctld-hooks"
  bash "$REPO/scripts/install-hooks.sh" --python "$py" --config "$cfg" "$tmp/hooks" >/dev/null
  # The controller's hooks run as SlurmUser with their own etcd identity when there is
  # a hooks.yaml; the node hooks never reach etcd.
  ctld_cfg=$cfg
  [ "$role" = controller ] && [ -f "$root$hooks_cfg" ] && ctld_cfg=$hooks_cfg
  bash "$REPO/scripts/install-hooks.sh" --python "$py" --config "$ctld_cfg" "$tmp/ctld-hooks" >/dev/null
  for hook in prolog-slurmctld epilog-slurmctld; do
    put "$tmp/ctld-hooks/$hook" "$libdir/$hook" 755
  done
  for hook in prolog epilog; do
    put "$tmp/hooks/$hook" "$libdir/$hook" 755
  done
  sed -e "s#/usr/local/lib/raps#$libdir#g" -e "s#/etc/slurm/plugstack.conf#$plugstack#g" \
    "$REPO/slurm/slurm.conf.d/raps.conf" >"$tmp/slurm-raps.conf"
  put "$tmp/slurm-raps.conf" "$sysconfdir/slurm/slurm.conf.d/raps.conf" 644
  slurm_user=$( (sed -n 's/^SlurmUser=//p' "${SLURM_CONF:-/etc/slurm/slurm.conf}" 2>/dev/null || true) | head -1)
  slurm_user=${slurm_user:-slurm}
  if [ "$role" = controller ] && id "$slurm_user" >/dev/null 2>&1; then
    keep_dir "$log_dir" 755 "$slurm_user"  # PrologSlurmctld logs here as SlurmUser
  else
    keep_dir "$log_dir" 755
  fi
fi
[ "$role" = compute ] && keep_dir "$ckpt_root" 700

# --- systemd unit ------------------------------------------------------------------------
unit=""
case $role in
  controller) unit=raps-coordinator ;;
  compute) unit=raps-agent ;;
esac
if [ -n "$unit" ]; then
  bindir=$(dirname "$py")
  if [ -x "$bindir/$unit" ]; then exe="$bindir/$unit"; else exe="$py -m raps_slurm.${unit#raps-}"; fi
  sed -e "s#^ExecStart=/opt/raps/venv/bin/$unit #ExecStart=$exe #" \
      -e "s#^Environment=RAPS_CONFIG=.*#Environment=RAPS_CONFIG=$cfg#" \
    "$REPO/slurm/systemd/$unit.service" >"$tmp/$unit.service"
  put "$tmp/$unit.service" "$sysconfdir/systemd/system/$unit.service" 644
fi

# --- rapsctl on PATH ----------------------------------------------------------------------
if [ -x "$(dirname "$py")/rapsctl" ] && [ "$(dirname "$py")" != "$prefix/bin" ]; then
  target=$(dirname "$py")/rapsctl
  if [ "$(readlink "$root$prefix/bin/rapsctl" 2>/dev/null)" != "$target" ]; then
    mkdir -p "$root$prefix/bin"
    ln -sfn "$target" "$root$prefix/bin/rapsctl"
    say "linked $prefix/bin/rapsctl -> $target"; changed=$((changed + 1))
  fi
fi

# --- enable (only when asked) ---------------------------------------------------------------
if [ -n "$enable" ]; then
  if [ -z "$unit" ]; then
    say "--enable: the login role has no service"
  elif [ -n "$root" ] || [ "$sysconfdir" != /etc ]; then
    say "--enable: not enabling $unit: it is installed under ${root:-$sysconfdir}, where systemd does not look"
  elif [ ! -d /run/systemd/system ]; then
    say "--enable: systemd is not running on this machine (no /run/systemd/system): $unit not enabled"
  elif systemctl is-enabled -q "$unit.service" 2>/dev/null; then
    :
  else
    systemctl daemon-reload
    systemctl enable "$unit.service"
    say "enabled $unit (not started: systemctl start $unit)"; changed=$((changed + 1))
  fi
fi

if ((changed)); then say "$role: $changed changed under ${root:-/}"; else say "$role: nothing changed under ${root:-/}"; fi
