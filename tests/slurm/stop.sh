#!/bin/bash
# Stop the single-node SLURM cluster started by start.sh: cancel jobs, then slurmd, slurmctld, munged (if
# start.sh started it) -- all by PID from their pid files.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
stop_pid() {  # pidfile comm
  local pid; pid="$(pid_of "$1")"
  if ! alive "$pid" "$2"; then log "$2 not running"; return 0; fi
  kill -TERM "$pid"
  for i in $(seq 150); do alive "$pid" "$2" || { log "$2 ($pid) stopped"; return 0; }; sleep 0.1; done
  log "$2 ($pid) did not stop after 15s; SIGKILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.2
}

# 1. cancel all jobs and wait for them to leave the queue
if alive "$(pid_of "$STATE/slurmctld.pid")" slurmctld; then
  for p in $(sinfo -h -o %R 2>/dev/null); do scancel --partition="$p" 2>/dev/null; done
  for i in $(seq 400); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  [ -z "$(squeue -h -o %i 2>/dev/null)" ] || log "jobs still listed after 40s: $(squeue -h -o '%i %T' | tr '\n' ' ')"
fi

# 2. daemons, in this order
stop_pid "$STATE/slurmd.pid" slurmd
stop_pid "$STATE/slurmctld.pid" slurmctld
if [ -e "$STATE/.munged-started-by-us" ]; then
  stop_pid /run/munge/munged.pid munged
  rm -f "$STATE/.munged-started-by-us"
else
  log "munged was not started by start.sh; leaving it"
fi

# 3. leftover job step daemons (children of our slurmd) would keep job processes alive
#    (zombies are skipped: here PID 1 reaps orphans lazily, so finished stepds linger as <defunct> for ~1 s)
left=$(stray_stepds)
if [ -n "$left" ]; then log "leftover slurmstepd pids: $left; killing them and their job processes"; for p in $left; do kill_tree "$p"; done; fi
exit 0
