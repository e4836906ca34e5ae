"""The records of what the tests ran (tests/records.py) and the stamps made from them
(source/_ext/verification.py): committed records are current, every script has one, a test
run writes them, and a changed file shows as not tested."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from hashlib import sha256

import pytest
import sphinx.locale

from conftest import EXAMPLES, ROOT, SOURCE, example_env

RECORDS = ROOT / "tests" / "records"
# The site extension needs docutils; a GPU machine running only `make test-gpu` may lack it.
pytest.importorskip(
    "docutils", reason="docutils comes with Sphinx in requirements.txt: run make venv"
)
_spec = importlib.util.spec_from_file_location("verification", SOURCE / "_ext" / "verification.py")
verification = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verification)
SCRIPT = verification.SCRIPT


# make test-changed checks, after its run, the records that run wrote: TESTS_RECORDS=worktree.
WORKTREE = os.environ.get("TESTS_RECORDS") == "worktree"


def committed():
    """{suite: examples} of the committed records (as git has them, not a run's new ones), or
    of the working tree's with TESTS_RECORDS=worktree."""
    records = {}
    for suite in ("cpu", "slurm", "gridengine", "pbs", "gpu"):
        if WORKTREE:
            path = RECORDS / f"{suite}.json"
            if path.is_file():
                records[suite] = json.loads(path.read_text(encoding="utf-8"))["examples"]
            continue
        proc = subprocess.run(
            ["git", "show", f"HEAD:tests/records/{suite}.json"],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode == 0:
            records[suite] = json.loads(proc.stdout)["examples"]
    return records


@pytest.fixture(scope="module")
def records():
    found = committed()
    assert "cpu" in found, "no committed tests/records/cpu.json: run `make test` and commit it"
    return found


def test_committed_records_describe_the_files_as_they_are(records):
    stale = [
        f"{suite}: {name}"
        for suite, examples in records.items()
        for name, entry in examples.items()
        if not (EXAMPLES / name).is_file()
        or sha256((EXAMPLES / name).read_bytes()).hexdigest() != entry["sha256"]
    ]
    assert stale == [], (
        "these files changed after their last recorded run: run their tests "
        "(make test PYTEST_ARGS='-k ...') and commit tests/records/"
    )


def test_committed_records_are_of_passing_tests(records):
    failed = [
        f"{suite}: {test}"
        for suite, examples in records.items()
        for entry in examples.values()
        for test, (outcome, _seconds) in entry["tests"].items()
        if outcome != "passed"
    ]
    assert failed == []


def test_every_script_has_a_record(records):
    scripts = {
        str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*")
        if p.is_file() and SCRIPT.match(p.name) and "__pycache__" not in p.parts
    }  # fmt: skip
    recorded = {name for examples in records.values() for name in examples}
    missing = sorted(scripts - recorded)
    assert missing == [], "no test run recorded running these: write a test that runs them"


def test_job_scripts_have_scheduler_records(records):
    for suffix, suite in ((".sbatch", "slurm"), (".qsub", "gridengine"), (".pbs", "pbs")):
        scripts = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob(f"*{suffix}")}
        assert scripts <= set(records.get(suite, {})), f"run the {suite} tests and commit"


# A test file for an inner pytest run: it runs one example, copies another, executes a third,
# and only reads a fourth (which is not running it).
INNER = textwrap.dedent(
    """
    import runpy, shutil, subprocess, sys
    from pathlib import Path

    EXAMPLES = Path({examples!r})

    def test_runs(tmp_path):
        subprocess.run([sys.executable, EXAMPLES / "install" / "check_pytorch.py", "--help"],
                       check=True, capture_output=True)

    def test_copies(tmp_path):
        shutil.copy2(EXAMPLES / "first-job" / "check_pytorch.sbatch", tmp_path)

    def test_executes():
        runpy.run_path(str(EXAMPLES / "ddp" / "ddp.py"), run_name="not_main")

    def test_reads_only():
        (EXAMPLES / "mps" / "mps_ddp.py").read_text()
    """
)


def run_with_records(tmp_path, *options):
    """Run tmp_path/test_inner.py under pytest with the records plugin; the records folder."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from records import pytest_configure, pytest_runtest_makereport, "
        "pytest_runtest_setup, pytest_runtest_teardown  # noqa\n"
    )
    records = tmp_path / "records"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
         *options, "test_inner.py"],
        cwd=tmp_path, env=example_env(PYTORCH_ON_HPC_RECORDS_DIR=records, PYTORCH_ON_HPC_RECORDS=1),
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return records


def test_a_test_run_records_what_each_test_ran(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER.format(examples=str(EXAMPLES)))
    records = run_with_records(tmp_path, "-n", "2")
    examples = json.loads((records / "cpu.json").read_text())["examples"]
    assert sorted(examples) == [
        "ddp/ddp.py", "first-job/check_pytorch.sbatch", "install/check_pytorch.py",
    ]  # fmt: skip
    entry = examples["install/check_pytorch.py"]
    assert list(entry["tests"]) == ["test_inner.py::test_runs"]
    assert entry["tests"]["test_inner.py::test_runs"][0] == "passed"
    digest = sha256((EXAMPLES / "install" / "check_pytorch.py").read_bytes()).hexdigest()
    assert entry["sha256"] == digest
    assert entry["python"] and entry["torch"] and entry["date"]


def test_a_changed_file_shows_as_not_tested(tmp_path):
    name = "install/check_pytorch.py"
    digest = sha256((EXAMPLES / name).read_bytes()).hexdigest()
    entry = {"sha256": digest, "date": "2026-11-25", "torch": "2.13.0", "python": "3.11.7",
             "tests": {"t::a": ["passed", 1.0], "t::b": ["passed", 2.0]}}  # fmt: skip
    (tmp_path / "cpu.json").write_text(json.dumps({"examples": {name: entry}}))
    records = verification.load_records(tmp_path)
    assert verification.untested(records, [name]) == []
    assert verification.summary(records, [name])["cpu"][:2] == (2, 0)
    entry["sha256"] = "0" * 64  # the file changed after this run
    (tmp_path / "cpu.json").write_text(json.dumps({"examples": {name: entry}}))
    records = verification.load_records(tmp_path)
    assert verification.untested(records, [name]) == [name]
    assert verification.summary(records, [name])["cpu"] == (0, 0, None)


def test_a_stamp_says_1_test_not_1_tests(tmp_path):
    """Counts take the plural form of their language (ngettext): 1 test, 2 tests."""
    sphinx.locale.init([], None)  # English, as a build without a language registers it
    name = "install/check_pytorch.py"
    digest = sha256((EXAMPLES / name).read_bytes()).hexdigest()
    for count, words in ((1, "1 test passed"), (2, "2 tests passed")):
        tests = {f"t::{n}": ["passed", 1.0] for n in range(count)}
        entry = {"sha256": digest, "date": "2026-11-25", "torch": "2.13.0", "python": "3.11.7",
                 "tests": tests}  # fmt: skip
        (tmp_path / "cpu.json").write_text(json.dumps({"examples": {name: entry}}))
        parts = verification.stamp_text(verification.load_records(tmp_path), [name])
        text = "".join(node.astext() for node in parts[0])
        assert text == f"CPU: {words} (2026-11-25, torch 2.13.0, Python 3.11.7)"


def test_a_test_marked_pbs_records_into_the_pbs_suite(tmp_path):
    """A test of the OpenPBS complex (marker pbs, as test_pbs.py and test_pbs_site.py set it)
    writes records/pbs.json, not cpu.json."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        import shutil
        from pathlib import Path

        import pytest

        pytestmark = pytest.mark.pbs

        def test_copies(tmp_path):
            shutil.copy2(Path({str(EXAMPLES)!r}) / "first-job" / "check_pytorch.pbs", tmp_path)
    """))  # fmt: skip
    records = run_with_records(tmp_path, "-n", "0", "-o", "markers=pbs")
    assert sorted(p.name for p in records.glob("*.json")) == ["pbs.json"]
    examples = json.loads((records / "pbs.json").read_text())["examples"]
    assert list(examples) == ["first-job/check_pytorch.pbs"], examples


def test_a_pbs_job_script_has_a_pbs_stamp_and_shows_as_not_tested_once_changed(tmp_path):
    """A .pbs file is a script: its stamp names the PBS test complex, and once it changed
    after its last run it is listed as not tested in its current version."""
    sphinx.locale.init([], None)  # English, as a build without a language registers it
    name = "first-job/check_pytorch.pbs"
    digest = sha256((EXAMPLES / name).read_bytes()).hexdigest()
    entry = {"sha256": digest, "date": "2026-11-28", "torch": "2.13.0", "python": "3.11.7",
             "tests": {"t::a": ["passed", 1.0]}}  # fmt: skip
    (tmp_path / "pbs.json").write_text(json.dumps({"examples": {name: entry}}))
    records = verification.load_records(tmp_path)
    parts = verification.stamp_text(records, [name])
    texts = ["".join(node.astext() for node in part) for part in parts]
    assert "PBS test complex: 1 test passed (2026-11-28, torch 2.13.0, Python 3.11.7)" in texts
    assert verification.untested(records, [name]) == []
    entry["sha256"] = "0" * 64  # the file changed after this run
    (tmp_path / "pbs.json").write_text(json.dumps({"examples": {name: entry}}))
    assert verification.untested(verification.load_records(tmp_path), [name]) == [name]
