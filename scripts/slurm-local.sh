#!/usr/bin/env bash
# A real single-node Slurm cluster with accounting (slurmdbd + MariaDB, so `sacct` works), for the
# tests and for local use. Everything lives in one state directory; nothing under /etc is touched.
#
#   bash scripts/slurm-local.sh install|start|stop|status|env [STATE_DIR]
#   eval "$(bash scripts/slurm-local.sh env)"      # SLURM_CONF for sbatch, srun, squeue, sacct, ...
#
# STATE_DIR: the argument, else $SLURM_LOCAL_DIR, else ${TMPDIR:-/tmp}/parallel-tuner-slurm.
# Knobs (environment): SLURM_LOCAL_PORT (slurmctld; slurmd +1, slurmdbd +2, default 26817),
# SLURM_LOCAL_CPUS (CPUs advertised, default 8), SLURM_LOCAL_TIMEOUT (s per readiness wait, 60).
# Needs root: slurmd launches jobs as their user and SlurmUser=root. See docs/slurm.md.
set -euo pipefail

CMD=${1:-}
DIR=${2:-${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/parallel-tuner-slurm}}
[[ $DIR == /* ]] || DIR=$PWD/$DIR  # slurm.conf needs absolute paths
PORT=${SLURM_LOCAL_PORT:-26817}
CPUS=${SLURM_LOCAL_CPUS:-8}
TIMEOUT_S=${SLURM_LOCAL_TIMEOUT:-60}
CLUSTER=local
NODE=$(hostname -s)
CONF=$DIR/etc/slurm.conf
MUNGE_SOCK=$DIR/munge/run/munge.sock
DB_SOCK=$DIR/mysql/mysqld.sock
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)  # start order; stop is the reverse

export PATH=$PATH:/usr/sbin:/sbin SLURM_CONF=$CONF
# libmariadb takes its default socket from here: slurmdbd reaches MariaDB without a TCP port.
export MYSQL_UNIX_PORT=$DB_SOCK

log() { echo "slurm-local: $*" >&2; }
die() { log "$*"; exit 1; }

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
  # fork again and $! is the daemon itself.
  setsid "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
  local pid=$!
  echo "$pid $(start_time "$pid")" >"$DIR/run/$name.pid"
}

stop_daemon() {  # stop_daemon NAME: SIGTERM, wait until gone, SIGKILL after 20 s
  local name=$1 pid i
  if running "$name"; then
    read -r pid _ <"$DIR/run/$name.pid"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do running "$name" || break; sleep 0.2; done
    if running "$name"; then
      log "$name ($pid) ignored SIGTERM for 20 s; sending SIGKILL"
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

# -------------------------------------------------------------------------------------- config
# 95 % of MemTotal, a little below what slurmd detects, as on a real node.
real_memory_mb() { awk '/^MemTotal:/ { print int($2 / 1024 * 0.95) }' /proc/meminfo; }

write_slurm_conf() {
  cat >"$CONF" <<EOF
# Written by scripts/slurm-local.sh; rewritten on every start.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$DIR/run/slurmd.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
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
# Advertise CPUs=$CPUS whatever the machine has, so that layouts of up to $CPUS ranks fit.
SlurmdParameters=config_overrides
# A node set DOWN (e.g. by a failure test) comes back when its slurmd registers again.
ReturnToService=2
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
# RealMemory: without it the node has 1 MB and any --mem request is refused.
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
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

# --------------------------------------------------------------------------------------- start
node_ready() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)$'; }
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

start_slurm() {
  launch slurmdbd slurmdbd -D
  wait_until slurmdbd "slurmdbd" sacctmgr -n list cluster
  # The cluster must exist in the database before slurmctld registers; adding it also creates
  # the root account and user, so root's jobs are accounted without further associations.
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
  launch slurmctld slurmctld -D -i -f "$CONF"
  wait_until slurmctld "slurmctld" sh -c 'scontrol ping | grep -q UP'
  launch slurmd slurmd -D -N "$NODE" -f "$CONF"
  wait_until slurmd "node $NODE idle" node_ready
  wait_until slurmctld "cluster $CLUSTER registered in slurmdbd" cluster_registered
}

do_start() {
  if running slurmctld; then
    log "already running in $DIR; stop it first for a fresh cluster"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as their user; SlurmUser=root)"
  do_install
  # Unix sockets hold at most 107 bytes; the longest of ours is the slurmd step socket.
  [ ${#DIR} -le 80 ] || die "state dir path too long for Unix sockets (${#DIR} > 80): $DIR"
  mkdir -p "$DIR" && chmod 755 "$DIR"
  local port closed
  closed=$(searchable_by_all "$DIR") \
    || die "$closed is not searchable by others (o+x), which munged requires above its socket; choose another STATE_DIR"
  do_stop >/dev/null  # leftovers of a half-started run, by their recorded PIDs
  for port in "$PORT" $((PORT + 1)) $((PORT + 2)); do
    port_free "$port" || die "port $port on 127.0.0.1 in use; choose another SLURM_LOCAL_PORT"
  done
  # Fresh state every time: old job ids would otherwise repeat in sacct.
  rm -rf "${DIR:?}"/{etc,state,spool,log,run,munge,mysql}
  mkdir -p "$DIR"/{etc,state,spool,log,run}
  local password; password=$(od -An -tx1 -N12 /dev/urandom | tr -d ' \n')
  write_slurm_conf
  write_slurmdbd_conf "$password"
  # A failed start leaves no daemon behind.
  trap 'do_stop >/dev/null 2>&1' EXIT
  start_munge
  start_mariadb "$password"
  start_slurm
  trap - EXIT
}

# ---------------------------------------------------------------------------------------- stop
do_stop() {
  local i jobs
  if running slurmctld; then
    # End the jobs through Slurm, so no step daemon outlives slurmd.
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do stop_daemon "${DAEMONS[i]}"; done
}

do_status() {
  local name ok=0
  for name in "${DAEMONS[@]}"; do
    if running "$name"; then
      echo "$name: running (pid $(cut -d' ' -f1 "$DIR/run/$name.pid"))"
    else
      echo "$name: not running"; ok=1
    fi
  done
  [ "$ok" = 0 ] && sinfo -N -o '%N %T %c CPUs' && return 0
  return 1
}

case "$CMD" in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|status|env [STATE_DIR]" >&2; exit 2 ;;
esac
