# shellcheck shell=bash
# Functions shared by tests/slurm/cluster.sh and tests/gridengine/cell.sh (they source it).
# LOGS names where to look when a daemon does not come up.

die() { echo "$(basename "$0"): error: $*" >&2; exit 1; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: run COMMAND until it succeeds
    local limit=$1 what=$2
    shift 2
    for _ in $(seq $((limit * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    die "$what did not happen within ${limit} s (logs: ${LOGS:-none})"
}

stop_pid_file() {  # TERM the process in a pid file, wait up to 10 s, KILL it if still there
    local file=$1 pid
    [[ -f "$file" ]] || return 0
    pid=$(cat "$file")
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    fi
    rm -f "$file"
}
