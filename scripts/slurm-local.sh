#!/usr/bin/env bash
# A real Slurm cluster with accounting (slurmdbd + MariaDB, so `sacct` works) on this one machine,
# for the tests and for local use: one node by default, or N nodes, each a network + UTS namespace
# of its own (own address and hostname) on one bridge. Everything it starts or creates is recorded
# in one state directory, and `stop` removes exactly that; nothing under /etc changes except tagged
# /etc/hosts lines for the node names of a multi-node cluster. See docs/slurm.md.
#
#   bash scripts/slurm-local.sh start [--nodes N] [--cpus-per-node C] [--inter-node-mbit R]
#                                     [--inter-node-latency-ms L] [STATE_DIR]
#   bash scripts/slurm-local.sh stop|status|env|install [STATE_DIR]
#   eval "$(bash scripts/slurm-local.sh env)"      # SLURM_CONF for sbatch, srun, squeue, sacct, ...
# Faults, for chaos tests (on a running cluster):
#   restart slurmctld|slurmdbd [STATE_DIR]   stop by PID, start again on the same state, wait
#   kill-slurmd NODE [STATE_DIR]             SIGKILL the node's slurmd: DOWN after SlurmdTimeout
#   start-slurmd NODE [STATE_DIR]            start it again and wait until the node is back
#   link NODE down|up [STATE_DIR]            cut / restore the node's network (multi-node only)
#   drain NODE | resume NODE [STATE_DIR]     scontrol update NodeName=NODE State=DRAIN|RESUME
#
# STATE_DIR: the argument, else $SLURM_LOCAL_DIR, else ${TMPDIR:-/tmp}/parallel-tuner-slurm.
# Knobs (environment; the options win): SLURM_LOCAL_NODES (1), SLURM_LOCAL_CPUS (CPUs per node:
# 8 on one node, 2 each on several), SLURM_LOCAL_INTER_NODE_MBIT, SLURM_LOCAL_INTER_NODE_LATENCY_MS,
# SLURM_LOCAL_PORT (slurmctld; slurmd +1, slurmdbd +2, default 26817; a multi-node cluster's
# bridge, namespaces, node names and subnet are derived from it), SLURM_LOCAL_TIMEOUT (s per
# readiness wait, 60). Needs root: slurmd launches jobs as their user and SlurmUser=root.
set -euo pipefail

log() { echo "slurm-local: $*" >&2; }
die() { log "$*"; exit 1; }

COMMANDS="install|start|stop|status|env|restart|kill-slurmd|start-slurmd|link|drain|resume"
usage() { echo "usage: $0 $COMMANDS [options] [ARGS] [STATE_DIR]; see the top of $0" >&2; exit 2; }

CMD=${1:-}
shift || true
NUM_NODES=${SLURM_LOCAL_NODES:-1}
CPUS=${SLURM_LOCAL_CPUS:-}
MBIT=${SLURM_LOCAL_INTER_NODE_MBIT:-}
LATENCY_MS=${SLURM_LOCAL_INTER_NODE_LATENCY_MS:-}
ARGS=()
OPTIONS=0
while [ $# -gt 0 ]; do
  case $1 in
    --nodes | --cpus-per-node | --inter-node-mbit | --inter-node-latency-ms)
      [ $# -ge 2 ] || die "$1 needs a value"
      set -- "$1=$2" "${@:3}"
      ;;
    --nodes=*) NUM_NODES=${1#*=}; OPTIONS=1; shift ;;
    --cpus-per-node=*) CPUS=${1#*=}; OPTIONS=1; shift ;;
    --inter-node-mbit=*) MBIT=${1#*=}; OPTIONS=1; shift ;;
    --inter-node-latency-ms=*) LATENCY_MS=${1#*=}; OPTIONS=1; shift ;;
    -h | --help) usage ;;
    -*) die "unknown option $1" ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
