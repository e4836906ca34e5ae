# PyTorch on HPC: the front door. `make help` lists the targets.
#
#   make html                              build English into _build/html/en/
#   make html SPHINXOPTS=-Dlanguage=fr     build French into _build/html/fr/
#   make html-all                          all four languages in one site, _build/html/
#   make test                              the whole CPU test suite
#   make html-all SITE=site.toml           a centre's edition (edition/template.toml)
#   make site-check SITE=site.toml         verify it on the centre's cluster (login node)

LANGUAGES    := en zh_CN ja fr
TRANSLATIONS := zh_CN ja fr
PYTHON_BASE  ?= python3
VENV         ?= .venv
VPY          := $(VENV)/bin/python
SPHINXOPTS   ?=
JOBS         ?= auto
STRICT       := -W --keep-going -j $(JOBS)
BUILDDIR     := _build
# What the tests build (DeepSpeed's compiled ops, Horovod's wheel, OpenPBS), cached outside the clone,
# so that later runs and fresh clones on this machine skip the builds; tests/conftest.py keys
# each part by the versions that built it (TORCH_EXTENSIONS_DIR too). make clean-cache empties it.
CACHE        ?= $(or $(PYTORCH_ON_HPC_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pytorch-on-hpc)
export PYTORCH_ON_HPC_CACHE := $(CACHE)
export TORCHINDUCTOR_CACHE_DIR ?= $(CACHE)/inductor
# torch is pinned as a constraint too, so no dependency can pull another (CUDA) build.
export PIP_CONSTRAINT        := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# A centre's edition: SITE=path/to/site.toml (edition/template.toml) builds the site with the
# centre's job scripts, generated from it, into _build/<site file name>/html/<lang>/.
SITE         ?=
ifneq ($(SITE),)
export PYTORCH_ON_HPC_SITE := $(abspath $(SITE))
BUILDDIR     := $(BUILDDIR)/$(basename $(notdir $(SITE)))
CHECK_SITE   := check-site
endif
CHECK_ARGS   ?=

# The language of `make html`, from SPHINXOPTS=-Dlanguage=xx (English by default).
lang := $(or $(patsubst -Dlanguage=%,%,$(filter -Dlanguage=%,$(SPHINXOPTS))),en)
SPHINXBUILD = $(VENV)/bin/sphinx-build

.DEFAULT_GOAL := help
.PHONY: help venv html html-all gettext update-po test test-quick test-changed test-gpu test-slurm \
        linkcheck serve \
        clean clean-venv clean-cache system-packages node-packages slurm-up slurm-down \
        test-pbs pbs-up pbs-down \
        check-site edition site-check

help:
	@echo "make html       build one language (SPHINXOPTS=-Dlanguage=fr for French) into $(BUILDDIR)/html/<lang>/"
	@echo "make html-all   build en, zh_CN, ja and fr into one site in $(BUILDDIR)/html/"
	@echo "make gettext    extract the English messages into $(BUILDDIR)/gettext/"
	@echo "make update-po  extract, update locale/<lang>/LC_MESSAGES/*.po, normalise wrapping"
	@echo "make test       the CPU test suite (examples, pages, translations, search)"
	@echo "make test-quick lint, includes, catalogs, records: about two minutes, no example runs"
	@echo "make test-changed  the tests that cover what differs from main (BASE=commit for another),"
	@echo "                  with the static checks; says what it runs and why"
	@echo "make test-gpu   the GPU tests (uses the active python if it has torch)"
	@echo "make test-slurm only the tests that submit job scripts to the tests' Slurm cluster (root)"
	@echo "make slurm-up   start that cluster by hand (root); make slurm-down stops it"
	@echo "make test-pbs   only the tests that submit job scripts to the tests' OpenPBS complex (root)"
	@echo "make pbs-up     start that complex by hand (root); make pbs-down stops it"
	@echo "make html-all SITE=site.toml  a centre's edition: its job scripts, its stamps"
	@echo "make edition SITE=site.toml   only the centre's job scripts, to diff with examples/"
	@echo "make site-check SITE=site.toml  on a login node: submit every job script, record"
	@echo "                  (CHECK_ARGS=--dry-run prints what it would submit)"
	@echo "make linkcheck  check every internal link of the built site"
	@echo "make serve      live preview on http://127.0.0.1:8000"
	@echo "make clean      remove $(BUILDDIR)/ ; make clean-venv removes $(VENV)/"
	@echo "make clean-cache remove what the tests built and keep between runs, in $(CACHE)/"

# The virtual environment, created from requirements.txt when missing or older than it.
venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt constraints.txt
	@echo ">>> Creating $(VENV) from requirements.txt (torch pinned, CPU build where available)"
	@test -x $(VPY) || $(PYTHON_BASE) -m venv $(VENV)
	$(VPY) -m pip install --quiet -r requirements.txt
	@touch $@

html: venv $(CHECK_SITE)
	@echo ">>> Building language '$(lang)' into $(BUILDDIR)/html/$(lang)/"
	$(SPHINXBUILD) -b html $(STRICT) -c . $(SPHINXOPTS) source $(BUILDDIR)/html/$(lang)
	@echo ">>> Open $(CURDIR)/$(BUILDDIR)/html/$(lang)/index.html"

# Every language fresh and strict (-E -W), side by side, once per content: a build of the same
# pages, catalogs, examples and records is taken from $(CACHE)/site/ (the tests use it too).
html-all: venv $(CHECK_SITE)
	@echo ">>> Building $(LANGUAGES) into $(BUILDDIR)/html/"
	$(VPY) tests/tools/site_build.py $(BUILDDIR)/html $(LANGUAGES) -- $(SPHINXOPTS)
	cp source/_root/index.html $(BUILDDIR)/html/index.html
	@echo ">>> Open $(CURDIR)/$(BUILDDIR)/html/index.html (it sends you to your browser's language)"

# One line naming the bad key, before anything is built.
check-site:
	@test -n "$(SITE)" || { echo "make: give the site file: SITE=path/to/site.toml" >&2; exit 2; }
	@$(PYTHON_BASE) edition/sitefile.py $(SITE)

edition: check-site
	@$(PYTHON_BASE) edition/generate.py $(SITE) $(BUILDDIR)/edition

# Run by a centre's staff on a login node, with the venv active (the jobs' data are made there).
site-check: check-site
	$(PYTHON_BASE) edition/site_check.py $(SITE) $(CHECK_ARGS)

gettext: venv
	@echo ">>> Extracting messages into $(BUILDDIR)/gettext/"
	$(SPHINXBUILD) -b gettext $(STRICT) -E -c . source $(BUILDDIR)/gettext

update-po: gettext
	@echo ">>> Updating the catalogs in locale/ and normalising their wrapping"
	$(VENV)/bin/sphinx-intl update -w 0 -p $(BUILDDIR)/gettext -d locale $(addprefix -l ,$(TRANSLATIONS))
	$(VENV)/bin/python tests/tools/clean_catalogs.py locale
	$(VENV)/bin/powrap --quiet locale/*/LC_MESSAGES/*.po locale/*/LC_MESSAGES/*/*.po

system-packages:
	@bash tests/install-system-packages.sh

node-packages: tests/node/node_modules/.installed
tests/node/node_modules/.installed: tests/node/package.json tests/node/package-lock.json
	@echo ">>> Installing the tests' Node.js packages (npm ci)"
	cd tests/node && npm ci --no-audit --no-fund --silent
	@touch $@

# The whole CPU suite, examples in parallel. Extra pytest options: make test PYTEST_ARGS='-k install'
test: venv system-packages node-packages
	@echo ">>> Running the test suite; built ops and wheels are kept in $(CACHE)/ (make clean-cache)"
	$(VPY) -m pytest $(PYTEST_ARGS)

# A first verdict in about a minute, no example run: lint and shellcheck, every include and
# python block of the pages, the catalogs and glossaries, the records, the site files.
QUICK := tests/test_pages.py tests/test_translations.py tests/test_records.py \
         tests/test_repo.py tests/test_edition.py
test-quick: venv
	@echo ">>> Quick checks (no example runs; make test runs everything)"
	$(VPY) -m pytest $(QUICK) $(PYTEST_ARGS)

# The tests that cover what differs from BASE (uncommitted edits and new files included), with
# the static checks of test-quick; a change it cannot map runs everything (tests/tools/changed.py
# prints what it maps and why). Extra pytest options: PYTEST_ARGS, as for make test.
BASE ?= main
test-changed: venv system-packages node-packages
	@$(VPY) tests/tools/changed.py $(BASE) -- $(PYTEST_ARGS)

# GPU tests. A GPU machine may reach no package registry: use the active python when it has
# torch (and pytest), else the venv.
# -p no:benchmark: pytest-benchmark, where installed, warns under xdist, and warnings are errors.
test-gpu:
	@py=$$(command -v python3); \
	if ! $$py -c 'import torch, pytest' 2>/dev/null; then make --no-print-directory venv && py=$(VPY); fi; \
	echo ">>> Running the GPU tests with $$py"; \
	$$py -m pytest -m gpu -p no:cacheprovider -p no:benchmark $(PYTEST_ARGS)

# Only the job scripts under the tests' real Slurm cluster (needs root: it starts the daemons).
test-slurm: venv system-packages
	@echo ">>> Running the Slurm tests"
	$(VPY) -m pytest -m slurm $(PYTEST_ARGS)

# The same two-node cluster for a person: sbatch, squeue, sinfo after `export SLURM_CONF=...`.
SLURM_RUN ?= /tmp/pytorch-on-hpc-slurm
slurm-up: system-packages
	bash tests/slurm/cluster.sh up $(SLURM_RUN)
slurm-down:
	bash tests/slurm/cluster.sh down $(SLURM_RUN)

# Only the job scripts under the tests' OpenPBS complex (root: the first run on a machine builds
# OpenPBS into $(CACHE)/, about 5 to 20 minutes, then starts its daemons).
test-pbs: venv system-packages
	@echo ">>> Running the PBS tests"
	$(VPY) -m pytest -m pbs $(PYTEST_ARGS)

# The same two-node complex for a person: qsub, qstat after the `export` line it prints.
pbs-up: system-packages
	bash tests/pbs/complex.sh up
pbs-down:
	bash tests/pbs/complex.sh down

linkcheck: venv
	@echo ">>> Checking the internal links of $(BUILDDIR)/html (build it first with make html-all)"
	$(VPY) tests/tools/check_links.py $(BUILDDIR)/html

serve: venv
	$(VENV)/bin/sphinx-autobuild -c . -Dlanguage=$(lang) $(SPHINXOPTS) source $(BUILDDIR)/serve/$(lang)

clean:
	rm -rf $(BUILDDIR)

clean-venv:
	rm -rf $(VENV)

clean-cache:
	rm -rf "$(CACHE)"
