"""examples/install/: check_pytorch.py, make_venv.sh, make_conda_env.sh and environment.yml."""

import sys

import pytest
import torch
import yaml

from conftest import EXAMPLES, VERSIONS, copy_example, example_env, load_example, run

CHECK = EXAMPLES / "install" / "check_pytorch.py"


def load_check_module():
    return load_example(CHECK)


def test_check_pytorch_reports_the_cpu_environment(tmp_path):
    out = run([sys.executable, CHECK, "--size", "64"], cwd=tmp_path).stdout
    assert f"PyTorch:         {torch.__version__}" in out
    assert "GPUs visible:    0" in out or torch.cuda.is_available()
    assert "Test product:    64x64 on " in out
    assert "Result: PyTorch" in out and "WARNING" not in out


def test_check_pytorch_takes_threads_from_the_allocation(tmp_path):
    env = example_env(SLURM_CPUS_PER_TASK=1)
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path, env=env).stdout
    assert "CPU threads:     1 (from SLURM_CPUS_PER_TASK)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only outcome")
def test_check_pytorch_refuses_cuda_without_a_gpu(tmp_path):
    proc = run([sys.executable, CHECK, "--device", "cuda"], cwd=tmp_path, expect_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no GPU is visible" in lines[0] and "--gpus-per-node=1" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only outcome")
def test_check_pytorch_warns_when_the_scheduler_gave_a_gpu_it_cannot_see(tmp_path):
    env = example_env(SLURM_JOB_GPUS="0", CUDA_VISIBLE_DEVICES="0")
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path, env=env).stdout
    assert "GPUs requested:  SLURM_JOB_GPUS=0" in out
    assert (
        "WARNING: the scheduler gave this job GPUs (SLURM_JOB_GPUS=0) but PyTorch sees none" in out
    )
    assert "works on cpu" in out


def test_check_pytorch_without_torch_says_what_to_do(tmp_path):
    # -S leaves site-packages out, so torch cannot be imported: a reader who forgot to
    # activate the environment.
    proc = run([sys.executable, "-S", CHECK], cwd=tmp_path, expect_rc=2)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "PyTorch is not installed" in proc.stderr and "activate" in proc.stderr


@pytest.mark.parametrize(
    ("capability", "arch_list", "expected"),
    [
        ((9, 0), ["sm_80", "sm_90"], True),  # H100, exact match
        ((9, 0), ["sm_70", "sm_80", "sm_86"], False),  # H100 on a build without sm_90
        ((8, 6), ["sm_80"], True),  # same major, lower minor runs
        ((8, 0), ["sm_86"], False),  # a higher minor does not
        ((9, 0), ["sm_90a"], True),  # arch-specific target, exact
        ((10, 0), ["sm_90a"], False),
        ((12, 0), ["sm_90", "compute_90"], True),  # PTX is compiled for newer GPUs at load
        ((7, 0), ["sm_80", "compute_80"], False),
        ((9, 0), [], False),  # CPU-only build
    ],
)
def test_kernels_available(capability, arch_list, expected):
    assert load_check_module().kernels_available(capability, arch_list) is expected


@pytest.mark.gpu
def test_check_pytorch_on_the_gpu(tmp_path):
    out = run([sys.executable, CHECK, "--device", "cuda"], cwd=tmp_path).stdout
    assert "GPU 0:" in out and "kernels in this build: yes" in out
    assert "Test product:    1024x1024 on cuda" in out
    assert "works on cuda" in out and "WARNING" not in out


def test_environment_yml_pins_the_verified_versions():
    env = yaml.safe_load((EXAMPLES / "install" / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge", "nodefaults"]
    deps = env["dependencies"]
    assert f"python={VERSIONS['cpu']['python']}" in deps
    pip = next(dep["pip"] for dep in deps if isinstance(dep, dict))
    assert pip == [f"torch=={VERSIONS['cpu']['torch']}"]


def test_make_venv_refuses_to_overwrite(tmp_path, job_env):
    copy_example(tmp_path, "install/make_venv.sh", "install/check_pytorch.py")
    (tmp_path / "existing").mkdir()
    env = {**job_env, "VENV": str(tmp_path / "existing")}
    proc = run(["bash", "make_venv.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert "already exists" in proc.stderr


def test_make_venv_rejects_a_missing_wheelhouse(tmp_path, job_env):
    copy_example(tmp_path, "install/make_venv.sh", "install/check_pytorch.py")
    env = {**job_env, "VENV": str(tmp_path / "venv"), "WHEELHOUSE": str(tmp_path / "nowhere")}
    proc = run(["bash", "make_venv.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert "is not a directory" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_make_conda_env_creates_the_environment_and_checks_it(tmp_path, job_env):
    """conda's channels cannot be reached here: tests/standins/conda plays conda's part
    (it logs the calls and makes a venv that sees the tests' torch)."""
    copy_example(
        tmp_path, "install/make_conda_env.sh", "install/environment.yml", "install/check_pytorch.py"
    )
    log = tmp_path / "conda.log"
    env = {**job_env, "CONDA_ENV": str(tmp_path / "env"), "CONDA_STANDIN_LOG": str(log)}
    out = run(["bash", "make_conda_env.sh"], cwd=tmp_path, env=env).stdout
    calls = log.read_text().splitlines()
    assert (
        calls[0]
        == f"conda env create --prefix {tmp_path / 'env'} --file {tmp_path / 'environment.yml'}"
    )
    assert calls[1].startswith(f"conda run --prefix {tmp_path / 'env'} python ")
    assert f"({tmp_path / 'env' / 'bin' / 'python'})" in out
    assert f"Environment ready: conda activate {tmp_path / 'env'}" in out
