"""examples/jupyter/jupyter.sbatch under bash, with the variables Slurm sets: what it does when
JupyterLab or the module is missing. test_slurm.py submits it and talks to the server."""

import sys

from conftest import copy_example, run

SCRIPT = "jupyter/jupyter.sbatch"
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2", "SLURMD_NODENAME": "n1"}


def test_without_jupyterlab_in_the_venv_it_says_how_to_install_it(tmp_path, job_env):
    venv = tmp_path / "venv"  # a venv with Python only (bin/activate, no jupyter-lab)
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    copy_example(tmp_path, SCRIPT)
    env = {**job_env, **SLURM, "VENV": str(venv)}
    proc = run(["bash", "jupyter.sbatch"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr.splitlines() == [
        f"jupyter lab is not installed in {venv}: install it in the venv on a login node "
        "with: python -m pip install jupyterlab"
    ], proc.stderr
    assert proc.stdout == "", proc.stdout  # no tunnel, no token


def test_a_wrong_module_fails_the_job(tmp_path, job_env):
    """The Slurm tests leave the server out of their broken-script test (it never ends)."""
    copy_example(tmp_path, SCRIPT)
    text = (tmp_path / "jupyter.sbatch").read_text()
    assert "module load python/3.11" in text
    (tmp_path / "jupyter.sbatch").write_text(text.replace("python/3.11", "python/3.99"))
    proc = run(["bash", "jupyter.sbatch"], cwd=tmp_path, env={**job_env, **SLURM}, expect_rc=None)
    assert proc.returncode != 0 and "unknown" in proc.stderr, proc.stderr
    assert "token=" not in proc.stdout
