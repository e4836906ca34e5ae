"""examples/horovod/: Horovod 0.28.1 built by install_horovod.sh, then trained with horovodrun.

The build is slow (minutes on two idle cores, 10 to 18 minutes measured while other tests shared
them), so it runs once per machine: the session fixture horovod_venv in conftest.py, which
test_slurm.py's Horovod job uses too, runs the script with --wheel-dir into the tests' cache,
keyed by the script's text, the compiler, torch and Python; later test runs install that wheel.
It needs the package index: a build that cannot download Horovod fails, it is not skipped.
"""

import importlib.metadata
import re
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from conftest import (
    EXAMPLES,
    HAS_CUDA,
    HOROVOD_WHEELS,
    TESTS,
    activated,
    copy_example,
    epoch_losses,
    example_env,
    on_a_gpu_node,
    path_without,
    run,
    without_cuda_module,
)

HOROVOD = EXAMPLES / "horovod"
INSTALL = HOROVOD / "install_horovod.sh"
TRAIN = HOROVOD / "horovod_train.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3",
        "--num-workers", "0"]  # fmt: skip
HOROVODRUN_VARIABLES = (
    "HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_GLOO_RENDEZVOUS_ADDR, "
    "HOROVOD_GLOO_RENDEZVOUS_PORT not set: start this script with horovodrun --gloo"
)


def losses(out):  # rank 0's lines: horovodrun puts [rank]<stdout>: before each line
    return epoch_losses(out, prefix="[0]<stdout>:")


# The folder install_horovod.sh --wheel-dir keeps the wheel in, for the tests' torch and Python.
PY = f"py{sys.version_info[0]}.{sys.version_info[1]}"
WHEEL_FOLDER = f"torch-{importlib.metadata.version('torch')}-{PY}-cpu"


def test_install_script_builds_horovod_with_pytorch_and_gloo(horovod_venv, record_property):
    """On a machine's first run, the script builds Horovod and keeps the wheel in the cache;
    later runs install that wheel, which this script (its text is in the cache key) built."""
    venv, out, seconds = horovod_venv
    wheels = list((HOROVOD_WHEELS / WHEEL_FOLDER).glob("horovod-0.28.1-*.whl"))
    assert len(wheels) == 1, out
    cached = f"Installing {wheels[0]}, built earlier by this script (remove it to build again)\n"
    how = "from the cached wheel" if cached in out else "build"
    record_property("timing", f"Horovod {how} (install_horovod.sh --wheel-dir): {seconds:.0f} s")
    assert "Building Horovod 0.28.1 for CPU tensors only (gloo)\n" in out, out
    assert "Horovod v0.28.1:" in out, out
    for line in ("[X] PyTorch", "[X] Gloo", "[ ] MPI", "[ ] TensorFlow"):
        assert line in out, out
    assert f"Horovod 0.28.1 installed in {venv}" in out


def horovodrun(venv, np, *command, cwd, expect_rc=0):
    """Run horovodrun -np NP on this machine, in the venv with Horovod; (process, seconds)."""
    cmd = ["horovodrun", "-np", np, "-H", f"localhost:{np}", "--gloo", *command]
    env = activated(venv, OMP_NUM_THREADS=1)
    start = time.perf_counter()
    proc = run(cmd, cwd=cwd, env=env, timeout=120, expect_rc=expect_rc)
    return proc, time.perf_counter() - start


def test_horovodrun_trains_two_processes(horovod_venv, tmp_path, record_property):
    venv, _, _ = horovod_venv
    proc, seconds = horovodrun(venv, 2, "python", TRAIN, *TINY, cwd=tmp_path)
    record_property("timing", f"horovodrun -np 2 horovod_train.py (3 epochs): {seconds:.1f} s")
    out = proc.stdout
    assert "[0]<stdout>:2 processes on 1 node(s), cpu, batch 64 per process, learning rate " \
        "0.025\n" in out, out  # fmt: skip
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out
    assert "[1]<stdout>:" not in out, "only rank 0 prints"
    assert "Traceback" not in out + proc.stderr


