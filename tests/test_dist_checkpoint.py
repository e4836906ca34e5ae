"""examples/dist-checkpoint/: checkpoints of DDP (rank 0 writes) and of FSDP2 (DCP, sharded),
resumed, resharded to another number of processes and converted, on CPU with gloo."""

import re
import subprocess
import sys
import time

import pytest
import torch
from recorded import check_recorded

from conftest import (
    EXAMPLES,
    TORCHRUN,
    epoch_losses,
    example_env,
    free_port,
    launch,
    load_example,
    on_a_small_disk,
    run,
)

FOLDER = EXAMPLES / "dist-checkpoint"
DDP = FOLDER / "ddp_checkpoint.py"
FSDP = FOLDER / "fsdp_dcp.py"
DDP_TINY = ["--device", "cpu", "--fake-data", "--fake-size", "512", "--num-workers", "0"]
FSDP_TINY = [*DDP_TINY, "--width", "64", "--blocks", "2"]


def srun_tasks(script, args, *, cwd, world=2, timeout=120):
    """world srun-style tasks of script: rank 0's stdout, after checking that every process
    exited 0 and that only rank 0 printed."""
    ranks = launch([sys.executable, script, *args], cwd=cwd, world=world, timeout=timeout)
    assert [rc for rc, _, _ in ranks] == [0] * world, ranks
    assert all(out == "" for _, out, _ in ranks[1:]), ranks  # only rank 0 prints
    return ranks[0][1]


def digest(out):
    """The final weights digest a script printed."""
    return re.search(r"^Weights digest: ([0-9a-f]{16})$", out, re.M)[1]


def timed(record_property, what, start):
    record_property("timing", f"{what}: {time.perf_counter() - start:.1f} s")


