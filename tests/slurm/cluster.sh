#!/bin/bash
# Start or stop the tests' Slurm cluster: munge, slurmctld and two slurmd (nodes n1 and n2),
# all on this machine, with their state in one run folder. Needs root (it installs Debian's
# packages when missing and starts the daemons).
#
#     bash tests/slurm/cluster.sh up   [RUN_DIR]   # prints: export SLURM_CONF=RUN_DIR/etc/slurm.conf
#     bash tests/slurm/cluster.sh down [RUN_DIR]
#
# Ports: SLURM_TEST_PORT (default 16817) for slurmctld, the next two for the nodes.
# Daemons are stopped by the process ids in their pid files, never by name.
set -euo pipefail

action=${1:-}
run=${2:-/tmp/pytorch-on-hpc-slurm}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
port=${SLURM_TEST_PORT:-16817}
export SLURM_CONF="$run/etc/slurm.conf"
LOGS="$run/log/"
SECONDS=0
# shellcheck source=tests/daemons.sh
source "$here/../daemons.sh"

install_packages() {
    local need=()
    for cmd in slurmctld slurmd sbatch munged; do
        command -v "$cmd" >/dev/null || need=(slurmctld slurmd slurm-client munge)
    done
    [[ ${#need[@]} -eq 0 ]] && return
    echo "Installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
}

nodes_idle() { [[ $(sinfo -h -N -o '%t' | sort -u | tr -d '\n') == idle ]]; }

up() {
    [[ $(id -u) -eq 0 ]] || die "needs root (it starts munged, slurmctld and slurmd)"
    install_packages
    [[ -f "$run/slurmctld.pid" ]] && die "a cluster already runs in $run: run '$0 down $run' first"
    mkdir -p "$run"/{etc,state,spool/n1,spool/n2,log,munge}

    # munge: a fresh key and a socket of our own, owned by the munge user.
    chown munge: "$run/munge"
    chmod 755 "$run/munge"
    runuser -u munge -- mungekey --create --keyfile "$run/munge/munge.key" --force
    runuser -u munge -- munged --socket "$run/munge/munge.socket" --key-file "$run/munge/munge.key" \
        --pid-file "$run/munge/munged.pid" --log-file "$run/munge/munged.log" \
        --seed-file "$run/munge/munged.seed"
    cp "$run/munge/munged.pid" "$run/munged.pid"
    wait_for 30 "munge" bash -c "munge -n -S '$run/munge/munge.socket' | unmunge -S '$run/munge/munge.socket'"

    # Node names resolve on a real cluster (jobs use them as MASTER_ADDR): here both are this machine.
    grep -qE '^127\.0\.0\.1[[:space:]].*\bn1 n2\b' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts

    sed -e "s|@RUN@|$run|g" -e "s|@CTLD_PORT@|$port|g" \
        -e "s|@N1_PORT@|$((port + 1))|g" -e "s|@N2_PORT@|$((port + 2))|g" \
        "$here/slurm.conf.in" > "$run/etc/slurm.conf"
    cp "$here/gres.conf" "$run/etc/gres.conf"
    sed -e "s|@RUN@|$run|g" "$here/task_prolog.sh" > "$run/etc/task_prolog.sh"
    chmod 755 "$run/etc/task_prolog.sh"
    : > "$run/log/steps.log"
    chmod 666 "$run/log/steps.log"

    slurmctld -c
    wait_for 30 "slurmctld start" scontrol ping
    slurmd -N n1
    slurmd -N n2
    wait_for 60 "both nodes idle" nodes_idle
    echo "Slurm cluster up in ${SECONDS} s: nodes n1 and n2 (16 CPUs, 64 GB, 2 GPUs each)"
    echo "export SLURM_CONF=$SLURM_CONF"
}

down() {
    if [[ -f "$run/slurmctld.pid" ]]; then
        scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pid_file "$run/slurmd-n1.pid"
    stop_pid_file "$run/slurmd-n2.pid"
    stop_pid_file "$run/slurmctld.pid"
    stop_pid_file "$run/munged.pid"
    rm -f "$run/munge/munged.pid"
    echo "Slurm cluster in $run stopped in ${SECONDS} s"
}

case "$action" in
    up) up ;;
    down) down ;;
    *) die "usage: $0 up|down [RUN_DIR]" ;;
esac