def test_horovod_and_ddp_train_the_same_model(horovod_venv, tmp_path):
    """The page's migration table: the same settings give the same losses under DDP."""
    venv, _, _ = horovod_venv
    hvd_out = horovodrun(venv, 2, "python", TRAIN, *TINY, cwd=tmp_path)[0].stdout
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           EXAMPLES / "ddp" / "ddp.py", *TINY, "--lr", "0.05"]  # fmt: skip
    ddp_out = run(ddp, cwd=tmp_path, env=example_env(OMP_NUM_THREADS=1)).stdout
    ddp_losses = [float(x) for x in re.findall(r"^epoch \d+: loss (\S+),", ddp_out, re.M)]
    assert "learning rate 0.025" in ddp_out and len(ddp_losses) == 3, ddp_out
    assert losses(hvd_out) == pytest.approx(ddp_losses, abs=2e-3), (hvd_out, ddp_out)


def test_a_process_that_never_joins_stops_the_run_within_seconds(horovod_venv, tmp_path):
    """Rank 1 never starts the script: rank 0 gives up after --init-timeout, no hang."""
    venv, _, _ = horovod_venv
    script = '[ "$HOROVOD_RANK" = 1 ] && exec sleep 60; exec python "$0" "$@" --init-timeout 3'
    proc, seconds = horovodrun(venv, 2, "bash", "-c", script, TRAIN, *TINY, cwd=tmp_path,
                               expect_rc=1)  # fmt: skip
    assert seconds < 30, f"{seconds:.0f} s: Horovod's own 30 s timeout, not --init-timeout 3"
    assert "[0]<stderr>:" in proc.stderr and "Wait timeout after 3 seconds" in proc.stderr, (
        proc.stdout + proc.stderr
    )
    assert "Terminating remaining workers after failure of Process 0." in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given where no GPU is visible")
