"""Records of what the tests ran: for each example file, the tests that ran it, per suite.

Every test run (`make test`, `make test-gpu`, or any pytest run of tests/) writes
tests/records/<suite>.json, where the suite of a test comes from its markers: `gpu`, `slurm`
(the tests' Slurm cluster), `gridengine` (the tests' Grid Engine cell), `pbs` (the tests' OpenPBS
complex), else `cpu`. A test ran an
example when, during its setup or call, the test process

- started a process whose command line names the example's path,
- copied the example (shutil.copy*: the tests copy job scripts and their files into a scratch
  folder before they run them there), or
- executed the example's code in-process (load_example, runpy).

Reading a file's text (for a static check) does not count. The files are followed with an
audit hook (PEP 578), so no test has to declare what it runs.

A record keeps, per example, the sha256 of the file the tests ran, the date and versions of the
newest run, and each test's outcome and duration. A later run that covers only some tests
merges into it: a file whose sha256 changed starts afresh, so its record never mixes versions.
The site shows these records on every page (source/_ext/verification.py), and
tests/test_records.py fails when a committed record no longer matches its file.
"""

import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import filelock
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# PYTORCH_ON_HPC_RECORDS_DIR: another folder (the tests of this file use one); "0" in
# PYTORCH_ON_HPC_RECORDS: write none.
RECORDS = Path(os.environ.get("PYTORCH_ON_HPC_RECORDS_DIR", ROOT / "tests" / "records"))
SUITES = ("cpu", "slurm", "gridengine", "pbs", "gpu")
_PATHS = re.compile(re.escape(str(EXAMPLES)) + r"/[\w./+-]+")

_touched = None  # the example files of the test that runs now; None between tests
# Folders that hold an edition of examples/ (edition/generate.py): running or copying a file
# from there runs the example it was generated from.
EDITIONS = []


def _note(path):
    try:
        path = Path(path).resolve()
    except (TypeError, ValueError, OSError):
        return
    for edition in EDITIONS:
        if edition in path.parents:
            path = EXAMPLES / path.relative_to(edition)
    try:  # an argument that is a whole script, not a path, can be too long a name
        is_file = path.is_file()
    except OSError:
        return
    if is_file and EXAMPLES in path.parents and "__pycache__" not in path.parts:
        _touched.add(path.relative_to(EXAMPLES).as_posix())


def _audit(event, args):
    if _touched is None:
        return
    if event == "subprocess.Popen":
        _, argv, cwd, _env = args
        for arg in argv if isinstance(argv, list | tuple) else [argv]:
            arg = os.fsdecode(arg) if isinstance(arg, bytes | os.PathLike) else str(arg)
            for found in _PATHS.findall(arg):
                _note(found)
            if cwd and not os.path.isabs(arg) and "/" in arg:
                _note(Path(os.fsdecode(cwd), arg))
    elif event == "shutil.copyfile":
        _note(args[0])
    elif event == "exec" and hasattr(args[0], "co_filename"):
        _note(args[0].co_filename)


sys.addaudithook(_audit)


@contextlib.contextmanager
def followed():
    """Follow, apart from the test that runs now, the example files touched inside the block:
    a fixture that runs jobs on behalf of several tests (tests/test_slurm.py submits them all
    at once) hands each test the files of its own job with credit()."""
    global _touched
    saved, _touched = _touched, set()
    try:
        yield _touched
    finally:
        _touched = saved


def credit(names):
    """Count the files followed() caught as run by the test that runs now."""
    if _touched is not None:
        _touched.update(names)


def suite_of(item):
    for suite in ("gpu", "slurm", "gridengine", "pbs"):
        if item.get_closest_marker(suite):
            return suite
    return "cpu"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _touched
    _touched = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" or (call.when == "setup" and report.failed):
        # The checksum of each file as it was when the test ran it.
        digests = {name: sha256(EXAMPLES / name) for name in sorted(_touched or ())}
        report.user_properties.append(("examples", digests))
        report.user_properties.append(("suite", suite_of(item)))
    return report


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    global _touched
    _touched = None


class Collector:
    """On the controlling process: the examples each finished test ran."""

    def __init__(self):
        # suite: {example: {"sha256": digest, "tests": {test id: [outcome, seconds]}}}
        self.results = {suite: {} for suite in SUITES}

    def pytest_runtest_logreport(self, report):
        properties = dict(report.user_properties)
        if "examples" not in properties or report.skipped:
            return
        outcome = "passed" if report.passed else "failed"
        for example, digest in properties["examples"].items():
            results = self.results[properties["suite"]]
            if results.get(example, {}).get("sha256") != digest:  # changed during the run
                results[example] = {"sha256": digest, "tests": {}}
            results[example]["tests"][report.nodeid] = [outcome, round(report.duration, 2)]

    def pytest_sessionfinish(self, session):
        if os.environ.get("PYTORCH_ON_HPC_RECORDS", "1") == "0":
            return
        written = [write(suite, tests) for suite, tests in self.results.items() if tests]
        if written:
            session.config.pluginmanager.get_plugin("terminalreporter").write_line(
                "records of this run: " + ", ".join(written)
            )


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # xdist workers report to the controller
        config.pluginmanager.register(Collector(), "example-records")


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


PBS_CONF = Path("/var/spool/pbs-tests.conf")  # the tests' OpenPBS complex (tests/pbs/complex.sh)


def pbs_exec():
    """The complex's PBS_EXEC (where OpenPBS is installed), or None when it was never started."""
    found = re.search(r"^PBS_EXEC=(.*)$", PBS_CONF.read_text(), re.M) if PBS_CONF.exists() else None
    return found[1] if found else None


def pbs_command(name):
    """The tests' OpenPBS command, not Grid Engine's of the same name."""
    return f"{pbs_exec()}/bin/{name}" if pbs_exec() else name


def environment(suite):
    """What the run ran on: versions, and the GPU and scheduler where the suite has them."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    command = {"slurm": ["sinfo", "--version"], "gridengine": ["qstat", "-help"],
               "pbs": [pbs_command("qstat"), "--version"]}.get(suite)  # fmt: skip
    if command and shutil.which(command[0]):
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
        env["scheduler"] = out.splitlines()[0].strip() if out else None
    return env


def write(suite, results):
    """Merge this run's results into tests/records/<suite>.json; returns the file's name."""
    RECORDS.mkdir(exist_ok=True)
    with filelock.FileLock(str(RECORDS / f".{suite}.lock")):  # two runs at once: one at a time
        return _merge(RECORDS / f"{suite}.json", suite, results)


def _merge(path, suite, results):
    old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    examples = old.get("examples", {})
    today = datetime.date.today().isoformat()
    env = environment(suite)
    for example, new in results.items():
        entry = examples.get(example)
        if entry is None or entry["sha256"] != new["sha256"]:
            entry = examples[example] = {"sha256": new["sha256"], "tests": {}}
        entry.update(date=today, **env)
        entry["tests"].update(new["tests"])
        entry["tests"] = dict(sorted(entry["tests"].items()))
    examples = {name: examples[name] for name in sorted(examples) if (EXAMPLES / name).is_file()}
    text = json.dumps({"suite": suite, "examples": examples}, indent=1, ensure_ascii=False)
    text = re.sub(r'\[\s+("\w+"),\s+([\d.]+)\s+\]', r"[\1, \2]", text)  # a test per line
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)
    return str(path)
