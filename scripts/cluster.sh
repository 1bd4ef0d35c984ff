#!/usr/bin/env bash
# A small real Slurm cluster on this machine for the tests and the demo:
# munged (if not already running), etcd (one member, or three), slurmctld and one slurmd per
# fake node,
# each fake node in its own cgroup (v2) so it can be crashed or frozen whole.
#
#   scripts/cluster.sh up|down|status|env
#   scripts/cluster.sh crash NODE | freeze NODE | thaw NODE | restart NODE | cgroup NODE
#   scripts/cluster.sh slurmd-kill NODE | slurmd-start NODE   (only the node's slurmd)
#   scripts/cluster.sh etcd-stop [MEMBER] | etcd-start [MEMBER]   (keeps etcd's data;
#                                   MEMBER 1..RAPS_CLUSTER_ETCD_MEMBERS, default all)
#   scripts/cluster.sh coordinator-start | coordinator-stop   (one raps-coordinator)
#   scripts/cluster.sh agent-start NODE | agent-stop NODE      (the node's raps-agent)
#   scripts/cluster.sh partition TARGET [SECONDS] | heal TARGET
#                                   (namespace mode: TARGET is a node nI, a rack rR, an
#                                   etcd member eI or a head hI, cut off the network and
#                                   back; SECONDS: heal then)
#
# Settings (environment): RAPS_CLUSTER_DIR (run dir, default /tmp/raps-cluster),
# RAPS_CLUSTER_NODES (6), RAPS_CLUSTER_RACKS (3), RAPS_CLUSTER_PORT (base port, 17000:
# slurmctld on base+817, slurmd on base+1.., etcd member i (1..) client/peer on
# base+377+2i/base+378+2i), RAPS_CLUSTER_ETCD_MEMBERS (1, or 3 for a quorum of two),
# RAPS_PYTHON (interpreter the Slurm hooks run with; SlurmUser must be able to run it:
# default /opt/raps/venv/bin/python, which scripts/test.sh creates, else python3).
# The RAPS config of the cluster is $RUN/etc/raps.yaml: RAPS_CLUSTER_PROFILE (default
# configs/test.yaml) with the cluster's etcd, key, checkpoint dirs ($RUN/ckpt/%n), agent
# sockets ($RUN/sock/%n/agent.sock) and hook log dir ($RUN/log/raps);
# RAPS_CLUSTER_STORE_TIMEOUT (seconds) sets its store.timeout_sec (default: the profile's
# with one etcd member, 1.5 with three).
# RAPS_CLUSTER_INSTALL=script: the hooks, the SPANK plugin, its plugstack.conf and the
# slurm.conf lines come from scripts/install.sh (--role controller, then compute, with
# --prefix/--sysconfdir $RUN/inst), as on a real cluster; unset: the cluster's own wiring.
# RAPS_CLUSTER_ETCD_AUTH=1 (the default but with RAPS_CLUSTER_INSTALL=script, which it does
# not go with): etcd with authentication and the least-privilege users of
# `rapsctl etcd-roles` (docs/store.md, Roles): $RUN/etc/raps.yaml (rapsctl, tests) is
# raps-admin's, agents, coordinators and the hooks read raps-{agent,coordinator,hooks}.yaml;
# passwords in $RUN/etc/etcd-pw, each mode 0600 and owned by the user that reads it.
# RAPS_CLUSTER_ETCD_AUTH=0: etcd without authentication.
# RAPS_CLUSTER_NET: lo (default) runs everything on 127.0.0.1; ns gives each node a network
# namespace of its own (its slurmd, agent and ranks), each rack a bridge and each etcd
# member a namespace on the core bridge, which joins the racks and carries the root
# namespace's address for slurmctld, coordinators and tests (see the ns section below).
# `down` stops exactly the processes `up` started (pids recorded in the run dir) and, in
# namespace mode, deletes the namespaces, veths and bridges `up` created (listed there too).
set -euo pipefail

