"""examples/install/make_venv.sh installing real PyTorch into a new venv (about 30 s each).

In a file of their own so that pytest-xdist runs them beside the other tests.
"""

import re
import sys

import pytest
import torch

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
