#!/bin/bash
# Start or stop the tests' OpenPBS complex: OpenPBS built by tests/pbs/build.sh (cached), one
# host running the server, the scheduler, the communication daemon, the PostgreSQL data service
# and two MoMs, so that the complex has two nodes, pbs-n1 and pbs-n2, each with 16 ncpus, 256 GB
# and 2 ngpus (a consumable the scheduler counts), a default queue workq, fast scheduling and job
# history (qstat -x). The node sizes are what jobs may ask for, as on a GPU node, not what this
# machine has: the job scripts keep their readers' sizes. Needs root.
#
#     bash tests/pbs/complex.sh up      # prints the variables the clients need
#     bash tests/pbs/complex.sh down
#
# PBS refuses loopback addresses (127.x) for its hosts, and the two MoMs need a host each: the
# nodes get two addresses of the benchmarking range 198.18.0.0/15 on the loopback interface,
# reachable from this machine only, and names in /etc/hosts. The complex's own pbs.conf (not
# /etc/pbs.conf: a machine with a real PBS keeps it) is named by PBS_CONF_FILE, which every job
# gets too (pbs_environment). Daemons are stopped by the process ids in their lock files.
#
# Ports: PBS's defaults (15001-15007, the MoMs', the comm's 17001) lie in 15000-29999, where the
# rendezvous ports of the Slurm and PBS jobs that the tests run beside this complex lie (15000 or
# 20000 + job id % 10000), and 7000-9000 has the tests' Slurm daemons, 6444-6445 Grid Engine's:
# its ports are 11001-11013 and 13001 instead, below 32768, where Linux starts picking ports
# for connections.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOME1=/var/spool/pbs-tests        # server, scheduler, comm, data service, MoM of pbs-n1
HOME2=/var/spool/pbs-tests-n2     # MoM of pbs-n2
CONF1=$HOME1.conf CONF2=$HOME2.conf
NODES=("198.18.0.1 pbs-n1" "198.18.0.2 pbs-n2")
MARK="# pytorch-on-hpc: the tests' PBS complex"
LOGS="$HOME1/*_logs/ $HOME2/mom_logs/"
SECONDS=0
# shellcheck source=tests/daemons.sh
source "$here/../daemons.sh"

addresses() {
    local present
    present=$(ip -4 -o addr show dev lo)  # not piped into grep -q: SIGPIPE under pipefail
    for node in "${NODES[@]}"; do
        read -r address name <<<"$node"
        [[ $present == *" $address/"* ]] || ip addr add "$address/32" dev lo \
            || die "cannot add $address to the loopback interface (needs CAP_NET_ADMIN)"
        grep -q "^$address $name " /etc/hosts || echo "$address $name $MARK" >> /etc/hosts
    done
}

SERVER_PORT=11001 DATA_PORT=11007 COMM=pbs-n1:13001
MOM1_PORT=11002 MOM2_PORT=11012  # each MoM's manager port is the next one

conf() {  # conf FILE HOME NODE MOM_PORT SERVER_DAEMONS(0|1)
    cat > "$1" <<CONF
$MARK
PBS_EXEC=$PBS_EXEC
PBS_SERVER=pbs-n1
PBS_BATCH_SERVICE_PORT=$SERVER_PORT
PBS_BATCH_SERVICE_PORT_DIS=$SERVER_PORT
PBS_DATA_SERVICE_PORT=$DATA_PORT
PBS_COMM_NAME=$COMM
PBS_LEAF_ROUTERS=$COMM
PBS_HOME=$2
PBS_START_SERVER=$5
PBS_START_SCHED=$5
PBS_START_COMM=$5
PBS_START_MOM=1
PBS_MOM_NODE_NAME=$3
PBS_LEAF_NAME=$3
PBS_MOM_SERVICE_PORT=$4
PBS_MANAGER_SERVICE_PORT=$(($4 + 1))
PBS_CORE_LIMIT=unlimited
PBS_SCP=/usr/bin/scp
CONF
}

qmgr_() { for command in "$@"; do PBS_CONF_FILE=$CONF1 "$PBS_EXEC/bin/qmgr" -c "$command" >/dev/null; done; }