def test_ddp_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, record_property):
    """2 epochs at once, or 1 epoch and a resumed run to 2: bit-for-bit the same weights.

    On CPU with gloo and a fixed number of processes and threads this is exact: the data, the
    shuffle and every sum happen in the same order, so no tolerance is needed."""
    start = time.perf_counter()
    whole = srun_tasks(DDP, [*DDP_TINY, "--epochs", 2, "--output-dir", "whole"], cwd=tmp_path)
    timed(record_property, "ddp_checkpoint.py --epochs 2, 2 srun-style tasks", start)
    assert "No checkpoint in whole: starting from scratch" in whole
    assert "2 processes, cpu (gloo), global batch 128, epochs 1 to 2" in whole
    assert "Saved whole/epoch-1.pt" in whole and "Saved whole/epoch-2.pt" in whole
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == [".lock", "epoch-1.pt",
                                                                       "epoch-2.pt"]  # fmt: skip

    start = time.perf_counter()
    first = srun_tasks(DDP, [*DDP_TINY, "--epochs", 1, "--output-dir", "parts", "--keep", 1],
                       cwd=tmp_path)  # fmt: skip
    timed(record_property, "ddp_checkpoint.py --epochs 1, 2 srun-style tasks", start)
    start = time.perf_counter()
    args = [*DDP_TINY, "--epochs", "2", "--output-dir", "parts", "--keep", "1"]
    env = example_env(OMP_NUM_THREADS=1)
    second = run([*TORCHRUN, "--nproc-per-node=2", DDP, *args], cwd=tmp_path, env=env).stdout
    timed(record_property, "ddp_checkpoint.py resumed to --epochs 2, torchrun", start)
    assert "Resumed from parts/epoch-1.pt, saved after epoch 1" in second
    assert "epochs 2 to 2" in second and "epoch 1:" not in second
    assert epoch_losses(first) + epoch_losses(second) == epoch_losses(whole), (first, second)
    assert epoch_losses(whole)[1] < epoch_losses(whole)[0], whole
    assert digest(second) == digest(whole) != digest(first), (second, whole)
    # --keep 1: only the newest file is left, and no temporary file
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [".lock", "epoch-2.pt"]

    # The file loads with weights_only=True into a plain model: no "module." prefix.
    state = torch.load(tmp_path / "parts" / "epoch-2.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])
    example = load_example(DDP)
    model = example.make_model(torch)
    model.load_state_dict(state["model"])  # strict: every key matches
    assert example.weights_digest(torch, model.state_dict()) == digest(whole)
    assert state["optimizer"]["state"], "the momentum buffers are part of the checkpoint"


def test_fsdp_checkpoint_reshards_to_4_and_to_1_process_and_converts(tmp_path, record_property):
    """Saved by 2 processes, resumed by 4, read back by 1: the same weights each time."""
    start = time.perf_counter()
    first = srun_tasks(FSDP, [*FSDP_TINY, "--epochs", 1], cwd=tmp_path)
    timed(record_property, "fsdp_dcp.py --epochs 1, 2 srun-style tasks", start)
    assert "2 processes, cpu (gloo), shards of 1/2, epochs 1 to 1" in first
    assert "Saved checkpoints/epoch-1" in first
    saved = tmp_path / "checkpoints" / "epoch-1"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    start = time.perf_counter()
    second = srun_tasks(FSDP, [*FSDP_TINY, "--epochs", 2], cwd=tmp_path, world=4)
    timed(record_property, "fsdp_dcp.py resumed to --epochs 2, 4 srun-style tasks", start)
    assert (
        "Resumed from checkpoints/epoch-1, saved by 2 processes after epoch 1, loaded by 4: "
        f"weights digest {digest(first)}"
    ) in second
    assert "4 processes, cpu (gloo), shards of 1/4, epochs 2 to 2" in second
    resumed = next(line for line in second.splitlines() if line.startswith("Resumed from"))
    check_recorded(FOLDER / "fsdp_dcp-resharded.out", resumed,
                   volatile=[(r"weights digest [0-9a-f]{16}", "weights digest …")])  # fmt: skip
    assert epoch_losses(second)[0] < epoch_losses(first)[0], (first, second)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == [".lock", "epoch-1", "epoch-2"], kept  # no epoch-2.tmp left behind
    written = sorted(p.name for p in (tmp_path / "checkpoints" / "epoch-2").iterdir())
    assert written == [".metadata", *(f"__{rank}_0.distcp" for rank in range(4))]

    start = time.perf_counter()
    third = srun_tasks(FSDP, [*FSDP_TINY, "--epochs", 2], cwd=tmp_path, world=1)
    timed(record_property, "fsdp_dcp.py read back by 1 process", start)
    assert (
        "Resumed from checkpoints/epoch-2, saved by 4 processes after epoch 2, loaded by 1: "
        f"weights digest {digest(second)}"
    ) in third
    assert "no epoch to train (--epochs 2)" in third and digest(third) == digest(second)

    start = time.perf_counter()
    args = ["--convert", "checkpoints/epoch-2", "model.pt", "--width", "64", "--blocks", "2"]
    out = run([sys.executable, FSDP, *args], cwd=tmp_path).stdout
    timed(record_property, "fsdp_dcp.py --convert", start)
    assert out == f"Wrote model.pt: the model after epoch 2, weights digest {digest(second)}\n"
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["epoch"] == 2 and state["world"] == 4
    assert all(type(t) is torch.Tensor for t in state["model"].values())  # no DTensor left

    # Resuming with another model: one line, not DCP's traceback.
    proc = run([sys.executable, FSDP, *FSDP_TINY, "--width", "32", "--epochs", "3"],
               cwd=tmp_path, env=one_of(1), expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "fsdp_dcp.py: error: cannot resume from checkpoints/epoch-2: Size mismatch between saved "
        "torch.Size([64, 3072]) and current: torch.Size([32, 3072]) for model.1.weight "
        "(--width and --blocks must be those of the run that saved it)\n"
    )
    check_recorded(FOLDER / "fsdp_dcp-width-mismatch.out", proc.stderr)

    # Converting with another model, or onto a full file system: one line, and no file with
    # the target's name or a .tmp one is left.
    args = ["--convert", "checkpoints/epoch-2", "other.pt", "--width", "32", "--blocks", "2"]
    proc = run([sys.executable, FSDP, *args], cwd=tmp_path, expect_rc=2)
    assert (
        proc.stderr.startswith(
            "fsdp_dcp.py: error: checkpoints/epoch-2 does not match --width 32 --blocks 2: "
            "size mismatch for "
        )
        and proc.stderr.count("\n") == 1
    ), proc.stderr
    assert not list(tmp_path.glob("other.pt*"))
    convert = [sys.executable, FSDP, "--convert", "checkpoints/epoch-2", "small/model.pt",
               "--width", "64", "--blocks", "2"]  # fmt: skip
    proc, kept = on_a_small_disk(convert, tmp_path, "small", "64k")
    assert proc.returncode == 2 and not list(kept.iterdir()), (proc.stderr, list(kept.iterdir()))
    assert (
        proc.stderr.startswith(
            "fsdp_dcp.py: error: cannot write small/model.pt: no space left (the file system"
        )
        and proc.stderr.count("\n") == 1
    ), proc.stderr


def one_of(world, rank=0, **extra):
    """The environment of one process in a world of world processes, as torchrun sets it."""
    return example_env(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=free_port(), **extra)  # fmt: skip


@pytest.mark.parametrize(
    ("script", "how"),
    [(DDP, "start this script with torchrun or srun"),
     (FSDP, "start this script with torchrun or srun (see fsdp_dcp.sbatch)")],
    ids=["ddp", "fsdp"],
)  # fmt: skip
def test_without_a_launcher_it_names_the_missing_variables(tmp_path, script, how):
    proc = run([sys.executable, script, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        f"{script.name}: error: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: "
        f"{how}\n"
    )


@pytest.mark.parametrize("script", [DDP, FSDP], ids=["ddp", "fsdp"])
def test_srun_without_master_variables_names_them(tmp_path, script):
    env = example_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    proc = run([sys.executable, script, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert proc.stderr.startswith(
        f"{script.name}: error: MASTER_ADDR, MASTER_PORT not set: export them in the job script"
    )
    assert proc.stderr.count("\n") == 1


def test_rank_outside_the_world_and_keep_0_are_refused(tmp_path):
    proc = run([sys.executable, FSDP, "--fake-data"], cwd=tmp_path, env=one_of(2, rank=2),
               expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "fsdp_dcp.py: error: rank 2 is outside a world of 2 processes (RANK, WORLD_SIZE)\n"
    )
    proc = run([sys.executable, DDP, "--fake-data", "--keep", "0"], cwd=tmp_path,
               env=one_of(2), expect_rc=2)  # fmt: skip
    assert proc.stderr.startswith("usage: ddp_checkpoint.py ") and proc.stderr.endswith(
        "ddp_checkpoint.py: error: argument --keep: must be a positive integer (got 0)\n"
    )  # refused when parsed, before the environment is looked at


def test_a_missing_process_stops_both_scripts_within_seconds(tmp_path):
    """WORLD_SIZE says 2, one process starts: a clear message after --init-timeout, no hang.
    Both scripts wait at once, to keep the test short."""
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--device", "cpu", "--fake-data", "--init-timeout", "3"],
            cwd=tmp_path,
            env=one_of(2),
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for script in (DDP, FSDP)
    ]
    errors = [proc.communicate(timeout=60)[1] for proc in procs]
    assert time.monotonic() - start < 30  # imports under load take most of it; no hang
    assert [proc.returncode for proc in procs] == [2, 2], errors
    for script, stderr in zip((DDP, FSDP), errors, strict=True):
        assert stderr.startswith(f"{script.name}: error: rank 0: not all 2 processes reached "
                                 "127.0.0.1:"), stderr  # fmt: skip
        assert "check that the world size matches the processes started" in stderr
        assert stderr.count("\n") == 1 and "Traceback" not in stderr


def test_convert_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "epoch-1.tmp").mkdir(parents=True)  # a save cut short
    args = ["--convert", "checkpoints/epoch-1.tmp", "model.pt"]
    proc = run([sys.executable, FSDP, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "fsdp_dcp.py: error: checkpoints/epoch-1.tmp is not a complete DCP checkpoint: "
        "it has no .metadata file\n"
    )
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_without_a_gpu_says_how_to_request_one(tmp_path):
    proc = run([sys.executable, DDP, "--device", "cuda", "--fake-data"], cwd=tmp_path,
               env=one_of(2), expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "ddp_checkpoint.py: error: local rank 0 but 0 GPUs visible: request one GPU per process "
        "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)\n"
    )


def test_job_script_keeps_the_checkpoints_of_a_run_beyond_the_job():
    """The run itself is in test_slurm.py; here: where fsdp_dcp.sbatch puts the checkpoints."""
    text = (FOLDER / "fsdp_dcp.sbatch").read_text()
    setting = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert setting["nodes"] == "2" and setting["ntasks-per-node"] == setting["gpus-per-node"]
    assert 'CHECKPOINTS="$SLURM_SUBMIT_DIR/checkpoints/$RUN"' in text
    assert "RUN=${RUN:-$SLURM_JOB_ID}" in text  # a requeued job keeps its id, and its folder
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "SLURM_TMPDIR" not in code  # node-local and deleted at the end of the job
    srun = 'srun -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python fsdp_dcp.py'
    assert f'{srun} --num-workers=1 --output-dir="$CHECKPOINTS" "$@"' in text


@pytest.mark.gpu
def test_on_the_gpus_each_rank_loads_onto_its_own_gpu(tmp_path):
    """DDP on every GPU, 1 epoch then resumed (map_location=cuda:<local rank>); FSDP saved by
    every GPU and read back by one, with the same weights."""
    gpus = torch.cuda.device_count()
    nproc = f"--nproc-per-node={gpus}"
    args = ["--device", "cuda", "--fake-data", "--fake-size", "4096"]
    first = run([*TORCHRUN, nproc, DDP, *args, "--epochs", "1"], cwd=tmp_path, timeout=300).stdout
    second = run([*TORCHRUN, nproc, DDP, *args, "--epochs", "2"], cwd=tmp_path, timeout=300).stdout
    assert f"{gpus} processes, cuda (nccl)" in first
    assert "Resumed from checkpoints/epoch-1.pt, saved after epoch 1" in second
    assert epoch_losses(second)[0] < epoch_losses(first)[0], (first, second)

    args = [*args, "--output-dir", "sharded", "--width", "256", "--blocks", "2"]
    saved = run([*TORCHRUN, nproc, FSDP, *args, "--epochs", "1"], cwd=tmp_path,
                timeout=300).stdout  # fmt: skip
    read = run([*TORCHRUN, "--nproc-per-node=1", FSDP, *args, "--epochs", "1"], cwd=tmp_path,
               timeout=300).stdout  # fmt: skip
    assert f"{gpus} processes, cuda (nccl), shards of 1/{gpus}" in saved
    assert f"saved by {gpus} processes after epoch 1, loaded by 1: weights digest " in read
    assert digest(read) == digest(saved)