def test_without_a_gpu_it_says_how_to_request_one(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc, _ = horovodrun(venv, 1, "python", TRAIN, "--device", "cuda", "--fake-data",
                         cwd=tmp_path, expect_rc=1)  # fmt: skip
    assert (
        "[0]<stderr>:horovod_train.py: error: local rank 0 but 0 GPUs visible: request one GPU "
        "per process (#SBATCH --gpus-per-node equal to --ntasks-per-node)\n" in proc.stderr
    )
    assert "Process 0 exit with status code 2." in proc.stdout


def test_a_job_given_gpus_that_pytorch_cannot_use_stops_in_one_line(horovod_venv, tmp_path):
    """tests/test_bad_input.py's GPU node case, where Horovod is installed: --device auto in a
    job given GPUs, on a node with a GPU device file, stops rather than train on the CPU."""
    venv, _, _ = horovod_venv
    cmd = on_a_gpu_node(["horovodrun", "-np", "1", "-H", "localhost:1", "--gloo", "python", TRAIN,
                         "--device", "auto", "--fake-data"], tmp_path)  # fmt: skip
    proc = run(cmd, cwd=tmp_path, env=activated(venv, SLURM_JOB_GPUS="0"), expect_rc=1)
    assert (
        "[0]<stderr>:horovod_train.py: error: this job was given GPUs (SLURM_JOB_GPUS=0) but "
        "PyTorch " in proc.stderr
    ), proc.stderr
    assert "Process 0 exit with status code 2." in proc.stdout
    assert "<stderr>:Traceback" not in proc.stderr  # horovodrun's own one follows any failure


def test_without_data_it_says_how_to_fetch_it(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc, _ = horovodrun(venv, 1, "python", TRAIN, "--device", "cpu", "--data-dir", "none",
                         cwd=tmp_path, expect_rc=1)  # fmt: skip
    assert "[0]<stderr>:horovod_train.py: error: no CIFAR-10 in none: download it once on a " \
        "login node" in proc.stderr  # fmt: skip
    assert "Process 0 exit with status code 2." in proc.stdout


def test_without_horovodrun_it_names_the_missing_variables(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc = run([venv / "bin" / "python", TRAIN, "--fake-data"], cwd=tmp_path,
               env=activated(venv), expect_rc=2)  # fmt: skip
    assert proc.stderr == f"horovod_train.py: error: {HOROVODRUN_VARIABLES}\n"


def test_without_horovod_it_says_how_to_install_it(tmp_path):
    proc = run([sys.executable, TRAIN, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "horovod_train.py: error: Horovod is not installed in this Python: "
        "build it with install_horovod.sh\n"
    )


def test_install_script_needs_an_active_venv(tmp_path):
    env = example_env()
    env.pop("VIRTUAL_ENV", None)
    proc = run(["bash", INSTALL], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: no active venv: source <venv>/bin/activate first\n"
    )


CPU_SETTINGS = (
    "HOROVOD_WITHOUT_MPI=1\nHOROVOD_WITHOUT_MXNET=1\nHOROVOD_WITHOUT_TENSORFLOW=1\n"
    "HOROVOD_WITH_GLOO=1\nHOROVOD_WITH_PYTORCH=1\n"
)


def install(venv, *options, expect_rc=0):
    """install_horovod.sh with options, in venv. PIP_NO_INDEX: a script that went on to
    download and build would fail at once, and install nothing into the venv."""
    env = activated(venv, PIP_NO_INDEX=1)
    return run(["bash", INSTALL, *options], cwd=Path(venv), env=env, expect_rc=expect_rc)


def test_install_script_prints_its_cpu_settings_without_building():
    proc = install(Path(sys.prefix), "--print-env")
    assert proc.stdout == "Building Horovod 0.28.1 for CPU tensors only (gloo)\n" + CPU_SETTINGS


def test_install_script_rejects_an_unknown_option():
    proc = install(Path(sys.prefix), "--cuda", expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: unknown option --cuda "
        "(usage: install_horovod.sh [--gpu] [--print-env] [--wheel-dir DIR])\n"
    )


def test_install_script_needs_a_folder_after_wheel_dir():
    proc = install(Path(sys.prefix), "--print-env", "--wheel-dir", expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: --wheel-dir needs a folder "
        "(usage: install_horovod.sh [--gpu] [--print-env] [--wheel-dir DIR])\n"
    )


FAKE_HOROVODRUN = """import sys

def main():
    print("Horovod v0.28.1:" if sys.argv[1:] == ["--check-build"] else "fake horovodrun")
"""


def fake_wheel(folder, name="horovod-0.28.1-py3-none-any.whl"):
    """A wheel of a stand-in horovod 0.28.1 whose horovodrun prints one line."""
    folder.mkdir(parents=True)
    info = "horovod-0.28.1.dist-info"
    files = {
        "horovod/__init__.py": FAKE_HOROVODRUN,
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\nhorovodrun = horovod:main\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return folder / name


def venv_with_the_tests_packages(folder):
    """A new venv that sees the tests' packages (torch, and pip), as horovod_venv makes it;
    without a pip of its own, which is slow to install."""
    venv = folder / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv],
        cwd=folder)  # fmt: skip
    theirs = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
    Path(theirs, "tests-packages.pth").write_text(f"{sysconfig.get_path('purelib')}\n")
    return venv


def test_a_kept_wheel_for_this_torch_is_installed_without_building(tmp_path):
    """PIP_NO_INDEX (install()): a script that went on to download and build would fail. A
    broken wheel (cut short, as by a full disk) stops the script; a good one installs."""
    wheel = fake_wheel(tmp_path / "wheels" / WHEEL_FOLDER)
    good = wheel.read_bytes()
    wheel.write_bytes(good[:100])
    venv = venv_with_the_tests_packages(tmp_path)
    using = f"Installing {wheel}, built earlier by this script (remove it to build again)\n"
    proc = install(venv, "--wheel-dir", tmp_path / "wheels", expect_rc=1)
    assert using in proc.stdout and "installed in" not in proc.stdout, proc.stdout
    wheel.write_bytes(good)
    out = install(venv, "--wheel-dir", tmp_path / "wheels").stdout
    assert using in out, out
    assert out.endswith(f"Horovod v0.28.1:\nHorovod 0.28.1 installed in {venv}\n"), out


@pytest.mark.parametrize(
    "folder",
    [
        f"torch-2.12.0+cpu-{PY}-cpu",
        f"torch-{importlib.metadata.version('torch')}-py3.10-cpu",
        WHEEL_FOLDER.replace("-cpu", "-gpu"),
    ],
    ids=["other-torch", "other-python", "gpu-build"],
)
def test_a_wheel_kept_for_another_build_is_not_used(tmp_path, folder):
    """The script goes on to download the source, which PIP_NO_INDEX stops (in the tests' venv:
    nothing is installed)."""
    fake_wheel(tmp_path / "wheels" / folder)
    proc = install(Path(sys.prefix), "--wheel-dir", tmp_path / "wheels", expect_rc=1)
    assert "Installing" not in proc.stdout and "horovod==0.28.1" in proc.stderr, proc.stderr


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given for a CPU build of torch")
def test_a_gpu_build_needs_a_cuda_torch():
    proc = install(Path(sys.prefix), "--gpu", "--print-env", expect_rc=1)
    assert proc.stderr == (
        f"install_horovod.sh: error: --gpu needs a CUDA build of torch, and torch in "
        f"{sys.prefix} is a CPU build: install a CUDA torch first, or build without --gpu\n"
    )


def cuda_wheel_venv(tmp_path, cuda, arch_flags="sm_80 sm_90 compute_90", gpu_visible=True):
    """A venv whose python imports a stand-in CUDA torch, with the nvidia-nccl files beside it
    as pip installs them (include/nccl.h, lib/libnccl.so.2). As in torch, the build's list of
    architectures comes from torch._C._cuda_getArchFlags(), and torch.cuda.get_arch_list()
    is that list only where a GPU is visible, else []."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    visible_archs = arch_flags.split() if gpu_visible else []
    (site / "torch" / "__init__.py").write_text(
        "from types import SimpleNamespace\n"
        f"version = SimpleNamespace(cuda={cuda!r})\n"
        f"_C = SimpleNamespace(_cuda_getArchFlags=lambda: {arch_flags!r})\n"
        f"cuda = SimpleNamespace(get_arch_list=lambda: {visible_archs!r})\n"
    )
    nccl = site / "nvidia" / "nccl"
    for name in ("include/nccl.h", "lib/libnccl.so.2"):
        (nccl / name).parent.mkdir(parents=True, exist_ok=True)
        (nccl / name).touch()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return venv, nccl


def test_a_gpu_build_uses_the_wheels_nccl_and_cuda(tmp_path):
    """torch.version.cuda = 12.8: the script loads cuda/12.8 (the tests' stand-in toolkit)
    and would build with NCCL from the wheel, linked as a shared library."""
    venv, nccl = cuda_wheel_venv(tmp_path, "12.8")
    toolkit = TESTS / "standins" / "cuda-12.8"
    out = install(venv, "--gpu", "--print-env").stdout
    lines = out.splitlines()
    assert lines[0] == (
        f"Building Horovod 0.28.1 for GPU tensors: NCCL of {nccl}, CUDA 12.8 ({toolkit}/bin/nvcc)"
    ), out
    home = re.search(r"^HOROVOD_NCCL_HOME=(.*)$", out, re.M)[1]
    assert sorted(lines[1:]) == lines[1:] and CPU_SETTINGS in out, out
    for line in ["HOROVOD_BUILD_CUDA_CC_LIST=80,90", f"HOROVOD_CUDA_HOME={toolkit}",
                 "HOROVOD_GPU_OPERATIONS=NCCL", "HOROVOD_NCCL_LINK=SHARED"]:  # fmt: skip
        assert line in lines, out
    assert home.endswith("/nccl") and not Path(home).exists()  # in the build folder, removed


def test_a_gpu_build_without_the_cuda_module_of_the_wheel_is_one_line(tmp_path):
    venv, _ = cuda_wheel_venv(tmp_path, "13.0")
    proc = install(venv, "--gpu", "--print-env", expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: torch was built with CUDA 13.0 but there is no module "
        "cuda/13.0\n"
    )


def test_a_gpu_build_at_a_site_without_a_cuda_module_takes_nvcc_from_path(tmp_path):
    venv, _ = cuda_wheel_venv(tmp_path, "12.8")
    script = without_cuda_module(tmp_path, INSTALL)
    env = activated(venv, PIP_NO_INDEX=1)
    env["PATH"] = path_without("nvcc", env["PATH"])
    proc = run(["bash", script, "--gpu", "--print-env"], cwd=venv, env=env, expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: no nvcc on PATH: install the CUDA 12.8 toolkit, or set "
        "CUDA_MODULE to your site's module\n"
    )
    toolkit = TESTS / "standins" / "cuda-12.8"
    env["PATH"] = f"{toolkit / 'bin'}:{env['PATH']}"
    out = run(["bash", script, "--gpu", "--print-env"], cwd=venv, env=env).stdout
    assert f"CUDA 12.8 ({toolkit}/bin/nvcc)" in out.splitlines()[0], out
    assert f"HOROVOD_CUDA_HOME={toolkit}" in out.splitlines(), out


def test_the_job_script_without_horovod_in_the_venv_says_how_to_install_it(job_env, tmp_path):
    """Found by make site-check on the tests' cluster: a venv without Horovod ended the job with
    bash's "horovodrun: command not found"."""
    copy_example(tmp_path, "horovod/horovod.sbatch", "horovod/horovod_train.py")
    env = {**job_env, "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_PER_TASK": "2"}  # fmt: skip
    proc = run(["bash", "horovod.sbatch", "--fake-data"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr.strip().splitlines() == [
        f"horovod.sbatch: error: no horovodrun in {env['VENV']}: install Horovod there with "
        "install_horovod.sh --gpu"
    ], proc.stderr


@pytest.mark.parametrize(
    ("arch_flags", "cc_list"),
    [
        ("sm_80 sm_90 compute_90", "80,90"),
        ("sm_75 sm_80 sm_90 sm_90a sm_100 sm_120", "75,80,90,100,120"),
    ],
)
def test_a_gpu_build_on_a_login_node_takes_the_architectures_of_the_build(
    tmp_path, arch_flags, cc_list
):
    """No GPU is visible on a login node, where the page builds: torch.cuda.get_arch_list() is
    [] there. The list comes from the build itself; before, the script exported an empty
    HOROVOD_BUILD_CUDA_CC_LIST and Horovod's build stopped on int('')."""
    venv, _ = cuda_wheel_venv(tmp_path, "12.8", arch_flags=arch_flags, gpu_visible=False)
    out = install(venv, "--gpu", "--print-env").stdout
    value = re.search(r"^HOROVOD_BUILD_CUDA_CC_LIST=(.*)$", out, re.M)[1]
    assert value == cc_list, out
    assert [int(cc) for cc in value.split(",")]  # as Horovod's cmake/build_utils.py reads it


def test_a_gpu_build_of_a_torch_without_architectures_stops_in_one_line(tmp_path):
    venv, _ = cuda_wheel_venv(tmp_path, "12.8", arch_flags="", gpu_visible=False)
    proc = install(venv, "--gpu", "--print-env", expect_rc=1)
    assert proc.stderr == (
        f"install_horovod.sh: error: the torch in {venv} names no GPU architecture (sm_XY) it "
        "was built for: reinstall torch from PyPI or the PyTorch wheel server\n"
    )
