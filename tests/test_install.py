"""examples/install/: check_pytorch.py, make_venv.sh, make_conda_env.sh and environment.yml."""

import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import (
    EXAMPLES,
    TESTS,
    VERSIONS,
    copy_example,
    example_env,
    gpus_used,
    load_example,
    on_a_gpu_node,
    page_python_block,
    run,
)

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


def test_check_pytorch_takes_threads_from_a_pbs_chunk(tmp_path):
    env = example_env(PBS_JOBID="7.pbs-n1", NCPUS=3)
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path, env=env).stdout
    assert "CPU threads:     3 (from NCPUS)" in out
    # NCPUS outside a PBS job (another tool's variable) is not an allocation.
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path,
              env=example_env(NCPUS=3)).stdout  # fmt: skip
    assert "(from NCPUS)" not in out


def test_check_pytorch_names_a_bad_pbs_count_in_one_line(tmp_path):
    env = example_env(PBS_JOBID="7.pbs-n1", NCPUS="two")
    proc = run([sys.executable, CHECK], cwd=tmp_path, env=env, expect_rc=None)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "NCPUS='two' is not a whole number above 0" in lines[0], proc.stderr


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
        "WARNING: the scheduler gave this job GPUs (SLURM_JOB_GPUS=0) but PyTorch sees none: "
        "this PyTorch is a CPU-only build" in out
    )
    assert "works on cpu" in out


@pytest.mark.parametrize(
    ("variable", "value", "gpus"),
    [
        ("SLURM_GPUS_ON_NODE", "10", 10),  # once read as "no GPU" because it ends in 0
        ("SLURM_GPUS_ON_NODE", "0", 0),
        ("SLURM_GPUS_PER_NODE", "gpu:a100:2", 2),
        ("SLURM_GPUS", "a100:2,h100:1", 3),
        ("SLURM_JOB_GPUS", "0-3", 4),
        ("SLURM_JOB_GPUS", "0,1", 2),
        ("SGE_HGR_gpu", "0 1", 2),  # Grid Engine lists the granted GPUs with spaces
        ("SLURM_STEP_GPUS", "none", 0),
    ],
)
def test_gpu_requests_are_counted_from_scheduler_variables(monkeypatch, variable, value, gpus):
    check = load_check_module()
    assert check.gpus_in(variable, value) == gpus
    for name in check.GPU_LIST_VARIABLES + check.GPU_COUNT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    assert check.gpu_request() == (f"{variable}={value}" if gpus else None)


