"""examples/deepspeed/: DeepSpeed ZeRO stage 3 on CPU with gloo, without offload and with CPU and
NVMe offload; Lightning's DeepSpeedStrategy, which needs CUDA GPUs, in the GPU suite."""

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    EXAMPLES,
    HAS_CUDA,
    TORCH_EXTENSIONS,
    TORCHRUN,
    epoch_losses,
    example_env,
    free_port,
    launch,
    run,
)

DS = EXAMPLES / "deepspeed"
TRAIN = DS / "deepspeed_train.py"
LIGHTNING = DS / "lightning_deepspeed.py"
ZERO3 = DS / "ds_zero3.json"
OFFLOAD_CPU = DS / "ds_zero3_offload_cpu.json"
OFFLOAD_NVME = DS / "ds_zero3_offload_nvme.json"
TINY = ["--device", "cpu", "--fake-size", "512", "--width", "64", "--layers", "2",
        "--epochs", "3", "--lr", "0.01"]  # fmt: skip
HEADER = "2 processes, cpu (gloo), ZeRO stage 3, 8,970 parameters, optimizer"
# DeepSpeed compiles its C++ ops on first use (minutes on 2 cores) into TORCH_EXTENSIONS_DIR:
# one folder for all the tests and test runs on this machine, keyed by the versions of torch,
# DeepSpeed, Python and the compiler (conftest.py), so that only the first run pays.
EXTENSIONS = str(TORCH_EXTENSIONS)
# A compile's lock file (torch waits for it without end) older than this is from a compile that
# was killed: the slowest compile, async_io, takes 7 to 8 minutes on 2 busy cores.
STALE_LOCK_SECONDS = 3600
NOT_ON_GPU = pytest.mark.skipif(HAS_CUDA, reason="checks the message given when no GPU is visible")
# The GPU runner may have its own Python without DeepSpeed (the lent GPU machines have none and
# no network): its GPU tests then skip with this reason instead of failing on the import.
NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed in this Python (pip install -r requirements.txt)",
)


def losses(out):
    return epoch_losses(out, unit="samples/s")


def ds_env(**extra):
    return example_env(**{"TORCH_EXTENSIONS_DIR": EXTENSIONS, "OMP_NUM_THREADS": 1, **extra})


COMPILED = {}


def compile_ops(record_property, *builders):
    """Compile DeepSpeed's CPU ops into the shared cache before a run, so that the runs are
    timed warm; record how long each took the first time (a compile on a cold cache, a check
    of the cache otherwise)."""
    for lock in Path(EXTENSIONS).glob("*/lock"):
        with contextlib.suppress(FileNotFoundError):  # another test run's compile just ended
            if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
                lock.unlink()
    for builder in builders:
        if builder in COMPILED:
            continue
        code = (
            "from deepspeed.accelerator import get_accelerator as a\n"
            f"a().create_op_builder({builder!r}).load()"
        )
        before = {(p, p.stat().st_mtime) for p in Path(EXTENSIONS).rglob("*.so")}
        start = time.perf_counter()
        run([sys.executable, "-c", code], cwd=tempfile.gettempdir(),
            env=ds_env(DS_ACCELERATOR="cpu"), timeout=3600)  # fmt: skip
        COMPILED[builder] = time.perf_counter() - start
        after = {(p, p.stat().st_mtime) for p in Path(EXTENSIONS).rglob("*.so")}
        how = "compiled" if after - before else "from the cache"
        record_property(
            "timing", f"DeepSpeed {builder} op ready ({how}): {COMPILED[builder]:.1f} s"
        )


def launched(**extra):
    """What torchrun gives a single process, plus extra variables."""
    return ds_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=free_port(), **extra)  # fmt: skip


def torchrun(args, tmp_path, record_property, what):
    start = time.perf_counter()
    proc = run([*TORCHRUN, "--nproc-per-node=2", TRAIN, *args], cwd=tmp_path, env=ds_env(),
               timeout=600)  # fmt: skip
    record_property("timing", f"DeepSpeed {what}, 2 processes: {time.perf_counter() - start:.1f} s")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_zero3_trains_on_two_processes(tmp_path, record_property):
    compile_ops(record_property, "ShareMemCommBuilder")
    out = torchrun(["--config", ZERO3, *TINY], tmp_path, record_property, "ZeRO-3")
    assert f"{HEADER} AdamW\n" in out, out
    assert "offload: parameters none, optimizer states none" in out, out
    assert "compute in float32 (bf16 of the config is for GPUs)\n" in out, out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out


