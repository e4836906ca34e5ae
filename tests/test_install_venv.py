"""examples/install/make_venv.sh installing real PyTorch into a new venv (about 30 s each).

In a file of their own so that pytest-xdist runs them beside the other tests.
"""

import sys

import pytest
import torch

from conftest import VERSIONS, copy_example, run


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
        ],
        cwd=folder,
        timeout=600,
    )
    return folder


@pytest.mark.parametrize("source", ["index", "wheelhouse"])
def test_make_venv_installs_a_working_pytorch(tmp_path, job_env, source, request):
    if torch.version.cuda and not torch.__version__.startswith(VERSIONS["cpu"]["torch"]):
        pytest.skip("installs the CPU suite's torch; the GPU machine has another one and no index")
    copy_example(tmp_path, "install/make_venv.sh", "install/check_pytorch.py")
    env = {**job_env, "VENV": str(tmp_path / "venv")}
    if source == "wheelhouse":
        # --no-index: pip must find everything in the wheelhouse.
        env["WHEELHOUSE"] = str(request.getfixturevalue("wheelhouse"))
    out = run(["bash", "make_venv.sh"], cwd=tmp_path, env=env, timeout=600).stdout
    venv_python = tmp_path / "venv" / "bin" / "python"
    assert f"PyTorch:         {VERSIONS['cpu']['torch']}" in out
    assert f"({venv_python})" in out, "check_pytorch.py did not run in the new venv"
    assert "Result: PyTorch" in out and f"Environment ready: source {tmp_path / 'venv'}" in out
    constraint = (tmp_path / "venv" / "constraints.txt").read_text().split()
    assert constraint == [f"torch=={VERSIONS['cpu']['torch']}"]
