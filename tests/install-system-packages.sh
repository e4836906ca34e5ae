#!/bin/bash
# Install the system tools the tests use (Debian/Ubuntu, as root): gettext (msgfmt),
# ShellCheck, Lmod (environment modules for the job scripts) and the site file that defines
# `module` in batch jobs (/etc/profile.d/modules.sh), Node.js (search index and workflow
# linting, the browser tests' driver), g++ and cmake (Horovod, LibTorch, DeepSpeed's ops), ccache
# (the tests compile the LibTorch example once per run, not in every test that builds it), libaio
# (DeepSpeed's NVMe offload), Chromium (the browser tests, tests/node/browser.mjs), the fonts
# the browser tests render with (Liberation Sans, metric-compatible with the Arial/Helvetica of
# Furo's font stack; Noto Sans CJK for Chinese and Japanese; DejaVu Sans, the wide font of the
# word-break check) with fontconfig's fc-match, which the tests ask which fonts they get, and
# hunspell with its French dictionary (the French spell check). Does nothing when all are present.
# Without root it lists what is missing; the tests that need it then skip, saying why (the
# browser tests fail instead when the fonts are missing: they would judge other fonts). The
# Slurm and Grid Engine daemons are installed by tests/slurm/cluster.sh and
# tests/gridengine/cell.sh when the tests start them.
set -euo pipefail
need=()
command -v msgfmt >/dev/null || need+=(gettext)
command -v shellcheck >/dev/null || need+=(shellcheck)
[[ -f /usr/share/lmod/lmod/init/bash ]] || need+=(lmod)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v ccache >/dev/null || need+=(ccache)
[[ -f /usr/include/libaio.h ]] || need+=(libaio-dev)
command -v chromium >/dev/null || need+=(chromium)
command -v fc-match >/dev/null || need+=(fontconfig)
# A font is present when fontconfig lists it (fc-list -q fails when no font matches).
has_font() { fc-list -q "$1" 2>/dev/null; }
has_font 'Liberation Sans' || need+=(fonts-liberation2)
has_font 'Noto Sans CJK JP' || need+=(fonts-noto-cjk)
has_font 'DejaVu Sans' || need+=(fonts-dejavu-core)
command -v hunspell >/dev/null || need+=(hunspell)
[[ -f /usr/share/hunspell/fr_FR.dic || -f /usr/share/hunspell/fr.dic ]] || need+=(hunspell-fr)
site_modules=/etc/profile.d/modules.sh
install_site_modules() {
    if [[ ! -f $site_modules && $(id -u) -eq 0 ]]; then
        cp "$(dirname "${BASH_SOURCE[0]}")/site/modules.sh" "$site_modules"
        echo "Installed $site_modules (defines module in batch jobs)"
    fi
}
if [[ ${#need[@]} -eq 0 ]]; then
    install_site_modules
    echo "System packages: all present."
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "System packages missing (install them, as root: apt-get install ${need[*]});" \
         "the tests that need them will be skipped." >&2
    exit 0
fi
echo "Installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
install_site_modules
