# Shared by start.sh and stop.sh (sourced): the state folder and process helpers.
STATE="${SLURM_LOCAL_STATE:-/tmp/megarl-slurm/state}"
log() { echo "[slurm-local] $*" >&2; }
alive() { [ -n "${1:-}" ] && [ "$(cat /proc/$1/comm 2>/dev/null)" = "$2" ] && ! grep -q '^State:[[:space:]]*Z' /proc/$1/status 2>/dev/null; }  # running, right name, not a zombie
pid_of() { cat "$1" 2>/dev/null || true; }
# kill a process and all its descendants (by PID, children first); used for orphaned slurmstepd of our cluster
kill_tree() { local c; for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$c"; done; kill -KILL "$1" 2>/dev/null || true; }
stray_stepds() { ps -eo pid=,stat=,comm= | awk '$3=="slurmstepd" && $2 !~ /^Z/ {print $1}' | paste -sd' '; }
