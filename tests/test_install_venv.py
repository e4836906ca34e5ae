"""examples/install/make_venv.sh installing real PyTorch into a new venv (about 30 s each).

In a file of their own so that pytest-xdist runs them beside the other tests.
"""

import os
import re
import sys

import pytest
import torch
from recorded import check_recorded

from conftest import EXAMPLES, VERSIONS, copy_example, run

# The torchvision that make_venv.sh installs with torch.
TORCHVISION = re.search(
    r"^TORCHVISION_VERSION=(\S+)", (EXAMPLES / "install" / "make_venv.sh").read_text(), re.M
)[1]


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory):
    """A site wheelhouse: torch and its dependencies as wheels in one folder."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--dest",
            folder,
            f"torch=={VERSIONS['cpu']['torch']}",
            f"torchvision=={TORCHVISION}",
        ],
        cwd=folder,
        timeout=600,
    )
    return folder


def wheel_server(wheelhouse, root):
    """A copy of PyTorch's wheel server layout (<root>/cu128/<project>/) made of the
    wheelhouse, as a site mirror would serve it: make_venv.sh must install from it."""
    for wheel in wheelhouse.glob("*.whl"):
        project = root / "cu128" / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        project.mkdir(parents=True, exist_ok=True)
        with (project / "index.html").open("a") as page:
            page.write(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    return root.as_uri()


@pytest.mark.parametrize("source", ["index", "wheelhouse", "TORCH_BUILD=cu128"])
def test_make_venv_installs_a_working_pytorch(tmp_path, job_env, source, request):
    if torch.version.cuda and not torch.__version__.startswith(VERSIONS["cpu"]["torch"]):
        pytest.skip("installs the CPU suite's torch; the GPU machine has another one and no index")
    copy_example(tmp_path, "install/make_venv.sh", "install/check_pytorch.py")
    venv = tmp_path / "venv"
    env = {**job_env, "VENV": str(venv)}
    env.pop("PIP_CONSTRAINT", None)  # the venv must pin torch by itself
    wheelhouse = request.getfixturevalue("wheelhouse")
    if source == "wheelhouse":
        # --no-index: pip must find everything in the wheelhouse.
        env["WHEELHOUSE"] = str(wheelhouse)
    elif source.startswith("TORCH_BUILD"):
        env.update(TORCH_BUILD="cu128", TORCH_INDEX=wheel_server(wheelhouse, tmp_path / "whl"))
        env["PIP_FIND_LINKS"] = ""  # only the wheel server
    out = run(["bash", "make_venv.sh"], cwd=tmp_path, env=env, timeout=600).stdout
    venv_python = venv / "bin" / "python"
    assert f"PyTorch:         {VERSIONS['cpu']['torch']}" in out
    assert f"({venv_python})" in out, "check_pytorch.py did not run in the new venv"
    assert "Result: PyTorch" in out and f"Environment ready: source {venv}" in out
    build = source.split("=")[-1] if "=" in source else "default"
    assert f"torchvision {TORCHVISION} (build: {build})" in out
    versions = run([venv_python, "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, env=env)
    assert f"torchvision=={TORCHVISION}" in versions.stdout.split()
    # Later, a package that wants another torch must fail, not replace it: the venv's own
    # pip.conf holds the constraint (PIP_CONSTRAINT of the install script is gone by then).
    proc = run(
        [venv_python, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
         wheelhouse, "torch==2.12.0"], cwd=tmp_path, env=env, expect_rc=1,
    )  # fmt: skip
    assert f"(constraint) torch=={VERSIONS['cpu']['torch']}" in proc.stdout + proc.stderr, (
        proc.stderr
    )


UV_SCRIPT = ("install/make_venv_uv.sh", "install/check_pytorch.py")


def uv_env(job_env, tmp_path, **extra):
    env = {**job_env, "VENV": str(tmp_path / "venv"), "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    env.pop("PIP_CONSTRAINT", None)  # the venv must pin torch by itself
    env.update(extra)
    return env


def test_make_venv_uv_installs_a_working_pytorch_from_a_mirror(tmp_path, job_env, wheelhouse):
    if torch.version.cuda and not torch.__version__.startswith(VERSIONS["cpu"]["torch"]):
        pytest.skip("installs the CPU suite's torch; the GPU machine has another one and no index")
    copy_example(tmp_path, *UV_SCRIPT)
    mirror = wheel_server(wheelhouse, tmp_path / "whl")
    env = uv_env(job_env, tmp_path, TORCH_BUILD="cu128", TORCH_INDEX=mirror)
    out = run(["bash", "make_venv_uv.sh"], cwd=tmp_path, env=env, timeout=600).stdout
    venv_python = tmp_path / "venv" / "bin" / "python"
    assert f"PyTorch:         {VERSIONS['cpu']['torch']}" in out
    assert f"({venv_python})" in out and "Result: PyTorch" in out
    assert f"torchvision {TORCHVISION} with uv (build: cu128)" in out
    # pip came with the venv (--seed), and reads the same pin as in make_venv.sh's venvs.
    proc = run(
        [venv_python, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
         wheelhouse, "torch==2.12.0"], cwd=tmp_path, env=env, expect_rc=1,
    )  # fmt: skip
    assert f"(constraint) torch=={VERSIONS['cpu']['torch']}" in proc.stdout + proc.stderr


# The drivers whose choice the install page shows: uv's own detection and index order, read
# from its debug log (offline: it downloads nothing).
DRIVERS = ["580.95.05", "570.86.15", "535.104.05", "470.82.01"]


def test_uv_chooses_the_build_from_the_driver_on_the_node(tmp_path, job_env):
    """TORCH_BUILD=auto: uv reads the driver with nvidia-smi (the stand-in plays each driver)
    and asks PyTorch's index of the newest CUDA that driver supports first."""
    copy_example(tmp_path, *UV_SCRIPT)
    # The seed packages (pip, setuptools, wheel) from PyPI into uv's cache first: the runs
    # below are offline, so that uv can only log which of PyPI's and PyTorch's indexes it asks.
    env = uv_env(job_env, tmp_path)
    run(["uv", "venv", "--seed", tmp_path / "seeded"], cwd=tmp_path, env=env, timeout=300)
    lines = []
    for driver in DRIVERS:
        env = uv_env(job_env, tmp_path, VENV=tmp_path / driver, NVIDIA_SMI_DRIVER=driver,
                     UV_OFFLINE="1", RUST_LOG="uv=debug")  # fmt: skip
        proc = run(["bash", "make_venv_uv.sh"], cwd=tmp_path, env=env, expect_rc=None)
        assert proc.returncode != 0  # offline: nothing to install
        seen = re.search(r"Detected CUDA driver version from `nvidia-smi`: (\S+)", proc.stderr)
        assert seen, proc.stderr  # uv writes 470.82.01 as 470.82.1
        assert [int(n) for n in seen[1].split(".")] == [int(n) for n in driver.split(".")]
        indexes = re.findall(r"GET request for: https://download\.pytorch\.org/whl/(\w+)/torch/",
                             proc.stderr)  # fmt: skip
        assert indexes and "cpu" in indexes, proc.stderr  # the last resort
        # uv sends these requests at once, so their order in the log varies: the index it
        # prefers is the newest CUDA among them.
        cuda = [i for i in indexes if i != "cpu"]
        newest = max(cuda, key=lambda i: (int(i[2:-1]), int(i[-1])))
        lines.append(f"driver {driver}: first {newest}, then older CUDA indexes, then cpu")
    check_recorded(EXAMPLES / "install" / "uv-torch-backend.out", "\n".join(lines))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PATH": "/usr/bin:/bin"}, "make_venv_uv.sh: error: uv not found: module load uv"),
        ({"NO_GPU": "1"}, "no GPU driver on "),
        ({"TORCH_BUILD": "cu121"}, "TORCH_BUILD=cu121: use auto, cu130, cu128, cu126 or cpu"),
        ({"TORCH_INDEX": "https://mirror.example.org/whl"},
         "TORCH_INDEX needs TORCH_BUILD: uv chooses only among download.pytorch.org's indexes"),
    ],
)  # fmt: skip
def test_make_venv_uv_refuses_what_would_go_wrong(tmp_path, job_env, env, message):
    copy_example(tmp_path, *UV_SCRIPT)
    env = uv_env(job_env, tmp_path, **env)
    if env.pop("NO_GPU", None):  # a login node without nvidia-smi
        env["PATH"] = os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if "standins" not in p
        )
    if env["PATH"] == "/usr/bin:/bin":
        env["BASH_ENV"] = ""  # no module command either: stop at uv
        text = (tmp_path / "make_venv_uv.sh").read_text().replace("\nmodule load", "\n: module")
        (tmp_path / "make_venv_uv.sh").write_text(text)
    proc = run(["bash", "make_venv_uv.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "venv").exists()