up() {
    [[ $(id -u) -eq 0 ]] || die "needs root (it builds OpenPBS and starts its daemons)"
    PBS_EXEC=$(bash "$here/build.sh")
    addresses
    down >/dev/null 2>&1 || true
    rm -rf "$HOME1" "$HOME2"
    mkdir -p "$HOME1"
    conf "$CONF1" "$HOME1" pbs-n1 "$MOM1_PORT" 1
    conf "$CONF2" "$HOME2" pbs-n2 "$MOM2_PORT" 0
    # PBS_HOME, the server's database and its first start; the output is the installer's.
    PBS_CONF_FILE=$CONF1 "$PBS_EXEC/libexec/pbs_habitat" > "$HOME1.habitat.log" 2>&1 \
        || die "pbs_habitat failed (log: $HOME1.habitat.log)"
    [[ -d $HOME1/server_priv && -d $HOME1/mom_priv ]] || die "pbs_habitat made no PBS_HOME (log: $HOME1.habitat.log)"
    # The second MoM's PBS_HOME: the first's MoM part, without its state.
    mkdir -p "$HOME2"
    cp -a "$HOME1"/{mom_priv,aux,spool,undelivered,checkpoint,pbs_environment,pbs_version} "$HOME2/"
    mkdir -p "$HOME2/mom_logs"
    rm -f "$HOME2"/mom_priv/mom.lock "$HOME2"/mom_priv/jobs/*
    for home in "$HOME1" "$HOME2"; do
        # Output files are copied with cp (all hosts are this machine), not scp.
        echo "\$usecp *:/ /" >> "$home/mom_priv/config"
        # Each MoM accepts the other's connections from the start, rather than once the server
        # has sent it the nodes' addresses: in one run it never did, pbs-n1's MoM refused
        # pbs-n2's ("im_request, bad connect from 198.18.0.2", JOIN_JOB error 15059) and every
        # two-node job was held after too many failed starts.
        printf "\$clienthost %s\n" pbs-n1 pbs-n2 >> "$home/mom_priv/config"
        echo "PBS_CONF_FILE=$CONF1" >> "$home/pbs_environment"
    done
    # Jobs run in a login shell, whose PATH gets PBS's commands from /etc/profile.d/pbs.sh
    # (installed by OpenPBS): there, first, as on a PBS site, not after Grid Engine's qstat and
    # qsub in /usr/bin (the Grid Engine tests' cell is installed here too).
    if [[ -f /etc/profile.d/pbs.sh ]]; then
        # shellcheck disable=SC2016  # the variables are pbs.sh's own
        sed -i 's|export PATH="${PATH}:${__PBS_EXEC}/bin"|export PATH="${__PBS_EXEC}/bin:${PATH}"|' \
            /etc/profile.d/pbs.sh
    fi
    # ngpus is a consumable only once the scheduler counts it.
    sed -i 's/^resources: "\(.*\)"$/resources: "\1, ngpus"/' "$HOME1/sched_priv/sched_config"
    PBS_CONF_FILE=$CONF1 "$PBS_EXEC/libexec/pbs_init.d" start > "$HOME1.start.log" 2>&1 \
        || die "pbs_init.d start failed (log: $HOME1.start.log)"
    PBS_CONF_FILE=$CONF2 "$PBS_EXEC/sbin/pbs_mom" || die "the MoM of pbs-n2 did not start (logs: $HOME2/mom_logs/)"
    wait_for 60 "the server answering" env PBS_CONF_FILE="$CONF1" "$PBS_EXEC/bin/qstat" -B
    qmgr_ "set server acl_roots = root" "set server flatuid = True" \
        "set server scheduler_iteration = 1" "set server job_history_enable = True" \
        "set server job_history_duration = 01:00:00" "set server resources_default.walltime = 00:10:00" \
        "create resource ngpus type=long, flag=nh"
    # pbs_habitat named the first node after the machine; the complex's nodes are pbs-n1, pbs-n2.
    PBS_CONF_FILE=$CONF1 "$PBS_EXEC/bin/qmgr" -c "list node @default" 2>/dev/null \
        | awk '/^Node / && $2 !~ /^pbs-n[12]$/ {print $2}' | while read -r node; do
            qmgr_ "delete node $node"; done
    for node in "pbs-n1:$MOM1_PORT" "pbs-n2:$MOM2_PORT"; do
        PBS_CONF_FILE=$CONF1 "$PBS_EXEC/bin/pbsnodes" "${node%:*}" >/dev/null 2>&1 \
            || qmgr_ "create node ${node%:*} port=${node#*:}"
        qmgr_ "set node ${node%:*} resources_available.ncpus = 16" \
              "set node ${node%:*} resources_available.mem = 256gb" \
              "set node ${node%:*} resources_available.ngpus = 2"
    done
    wait_for 60 "both nodes free" bash -c \
        "[[ \$(PBS_CONF_FILE=$CONF1 $PBS_EXEC/bin/pbsnodes -a | grep -c 'state = free') == 2 ]]"
    echo "OpenPBS complex up in ${SECONDS} s: nodes pbs-n1, pbs-n2 (16 ncpus, 256 GB, 2 ngpus each), queue workq"
    echo "export PBS_CONF_FILE=$CONF1 PBS_EXEC=$PBS_EXEC"
}

down() {
    local exec
    exec=$(sed -n 's/^PBS_EXEC=//p' "$CONF1" 2>/dev/null || true)
    if [[ -n $exec && -x $exec/bin/qdel ]]; then
        PBS_CONF_FILE=$CONF1 timeout 10 "$exec/bin/qdel" -W force "$(PBS_CONF_FILE=$CONF1 timeout 10 \
            "$exec/bin/qselect" 2>/dev/null)" >/dev/null 2>&1 || true
        PBS_CONF_FILE=$CONF1 timeout 60 "$exec/libexec/pbs_init.d" stop >/dev/null 2>&1 || true
    fi
    # What is still running (a MoM, the second's always): by the pids in their lock files.
    for lock in "$HOME2/mom_priv/mom.lock" "$HOME1/mom_priv/mom.lock" "$HOME1/sched_priv/sched.lock" \
                "$HOME1/server_priv/server.lock" "$HOME1/server_priv/comm.lock"; do
        [[ -f $lock ]] && head -c 20 "$lock" | tr -dc 0-9 > "$lock.pid" && stop_pid_file "$lock.pid"
    done
    echo "OpenPBS complex stopped in ${SECONDS} s"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) die "usage: $0 up|down" ;;
esac