@pytest.mark.parametrize("config", [ZERO3, OFFLOAD_CPU, OFFLOAD_NVME], ids=lambda p: p.stem)
def test_the_configs_ask_for_bf16_and_deepspeed_accepts_them(tmp_path, config):
    """DeepSpeed's own parser reads each config: bf16 on, ZeRO stage 3. (On GPUs the script
    keeps bf16 and says so; test_zero3_on_the_gpus checks it.)"""
    code = (
        "import json, sys\n"
        "from deepspeed.runtime.config import DeepSpeedConfig\n"
        "c = DeepSpeedConfig(json.load(open(sys.argv[1])))\n"
        "print('bf16', c.bfloat16_config.enabled, 'fp16', c.float16_config.enabled, "
        "'stage', c.zero_optimization_stage)\n"
    )
    out = run([sys.executable, "-c", code, config], cwd=tmp_path, env=ds_env()).stdout
    assert out.splitlines()[-1] == "bf16 True fp16 False stage 3", out


def checkpoint_run(tmp_path, record_property, what, folder, epochs):
    args = ["--config", ZERO3, *TINY, "--epochs", str(epochs), "--checkpoint-dir", folder]
    return torchrun(args, tmp_path, record_property, what)


FP32_LINE = re.compile(r"^wrote (\S+): 8,970 float32 parameters, sha256 ([0-9a-f]{16})$", re.M)


def test_checkpoints_save_resume_and_convert_to_fp32(tmp_path, record_property):
    """2 epochs with checkpoints, then a rerun asking for 3 resumes after epoch 2 and trains
    only the third; its fp32 export equals that of 3 epochs in one go, bit for bit."""
    compile_ops(record_property, "ShareMemCommBuilder")
    first = checkpoint_run(tmp_path, record_property, "checkpoints, 2 epochs", "ck", 2)
    assert "no checkpoint in ck: starting from scratch\n" in first, first
    assert "saved ck/epoch-1\n" in first and "saved ck/epoch-2\n" in first, first
    assert (tmp_path / "ck" / "latest").read_text() == "epoch-2"
    resumed = checkpoint_run(tmp_path, record_property, "resume, epoch 3", "ck", 3)
    assert "resumed from ck/epoch-2 after epoch 2\n" in resumed, resumed
    assert [line[:8] for line in resumed.splitlines() if line.startswith("epoch ")] == [
        "epoch 3:"
    ], resumed
    whole = checkpoint_run(tmp_path, record_property, "checkpoints, 3 epochs", "whole", 3)
    assert FP32_LINE.search(resumed)[1] == "ck/model_fp32.pt", resumed
    assert FP32_LINE.search(resumed)[2] == FP32_LINE.search(whole)[2], resumed + whole
    # A plain state dict: loads without DeepSpeed, with weights_only=True.
    one, two = (
        torch.load(tmp_path / d / "model_fp32.pt", weights_only=True) for d in ("ck", "whole")
    )
    assert list(one) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(torch.equal(one[k], two[k]) and one[k].dtype == torch.float32 for k in one)


def fake_slurm_commands(folder, running):
    """squeue listing the given running jobs, scontrol naming one node, and an srun that
    prints what it would start."""
    folder.mkdir()
    scripts = {
        "squeue": "".join(f"echo {job}\n" for job in running),
        "scontrol": "echo n1\n",
        "srun": 'echo "srun $*"\n',
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}")
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize(
    ("others", "age"),
    [(False, 7200), (True, 7200), (False, 60)],
    ids=["only-job", "other-jobs-running", "compiling-now"],
)
def test_the_job_script_removes_a_stale_extension_lock(tmp_path, job_env, others, age):
    """A job killed while compiling left cpu_adam/lock two hours ago: with no other running
    job of the user's, deepspeed.sbatch removes it (else the job would wait forever); when
    other jobs run, or the lock is a minute old (a compile on a login node, or a test, now),
    it keeps the lock and says so."""
    (tmp_path / "deepspeed.sbatch").write_text((DS / "deepspeed.sbatch").read_text())
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age, time.time() - age))
    bin_dir = fake_slurm_commands(tmp_path / "bin", ["4242", "17"] if others else ["4242"])
    env = dict(job_env, PATH=f"{bin_dir}:{job_env['PATH']}", SLURM_TMPDIR=str(tmp_path))
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), SLURM_JOB_ID="4242")
    env.update(SLURM_JOB_NODELIST="n1", SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="2")
    out = run(["bash", "deepspeed.sbatch", "--epochs", "1"], cwd=tmp_path, env=env).stdout
    if others:
        assert f"Found {lock}: if nothing of yours compiles (jobs: 17), rm it\n" in out, out
        assert lock.exists()
    elif age < 3600:
        assert f"Found {lock}: if nothing of yours compiles (jobs: none), rm it\n" in out, out
        assert lock.exists()
    else:
        assert f"Removed a stale lock: {lock}\n" in out, out
        assert not lock.exists()
    assert "srun -c 2 --kill-on-bad-exit=1 python deepspeed_train.py --nvme-dir" in out, out


