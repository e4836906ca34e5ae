# shellcheck shell=bash
# /etc/profile.d/modules.sh of the tests' emulated site (installed by
# tests/install-system-packages.sh when missing): defines the module command (Lmod) in shells
# that read no login files, such as Grid Engine batch jobs.
# shellcheck source=/dev/null
. /usr/share/lmod/lmod/init/bash