def test_the_typed_arch_check_on_gpus(monkeypatch, capsys):
    """install.md's arch check, as the page has it, on two stand-in GPUs: this CPU machine's
    torch has none, so the loop that a reader's GPU node runs never runs here by itself."""
    gpus = [("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA B200", (10, 0))]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index][1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    code = page_python_block("getting-started/install.md", "get_arch_list")
    exec(compile(code, "install.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    assert capsys.readouterr().out == "NVIDIA H100 80GB HBM3 sm_90 True\nNVIDIA B200 sm_100 False\n"


# check_pytorch.py run on this CPU torch made to look like another build.
AS_BUILD = """
import runpy, sys, torch
torch.version.cuda = sys.argv[1] or None
torch.version.hip = sys.argv[2] or None
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def as_build(tmp_path, cuda, hip, *args, expect_rc=0, **variables):
    (tmp_path / "as_build.py").write_text(AS_BUILD)
    env = example_env(**variables)
    env["PATH"] = f"{TESTS / 'standins'}:{env['PATH']}"  # nvidia-smi
    return run([sys.executable, "as_build.py", cuda, hip, CHECK, "--size", "32", *args],
               cwd=tmp_path, env=env, expect_rc=expect_rc)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the outcome without a GPU")
def test_a_driver_older_than_the_build_is_named_with_the_build_to_install(tmp_path):
    """The default torch 2.13.0 wheel is built for CUDA 13; a node whose driver supports
    only CUDA 12.4 sees no GPU with it. The check names the driver and the build to use."""
    old = {"NVIDIA_SMI_DRIVER": "550.54.15", "NVIDIA_SMI_CUDA": "12.4", "SLURM_JOB_GPUS": "0"}
    out = as_build(tmp_path, "13.0", "", **old).stdout
    assert "NVIDIA driver:   550.54.15 (supports CUDA up to 12.4)" in out
    assert (
        "PyTorch sees none: the NVIDIA driver 550.54.15 supports CUDA up to 12.4, older than "
        "the CUDA 13.0 this PyTorch is built for: reinstall with TORCH_BUILD=cu128" in out
    )
    assert "CUDA_VISIBLE_DEVICES" not in out
    proc = as_build(tmp_path, "13.0", "", "--device", "cuda", expect_rc=2, **old)
    assert proc.stderr.count("\n") == 1 and "TORCH_BUILD=cu128" in proc.stderr, proc.stderr
    # A driver as new as the build: then the GPU must be hidden from the job.
    new = {**old, "NVIDIA_SMI_DRIVER": "580.95.05", "NVIDIA_SMI_CUDA": "13.0"}
    out = as_build(tmp_path, "13.0", "", **new).stdout
    assert "PyTorch sees none: check CUDA_VISIBLE_DEVICES" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the outcome without a GPU")
def test_a_rocm_build_is_not_called_cpu_only(tmp_path):
    out = as_build(tmp_path, "", "6.4.43482", SLURM_JOB_GPUS="0").stdout
    assert "CUDA build:      none: a ROCm build, HIP 6.4.43482 (AMD GPUs)" in out
    assert "CPU-only" not in out and "NVIDIA driver" not in out
    assert "PyTorch sees none: check HIP_VISIBLE_DEVICES" in out


def on_node(tmp_path, devices, cuda, hip, *args, expect_rc=0, **variables):
    """as_build, run where the device files exist (stand-ins, no GPU behind them)."""
    (tmp_path / "as_build.py").write_text(AS_BUILD)
    env = example_env(**variables)
    env["PATH"] = f"{TESTS / 'standins'}:{env['PATH']}"  # nvidia-smi
    command = [sys.executable, "as_build.py", cuda, hip, CHECK, "--size", "32", *args]
    node = tmp_path / f"node-{len(list(tmp_path.glob('node-*')))}"  # its own /dev
    node.mkdir()
    return run(on_a_gpu_node(command, node, devices), cwd=tmp_path, env=env,
               expect_rc=expect_rc)  # fmt: skip


def one_error(proc, *parts):
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(part in lines[0] for part in parts), lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the outcome without a GPU")
def test_a_pbs_job_given_a_gpu_that_pytorch_cannot_use_stops(tmp_path):
    """PBS sets no GPU variable by default: check_pytorch.pbs exports the request as JOB_GPUS.
    On a GPU node the check stops on it; where no GPU device exists (the tests' complex) it
    warns and runs on the CPU."""
    pbs = {"PBS_JOBID": "12.pbs-n1", "NCPUS": "2", "JOB_GPUS": "1"}
    one_error(on_node(tmp_path, ["nvidia0"], "", "", expect_rc=2, **pbs),
              "the scheduler gave this job GPUs (JOB_GPUS=1)", "CPU-only build")  # fmt: skip
    one_error(on_node(tmp_path, ["nvidia0"], "", "", expect_rc=2, PBS_NGPUS="1"),
              "(PBS_NGPUS=1)")  # fmt: skip
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path, env=example_env(**pbs)).stdout
    assert "GPUs requested:  JOB_GPUS=1" in out
    assert "WARNING: the scheduler gave this job GPUs (JOB_GPUS=1) but PyTorch sees none" in out
    assert "works on cpu" in out
    out = run([sys.executable, CHECK, "--size", "32"], cwd=tmp_path,
              env=example_env(**{**pbs, "JOB_GPUS": "0"})).stdout  # fmt: skip
    assert "GPUs requested" not in out and "WARNING" not in out and "works on cpu" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the outcome without a GPU")
def test_a_build_for_the_other_vendor_is_named(tmp_path):
    """A CUDA wheel on an AMD node (/dev/kfd, no /dev/nvidia*): install a ROCm build, not
    "check CUDA_VISIBLE_DEVICES"; a ROCm build on an NVIDIA node likewise."""
    proc = on_node(tmp_path, ["kfd"], "13.0", "", expect_rc=2, SLURM_JOB_GPUS="0")
    one_error(proc, "(SLURM_JOB_GPUS=0)", "this node has AMD GPUs and this PyTorch is a CUDA "
              "build: install a ROCm build")  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in proc.stderr
    proc = on_node(tmp_path, ["nvidia0"], "", "6.4.43482", expect_rc=2, SLURM_JOB_GPUS="0")
    one_error(proc, "this node has NVIDIA GPUs and this PyTorch is a ROCm build: install a CUDA "
              "build")  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the outcome without a GPU")
def test_an_srun_step_without_gpus_in_a_job_with_some_runs_on_the_cpu(tmp_path):
    """What Slurm 22.05 sets in `srun --gpus-per-node=0` inside a job given a GPU (seen on the
    tests' cluster): the job's SLURM_JOB_GPUS and SLURM_GPUS_PER_NODE, copied into the step,
    and no SLURM_STEP_GPUS. On a GPU node (its cgroup hides the GPUs) the step is not stopped;
    a step given GPUs is."""
    step = {"SLURM_STEP_ID": "2", "SLURM_JOB_GPUS": "0", "SLURM_GPUS_PER_NODE": "1"}
    out = on_node(tmp_path, ["nvidia0"], "", "", **step).stdout
    assert "GPUs requested" not in out and "WARNING" not in out and "works on cpu" in out
    proc = on_node(tmp_path, ["nvidia0"], "", "", expect_rc=2, SLURM_STEP_GPUS="0",
                   SLURM_GPUS_ON_NODE="1", **step)  # fmt: skip
    one_error(proc, "(SLURM_STEP_GPUS=0)")
    cnn = [sys.executable, EXAMPLES / "one-gpu" / "cnn_gpu.py", "--fake-data", "--fake-size",
           "32", "--epochs", "1", "--batch-size", "16", "--num-workers", "0"]  # fmt: skip
    (tmp_path / "cnn").mkdir()
    proc = run(on_a_gpu_node(cnn, tmp_path / "cnn"), cwd=tmp_path / "cnn", env=example_env(**step))
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr


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
    assert gpus_used(out)[0] == 1, out  # the line make site-check counts


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


def test_make_venv_rejects_an_unknown_build(tmp_path, job_env):
    copy_example(tmp_path, "install/make_venv.sh", "install/check_pytorch.py")
    env = {**job_env, "VENV": str(tmp_path / "venv"), "TORCH_BUILD": "cu118"}
    proc = run(["bash", "make_venv.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr == (
        "make_venv.sh: error: TORCH_BUILD=cu118: use default, cu130, cu128, cu126 or cpu\n"
    )
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


def make_conda_env(tmp_path, job_env):
    """An environment made by make_conda_env.sh with the conda stand-in; its prefix."""
    copy_example(
        tmp_path, "install/make_conda_env.sh", "install/environment.yml", "install/check_pytorch.py"
    )
    env = {**job_env, "CONDA_ENV": str(tmp_path / "env")}
    run(["bash", "make_conda_env.sh"], cwd=tmp_path, env=env)
    return tmp_path / "env"


@pytest.mark.parametrize("hook", [True, False], ids=["with-hook", "without-hook"])
def test_conda_job_script_activates_the_environment_in_batch(tmp_path, job_env, hook):
    """A batch shell has no `conda init` setup: `conda activate` alone fails, as the real
    conda does; after `eval "$(conda shell.bash hook)"` it works."""
    prefix = make_conda_env(tmp_path, job_env)
    copy_example(tmp_path, "install/check_pytorch_conda.sbatch")
    script = tmp_path / "check_pytorch_conda.sbatch"
    hook_line = 'eval "$(conda shell.bash hook)"\n'
    assert hook_line in script.read_text()
    if not hook:
        script.write_text(script.read_text().replace(hook_line, ""))
    env = {**job_env, "CONDA_ENV": str(prefix), "SLURM_JOB_ID": "4242"}
    proc = run(["bash", script.name, "--size", "32"], cwd=tmp_path, env=env, expect_rc=None)
    if hook:
        assert proc.returncode == 0, proc.stderr
        assert f"conda environment {prefix}" in proc.stdout
        assert f"({prefix / 'bin' / 'python'})" in proc.stdout  # check_pytorch.py ran in it
    else:
        assert proc.returncode != 0 and "Run 'conda init' before 'conda activate'" in proc.stderr


@pytest.mark.parametrize(
    ("gcn_arch", "arch_list", "expected"),
    [
        ("gfx90a:sramecc+:xnack-", ["gfx90a", "gfx942"], True),  # MI250X
        ("gfx942:sramecc+:xnack-", ["gfx90a", "gfx942"], True),  # MI300X
        ("gfx942", ["gfx90a:xnack-", "gfx942:xnack-"], True),  # features on the list's side
        ("gfx90a:sramecc+:xnack-", ["gfx942", "gfx1100"], False),
        ("gfx908:sramecc+:xnack-", ["gfx90a"], False),  # no prefix match: gfx90 is not gfx908
        ("gfx90a", [], False),
    ],
)
def test_kernels_available_for_rocm_gpus(gcn_arch, arch_list, expected):
    assert load_check_module().kernels_available((9, 0), arch_list, gcn_arch) is expected


def fake_rocm_torch(gcn_arch, arch_list):
    """A stand-in for a ROCm build of torch with one AMD GPU; its tensors are the real CPU ones."""
    props = SimpleNamespace(
        name="AMD Instinct MI250X", major=9, minor=0, total_memory=64 * 2**30,
        gcnArchName=gcn_arch, uuid="GPU-0a1b2c3d",
    )  # fmt: skip
    cuda = SimpleNamespace(
        get_arch_list=lambda: arch_list, is_available=lambda: True, device_count=lambda: 1,
        get_device_properties=lambda index: props, synchronize=lambda: None,
    )  # fmt: skip
    return SimpleNamespace(
        __version__="2.13.0+rocm7.0",
        version=SimpleNamespace(hip="7.0.51831", cuda=None),
        backends=SimpleNamespace(cudnn=SimpleNamespace(is_available=lambda: False)),
        cuda=cuda,
        set_num_threads=lambda n: None,
        randn=lambda *size, device: torch.randn(*size),
        mm=torch.mm,
        isfinite=torch.isfinite,
    )


@pytest.mark.parametrize(
    ("gcn_arch", "usable"), [("gfx90a:sramecc+:xnack-", True), ("gfx1100", False)]
)
def test_a_rocm_gpu_of_the_builds_list_is_usable(monkeypatch, capsys, gcn_arch, usable):
    """A ROCm job given an AMD GPU of the build's gfx list runs on it; before, every ROCm GPU
    was 'unusable' (only sm_/compute_ names were known) and the job stopped."""
    check = load_check_module()
    monkeypatch.setitem(sys.modules, "torch", fake_rocm_torch(gcn_arch, ["gfx90a", "gfx942"]))
    monkeypatch.setattr(check.glob, "glob", lambda pattern: ["/dev/kfd"])  # a GPU node
    for name in check.GPU_LIST_VARIABLES + check.GPU_COUNT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    if usable:
        check.main(["--size", "32"])
        out = capsys.readouterr().out
        assert "kernels in this build: yes" in out and "WARNING" not in out, out
        assert "GPU in use: GPU-0a1b2c3d (AMD Instinct MI250X)" in out
        assert out.rstrip().endswith("works on cuda"), out
    else:
        with pytest.raises(SystemExit) as stop:
            check.main(["--size", "32"])
        assert stop.value.code == 2
        captured = capsys.readouterr()
        assert "WARNING: this PyTorch has no kernels for gfx1100 (built for gfx90a gfx942)" in (
            captured.out
        )
        assert "HIP error: invalid device function" in captured.out
        assert captured.err.count("\n") == 1 and "has no kernels for them" in captured.err


def conda_keeping_its_file(tmp_path):
    """A `conda` first on PATH that keeps a copy of the --file it is given (make_conda_env.sh
    removes its own copy when it ends), then runs the tests' conda stand-in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "conda").write_text(
        "#!/bin/bash\n"
        'args=("$@")\n'
        "for ((i = 0; i < $#; i++)); do\n"
        '    [[ ${args[i]} == --file ]] && cp "${args[i+1]}" "$SEEN"\n'
        "done\n"
        f'exec "{TESTS / "standins" / "conda"}" "$@"\n'
    )
    (bin_dir / "conda").chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    ("build", "index"),
    [("cu128", None), ("cpu", None), ("cu126", "https://mirror.example.org/pytorch/whl")],
)
def test_make_conda_env_takes_torch_from_the_builds_index(tmp_path, job_env, build, index):
    """TORCH_BUILD as in make_venv.sh: the environment conda creates takes the pinned torch from
    that build's index; before, conda always got environment.yml, hence the CUDA 13 wheel."""
    copy_example(
        tmp_path, "install/make_conda_env.sh", "install/environment.yml", "install/check_pytorch.py"
    )
    # The tests' miniconda3 module puts the stand-in first on PATH: this copy loads none.
    script = tmp_path / "make_conda_env.sh"
    text = script.read_text()
    assert text.count("\nmodule load miniconda3 ") == 1
    script.write_text(text.replace("\nmodule load miniconda3 ", "\ntrue "))
    seen = tmp_path / "seen.yml"
    env = {
        **job_env,
        "PATH": f"{conda_keeping_its_file(tmp_path)}:{job_env['PATH']}",
        "CONDA_ENV": str(tmp_path / "env"),
        "TORCH_BUILD": build,
        "SEEN": str(seen),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    (tmp_path / "tmp").mkdir()
    if index:
        env["TORCH_INDEX"] = index
    out = run(["bash", "make_conda_env.sh"], cwd=tmp_path, env=env).stdout
    assert f"(PyTorch build: {build})" in out
    assert f"Environment ready: conda activate {tmp_path / 'env'}" in out
    original = yaml.safe_load((tmp_path / "environment.yml").read_text())
    created = yaml.safe_load(seen.read_text())
    pip = next(dep["pip"] for dep in created["dependencies"] if isinstance(dep, dict))
    url = f"{index or 'https://download.pytorch.org/whl'}/{build}"
    assert pip == [f"--index-url {url}", f"torch=={VERSIONS['cpu']['torch']}"], pip
    # everything else as in environment.yml, which stays as it was; the copy is gone
    pip_original = next(d["pip"] for d in original["dependencies"] if isinstance(d, dict))
    assert pip[1:] == pip_original
    assert {**created, "dependencies": []} == {**original, "dependencies": []}
    assert [d for d in created["dependencies"] if not isinstance(d, dict)] == [
        d for d in original["dependencies"] if not isinstance(d, dict)
    ]
    assert not list((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"TORCH_BUILD": "cu118"}, "TORCH_BUILD=cu118: use default, cu130, cu128, cu126 or cpu"),
        ({"TORCH_BUILD": "$(touch pwned)"}, "use default, cu130, cu128, cu126 or cpu"),
        (
            {"TORCH_BUILD": "cu128", "TORCH_INDEX": "https://x.org/whl\n  - evil==1"},
            "is not an http(s) address",
        ),
    ],
    ids=["unknown-build", "shell-in-build", "yaml-in-index"],
)
def test_make_conda_env_rejects_a_bad_build_or_index(tmp_path, job_env, variables, message):
    copy_example(
        tmp_path, "install/make_conda_env.sh", "install/environment.yml", "install/check_pytorch.py"
    )
    log = tmp_path / "conda.log"
    env = {**job_env, "CONDA_ENV": str(tmp_path / "env"), "CONDA_STANDIN_LOG": str(log),
           **variables}  # fmt: skip
    proc = run(["bash", "make_conda_env.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("make_conda_env.sh: error: ")
    assert not log.exists() and not (tmp_path / "env").exists()
    assert not (tmp_path / "pwned").exists()