def test_the_deepspeed_launcher_starts_it_too(tmp_path, record_property):
    """DeepSpeed's launcher passes --local_rank, which the script accepts."""
    compile_ops(record_property, "ShareMemCommBuilder")
    launcher = Path(sys.executable).parent / "deepspeed"
    start = time.perf_counter()
    out = run([launcher, "--num_gpus=2", TRAIN, "--config", ZERO3, *TINY], cwd=tmp_path,
              env=ds_env(), timeout=600).stdout  # fmt: skip
    record_property(
        "timing", f"DeepSpeed launcher, 2 processes: {time.perf_counter() - start:.1f} s"
    )
    assert f"{HEADER} AdamW\n" in out, out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out


def test_cpu_offload_with_srun_style_tasks(tmp_path, record_property):
    """One process per Slurm task, as deepspeed.sbatch starts them; DeepSpeedCPUAdam updates
    the offloaded optimizer states."""
    compile_ops(record_property, "ShareMemCommBuilder", "CPUAdamBuilder")
    start = time.perf_counter()
    ranks = launch([sys.executable, TRAIN, "--config", OFFLOAD_CPU, *TINY], cwd=tmp_path,
                   env=ds_env, timeout=600)  # fmt: skip
    record_property("timing", f"DeepSpeed CPU offload, 2 srun-style tasks: "
                              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    assert [rc for rc, _, _ in ranks] == [0, 0], ranks
    out = ranks[0][1]
    assert f"{HEADER} DeepSpeedCPUAdam\n" in out, out
    assert "offload: parameters cpu, optimizer states cpu" in out, out
    assert "epoch" not in ranks[1][1]  # only rank 0 prints
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out


def libaio_found(accelerator="cpu"):
    """DeepSpeed's own check for what its async_io op (NVMe offload) is built with."""
    code = (
        "from deepspeed.accelerator import get_accelerator as a\n"
        "print(a().create_op_builder('AsyncIOBuilder').is_compatible())"
    )
    env = ds_env(DS_ACCELERATOR=accelerator)
    out = run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=env).stdout
    return out.strip().splitlines()[-1] == "True"


NO_LIBAIO = "DeepSpeed's async_io op needs libaio: apt-get install libaio-dev (as root)"


