#!/bin/bash
# Start or stop the tests' Grid Engine cell: Debian's gridengine packages, one host that is
# both master and execution host, a queue all.q with 4 slots, the parallel environment smp,
# a consumable gpu resource (2 per host, counted per job) and fast scheduling. Needs root.
#
#     bash tests/gridengine/cell.sh up      # prints the variables qsub needs
#     bash tests/gridengine/cell.sh down
#
# Daemons are stopped by the process ids in their pid files, never by name.
set -euo pipefail

export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
host=$(hostname)
common=$SGE_ROOT/$SGE_CELL/common
LOGS="/var/spool/gridengine/*/messages"
SECONDS=0
# shellcheck source=tests/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/../daemons.sh"

install_packages() {
    command -v qsub >/dev/null && [[ -f $common/bootstrap ]] && return
    echo "Installing gridengine-master, gridengine-exec, gridengine-client"
    debconf-set-selections <<EOF
gridengine-common shared/gridengineconfig boolean true
gridengine-common shared/gridenginecell string $SGE_CELL
gridengine-common shared/gridenginesqmaster string $host
gridengine-master shared/gridengineconfig boolean true
gridengine-client shared/gridengineconfig boolean true
gridengine-exec shared/gridengineconfig boolean true
EOF
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gridengine-master gridengine-exec gridengine-client >/dev/null
}

edit() {  # edit "qconf -mconf" SED-EXPRESSIONS...: change a configuration through qconf's editor
    local command=$1 editor
    shift
    editor=$(mktemp)
    # shellcheck disable=SC2016  # $1 belongs to the editor script
    printf '#!/bin/sh\nsed -i %s "$1"\n' "$(printf -- "-e '%s' " "$@")" > "$editor"
    chmod +x "$editor"
    EDITOR=$editor $command >/dev/null 2>&1
    rm -f "$editor"
}

up() {
    [[ $(id -u) -eq 0 ]] || die "needs root (it installs gridengine and starts sge_qmaster and sge_execd)"
    install_packages
    echo "$host" > "$common/act_qmaster"
    # This machine's name resolves to 127.0.0.1, whose name is localhost: the same host.
    echo "$host localhost" > "$common/host_aliases"
    /usr/sbin/sge_qmaster
    wait_for 60 "sge_qmaster start" qconf -sh

    qconf -sh | grep -qx "$host" || qconf -ah "$host" >/dev/null
    qconf -ss | grep -qx "$host" || qconf -as "$host" >/dev/null
    edit "qconf -mconf" "s/^min_uid .*/min_uid 0/" "s/^min_gid .*/min_gid 0/"
    # The machine that runs the tests is busy: no load thresholds or load adjustments, which
    # would hold jobs back ("cannot run in PE smp because it only offers 0 slots").
    edit "qconf -msconf" "s/^schedule_interval .*/schedule_interval 0:0:1/" \
        "s/^flush_submit_sec .*/flush_submit_sec 1/" "s/^flush_finish_sec .*/flush_finish_sec 1/" \
        "s/^job_load_adjustments .*/job_load_adjustments NONE/"
    if ! qconf -sc | grep -q "^gpu "; then  # GPUs: a consumable counted per job, not per slot
        { qconf -sc; echo "gpu gpu INT <= YES JOB 0 0"; } > /tmp/gridengine-complex.$$
        qconf -Mc /tmp/gridengine-complex.$$ >/dev/null
        rm -f /tmp/gridengine-complex.$$
    fi
    if ! qconf -sel 2>/dev/null | grep -qx "$host"; then
        printf 'hostname %s\nload_scaling NONE\ncomplex_values gpu=2\nuser_lists NONE\nxuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\nreport_variables NONE\n' "$host" > /tmp/gridengine-host.$$
        qconf -Ae /tmp/gridengine-host.$$ >/dev/null
        rm -f /tmp/gridengine-host.$$
    fi
    if ! qconf -spl 2>/dev/null | grep -qx smp; then
        # shellcheck disable=SC2016  # $pe_slots is Grid Engine's keyword
        printf 'pe_name smp\nslots 4\nuser_lists NONE\nxuser_lists NONE\nstart_proc_args NONE\nstop_proc_args NONE\nallocation_rule $pe_slots\ncontrol_slaves FALSE\njob_is_first_task TRUE\nurgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n' > /tmp/gridengine-pe.$$
        qconf -Ap /tmp/gridengine-pe.$$ >/dev/null
        rm -f /tmp/gridengine-pe.$$
    fi
    if ! qconf -sql 2>/dev/null | grep -qx all.q; then
        edit "qconf -aq" "s/^qname .*/qname all.q/" "s/^hostlist .*/hostlist $host/" \
            "s/^slots .*/slots 4/" "s/^pe_list .*/pe_list smp/"
        # shell and shell_start_mode stay as Grid Engine installs them (posix_compliant: the
        # queue's shell runs the script, not its #! line), so the tests see what readers see.
    fi
    qconf -rattr queue load_thresholds NONE all.q >/dev/null
    /usr/sbin/sge_execd
    wait_for 120 "the execution host reporting" bash -c "qstat -f | grep -q 'all.q@.*lx-amd64 *$'"
    echo "Grid Engine cell up in ${SECONDS} s: queue all.q on $host (4 slots, PE smp, gpu=2)"
    echo "export SGE_ROOT=$SGE_ROOT SGE_CELL=$SGE_CELL"
}

down() {
    if [[ -f /var/spool/gridengine/qmaster/qmaster.pid ]]; then
        qdel -u root >/dev/null 2>&1 || true
    fi
    for pid_file in /var/spool/gridengine/execd/*/execd.pid; do stop_pid_file "$pid_file"; done
    stop_pid_file /var/spool/gridengine/qmaster/qmaster.pid
    echo "Grid Engine cell stopped in ${SECONDS} s"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) die "usage: $0 up|down" ;;
esac