RUN=${RAPS_CLUSTER_DIR:-/tmp/raps-cluster}
NODES=${RAPS_CLUSTER_NODES:-6}
RACKS=${RAPS_CLUSTER_RACKS:-3}
BASE=${RAPS_CLUSTER_PORT:-17000}
CTLD_PORT=$((BASE + 817))
ETCD_MEMBERS=${RAPS_CLUSTER_ETCD_MEMBERS:-1}
INSTALL=${RAPS_CLUSTER_INSTALL:-}
[[ "$INSTALL" =~ ^(|script)$ ]] || { echo "cluster.sh: RAPS_CLUSTER_INSTALL must be 'script' or unset, got '$INSTALL'" >&2; exit 2; }
# As in production, unless the install script wires the cluster (it knows no etcd users).
ETCD_AUTH_DEFAULT=1
[ -z "$INSTALL" ] || ETCD_AUTH_DEFAULT=0
ETCD_AUTH=${RAPS_CLUSTER_ETCD_AUTH:-$ETCD_AUTH_DEFAULT}
[[ "$ETCD_AUTH" =~ ^(0|1)$ ]] || { echo "cluster.sh: RAPS_CLUSTER_ETCD_AUTH must be 1 or 0, got '$ETCD_AUTH'" >&2; exit 2; }
[ "$ETCD_AUTH" = 0 ] || [ -z "$INSTALL" ] || { echo "cluster.sh: RAPS_CLUSTER_ETCD_AUTH=1 does not go with RAPS_CLUSTER_INSTALL=script" >&2; exit 2; }
[[ "$ETCD_MEMBERS" =~ ^(1|3)$ ]] || { echo "cluster.sh: RAPS_CLUSTER_ETCD_MEMBERS must be 1 or 3, got '$ETCD_MEMBERS'" >&2; exit 2; }
STORE_TIMEOUT=${RAPS_CLUSTER_STORE_TIMEOUT:-}
[[ "$STORE_TIMEOUT" =~ ^([0-9]+(\.[0-9]+)?)?$ ]] || { echo "cluster.sh: RAPS_CLUSTER_STORE_TIMEOUT must be a number of seconds or unset, got '$STORE_TIMEOUT'" >&2; exit 2; }
# Three members: a request fails over to the next one only after store.timeout_sec, which
# the config refuses at 2/3 of the leader lease or more (the test profile's lease is 3 s).
if [ "$ETCD_MEMBERS" = 3 ] && [ -z "$STORE_TIMEOUT" ]; then STORE_TIMEOUT=1.5; fi
AGENT_NICE=-5  # the agents run above the ranks, as raps-agent.service's Nice=-5
NET=${RAPS_CLUSTER_NET:-lo}
[ "$NET" = lo ] || [ "$NET" = ns ] || { echo "cluster.sh: RAPS_CLUSTER_NET must be 'lo' or 'ns', got '$NET'" >&2; exit 2; }
# Namespace mode: names carry the port base (two clusters never share one), addresses
# are 10.S.0.0/16 with S from the port base (bases 50 apart get different ones).
NS_PREFIX="rc$BASE"
NET_OCTET=$(((BASE / 50) % 256))
if [ "$NET" = ns ]; then HOST="10.$NET_OCTET.0.1"; else HOST=127.0.0.1; fi
etcd_client_port() { echo $((BASE + 377 + 2 * $1)); }
etcd_peer_port() { echo $((BASE + 378 + 2 * $1)); }
# Where etcd member I listens: its namespace's address, or loopback.
etcd_host() { if [ "$NET" = ns ]; then echo "10.$NET_OCTET.0.$((10 + $1))"; else echo 127.0.0.1; fi; }
# Namespace mode's head namespaces h1..h$HEADS, where tests run coordinators that a
# partition can cut off (coordinators started by this script stay in the root namespace).
HEADS=2
head_host() { echo "10.$NET_OCTET.0.$((20 + $1))"; }
etcd_urls() {
  local i urls=()
  for ((i = 1; i <= ETCD_MEMBERS; i++)); do urls+=("http://$(etcd_host "$i"):$(etcd_client_port "$i")"); done
  (IFS=,; echo "${urls[*]}")
}
CG_ROOT=${RAPS_CGROUP_ROOT:-/sys/fs/cgroup/unified}
CG_DIR="$CG_ROOT/raps-cluster-$(echo "$RUN" | md5sum | cut -c1-8)"
SLURM_SBIN=${RAPS_SLURM_SBIN:-/usr/sbin}
REPO=$(realpath -m "$(dirname "$0")/..")
if [ -z "${RAPS_PYTHON:-}" ]; then
  if [ -x /opt/raps/venv/bin/python ]; then RAPS_PYTHON=/opt/raps/venv/bin/python
  else RAPS_PYTHON=$(command -v python3); fi
fi

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

# Poll a command until it succeeds or the deadline passes; print what was seen.
wait_for() {
  local what=$1 secs=$2; shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      die "timed out after ${secs}s waiting for $what"
    fi
    sleep 0.2
  done
}

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "n$i"; done; }

# NODE_ARGV: the argv that runs shell command $2 as node $1: in namespace mode in the
# node's network namespace and a mount namespace of its own where /etc/hosts is the
# node's (the host's name resolves to the node's address there, as a node's own name does
# on a real cluster). Not `ip netns exec`: it remounts /sys, hiding the node's cgroup.
# Each step execs, so the pid is the final program's.
node_argv() {
  NODE_ARGV=(sh -c "$2")
  [ "$NET" = ns ] || return 0
  NODE_ARGV=(nsenter "--net=/run/netns/${NS_PREFIX}$1" unshare --mount --propagation private \
             sh -c "mount --bind '$RUN/net/hosts-$1' /etc/hosts && $2")
}

node_index() { echo "${1#n}"; }
node_rack() { local per_rack=$(((NODES + RACKS - 1) / RACKS)); echo $((($(node_index "$1") - 1) / per_rack + 1)); }
# Node nI of rack R: 10.S.R.I (one /16: racks are bridged, not routed).
node_addr() { echo "10.$NET_OCTET.$(node_rack "$1").$(node_index "$1")"; }

cgroups_usable() {
  [ -f "$CG_ROOT/cgroup.procs" ] && mkdir -p "$CG_DIR" 2>/dev/null && [ -w "$CG_DIR" ]
}