def test_nvme_offload_swaps_to_the_folder(tmp_path, record_property):
    if not libaio_found():
        pytest.skip(NO_LIBAIO)
    compile_ops(record_property, "ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = ["--config", OFFLOAD_NVME, "--nvme-dir", nvme, *TINY]
    out = torchrun(args, tmp_path, record_property, "NVMe offload")
    assert f"{HEADER} DeepSpeedCPUAdam\n" in out, out
    assert "offload: parameters nvme, optimizer states nvme" in out, out
    assert f"NVMe swap files in {nvme}" in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out
    swapped = {path.name for path in (nvme / "zero_stage_3").iterdir()}
    assert swapped == {"float32params", "optimizer"}, swapped  # one folder per rank in each


def test_without_a_launcher_it_names_the_missing_variables(tmp_path):
    proc = run([sys.executable, TRAIN], cwd=tmp_path, env=ds_env(), expect_rc=2)
    assert proc.stderr == (
        "deepspeed_train.py: error: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not "
        "set: start this script with torchrun, deepspeed or srun (see deepspeed.sbatch)\n"
    )


def test_srun_without_master_variables_names_them(tmp_path):
    env = ds_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    proc = run([sys.executable, TRAIN], cwd=tmp_path, env=env, expect_rc=2)
    assert "MASTER_ADDR, MASTER_PORT not set: export them in the job script" in proc.stderr


def test_nvme_offload_without_a_folder_says_what_to_pass(tmp_path):
    proc = run([sys.executable, TRAIN, "--config", OFFLOAD_NVME], cwd=tmp_path,
               env=launched(), expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "deepspeed_train.py: error: NVMe offload needs a folder and SLURM_TMPDIR, SLURM_JOB_ID "
        "are not set: pass --nvme-dir with a folder on a node-local disk\n"
    )


@pytest.mark.parametrize("variable", ["SLURM_TMPDIR", "SLURM_JOB_ID"])
def test_nvme_folder_of_the_job_must_exist(tmp_path, variable):
    """The default folder comes from the job: $SLURM_TMPDIR, else /tmp/$USER-ds-<job id>."""
    value = str(tmp_path / "gone") if variable == "SLURM_TMPDIR" else "424242"
    env = launched(USER="alice", **{variable: value})
    proc = run([sys.executable, TRAIN, "--config", OFFLOAD_NVME], cwd=tmp_path, env=env,
               expect_rc=2)  # fmt: skip
    folder = value if variable == "SLURM_TMPDIR" else "/tmp/alice-ds-424242"
    assert proc.stderr == (
        f"deepspeed_train.py: error: NVMe folder {folder} does not exist: create it in the job "
        "script (see deepspeed.sbatch)\n"
    )


def test_a_missing_config_is_named(tmp_path):
    proc = run([sys.executable, TRAIN, "--config", "nowhere.json"], cwd=tmp_path,
               env=launched(), expect_rc=2)  # fmt: skip
    # argparse's usage, then one line.
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("deepspeed_train.py: error: argument --config: no file nowhere.json")
    assert "Traceback" not in proc.stderr


@NOT_ON_GPU
def test_cuda_without_a_gpu_says_how_to_request_one(tmp_path):
    args = ["--config", ZERO3, "--device", "cuda"]
    proc = run([sys.executable, TRAIN, *args], cwd=tmp_path, env=launched(), expect_rc=2)
    assert proc.stderr == (
        "deepspeed_train.py: error: --device cuda but no GPU is visible: request GPUs (Slurm: "
        "--gpus-per-node=2, PBS: -l select=1:ncpus=4:ngpus=2, Grid Engine: -l gpu=2)\n"
    )


def test_a_missing_process_stops_the_run_within_seconds(tmp_path):
    """WORLD_SIZE says 2, one process starts: a clear message after --init-timeout, no hang."""
    env = ds_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=free_port())  # fmt: skip
    start = time.monotonic()
    args = ["--config", ZERO3, *TINY, "--init-timeout", "3"]
    proc = run([sys.executable, TRAIN, *args], cwd=tmp_path, env=env, expect_rc=2, timeout=60)
    assert time.monotonic() - start < 30
    assert "rank 0: not all 2 processes reached 127.0.0.1:" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@NOT_ON_GPU
def test_lightning_without_a_gpu_stops_with_one_line(tmp_path):
    proc = run([sys.executable, LIGHTNING], cwd=tmp_path, env=ds_env(), expect_rc=2)
    assert proc.stderr == (
        "lightning_deepspeed.py: error: Lightning's DeepSpeedStrategy runs on CUDA GPUs only "
        "and none is visible: request them with #SBATCH --gpus-per-node=2 (on CPUs, use "
        "deepspeed_train.py)\n"
    )


def test_lightning_refuses_the_strategy_on_cpu(tmp_path):
    """Why lightning_deepspeed.py stops without a GPU: Lightning itself would raise."""
    code = (
        "import lightning as L\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from lightning.pytorch.strategies import DeepSpeedStrategy\n"
        "strategy = DeepSpeedStrategy(stage=3)\n"
        "trainer = L.Trainer(accelerator='cpu', devices=1, strategy=strategy, logger=False)\n"
        "trainer.fit(BoringModel())\n"
    )
    proc = run([sys.executable, "-c", code], cwd=tmp_path, env=ds_env(), expect_rc=1)
    assert (
        "RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs but "
        "`CPUAccelerator` is used." in proc.stderr
    ), proc.stderr


