#!/bin/bash
# Start a single-node SLURM cluster (munged + slurmctld + slurmd) without systemd, for the tests
# (tests/slurm_cluster.py); Debian's slurm-wlm and munge are installed with apt-get when missing.
# From the measured recipe ../shared/reference/slurm-local (its README lists the pitfalls these lines avoid).
# Run as root. If our slurmctld is already running it just waits for the node.
# Env: SLURM_LOCAL_STATE (default /tmp/megarl-slurm/state), KEEP_STATE=1 to keep old job state,
#      SLURM_WAIT_S (default 60) how long to wait for the node to become idle,
#      SLURM_PROBE=0 to skip the probe job.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
TEMPLATE="${SLURM_CONF_TEMPLATE:-$HERE/slurm.conf.template}"
CONF=/etc/slurm/slurm.conf          # default path compiled into Debian's slurm; no SLURM_CONF needed
WAIT_S="${SLURM_WAIT_S:-60}"

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

# 1. packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurm-wlm + munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# already up?
RUNNING=0
if alive "$(pid_of "$STATE/slurmctld.pid")" slurmctld && alive "$(pid_of "$STATE/slurmd.pid")" slurmd; then
  log "slurmctld/slurmd already running (state $STATE)"; RUNNING=1
else
  if alive "$(pid_of "$STATE/slurmctld.pid")" slurmctld || alive "$(pid_of "$STATE/slurmd.pid")" slurmd; then
    log "cluster only partly running; stopping it first"; "$HERE/stop.sh"
  fi
  # 2. munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown -R munge:munge /etc/munge; chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
  mkdir -p "$STATE"
  # (check the pid first: with a stale socket, the munge client retries for ~2 s before failing)
  if alive "$(pid_of /run/munge/munged.pid)" munged && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running and working; reusing it"
  else
    # stale pid/socket from an unclean stop would make munged refuse to start
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged
    touch "$STATE/.munged-started-by-us"   # stop.sh only kills munged if we started it
    for i in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || { log "munged does not work"; tail /var/log/munge/munged.log; exit 1; }
  fi

  # 3. config
  HOST="$(hostname -s)"
  HW="$(slurmd -C | head -1)"          # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
  get() { echo "$HW" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
  CPUS=$(get CPUs); SOCKETS=$(get SocketsPerBoard); CORES=$(get CoresPerSocket); THREADS=$(get ThreadsPerCore)
  REALMEM=$(( $(get RealMemory) * 95 / 100 ))
  getent hosts "$HOST" >/dev/null || log "WARNING: '$HOST' does not resolve; jobs using it as MASTER_ADDR will fail (add it to /etc/hosts)"
  if [ "${KEEP_STATE:-0}" != 1 ]; then
    left=$(stray_stepds)   # after an unclean stop (daemons SIGKILLed) old job steps may still run
    if [ -n "$left" ]; then log "killing stray slurmstepd from a previous run: $left"; for p in $left; do kill_tree "$p"; done; fi
    rm -rf "$STATE/ctld" "$STATE/slurmd" "$STATE/log"; fi
  mkdir -p "$STATE/ctld" "$STATE/slurmd" "$STATE/log"
  mkdir -p /etc/slurm
  sed -e '/^#   @/d' -e '/^# Placeholders/d' -e "s|@HOST@|$HOST|g" -e "s|@ADDR@|127.0.0.1|g" -e "s|@CPUS@|$CPUS|g" -e "s|@SOCKETS@|$SOCKETS|g" \
      -e "s|@CORES@|$CORES|g" -e "s|@THREADS@|$THREADS|g" -e "s|@REALMEM@|$REALMEM|g" -e "s|@STATE@|$STATE|g" \
      "$TEMPLATE" > "$CONF"
  cp "$CONF" "$STATE/slurm.conf"

  # 4. daemons (daemon mode: they fork and write the pid files named in slurm.conf)
  alive "$(pid_of "$STATE/slurmctld.pid")" slurmctld || slurmctld
  for i in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
  alive "$(pid_of "$STATE/slurmd.pid")" slurmd || slurmd
fi

# 5. wait for the node
HOST="$(hostname -s)"
deadline=$(( $(date +%s) + WAIT_S ))
# (a cluster that was already running may be busy with jobs: then any working state will do)
until case "$(sinfo -h -n "$HOST" -o %T 2>/dev/null)" in idle) true;; mixed|allocated) [ "$RUNNING" = 1 ];; *) false;; esac; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    log "node $HOST not idle after ${WAIT_S}s: $(sinfo -h -N -o '%N %T %E' 2>&1)"
    tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
    exit 1
  fi
  sleep 0.2
done
# 6. probe: one batch job that also launches a step. Verifies munge creds, batch launch, srun I/O.
#    Also absorbs the ~3 s after slurmctld start before its first batch scheduling pass.
if [ "${SLURM_PROBE:-1}" = 1 ] && [ "$RUNNING" = 0 ]; then
  pj=$(sbatch --parsable -J slurm-local-probe -o "$STATE/log/probe.out" --wrap 'srun -n1 true && echo probe-ok')
  until ! squeue -h -j "$pj" 2>/dev/null | grep -q .; do
    [ "$(date +%s)" -lt "$deadline" ] || { log "probe job $pj did not finish"; squeue >&2; exit 1; }; sleep 0.1; done
  grep -q probe-ok "$STATE/log/probe.out" 2>/dev/null || { log "probe job $pj failed:"; cat "$STATE/log/probe.out" >&2; scontrol show job "$pj" >&2; exit 1; }
fi
log "up: $(sinfo -h -o '%P %a %D %T %N' | tr '\n' ' ')(slurmctld $(pid_of "$STATE/slurmctld.pid"), slurmd $(pid_of "$STATE/slurmd.pid"), munged $(pid_of /run/munge/munged.pid); logs in $STATE/log)"