write_conf() {
  mkdir -p "$RUN"/{etc,log,ctld,spool,pids,etcd}
  # slurmctld runs as SlurmUser and must reach its state and log dirs.
  chmod 0755 "$RUN"
  chown slurm:slurm "$RUN/ctld" "$RUN/log" 2>/dev/null || true
  local per_rack=$(((NODES + RACKS - 1) / RACKS)) r i first last
  {
    echo "ClusterName=raps"
    echo "SlurmctldHost=localhost($HOST)"
    echo "SlurmctldPort=$CTLD_PORT"
    echo "SlurmUser=slurm"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$RUN/ctld"
    echo "SlurmdSpoolDir=$RUN/spool/%n"
    # Per node: PMIx makes its client directory under TmpFS, named by job and step
    # only, and the fake nodes of one host would share it (srun --mpi=pmix).
    echo "TmpFS=$RUN/tmp/%n"
    echo "SlurmctldPidFile=$RUN/pids/slurmctld.pid"
    echo "SlurmdPidFile=$RUN/pids/slurmd-%n.pid"
    echo "SlurmctldLogFile=$RUN/log/slurmctld.log"
    echo "SlurmdLogFile=$RUN/log/slurmd-%n.log"
    echo "SlurmctldDebug=info"
    echo "SlurmdDebug=info"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=10"
    echo "MessageTimeout=5"
    echo "MailProg=/bin/true"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    echo "JobCompType=jobcomp/none"
    echo "AccountingStorageType=accounting_storage/none"
    if [ "$INSTALL" = script ]; then
      # What scripts/install.sh wrote from slurm/slurm.conf.d/raps.conf (write_raps_conf).
      echo "Include $RUN/inst/etc/slurm/slurm.conf.d/raps.conf"
    else
      echo "TopologyPlugin=topology/tree"
      echo "PlugStackConfig=$RUN/etc/plugstack.conf"
      echo "PrologSlurmctld=$RUN/hooks/prolog-slurmctld"
      echo "EpilogSlurmctld=$RUN/hooks/epilog-slurmctld"
      echo "Prolog=$RUN/hooks/prolog"
      echo "Epilog=$RUN/hooks/epilog"
      echo "PrologFlags=Alloc"
    fi
    if [ "$NET" = ns ]; then
      for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=n$i NodeHostname=localhost NodeAddr=$(node_addr "n$i") Port=$((BASE + i)) CPUs=2 RealMemory=1000 State=UNKNOWN"
      done
    else
      echo "NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((BASE + 1))-$((BASE + NODES))] CPUs=2 RealMemory=1000 State=UNKNOWN"
    fi
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$RUN/etc/slurm.conf"
  # The SPANK shim (scripts/test.sh builds it; built here when missing): the --raps options.
  local so
  so=$(realpath -m "$(dirname "$0")/../spank/raps_spank.so")
  if [ ! -f "$so" ] && [ "$INSTALL" != script ]; then
    echo "cluster: building the SPANK shim $so (the --raps options of sbatch and srun)" >&2
    make -s -C "$(dirname "$so")" >&2 ||
      echo "cluster: SPANK shim not built: sbatch and srun will refuse --raps (needs gcc, make, libslurm-dev; scripts/test.sh installs them)" >&2
  fi
  if [ -f "$so" ] && [ "$INSTALL" != script ]; then
    echo "required $so agent_socket=$RUN/sock/%n/agent.sock coordinator=$HOST:$((BASE + 470))"
  fi >"$RUN/etc/plugstack.conf"
  {
    for ((r = 1; r <= RACKS; r++)); do
      first=$(((r - 1) * per_rack + 1))
      last=$((r * per_rack > NODES ? NODES : r * per_rack))
      ((first > NODES)) && break
      echo "SwitchName=r$r Nodes=n[$first-$last]"
    done
    echo "SwitchName=root Switches=r[1-$RACKS]"
  } >"$RUN/etc/topology.conf"
  write_raps_conf
  cat >"$RUN/env" <<EOF
export SLURM_CONF=$RUN/etc/slurm.conf
export RAPS_CLUSTER_DIR=$RUN
export RAPS_ETCD_URL=$(etcd_urls)
export RAPS_CONFIG=$RUN/etc/raps.yaml
export RAPS_CLUSTER_NET=$NET
EOF
}

# The config a RAPS process of WHO (agent, coordinator, hooks) reads.
raps_conf() {
  # its own when `up` wrote one (etcd with authentication; the agents always), so later
  # commands follow the mode the cluster came up in
  if [ -f "$RUN/etc/raps-$1.yaml" ]; then echo "$RUN/etc/raps-$1.yaml"; else echo "$RUN/etc/raps.yaml"; fi
}

# The agents' config names a cluster key that does not exist: they run on their node key
# and transfer tickets alone, as a compute node that holds no cluster key does.
no_cluster_key() {
  sed -i "s#^  cluster_key_file: .*#  cluster_key_file: $RUN/etc/compute-nodes-hold-no-cluster-key#" "$1"
}

# RAPS_CLUSTER_ETCD_AUTH=1: one config per etcd user (docs/store.md, Roles), raps.yaml the
# admin's; each agent is user raps-agent-<node> (%n); the passwords come with etcd_auth_on.
write_auth_confs() {
  local who user
  for who in agent coordinator hooks admin; do
    user=raps-$who
    [ "$who" = agent ] && user=raps-agent-%n
    sed -e "/^store:/a\\  user: $user" \
        -e "/^store:/a\\  password_file: $RUN/etc/etcd-pw/$user.password" \
        "$RUN/etc/raps.yaml" >"$RUN/etc/raps-$who.yaml.new"
    if [ "$who" = agent ]; then no_cluster_key "$RUN/etc/raps-agent.yaml.new"; fi
    mv "$RUN/etc/raps-$who.yaml.new" "$RUN/etc/raps-$who.yaml"
    chmod 0644 "$RUN/etc/raps-$who.yaml"
  done
  mv "$RUN/etc/raps-admin.yaml" "$RUN/etc/raps.yaml"
}

# Root and auth on, then the RAPS roles and users as root (passwords into $RUN/etc/etcd-pw,
# each 0600: root's daemons read theirs, SlurmUser owns the hooks' and the admins' ones).
etcd_auth_on() {
  local pw="$RUN/etc/etcd-pw" ctl=(etcdctl --endpoints "$(etcd_urls)")
  mkdir -p "$pw"
  [ -s "$pw/root.password" ] || "$RAPS_PYTHON" -c 'import secrets; print(secrets.token_hex(24))' >"$pw/root.password"
  chmod 0600 "$pw/root.password"
  ETCDCTL_API=3 "${ctl[@]}" user add root --interactive=false <"$pw/root.password" >/dev/null
  ETCDCTL_API=3 "${ctl[@]}" user grant-role root root >/dev/null
  ETCDCTL_API=3 "${ctl[@]}" auth enable >/dev/null
  "$RAPS_PYTHON" -m raps_slurm.cli --config "$RUN/etc/raps.yaml" etcd-roles --apply --user root \
    --password-file "$pw/root.password" --password-dir "$pw" \
    --nodes "$(node_names | paste -sd,)" >>"$RUN/log/etcd-roles.log" \
    || die "rapsctl etcd-roles --apply failed (log: $RUN/log/etcd-roles.log)"
  chmod 0711 "$pw" && chmod 0600 "$pw"/*.password
  # SlurmUser runs the controller hooks and, like root, may drain and resume with rapsctl
  if id slurm >/dev/null 2>&1; then chown slurm "$pw/raps-hooks.password" "$pw/raps-admin.password"; fi
  log "etcd auth on: users raps-agent-<node>, raps-coordinator, raps-hooks, raps-admin ($pw)"
}

# The RAPS side: config, hook wrappers, checkpoint and hook log dirs.
write_raps_conf() {
  mkdir -p "$RUN/ckpt" "$RUN/log/raps"
  # Namespace mode: a rank listens on its node's address (its hostname resolves to it in
  # the node's namespace) and each agent is given its own transfer address.
  local ns_sed="s#^  listen_address: 127.0.0.1.*#  listen_address: ''#"
  [ "$NET" = ns ] || ns_sed=""
  # PrologSlurmctld (SlurmUser) and Prolog (root) both log here; no one else may write.
  if id slurm >/dev/null 2>&1; then chown slurm "$RUN/log/raps"; fi
  chmod 0700 "$RUN/log/raps"
  {
    sed -e "s#^  local_dir: .*#  local_dir: $RUN/ckpt/%n#" \
        -e "s#^  log_dir: .*#  log_dir: $RUN/log/raps#" "${RAPS_CLUSTER_PROFILE:-$REPO/configs/test.yaml}"
    echo "store:"
    echo "  endpoints: ['$(etcd_urls | sed "s/,/', '/g")']"
    if [ -n "$STORE_TIMEOUT" ]; then echo "  timeout_sec: $STORE_TIMEOUT"; fi
  } | sed -e "/^detection:/a\\  cluster_key_file: $RUN/etc/raps.key" \
        -e "/^detection:/a\\  node_key_file: $RUN/etc/nodekeys/%n.key" \
        -e "/^detection:/a\\  transfer_tickets_file: $RUN/etc/nodekeys/%n.tickets" \
        -e "/^agent:/a\\  socket_path: $RUN/sock/%n/agent.sock" \
        -e "/^coordinator:/a\\  addresses: ['$HOST:$((BASE + 470))']" \
        -e "$ns_sed" >"$RUN/etc/raps.yaml"
  chmod 0644 "$RUN/etc/raps.yaml"
  cp "$RUN/etc/raps.yaml" "$RUN/etc/raps-agent.yaml"
  no_cluster_key "$RUN/etc/raps-agent.yaml"
  rm -f "$RUN/etc/raps-coordinator.yaml" "$RUN/etc/raps-hooks.yaml"
  if [ "$ETCD_AUTH" = 1 ]; then write_auth_confs; fi
  if id slurm >/dev/null 2>&1 && ! runuser -u slurm -- "$RAPS_PYTHON" -c 'import raps_slurm.hooks.run' 2>/dev/null; then
    die "SlurmUser 'slurm' cannot run $RAPS_PYTHON with raps_slurm (PrologSlurmctld would fail every job): set RAPS_PYTHON, e.g. to the venv scripts/test.sh creates"
  fi
  if [ "$INSTALL" = script ]; then
    # As an admin would: the controller's install creates the key (the config names
    # $RUN/etc/raps.key), the compute install finds it there.
    local role
    for role in controller compute; do
      bash "$REPO/scripts/install.sh" --role "$role" --prefix "$RUN/inst" --sysconfdir "$RUN/inst/etc" \
        --python "$RAPS_PYTHON" --config "$RUN/etc/raps.yaml" >>"$RUN/log/install.log" \
        || die "scripts/install.sh --role $role failed (log: $RUN/log/install.log)"
    done
    make_node_keys
    return
  fi
  [ -f "$RUN/etc/raps.key" ] || "$RAPS_PYTHON" -m raps_slurm.cli config create-key "$RUN/etc/raps.key" >/dev/null
  make_node_keys
  bash "$REPO/scripts/install-hooks.sh" --python "$RAPS_PYTHON" --config "$(raps_conf hooks)" "$RUN/hooks" >/dev/null
}

# Each fake node's own heartbeat key ($RUN/etc/nodekeys/nI.key, detection.node_key_file)
# and chunk transfer tickets (nI.tickets, detection.transfer_tickets_file), made as an admin
# makes them on the head node: the agents read no cluster key; the coordinator keeps it.
make_node_keys() {
  rm -rf "$RUN/etc/nodekeys" # derived from the cluster key: made again every time
  mkdir -m 0700 "$RUN/etc/nodekeys"
  # shellcheck disable=SC2046 # one argument per node name
  "$RAPS_PYTHON" -m raps_slurm.cli config node-key $(node_names) --cluster-key "$RUN/etc/raps.key" \
    --out "$RUN/etc/nodekeys/%n.key" >/dev/null || die "cannot make the node keys in $RUN/etc/nodekeys"
  # shellcheck disable=SC2046 # one argument per node name
  "$RAPS_PYTHON" -m raps_slurm.cli config transfer-tickets $(node_names) \
    --peers "$(node_names | paste -sd,)" --cluster-key "$RUN/etc/raps.key" \
    --out "$RUN/etc/nodekeys/%n.tickets" >/dev/null || die "cannot make the transfer tickets in $RUN/etc/nodekeys"
}

# --- Namespace mode (RAPS_CLUSTER_NET=ns) ---------------------------------------------
# Bridge <P>core (10.S.0.1/16 in the root namespace: slurmctld, coordinators, tests) joins
# one bridge <P>rR per rack through a veth pair <P>uR (rack side) / <P>cR (core side).
# Node nI lives in namespace <P>nI (eth0 = 10.S.R.I/16, lo up), its veth's other end,
# <P>nI, in its rack's bridge; etcd member I in namespace <P>eI (10.S.0.(10+I)) on the
# core bridge; head I in namespace <P>hI (10.S.0.(20+I)) on the core bridge, for a
# coordinator that a partition can cut off. <P> = rc<port base>. Everything created is listed in $RUN/net/created,
# which `down` deletes in reverse order.
net_created() { echo "$1 $2" >>"$RUN/net/created"; }

# A namespace NS with address ADDR, its link in BRIDGE.
net_ns_add() {
  local ns=$1 addr=$2 bridge=$3
  ip netns add "$ns"; net_created netns "$ns"
  ip link add "$ns" type veth peer name "${ns}x"; net_created link "$ns"
  ip link set "${ns}x" netns "$ns"
  ip -n "$ns" link set "${ns}x" name eth0
  ip -n "$ns" addr add "$addr/16" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  echo 1 >"/proc/sys/net/ipv4/conf/$ns/arp_ignore" # see cmd_partition
  ip link set "$ns" master "$bridge"
  ip link set "$ns" up
}

net_up() {
  command -v ip >/dev/null || die "ip not found (apt-get install iproute2)"
  if ip -o addr show | grep -q " inet 10\.$NET_OCTET\."; then
    die "10.$NET_OCTET.0.0/16 is already in use on this host (a namespace-mode cluster with port base $BASE still up? scripts/cluster.sh down)"
  fi
  mkdir -p "$RUN/net"
  : >"$RUN/net/created"
  local core="${NS_PREFIX}core" r n i racks
  ip link add "$core" type bridge || die "cannot create bridge $core (needs root and a kernel with bridge support)"
  net_created link "$core"
  ip addr add "$HOST/16" dev "$core"
  ip link set "$core" up
  racks=$(node_rack "n$NODES")
  for ((r = 1; r <= racks; r++)); do
    # A rack bridge is a switch, not a host: the root namespace must not answer ARP
    # through it (it would, for its own core address, with the bridge's MAC), and that MAC
    # is fixed. Left to the kernel it is the lowest of its ports' MACs, so a partition that
    # takes a node's port out changes it: a neighbour that had resolved the coordinator's
    # address to it lost the coordinator until its ARP entry expired (~30 s), and was
    # found DEAD with the partitioned node.
    ip link add "${NS_PREFIX}r$r" address "$(printf '02:72:61:%02x:00:%02x' "$NET_OCTET" "$r")" \
      type bridge; net_created link "${NS_PREFIX}r$r"
    echo 1 >"/proc/sys/net/ipv4/conf/${NS_PREFIX}r$r/arp_ignore"
    ip link set "${NS_PREFIX}r$r" up
    ip link add "${NS_PREFIX}u$r" type veth peer name "${NS_PREFIX}c$r"; net_created link "${NS_PREFIX}u$r"
    echo 1 >"/proc/sys/net/ipv4/conf/${NS_PREFIX}u$r/arp_ignore" # see cmd_partition
    ip link set "${NS_PREFIX}u$r" master "${NS_PREFIX}r$r"
    ip link set "${NS_PREFIX}c$r" master "$core"
    ip link set "${NS_PREFIX}u$r" up
    ip link set "${NS_PREFIX}c$r" up
  done
  for n in $(node_names); do
    net_ns_add "${NS_PREFIX}$n" "$(node_addr "$n")" "${NS_PREFIX}r$(node_rack "$n")"
  done
  for ((i = 1; i <= ETCD_MEMBERS; i++)); do
    net_ns_add "${NS_PREFIX}e$i" "$(etcd_host "$i")" "$core"
  done
  for ((i = 1; i <= HEADS; i++)); do
    net_ns_add "${NS_PREFIX}h$i" "$(head_host "$i")" "$core"
  done
  # Each node's /etc/hosts: this host's name is the node's own address there (what a
  # rank's default listen address resolves), every node's name is its address.
  local me; me=$(uname -n)
  for n in $(node_names); do
    {
      echo "127.0.0.1 localhost"
      echo "$(node_addr "$n") $me $n"
      for i in $(node_names); do [ "$i" = "$n" ] || echo "$(node_addr "$i") $i"; done
    } >"$RUN/net/hosts-$n"
  done
}

# Delete what net_up created (links first: a namespace goes once its processes are gone).
net_down() {
  [ -f "$RUN/net/created" ] || return 0
  local kind name
  tac "$RUN/net/created" | while read -r kind name; do
    case "$kind" in
      link) ip link show "$name" >/dev/null 2>&1 && ip link del "$name" 2>/dev/null || true ;;
      netns) ip netns del "$name" 2>/dev/null || true ;;
    esac
  done
  rm -f "$RUN/net/created"
}

# "LINK BRIDGE": the bridge port that cuts TARGET off: node nI -> its veth in its rack's
# bridge; rack rR -> the rack's uplink in the rack bridge; etcd member eI and head hI ->
# its veth in the core bridge.
net_link() {
  [ "$NET" = ns ] || die "partition and heal need namespace mode (RAPS_CLUSTER_NET=ns)"
  local t=$1
  if [[ "$t" =~ ^n[0-9]+$ ]] && (($(node_index "$t") >= 1 && $(node_index "$t") <= NODES)); then
    echo "${NS_PREFIX}$t ${NS_PREFIX}r$(node_rack "$t")"
  elif [[ "$t" =~ ^r[0-9]+$ ]] && ((${t#r} >= 1 && ${t#r} <= $(node_rack "n$NODES"))); then
    echo "${NS_PREFIX}u${t#r} ${NS_PREFIX}$t"
  elif [[ "$t" =~ ^e[0-9]+$ ]] && ((${t#e} >= 1 && ${t#e} <= ETCD_MEMBERS)); then
    echo "${NS_PREFIX}$t ${NS_PREFIX}core"
  elif [[ "$t" =~ ^h[0-9]+$ ]] && ((${t#h} >= 1 && ${t#h} <= HEADS)); then
    echo "${NS_PREFIX}$t ${NS_PREFIX}core"
  else
    die "unknown target '$t' (expected a node n1..n$NODES, a rack r1..r$(node_rack "n$NODES"), an etcd member e1..e$ETCD_MEMBERS or a head h1..h$HEADS)"
  fi
}

# A partition takes the target's port out of its bridge: both ends keep their carrier and
# every frame is lost, as behind a dead switch port or uplink. Not `ip link set down`:
# the kernel passes traffic again only ~0.8 s after a link comes back up (measured here),
# which would stretch every cut past a short miss window. The detached end, now a bare
# link of the root namespace, answers no ARP (arp_ignore=1, set when it was created), so
# nothing reaches the root namespace's addresses through it either.
# partition TARGET [SECONDS]: with SECONDS, heal after that long, in this process (a
# blip shorter than the miss window needs a cut not stretched by a second start).
cmd_partition() {
  local link bridge
  read -r link bridge <<<"$(net_link "$1")"
  [ -z "${2:-}" ] || [[ "$2" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "partition SECONDS must be a number, got '$2'"
  ip link set "$link" nomaster
  if [ -n "${2:-}" ]; then
    sleep "$2"
    ip link set "$link" master "$bridge"
    log "partitioned $1 for ${2}s ($link out of $bridge, then back)"
  else
    log "partitioned $1 ($link out of $bridge)"
  fi
}

cmd_heal() {
  local link bridge
  read -r link bridge <<<"$(net_link "$1")"
  ip link set "$link" master "$bridge"
  log "healed $1 ($link back in $bridge)"
}

munge_ok() { echo | munge 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (apt-get install munge creates it)"
  runuser -u munge -- /usr/sbin/munged
  wait_for "munged" 10 munge_ok
  cat /run/munge/munged.pid >"$RUN/pids/munged.started"
}

# start_etcd [keep] [MEMBER]: every member (or one), on fresh data unless "keep".
start_etcd() {
  command -v etcd >/dev/null || die "etcd not found (apt-get install etcd-server)"
  local keep=${1:-} only=${2:-} i peers=() members=()
  for ((i = 1; i <= ETCD_MEMBERS; i++)); do peers+=("raps$i=http://$(etcd_host "$i"):$(etcd_peer_port "$i")"); done
  if [ -n "$only" ]; then members=("$only"); else for ((i = 1; i <= ETCD_MEMBERS; i++)); do members+=("$i"); done; fi
  for i in "${members[@]}"; do
    local data="$RUN/etcd/data$i" client peer at wrap=()
    client=$(etcd_client_port "$i"); peer=$(etcd_peer_port "$i"); at=$(etcd_host "$i")
    [ "$NET" = ns ] && wrap=(ip netns exec "${NS_PREFIX}e$i")
    [ "$keep" = keep ] || rm -rf "$data"
    nohup "${wrap[@]}" etcd --name "raps$i" --data-dir "$data" \
      --listen-client-urls "http://$at:$client" \
      --advertise-client-urls "http://$at:$client" \
      --listen-peer-urls "http://$at:$peer" \
      --initial-advertise-peer-urls "http://$at:$peer" \
      --initial-cluster "$(IFS=,; echo "${peers[*]}")" \
      --initial-cluster-state new --initial-cluster-token "raps-$BASE" \
      </dev/null >>"$RUN/log/etcd$i.log" 2>&1 &
    echo $! >"$RUN/pids/etcd$i.pid"
  done
  # A member of three answers /health only once a quorum has formed: wait for every
  # started one (one member back alone joins the quorum of the two still running).
  for i in "${members[@]}"; do
    wait_for "etcd member $i on port $(etcd_client_port "$i")" 30 curl -sf "http://$(etcd_host "$i"):$(etcd_client_port "$i")/health"
  done
}

etcd_member_arg() {
  [ -z "${1:-}" ] && return 0
  [[ "$1" =~ ^[0-9]+$ ]] && (($1 >= 1 && $1 <= ETCD_MEMBERS)) || die "unknown etcd member '$1' (expected 1..$ETCD_MEMBERS)"
}

start_slurmd() {
  local n=$1
  mkdir -p "$RUN/spool/$n" "$RUN/tmp/$n"
  chmod 1777 "$RUN/tmp/$n"
  local cmd="exec '$SLURM_SBIN/slurmd' -N '$n' -f '$RUN/etc/slurm.conf'"
  if cgroups_usable; then
    mkdir -p "$CG_DIR/$n"
    # The shell joins the node's cgroup, then becomes slurmd: slurmstepd, batch
    # scripts and tasks started by it stay in that cgroup.
    cmd="echo \$\$ > '$CG_DIR/$n/cgroup.procs' && $cmd"
  fi
  node_argv "$n" "$cmd"
  "${NODE_ARGV[@]}" </dev/null >>"$RUN/log/slurmd-$n.out" 2>&1
  wait_for "slurmd $n pid file" 20 test -s "$RUN/pids/slurmd-$n.pid"
  [ "${2:-}" = "--no-agent" ] || start_agent "$n"
}

# Only the node's slurmd dies (its agent and the node stay up): steps cannot start there.
cmd_slurmd_kill() {
  local pidf="$RUN/pids/slurmd-$1.pid"
  [ -s "$pidf" ] || die "no slurmd pid file for $1"
  kill -9 "$(cat "$pidf")" && rm -f "$pidf"
  log "killed the slurmd of $1 (its agent keeps running)"
}

cmd_slurmd_start() {
  export SLURM_CONF="$RUN/etc/slurm.conf"
  node_cgroup "$1" >/dev/null
  start_slurmd "$1" --no-agent
}

# The node's raps-agent, in the node's cgroup: a node crash takes it down too.
start_agent() {
  local n=$1 pidf="$RUN/pids/agent-$1.pid"
  if [ -s "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then die "the agent of $n already runs"; fi
  # Above the ranks (nice 0), as raps-agent.service puts it: on this machine every core is
  # busy during the suite, and a starved agent's late acks and reports made healthy ranks
  # fence themselves or look hung. Root only; as a user nice warns and runs it at 0.
  local cmd="exec nice -n $AGENT_NICE '$RAPS_PYTHON' -m raps_slurm.agent --node '$n' --config '$(raps_conf agent)' ${RAPS_AGENT_ARGS:-}"
  [ "$NET" = ns ] && cmd="$cmd --transfer-address '$(node_addr "$n"):0'"
  if cgroups_usable; then
    cmd="echo \$\$ > '$CG_DIR/$n/cgroup.procs' && $cmd"
  fi
  node_argv "$n" "$cmd"
  nohup "${NODE_ARGV[@]}" </dev/null >>"$RUN/log/agent-$n.log" 2>&1 &
  echo $! >"$pidf"
}

cmd_up() {
  if [ -s "$RUN/pids/slurmctld.pid" ] && kill -0 "$(cat "$RUN/pids/slurmctld.pid")" 2>/dev/null; then
    die "a cluster already runs in $RUN (scripts/cluster.sh down first)"
  fi
  command -v slurmctld >/dev/null || [ -x "$SLURM_SBIN/slurmctld" ] || die "slurmctld not found (apt-get install slurmctld slurmd)"
  [ "$ETCD_AUTH" = 0 ] || command -v etcdctl >/dev/null || die "etcdctl not found (apt-get install etcd-client): it sets up etcd's authentication (RAPS_CLUSTER_ETCD_AUTH=0: none)"
  write_conf
  [ "$NET" = ns ] && net_up
  start_munge
  start_etcd
  if [ "$ETCD_AUTH" = 1 ]; then etcd_auth_on; fi
  export SLURM_CONF="$RUN/etc/slurm.conf"
  "$SLURM_SBIN/slurmctld" -f "$SLURM_CONF" -c -i </dev/null >>"$RUN/log/slurmctld.out" 2>&1 \
    || die "slurmctld failed to start: $(tail -5 "$RUN/log/slurmctld.log" 2>/dev/null)"
  wait_for "slurmctld" 30 scontrol ping
  local n
  for n in $(node_names); do start_slurmd "$n"; done
  wait_for "all $NODES nodes to register" 60 all_nodes_up
  cgroups_usable || log "cgroup v2 not writable at $CG_ROOT: crash/freeze fall back to signals"
  log "up: $NODES nodes in $RACKS racks, run dir $RUN, network $NET${HOST:+ ($HOST)} (source <(scripts/cluster.sh env))"
}

all_nodes_up() {
  local out
  out=$(sinfo -h -N -o '%N %t') || return 1
  [ "$(echo "$out" | grep -c .)" -eq "$NODES" ] || return 1
  ! echo "$out" | grep -Eq ' (down|unk|idle\*|mix\*|alloc\*|drain\*)'
}

# Stop the processes named by these pid files: TERM to all at once, KILL after 15 s.
stop_pidfiles() {
  local f pid pids=()
  for f in "$@"; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null && { kill "$pid" 2>/dev/null || true; pids+=("$pid"); }
  done
  local end=$((SECONDS + 15)) alive
  while :; do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    ((${#alive[@]} == 0)) && break
    if ((SECONDS >= end)); then kill -9 "${alive[@]}" 2>/dev/null || true; break; fi
    sleep 0.1
  done
  rm -f "$@"
}

cmd_down() {
  [ -d "$RUN" ] || { log "no cluster in $RUN"; return 0; }
  export SLURM_CONF="$RUN/etc/slurm.conf"
  local n slurmds=()
  for n in $(node_names); do
    [ -f "$CG_DIR/$n/cgroup.freeze" ] && echo 0 >"$CG_DIR/$n/cgroup.freeze" 2>/dev/null || true
    slurmds+=("$RUN/pids/slurmd-$n.pid")
  done
  stop_pidfiles "${slurmds[@]}" "$RUN"/pids/agent-*.pid
  for n in $(node_names); do
    # Whatever the fake node still runs (steps, tasks) dies with its cgroup.
    [ -f "$CG_DIR/$n/cgroup.kill" ] && echo 1 >"$CG_DIR/$n/cgroup.kill" 2>/dev/null || true
  done
  stop_pidfiles "$RUN/pids/coordinator.pid"
  stop_pidfiles "$RUN/pids/slurmctld.pid" "$RUN"/pids/etcd*.pid
  if [ -s "$RUN/pids/munged.started" ]; then
    mv "$RUN/pids/munged.started" "$RUN/pids/munged.pid"
    stop_pidfiles "$RUN/pids/munged.pid"
  fi
  for n in $(node_names); do
    [ -d "$CG_DIR/$n" ] && { wait_empty_cgroup "$CG_DIR/$n"; rmdir "$CG_DIR/$n" 2>/dev/null || true; }
  done
  [ -d "$CG_DIR" ] && rmdir "$CG_DIR" 2>/dev/null || true
  net_down
  log "down: $RUN"
}

wait_empty_cgroup() {
  local end=$((SECONDS + 10))
  while [ -s "$1/cgroup.procs" ] && ((SECONDS < end)); do sleep 0.1; done
}

cmd_status() {
  [ -f "$RUN/env" ] || { echo "no cluster in $RUN"; return 1; }
  export SLURM_CONF="$RUN/etc/slurm.conf"
  local f name pid
  for f in "$RUN"/pids/*.pid; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid); pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then echo "$name: running (pid $pid)"; else echo "$name: stopped"; fi
  done
  sinfo -N -o '%N %t %E' 2>/dev/null || echo "slurmctld: not answering"
  if [ "$NET" = ns ] && [ -f "$RUN/net/created" ]; then
    local t link bridge cut=()
    for t in $(node_names) $(seq -f 'r%g' 1 "$(node_rack "n$NODES")") $(seq -f 'e%g' 1 "$ETCD_MEMBERS") $(seq -f 'h%g' 1 "$HEADS"); do
      read -r link bridge <<<"$(net_link "$t")"
      [ -e "/sys/class/net/$link/master" ] || cut+=("$t")
    done
    echo "network ns ($HOST): partitioned: ${cut[*]:-none}"
  fi
}

node_cgroup() {
  local n=$1
  [[ "$n" =~ ^n[0-9]+$ ]] || die "unknown node '$n' (expected n1..n$NODES)"
  echo "$CG_DIR/$n"
}

# Signal every process of a fake node: fallback when cgroups are not writable.
signal_node_tree() {
  local n=$1 sig=$2 pid
  pid=$(cat "$RUN/pids/slurmd-$n.pid" 2>/dev/null) || die "no slurmd pid for $n"
  local all="$pid $(pgrep -d ' ' -P "$pid" 2>/dev/null || true)"
  local more=$all
  while [ -n "${more// /}" ]; do
    local next=""
    for p in $more; do next="$next $(pgrep -d ' ' -P "$p" 2>/dev/null || true)"; done
    more=$next; all="$all $next"
  done
  # shellcheck disable=SC2086
  kill -"$sig" $all 2>/dev/null || true
}

cmd_crash() {
  local cg; cg=$(node_cgroup "$1")
  if [ -f "$cg/cgroup.kill" ]; then
    echo 1 >"$cg/cgroup.kill"
    log "crashed $1 (cgroup.kill)"
  else
    log "cgroup.kill not available for $1 (cgroup v2 at $CG_ROOT not writable): killing its process tree"
    signal_node_tree "$1" KILL
  fi
  rm -f "$RUN/pids/slurmd-$1.pid" "$RUN/pids/agent-$1.pid"
}

cmd_freeze() {
  local cg; cg=$(node_cgroup "$1")
  if [ -f "$cg/cgroup.freeze" ]; then
    echo 1 >"$cg/cgroup.freeze"; log "froze $1 (cgroup.freeze)"
  else
    log "cgroup.freeze not available for $1: sending SIGSTOP to its process tree"
    signal_node_tree "$1" STOP
  fi
}

cmd_thaw() {
  local cg; cg=$(node_cgroup "$1")
  if [ -f "$cg/cgroup.freeze" ]; then
    echo 0 >"$cg/cgroup.freeze"; log "thawed $1"
  else
    signal_node_tree "$1" CONT
  fi
}

cmd_etcd_stop() {
  etcd_member_arg "${1:-}"
  local files=() i
  if [ -n "${1:-}" ]; then files=("$RUN/pids/etcd$1.pid"); else
    for ((i = 1; i <= ETCD_MEMBERS; i++)); do files+=("$RUN/pids/etcd$i.pid"); done
  fi
  local f any=""
  for f in "${files[@]}"; do [ -s "$f" ] && any=1; done
  [ -n "$any" ] || die "etcd${1:+ member $1} of $RUN is not running"
  stop_pidfiles "${files[@]}"
  log "etcd${1:+ member $1} stopped (data kept)"
}

cmd_etcd_start() {
  etcd_member_arg "${1:-}"
  local i
  for ((i = 1; i <= ETCD_MEMBERS; i++)); do
    [ -n "${1:-}" ] && [ "$i" != "$1" ] && continue
    if [ -s "$RUN/pids/etcd$i.pid" ] && kill -0 "$(cat "$RUN/pids/etcd$i.pid")" 2>/dev/null; then
      die "etcd member $i of $RUN already runs"
    fi
  done
  start_etcd keep "${1:-}"
  log "etcd${1:+ member $1} started"
}

cmd_coordinator_start() {
  local pidf="$RUN/pids/coordinator.pid"
  if [ -s "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then die "a coordinator already runs"; fi
  SLURM_CONF="$RUN/etc/slurm.conf" nohup "$RAPS_PYTHON" -m raps_slurm.coordinator \
    --config "$(raps_conf coordinator)" --name coordinator --metrics-address "$HOST:$((BASE + 471))" \
    --heartbeat-address "$HOST:$((BASE + 470))" --user-address "$HOST:$((BASE + 470))" \
    </dev/null >>"$RUN/log/coordinator.log" 2>&1 &
  echo $! >"$pidf"
  log "raps-coordinator started (log $RUN/log/coordinator.log, metrics http://$HOST:$((BASE + 471))/metrics)"
}

cmd_coordinator_stop() {
  stop_pidfiles "$RUN/pids/coordinator.pid"
}

cmd_restart() {
  export SLURM_CONF="$RUN/etc/slurm.conf"
  node_cgroup "$1" >/dev/null
  start_slurmd "$1"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) [ -f "$RUN/env" ] || die "no cluster in $RUN (scripts/cluster.sh up)"; cat "$RUN/env" ;;
  cgroup) [ $# -eq 2 ] || die "usage: scripts/cluster.sh cgroup NODE"; node_cgroup "$2" ;;
  crash | freeze | thaw | restart)
    [ $# -eq 2 ] || die "usage: scripts/cluster.sh $1 NODE"
    "cmd_$1" "$2" ;;
  slurmd-kill | slurmd-start)
    [ $# -eq 2 ] || die "usage: scripts/cluster.sh $1 NODE"
    "cmd_${1//-/_}" "$2" ;;
  agent-start) [ $# -eq 2 ] || die "usage: scripts/cluster.sh agent-start NODE"; node_cgroup "$2" >/dev/null; start_agent "$2" ;;
  agent-stop) [ $# -eq 2 ] || die "usage: scripts/cluster.sh agent-stop NODE"; node_cgroup "$2" >/dev/null; stop_pidfiles "$RUN/pids/agent-$2.pid" ;;
  etcd-stop | etcd-start)
    [ $# -le 2 ] || die "usage: scripts/cluster.sh $1 [MEMBER]"
    "cmd_${1//-/_}" "${2:-}" ;;
  coordinator-start) cmd_coordinator_start ;;
  coordinator-stop) cmd_coordinator_stop ;;
  partition) [ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: scripts/cluster.sh partition nNODE|rRACK|eMEMBER|hHEAD [SECONDS]"; cmd_partition "$2" "${3:-}" ;;
  heal) [ $# -eq 2 ] || die "usage: scripts/cluster.sh heal nNODE|rRACK|eMEMBER|hHEAD"; cmd_heal "$2" ;;
  *) echo "usage: scripts/cluster.sh up|down|status|env|crash NODE|freeze NODE|thaw NODE|restart NODE|slurmd-kill NODE|slurmd-start NODE|cgroup NODE|etcd-stop [MEMBER]|etcd-start [MEMBER]|coordinator-start|coordinator-stop|agent-start NODE|agent-stop NODE|partition TARGET|heal TARGET" >&2; exit 2 ;;
esac