case "$CMD" in  # how many positional arguments come before the optional STATE_DIR
  restart | kill-slurmd | start-slurmd | drain | resume) NUM_ARGS=1 ;;
  link) NUM_ARGS=2 ;;
  install | start | stop | status | env) NUM_ARGS=0 ;;
  *) usage ;;
esac
[ "$OPTIONS" = 0 ] || [ "$CMD" = start ] || die "options are for start; $CMD takes the cluster's own"
if [ ${#ARGS[@]} -lt "$NUM_ARGS" ] || [ ${#ARGS[@]} -gt $((NUM_ARGS + 1)) ]; then usage; fi
DIR=${ARGS[NUM_ARGS]:-${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/parallel-tuner-slurm}}
[[ $DIR == /* ]] || DIR=$PWD/$DIR  # slurm.conf needs absolute paths
PORT=${SLURM_LOCAL_PORT:-26817}
if ! [[ $PORT =~ ^[1-9][0-9]{3,4}$ ]] || [ "$PORT" -gt 65533 ]; then
  die "SLURM_LOCAL_PORT must be a port number, not '$PORT'"
fi
TIMEOUT_S=${SLURM_LOCAL_TIMEOUT:-60}
CLUSTER=local
HOST=$(hostname -s)
CONF=$DIR/etc/slurm.conf
MUNGE_SOCK=$DIR/munge/run/munge.sock
DB_SOCK=$DIR/mysql/mysqld.sock
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
# Start order; stop is the reverse, after every slurmd.
DAEMONS=(munged mariadbd slurmdbd slurmctld)
# Every /etc/hosts line of this cluster ends with it, so `stop` removes exactly those.
TAG="# slurm-local $DIR"
# A node's slurmd is declared DOWN (and its jobs NODE_FAIL) once it has not answered slurmctld's
# pings for this long; the default, 300 s, would make every node-fault test take minutes.
SLURMD_TIMEOUT_S=10

export PATH=$PATH:/usr/sbin:/sbin SLURM_CONF=$CONF
# libmariadb takes its default socket from here: slurmdbd reaches MariaDB without a TCP port.
export MYSQL_UNIX_PORT=$DB_SOCK

# A running cluster's own settings win over the caller's environment for every other command.
if [ "$CMD" != start ] && [ -f "$DIR/etc/cluster.env" ]; then
  # shellcheck disable=SC1091
  . "$DIR/etc/cluster.env"
fi

# Names of a multi-node cluster, derived from the port so that clusters on different ports (two
# engineers' test sessions) never share a bridge, a namespace, a hostname or a subnet.
[[ $NUM_NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes must be 1-99, not '$NUM_NODES'"
PREFIX=sl$PORT
BRIDGE=${PREFIX}br
SUBNET=10.$((PORT >> 8 & 255)).$((PORT & 255))  # one /24 per port, inside 10.0.0.0/8
BRIDGE_IP=$SUBNET.1
node_name() { if [ "$NUM_NODES" = 1 ]; then echo "$HOST"; else echo "${PREFIX}n$1"; fi; }
node_addr() { if [ "$NUM_NODES" = 1 ]; then echo 127.0.0.1; else echo "$SUBNET.$((10 + $1))"; fi; }
# The slurmd pid file's name; the single node keeps the name it always had.
slurmd_name() { if [ "$NUM_NODES" = 1 ]; then echo slurmd; else echo "slurmd-$1"; fi; }
NODES=()
for ((k = 1; k <= NUM_NODES; k++)); do NODES+=("$(node_name "$k")"); done

node_index() {  # node_index NAME: K of node NAME, or die naming the nodes there are
  local k
  for ((k = 1; k <= NUM_NODES; k++)); do [ "${NODES[k - 1]}" = "$1" ] && { echo "$k"; return; }; done
  die "no node $1 in the cluster in $DIR (nodes: ${NODES[*]})"
}

# ------------------------------------------------------------------------------------- packages
missing_packages() {
  local pkg missing=()
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  done
  echo "${missing[*]}"
}

do_install() {
  local missing; missing=$(missing_packages)
  [ -z "$missing" ] && return 0
  if [ "$(id -u)" != 0 ]; then
    die "Slurm packages missing ($missing); as root: apt-get install --no-install-recommends $missing"
  fi
  log "installing $missing"
  # --no-install-recommends: ~32 packages, ~200 MB; the post-install service starts are refused
  # without an init system, which is what we want.
  export DEBIAN_FRONTEND=noninteractive
  local out; out=$(mktemp)
  # shellcheck disable=SC2086
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } >"$out" 2>&1; then
    cat "$out" >&2; rm -f "$out"; die "apt-get install $missing failed"
  fi
  rm -f "$out"
}

# ---------------------------------------------------------------------------------- processes
# A pid file holds "PID STARTTIME" (field 22 of /proc/PID/stat), so a reused PID is never ours.
start_time() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }

running() {  # running NAME: the process we recorded still runs (a zombie counts as gone)
  local pid started
  read -r pid started 2>/dev/null <"$DIR/run/$1.pid" || return 1
  [ -n "$pid" ] && [ "$(start_time "$pid")" = "$started" ] || return 1
  ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

launch() {  # launch NAME CMD...: foreground daemon in its own session, logs in log/NAME.out
  local name=$1; shift
  # Without job control the background child is no process-group leader, so setsid does not
  # fork again and $! is the daemon itself (nsenter, unshare and sh below exec, keeping the PID).
  setsid "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
  local pid=$!
  echo "$pid $(start_time "$pid")" >"$DIR/run/$name.pid"
}

stop_daemon() {  # stop_daemon NAME [SIGNAL]: SIGNAL (TERM), wait until gone, SIGKILL after 20 s
  local name=$1 signal=${2:-TERM} pid i
  if running "$name"; then
    read -r pid _ <"$DIR/run/$name.pid"
    kill -"$signal" "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do running "$name" || break; sleep 0.2; done
    if running "$name"; then
      log "$name ($pid) ignored SIG$signal for 20 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 25; i++)); do running "$name" || break; sleep 0.2; done
    fi
  fi
  rm -f "$DIR/run/$name.pid"
}

wait_until() {  # wait_until NAME WHAT CMD...: poll CMD every 0.2 s while daemon NAME runs
  local name=$1 what=$2 i; shift 2
  for ((i = 0; i < TIMEOUT_S * 5; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    if ! running "$name"; then
      show_logs "$name"
      die "$name exited while waiting for $what; logs in $DIR/log"
    fi
    sleep 0.2
  done
  die "no $what after ${TIMEOUT_S} s; logs in $DIR/log"
}

show_logs() {  # show_logs NAME: the end of a daemon's logs, on stderr
  local file
  for file in "$DIR/log/$1.out" "$DIR/log/$1.log"; do
    [ -s "$file" ] && { echo "==> $file" && tail -n 15 "$file"; } >&2
  done
  return 0
}

searchable_by_all() {  # munged refuses a socket below a directory that others cannot enter
  local dir=$1
  while [ "$dir" != / ] && [ -n "$dir" ]; do
    [ "$(( 8#$(stat -L -c %a "$dir") & 1 ))" = 1 ] || { echo "$dir"; return 1; }
    dir=$(dirname "$dir")
  done
}

port_free() { ! (: </dev/tcp/127.0.0.1/"$1") 2>/dev/null; }

# -------------------------------------------------------------------------------------- network
# Each thing is recorded in run/created before it is made, so a start that fails half-way is
# undone by `stop` like a whole one. Links carry TAG as their alias: `stop` leaves a link or
# namespace alone that another cluster has since claimed.
record() { echo "$*" >>"$DIR/run/created"; }

link_exists() { ip link show dev "$1" >/dev/null 2>&1; }
link_alias() { ip ${2:+-n "$2"} -d link show dev "$1" 2>/dev/null | sed -n 's/^ *alias //p'; }  # DEV [NETNS]
ours_or_unclaimed() { [ -z "$1" ] || [ "$1" = "$TAG" ]; }

# shellcheck disable=SC2094  # fd 9 on /etc/hosts only holds the lock
hosts_edit() {  # hosts_edit add|remove: this cluster's node lines; flock: other clusters edit too
  (
    flock 9
    if [ "$1" = add ]; then
      [ -z "$(tail -c1 /etc/hosts)" ] || echo >>/etc/hosts
      for ((k = 1; k <= NUM_NODES; k++)); do echo "$(node_addr "$k") $(node_name "$k") $TAG"; done >>/etc/hosts
    elif grep -qF -- "$TAG" /etc/hosts; then
      # Rewrite in place (cat >, not mv): /etc/hosts may be a bind mount. Exact suffix match, so
      # a state dir that is a prefix of another's keeps the other's lines.
      awk -v tag=" $TAG" 'substr($0, length($0) - length(tag) + 1) != tag' /etc/hosts >"$DIR/run/hosts.new"
      cat "$DIR/run/hosts.new" >/etc/hosts
      rm -f "$DIR/run/hosts.new"
    fi
  ) 9</etc/hosts
}

shape_link() {  # shape_link DEV: the rate/latency of traffic leaving the bridge towards a node
  if [ -n "$LATENCY_MS" ]; then
    # netem delays every packet (and limits the rate itself); kernels without sch_netem refuse it.
    tc qdisc add dev "$1" root netem delay "${LATENCY_MS}ms" ${MBIT:+rate "${MBIT}mbit"} \
      || die "tc netem failed on $1 (--inter-node-latency-ms needs a kernel with sch_netem)"
  elif [ -n "$MBIT" ]; then
    tc qdisc add dev "$1" root tbf rate "${MBIT}mbit" burst 64kb latency 50ms
  fi
}

net_up() {
  local k name veth
  [ -z "$(ip -4 -o addr show to "$SUBNET.0/24")$(ip -4 route show root "$SUBNET.0/24")" ] \
    || die "subnet $SUBNET.0/24 (from port $PORT) is in use here; choose another SLURM_LOCAL_PORT"
  for name in "$BRIDGE" "${NODES[@]}"; do
    ! link_exists "$name" || die "network link $name exists (another cluster on port $PORT?)"
    [ ! -e "/var/run/netns/$name" ] || die "network namespace $name exists (another cluster on port $PORT?)"
  done
  record link "$BRIDGE"
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" alias "$TAG"
  ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for ((k = 1; k <= NUM_NODES; k++)); do
    name=$(node_name "$k") veth=$(node_name "$k")  # the bridge's end of the node's cable
    record netns "$name"
    ip netns add "$name"
    record link "$veth"
    ip link add "$veth" type veth peer name "${veth}p"
    ip link set "$veth" alias "$TAG"
    ip link set "$veth" master "$BRIDGE" up
    ip link set "${veth}p" netns "$name"
    ip -n "$name" link set "${veth}p" name eth0
    ip -n "$name" link set eth0 alias "$TAG"
    ip -n "$name" addr add "$(node_addr "$k")/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    if [ -n "$MBIT$LATENCY_MS" ]; then record qdisc "$veth"; shape_link "$veth"; fi
  done
  record hosts
  hosts_edit add
}

kill_netns_processes() {  # what a node's slurmd left running (steps of a killed slurmd)
  local pids i
  pids=$(ip netns pids "$1" 2>/dev/null | tr '\n' ' ')
  [ -n "${pids// /}" ] || return 0
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for ((i = 0; i < 25; i++)); do [ -z "$(ip netns pids "$1" 2>/dev/null)" ] && return 0; sleep 0.2; done
  pids=$(ip netns pids "$1" 2>/dev/null | tr '\n' ' ')
  # shellcheck disable=SC2086
  [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
}

net_down() {  # undo run/created, last first; safe to repeat
  [ -f "$DIR/run/created" ] || return 0
  local kind name
  while read -r kind name; do
    case $kind in
      hosts) hosts_edit remove ;;
      qdisc) link_exists "$name" && ours_or_unclaimed "$(link_alias "$name")" \
               && tc qdisc del dev "$name" root 2>/dev/null ;;
      link) link_exists "$name" && ours_or_unclaimed "$(link_alias "$name")" \
              && ip link del "$name" 2>/dev/null ;;
      netns)
        if [ -e "/var/run/netns/$name" ] \
          && ours_or_unclaimed "$(link_alias eth0 "$name")"; then
          kill_netns_processes "$name"
          ip netns del "$name"
        fi
        ;;
    esac || true
  done < <(tac "$DIR/run/created")
  rm -f "$DIR/run/created"
}

# -------------------------------------------------------------------------------------- config
# 95 % of MemTotal, a little below what slurmd detects, as on a real node. Every node of a
# multi-node cluster reports the whole machine's memory: memory is not a consumed resource here.
real_memory_mb() { awk '/^MemTotal:/ { print int($2 / 1024 * 0.95) }' /proc/meminfo; }

write_slurm_conf() {
  local k spool=$DIR/spool slurmd_files=slurmd ctld_addr=127.0.0.1
  if [ "$NUM_NODES" -gt 1 ]; then
    # slurmctld stays in the root namespace, reached by the nodes at the bridge's address; it must
    # be named by the machine's real hostname ("This host ... not a valid controller" otherwise).
    spool=$DIR/spool/%n slurmd_files=slurmd-%n ctld_addr=$BRIDGE_IP
  fi
  cat >"$CONF" <<EOF
# Written by scripts/slurm-local.sh; rewritten on every start.
ClusterName=$CLUSTER
SlurmctldHost=$HOST($ctld_addr)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$DIR/run/$slurmd_files.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/$slurmd_files.log
MailProg=/bin/true
MpiDefault=none
# No cgroups here: track job processes by parentage and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Cores only: with CR_Core_Memory and no DefMemPerCPU every job takes the whole node's memory.
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# The defaults (sched_interval=60, bf_interval=30) leave queued jobs waiting for seconds.
SchedulerParameters=sched_interval=2,bf_interval=1,sched_min_interval=0
# Advertise CPUs=$CPUS per node whatever the machine has, so that layouts of that many ranks fit.
SlurmdParameters=config_overrides
# A node set DOWN (e.g. by a failure test) comes back when its slurmd registers again.
ReturnToService=2
# A slurmd silent for this long (pinged every third of it) is DOWN and its jobs end NODE_FAIL:
# seconds for the fault tests instead of the default 300 s.
SlurmdTimeout=$SLURMD_TIMEOUT_S
# One rank of an srun step exiting non-zero ends the step: the other ranks would otherwise wait
# in a collective until the time limit.
KillOnBadExit=1
# No grace beyond --time. Limits are whole minutes (--time=0:10 becomes 1:00) and slurmctld
# checks them every 30 s, so TIMEOUT lands 0-30 s (+ KillWait) late: --time=1 ended at 86 s.
OverTimeLimit=0
KillWait=2
MinJobAge=10
InactiveLimit=0
Waittime=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
# slurmctld, sacct and sacctmgr reach slurmdbd through the munge socket named here, not AuthInfo.
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/none
EOF
  # RealMemory: without it the node has 1 MB and any --mem request is refused.
  for ((k = 1; k <= NUM_NODES; k++)); do
    if [ "$NUM_NODES" = 1 ]; then
      echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$(real_memory_mb) State=UNKNOWN"
    else
      echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k") NodeHostname=$(node_name "$k")" \
        "CPUs=$CPUS RealMemory=$(real_memory_mb) State=UNKNOWN"
    fi
  done >>"$CONF"
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

write_slurmdbd_conf() {  # slurmdbd reads slurmdbd.conf beside SLURM_CONF; it refuses one others can read
  (
    umask 077
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.daemon.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$1
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

write_cluster_env() {  # what every later command needs to know about this cluster
  printf 'PORT=%q\nNUM_NODES=%q\nCPUS=%q\nMBIT=%q\nLATENCY_MS=%q\n' \
    "$PORT" "$NUM_NODES" "$CPUS" "$MBIT" "$LATENCY_MS" >"$DIR/etc/cluster.env"
}

# --------------------------------------------------------------------------------------- start
node_ready() { sinfo -h -N -n "$1" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)$'; }
cluster_registered() {  # slurmctld told slurmdbd where it listens
  [ -n "$(sacctmgr -n -P show cluster "$CLUSTER" format=ControlHost 2>/dev/null)" ]
}

start_munge() {
  mkdir -p "$DIR/munge/key" "$DIR/munge/run"
  # munged checks permissions: a private key directory, a socket directory others can enter.
  chmod 700 "$DIR/munge/key"
  chmod 755 "$DIR/munge" "$DIR/munge/run"
  mungekey --create --keyfile="$DIR/munge/key/munge.key"
  launch munged munged --foreground --socket="$MUNGE_SOCK" --key-file="$DIR/munge/key/munge.key" \
    --pid-file="$DIR/munge/run/munged.pid" --seed-file="$DIR/munge/key/munged.seed" \
    --log-file="$DIR/log/munged.log"
  wait_until munged "munge socket" sh -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'"
}

start_mariadb() {
  local password=$1 sql=(mariadb --no-defaults --socket="$DB_SOCK" --user=root)
  # A throwaway database: never fsync, a small redo log (mariadb-install-db 4-8 s -> 0.5-3 s
  # here). slurmdbd logs "Database settings not recommended values: innodb_buffer_pool_size"
  # even at 128M; a few jobs' records need far less.
  local opts=(--no-defaults --user=root --datadir="$DIR/mysql/data" --skip-name-resolve
    --innodb-flush-method=nosync --innodb-doublewrite=0 --innodb-log-file-size=64M
    --innodb-buffer-pool-size=32M --innodb-lock-wait-timeout=900)
  mkdir -p "$DIR/mysql"
  mariadb-install-db "${opts[@]}" --auth-root-authentication-method=socket --skip-test-db \
    >"$DIR/log/mariadb-install.out" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.out"
  # Socket only: no TCP port to clash with.
  launch mariadbd mariadbd "${opts[@]}" --socket="$DB_SOCK" --skip-networking --skip-log-bin \
    --pid-file="$DIR/mysql/mariadbd.pid" --log-error="$DIR/log/mariadbd.log"
  wait_until mariadbd "MariaDB" "${sql[@]}" -e 'SELECT 1'
  "${sql[@]}" -e "CREATE DATABASE slurm_acct_db;
    CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$password';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
}

launch_slurmdbd() { launch slurmdbd slurmdbd -D; wait_until slurmdbd "slurmdbd" sacctmgr -n list cluster; }
launch_slurmctld() {
  launch slurmctld slurmctld -D -i -f "$CONF"
  wait_until slurmctld "slurmctld" sh -c 'scontrol ping | grep -q UP'
}

launch_slurmd() {  # launch_slurmd K: node K's slurmd, not waiting for it
  local name; name=$(node_name "$1")
  if [ "$NUM_NODES" = 1 ]; then
    launch slurmd slurmd -D -N "$name" -f "$CONF"
  else
    # Inside the node's network namespace, with a hostname of its own. Not `ip netns exec`: it
    # remounts /sys, /sys/fs/cgroup disappears and slurmd fails ("Unable to initialize cgroup
    # plugin"). Jobs inherit both namespaces: `hostname` is the node's, eth0 its interface.
    mkdir -p "$DIR/spool/$name"
    # shellcheck disable=SC2016  # $1 and $2 are sh's
    launch "slurmd-$name" nsenter --net="/var/run/netns/$name" unshare --uts \
      sh -c 'hostname "$1" && exec slurmd -D -N "$1" -f "$2"' sh "$name" "$CONF"
  fi
}

start_slurm() {
  local k
  launch_slurmdbd
  # The cluster must exist in the database before slurmctld registers; adding it also creates
  # the root account and user, so root's jobs are accounted without further associations.
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
  launch_slurmctld
  for ((k = 1; k <= NUM_NODES; k++)); do launch_slurmd "$k"; done
  for ((k = 1; k <= NUM_NODES; k++)); do
    wait_until "$(slurmd_name "$(node_name "$k")")" "node $(node_name "$k") idle" node_ready "$(node_name "$k")"
  done
  wait_until slurmctld "cluster $CLUSTER registered in slurmdbd" cluster_registered
}

check_options() {
  [ -n "$CPUS" ] || CPUS=$([ "$NUM_NODES" = 1 ] && echo 8 || echo 2)
  [[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "CPUs per node must be a positive integer, not '$CPUS'"
  [[ -z $MBIT || $MBIT =~ ^[1-9][0-9]*$ ]] || die "--inter-node-mbit must be a positive integer, not '$MBIT'"
  [[ -z $LATENCY_MS || $LATENCY_MS =~ ^[0-9]+$ ]] || die "--inter-node-latency-ms must be an integer, not '$LATENCY_MS'"
  if [ "$NUM_NODES" = 1 ] && [ -n "$MBIT$LATENCY_MS" ]; then
    die "--inter-node-mbit and --inter-node-latency-ms shape links between nodes: they need --nodes 2 or more"
  fi
  # Unix sockets hold at most 107 bytes; the longest of ours is a slurmd step socket,
  # SPOOL/NODE_JOBID.STEPID (the batch step is 4294967291).
  if [ "$NUM_NODES" = 1 ]; then
    [ ${#DIR} -le 80 ] || die "state dir path too long for Unix sockets (${#DIR} > 80): $DIR"
  else
    local longest="$DIR/spool/${NODES[-1]}/${NODES[-1]}_9999999.4294967291"
    [ ${#longest} -le 107 ] || die "state dir path too long for Unix sockets ($longest: ${#longest} > 107 bytes)"
  fi
}

do_start() {
  if running slurmctld; then
    log "already running in $DIR; stop it first for a fresh cluster"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as their user; SlurmUser=root)"
  check_options
  do_install
  mkdir -p "$DIR" && chmod 755 "$DIR"
  local port closed
  closed=$(searchable_by_all "$DIR") \
    || die "$closed is not searchable by others (o+x), which munged requires above its socket; choose another STATE_DIR"
  do_stop >/dev/null  # leftovers of a half-started run, by their recorded PIDs and names
  for port in "$PORT" $((PORT + 1)) $((PORT + 2)); do
    port_free "$port" || die "port $port on 127.0.0.1 in use; choose another SLURM_LOCAL_PORT"
  done
  # Fresh state every time: old job ids would otherwise repeat in sacct.
  rm -rf "${DIR:?}"/{etc,state,spool,log,run,munge,mysql}
  mkdir -p "$DIR"/{etc,state,spool,log,run}
  local password; password=$(od -An -tx1 -N12 /dev/urandom | tr -d ' \n')
  write_cluster_env
  write_slurm_conf
  write_slurmdbd_conf "$password"
  # A failed start leaves no daemon, namespace, link or hosts line behind.
  trap 'do_stop >/dev/null 2>&1' EXIT
  [ "$NUM_NODES" = 1 ] || net_up
  start_munge
  start_mariadb "$password"
  start_slurm
  trap - EXIT
}

# ---------------------------------------------------------------------------------------- stop
do_stop() {
  local i jobs file
  if running slurmctld; then
    # End the jobs through Slurm, so no step daemon outlives slurmd.
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  for file in "$DIR"/run/slurmd*.pid; do  # ours, not the *.daemon.pid files slurmd writes
    [ -e "$file" ] && [[ $file != *.daemon.pid ]] && stop_daemon "$(basename "$file" .pid)"
  done
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do stop_daemon "${DAEMONS[i]}"; done
  net_down
}

do_status() {
  local name k ok=0
  for name in "${DAEMONS[@]}" $(for k in "${NODES[@]}"; do slurmd_name "$k"; done); do
    if running "$name"; then
      echo "$name: running (pid $(cut -d' ' -f1 "$DIR/run/$name.pid"))"
    else
      echo "$name: not running"; ok=1
    fi
  done
  if [ "$NUM_NODES" -gt 1 ]; then
    for name in "${NODES[@]}"; do
      link_exists "$name" || { echo "link $name: absent"; continue; }
      echo "link $name: $(ip -br link show dev "$name" | awk '{print $2}')" \
        "$(tc qdisc show dev "$name" | grep -oE '(tbf|netem) .*' || true)"
    done
  fi
  running slurmctld && sinfo -N -o '%N %T %c %o'
  return "$ok"
}

# -------------------------------------------------------------------------------------- faults
need_cluster() { running slurmctld || die "no cluster running in $DIR"; }

nodes_registered() {  # every node with a running slurmd is known again to a restarted slurmctld
  local node
  for node in "${NODES[@]}"; do
    running "$(slurmd_name "$node")" || continue
    sinfo -h -N -n "$node" -o %T | grep -q '^unknown' && return 1
  done
  return 0
}

do_restart() {  # the daemon again on the same state: running jobs keep running
  need_cluster
  case $1 in
    slurmctld)
      stop_daemon slurmctld
      launch_slurmctld
      # Nodes it recovers without a job are UNKNOWN until their slurmd registers again (~3 s).
      wait_until slurmctld "nodes registered with the restarted slurmctld" nodes_registered
      ;;
    slurmdbd) stop_daemon slurmdbd; launch_slurmdbd ;;
    *) die "restart knows slurmctld and slurmdbd, not '$1' (a slurmd: kill-slurmd, start-slurmd)" ;;
  esac
}

do_kill_slurmd() {  # a crashed slurmd: no goodbye to slurmctld, its job steps keep running
  need_cluster
  node_index "$1" >/dev/null
  local name; name=$(slurmd_name "$1")
  running "$name" || die "slurmd of $1 is not running"
  stop_daemon "$name" KILL
}

slurmd_registered() {  # slurmd_registered NODE SINCE: its slurmd registered at SINCE or later
  local started
  node_ready "$1" || return 1
  started=$(scontrol -o show node "$1" | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
  [ "$(date -d "$started" +%s 2>/dev/null || echo 0)" -ge "$2" ]
}

do_start_slurmd() {
  need_cluster
  local k since; k=$(node_index "$1")
  running "$(slurmd_name "$1")" && return 0
  since=$(date +%s)
  launch_slurmd "$k"
  wait_until "$(slurmd_name "$1")" "node $1 back" slurmd_registered "$1" "$since"
}

do_link() {
  [ "$NUM_NODES" -gt 1 ] || die "link needs a multi-node cluster: a single node talks over 127.0.0.1"
  node_index "$1" >/dev/null
  case $2 in
    up | down) ip link set dev "$1" "$2" ;;  # the bridge's end: the node sees NO-CARRIER
    *) die "link $1 up|down, not '$2'" ;;
  esac
}

do_scontrol_state() {  # do_scontrol_state NODE DRAIN|RESUME [REASON]
  need_cluster
  node_index "$1" >/dev/null
  if [ "$2" = RESUME ] && ! sinfo -h -N -n "$1" -o %T | grep -qE 'down|drain'; then
    return 0  # scontrol refuses to resume a node that is neither ("Invalid node state")
  fi
  local reason=()
  [ -z "${3:-}" ] || reason=(Reason="$3")
  scontrol update NodeName="$1" State="$2" "${reason[@]}"
}

case "$CMD" in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  restart) do_restart "${ARGS[0]}" ;;
  kill-slurmd) do_kill_slurmd "${ARGS[0]}" ;;
  start-slurmd) do_start_slurmd "${ARGS[0]}" ;;
  link) do_link "${ARGS[0]}" "${ARGS[1]}" ;;
  drain) do_scontrol_state "${ARGS[0]}" DRAIN "drained by slurm-local.sh" ;;
  resume) do_scontrol_state "${ARGS[0]}" RESUME ;;
esac
