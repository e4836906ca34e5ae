"""examples/fsdp/: FSDP2 (fully_shard) under torchrun and as srun tasks, on CPU with gloo."""

import re
import sys
import time

import pytest
import torch

from conftest import EXAMPLES, TORCHRUN, epoch_losses, example_env, free_port, launch, run

FSDP = EXAMPLES / "fsdp" / "fsdp_train.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2",
        "--width", "128", "--blocks", "2", "--num-workers", "0"]  # fmt: skip
# 3072 * 128 + 128 inputs, 2 blocks of 132,224, a LayerNorm of 256, a head of 1,290
TOTAL = 658_826


losses = epoch_losses


def holdings(out):
    """{rank: (parameters held, parameters of the full model)} from rank 0's lines."""
    found = re.findall(r"^rank (\d+) on \S+ holds ([\d,]+) of ([\d,]+) parameters", out, re.M)
    return {int(r): (int(h.replace(",", "")), int(t.replace(",", ""))) for r, h, t in found}


def srun_tasks(tmp_path, args, world=2):
    """Start world processes as srun does (SLURM_PROCID, ...); return [(rc, stdout, stderr)]."""
    return launch([sys.executable, FSDP, *args], cwd=tmp_path, world=world)


def test_torchrun_shards_the_model_and_trains(tmp_path, record_property):
    start = time.perf_counter()
    out = run([*TORCHRUN, "--nproc-per-node=2", FSDP, *TINY], cwd=tmp_path, timeout=120).stdout
    record_property("timing", f"fsdp_train.py, torchrun, 2 processes: "
                    f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    assert ("2 processes, cpu (gloo), shards of 1/2, compute in float32, "
            "reshard after forward: True, CPU offload: False") in out  # fmt: skip
    held = holdings(out)
    assert sorted(held) == [0, 1], out
    for count, total in held.values():  # each rank holds half of every parameter
        assert total == TOTAL and count == TOTAL // 2, out
    assert len(losses(out)) == 2 and losses(out)[-1] < losses(out)[0], out


@pytest.mark.parametrize(
    ("option", "header"),
    [
        (["--cpu-offload"], "compute in float32, reshard after forward: True, CPU offload: True"),
        (  # two options in one run: each run costs seconds of imports on a 2-core machine
            ["--no-reshard", "--param-dtype", "bfloat16"],
            "compute in bfloat16, reshard after forward: False, CPU offload: False",
        ),
    ],
    ids=["cpu-offload", "no-reshard-bf16"],
)
def test_srun_style_tasks_with_options(tmp_path, record_property, option, header):
    start = time.perf_counter()
    results = srun_tasks(tmp_path, [*TINY, *option])
    record_property("timing", f"fsdp_train.py {' '.join(option)}, 2 srun-style tasks: "
                    f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    assert [rc for rc, _, _ in results] == [0, 0], results
    out = results[0][1]
    assert header in out and results[1][1] == "", results
    assert all(held == (TOTAL // 2, TOTAL) for held in holdings(out).values()), out
    assert len(holdings(out)) == 2 and losses(out)[-1] < losses(out)[0], out


def test_hsdp_shards_within_groups_and_replicates_across(tmp_path, record_property):
    """4 processes, --replicate 2: two replicas, each sharded over 2 processes."""
    start = time.perf_counter()
    results = srun_tasks(tmp_path, [*TINY, "--replicate", "2"], world=4)
    record_property("timing", f"fsdp_train.py --replicate 2, 4 srun-style tasks: "
                    f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    assert [rc for rc, _, _ in results] == [0, 0, 0, 0], results
    out = results[0][1]
    assert "4 processes, cpu (gloo), shards of 1/2, 2 replicas, compute in float32" in out
    held = holdings(out)
    assert sorted(held) == [0, 1, 2, 3], out
    assert all(count == (TOTAL // 2, TOTAL) for count in held.values()), out
    assert losses(out)[-1] < losses(out)[0], out


def test_without_a_launcher_it_names_the_missing_variables(tmp_path):
    proc = run([sys.executable, FSDP, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "fsdp_train.py: error: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: "
        "start this script with torchrun or srun (see fsdp.sbatch)\n"
    )


def test_srun_without_master_variables_names_them(tmp_path):
    env = example_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    proc = run([sys.executable, FSDP, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert "fsdp_train.py: error: MASTER_ADDR, MASTER_PORT not set: export them" in proc.stderr


def one_of_two(**extra):
    """The environment of rank 0 in a world of 2 processes, as torchrun sets it."""
    return example_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=free_port(), **extra)  # fmt: skip


def test_replicas_must_divide_the_processes(tmp_path):
    args = [*TINY, "--replicate", "3"]
    proc = run([sys.executable, FSDP, *args], cwd=tmp_path, env=one_of_two(), expect_rc=2)
    assert proc.stderr == "fsdp_train.py: error: --replicate 3 does not divide the 2 processes\n"


def test_a_missing_process_stops_the_run_within_seconds(tmp_path):
    """WORLD_SIZE says 2, one process starts: a clear message after --init-timeout, no hang."""
    start = time.monotonic()
    proc = run([sys.executable, FSDP, *TINY, "--init-timeout", "3"], cwd=tmp_path,
               env=one_of_two(), expect_rc=2, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 25
    assert "fsdp_train.py: error: rank 0: not all 2 processes reached 127.0.0.1:" in proc.stderr
    assert "check that the world size matches the processes started" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_without_a_gpu_says_how_to_request_one(tmp_path):
    args = ["--device", "cuda", "--fake-data"]
    proc = run([sys.executable, FSDP, *args], cwd=tmp_path, env=one_of_two(), expect_rc=2)
    assert proc.stderr == (
        "fsdp_train.py: error: local rank 0 but 0 GPUs visible: request one GPU per process "
        "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)\n"
    )


def test_without_data_it_says_how_to_fetch_it(tmp_path):
    args = ["--device", "cpu", "--data-dir", tmp_path / "none"]
    proc = run([sys.executable, FSDP, *args], cwd=tmp_path, env=one_of_two(), expect_rc=2)
    assert proc.stderr.startswith("fsdp_train.py: error: no CIFAR-10 in ")
    assert "on a login node" in proc.stderr and proc.stderr.count("\n") == 1


def test_job_script_starts_one_task_per_gpu():
    """fsdp_train.py needs a GPU per process; the Slurm run itself is in test_slurm.py."""
    text = (EXAMPLES / "fsdp" / "fsdp.sbatch").read_text()
    setting = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert setting["ntasks-per-node"] == setting["gpus-per-node"] == "2"
    assert (
        setting["nodes"] == "2"
        and 'srun -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python fsdp_train.py '
        '--num-workers=1 "$@"'
        in text
    )


@pytest.mark.gpu
@pytest.mark.parametrize("option", [[], ["--no-reshard"], ["--cpu-offload"]])
def test_torchrun_on_the_gpus(tmp_path, option):
    gpus = torch.cuda.device_count()
    args = ["--device", "cuda", "--fake-data", "--epochs", "2", *option]
    out = run([*TORCHRUN, f"--nproc-per-node={gpus}", FSDP, *args], cwd=tmp_path,
              timeout=300).stdout  # fmt: skip
    assert f"{gpus} processes, cuda (nccl), shards of 1/{gpus}, compute in bfloat16" in out
    assert f"CPU offload: {'--cpu-offload' in option}" in out
    held = holdings(out)
    assert sorted(held) == list(range(gpus)), out
    for count, total in held.values():  # at most one row more than an even share
        assert abs(count - total / gpus) < total / 100, out
    assert re.search(r"^epoch 2: loss \S+, \d+ images/s, \d+ MiB peak on rank 0$", out, re.M)
    assert losses(out)[-1] < losses(out)[0], out