def test_job_script_gives_each_job_its_own_folders():
    """deepspeed.sbatch: one task per GPU; a per-user op cache; the NVMe folder of this job
    only, removed at the end when the job made it. The run under Slurm is in test_slurm.py."""
    text = (EXAMPLES / "deepspeed" / "deepspeed.sbatch").read_text()
    setting = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert setting["ntasks-per-node"] == setting["gpus-per-node"] == "2"
    assert "TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions/" in text
    assert "\nLOCAL=${SLURM_TMPDIR:-${TMPDIR:-/tmp}} " in text  # in the site-specific block
    assert "nvme_dir=$LOCAL/${USER:-$(id -un)}-ds-$SLURM_JOB_ID" in text
    assert """trap 'rm -rf "$nvme_dir"' EXIT""" in text
    assert (
        'srun -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python deepspeed_train.py '
        '--nvme-dir "$nvme_dir" "$@"'
    ) in text


@pytest.mark.gpu
@NEEDS_DEEPSPEED
@pytest.mark.parametrize("config", [ZERO3, OFFLOAD_CPU, OFFLOAD_NVME], ids=lambda p: p.stem)
def test_zero3_on_the_gpus(tmp_path, config):
    if config == OFFLOAD_NVME and not libaio_found("cuda"):
        pytest.skip(NO_LIBAIO)
    gpus = torch.cuda.device_count()
    (tmp_path / "nvme").mkdir()
    args = ["--device", "cuda", "--config", config, "--nvme-dir", tmp_path / "nvme",
            "--epochs", "2"]  # fmt: skip
    out = run([*TORCHRUN, f"--nproc-per-node={gpus}", TRAIN, *args], cwd=tmp_path, env=ds_env(),
              timeout=1200).stdout  # fmt: skip
    assert f"{gpus} processes, cuda (nccl), ZeRO stage 3" in out, out
    assert "compute in bfloat16\n" in out, out  # the configs' bf16, picked on GPUs
    assert losses(out)[-1] < losses(out)[0], out


@pytest.mark.gpu
@NEEDS_DEEPSPEED
def test_lightning_deepspeed_on_the_gpus(tmp_path):
    gpus = torch.cuda.device_count()
    args = ["--devices", gpus, "--epochs", "2", "--fake-size", "2048"]
    out = run([sys.executable, LIGHTNING, *args], cwd=tmp_path, env=ds_env(), timeout=1200).stdout
    assert f"{gpus} processes, ZeRO stage 3, optimizer states offloaded to CPU" in out, out
    found = [float(x) for x in re.findall(r"^epoch \d+: loss (\S+)$", out, re.M)]
    assert len(found) == 2 and found[-1] < found[0], out


def test_the_pages_checkpoint_commands_resume_as_recorded(tmp_path, record_property):
    """The two commands the page shows, run as they stand in a folder with the config: the
    lines the script prints about checkpoints and epochs, compared with the recording the page
    includes (timings, losses and digests vary with the machine)."""
    from recorded import check_recorded, transcript  # noqa: PLC0415 (this test was added last)

    compile_ops(record_property, "ShareMemCommBuilder")
    (tmp_path / ZERO3.name).write_bytes(ZERO3.read_bytes())
    (tmp_path / TRAIN.name).write_bytes(TRAIN.read_bytes())
    steps, tiny = [], TINY[: TINY.index("--epochs")] + TINY[TINY.index("--epochs") + 2 :]
    for epochs in (2, 3):
        args = [*tiny, "--epochs", str(epochs), "--checkpoint-dir", "ck"]
        command = f"torchrun --standalone --nproc-per-node=2 {TRAIN.name} {' '.join(args)}"
        out = run([*TORCHRUN, "--nproc-per-node=2", TRAIN.name, *args], cwd=tmp_path,
                  env=ds_env(), timeout=600).stdout  # fmt: skip
        kept = ("no checkpoint in ", "resumed from ", "epoch ", "saved ", "wrote ")
        steps.append((command, "".join(line for line in out.splitlines(keepends=True)
                                       if line.startswith(kept))))  # fmt: skip
    check_recorded(
        DS / "deepspeed_train-resume.out",
        transcript(*steps),
        volatile=[
            (r"\d+ samples/s", "… samples/s"),
            (r"loss \d+\.\d+", "loss …"),
            (r"sha256 [0-9a-f]{16}", "sha256 …"),
        ],
    )
