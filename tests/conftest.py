"""Shared fixtures: where things are, how an example runs, and which tests can run here."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SOURCE = ROOT / "source"
LOCALE = ROOT / "locale"
TESTS = ROOT / "tests"
VERSIONS = tomllib.loads((ROOT / "versions.toml").read_text(encoding="utf-8"))
LANGUAGES = ["en", "zh_CN", "ja", "fr"]
TRANSLATIONS = LANGUAGES[1:]
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")

# Warnings raised by the examples' own code (module __main__) are errors in the tests.
OWN_WARNINGS_AS_ERRORS = "error:::__main__"


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU and none is visible here: run `make test-gpu` on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_terminal_summary(terminalreporter):
    """Print the durations tests recorded with record_property("timing", "what: N s")."""
    notes = sorted(
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "timing"
    )
    if notes:
        terminalreporter.section("timings")
        for note in notes:
            terminalreporter.write_line(note)


def example_env(**extra):
    """Environment for running an example: the tests' Python first on PATH, own warnings fatal."""
    env = dict(os.environ)
    for name in list(env):  # a test run inside a real job must not leak that job's settings
        if name.startswith(("SLURM_", "SGE_")) or name in ("CUDA_VISIBLE_DEVICES", "NSLOTS"):
            del env[name]
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONWARNINGS"] = OWN_WARNINGS_AS_ERRORS
    env["PYTHONUNBUFFERED"] = "1"
    env.update({key: str(value) for key, value in extra.items()})
    return env


def run(cmd, *, cwd, env=None, timeout=120, expect_rc=0):
    """Run a command, and fail with its whole output when the exit code is not expect_rc."""
    proc = subprocess.run(
        [str(part) for part in cmd],
        cwd=cwd,
        env=env or example_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if expect_rc is not None and proc.returncode != expect_rc:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}, expected {expect_rc}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
            pytrace=False,
        )
    return proc


@pytest.fixture
def job_env(tmp_path):
    """Environment for job scripts run by bash: Lmod with the tests' modulefile tree.

    The venv the scripts activate is the one the tests run in (VENV=sys.prefix).
    """
    if not LMOD_INIT.exists():
        pytest.skip(
            "Lmod is not installed: run `make system-packages` as root (apt-get install lmod)"
        )
    return example_env(
        BASH_ENV=LMOD_INIT,
        MODULEPATH=TESTS / "modulefiles",
        LMOD_IGNORE_CACHE=1,
        VENV=sys.prefix,
        HOME=tmp_path,
    )


def copy_example(tmp_path, *names):
    """Copy example files into tmp_path, as a reader puts them side by side in one folder."""
    for name in names:
        shutil.copy2(EXAMPLES / name, tmp_path / Path(name).name)
    return tmp_path


def require_command(name, how):
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed: {how}")
