"""examples/ddp/: DistributedDataParallel under torchrun and as srun tasks, on CPU with gloo."""

import csv
import re
import sys
import time

import pytest
import torch

from conftest import (
    EXAMPLES,
    TORCHRUN,
    epoch_losses,
    example_env,
    free_port,
    gpus_used,
    launch,
    run,
)

DDP = EXAMPLES / "ddp" / "ddp.py"
SCALING = EXAMPLES / "ddp" / "ddp_scaling.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3"]


losses = epoch_losses


def test_torchrun_trains_two_replicas(tmp_path):
    out = run([*TORCHRUN, "--nproc-per-node=2", DDP, *TINY], cwd=tmp_path, timeout=120).stdout
    assert "2 processes, cpu (gloo), global batch 128, learning rate 0.02" in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out


def test_srun_style_tasks_train_together(tmp_path):
    """What srun gives each task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the job script
    exports MASTER_ADDR and MASTER_PORT."""
    ranks = launch([sys.executable, DDP, *TINY, "--num-workers", "0"], cwd=tmp_path)
    assert [rc for rc, _, _ in ranks] == [0, 0], ranks
    out = ranks[0][1]
    assert "2 processes, cpu (gloo), global batch 128" in out and ranks[1][1] == ""
    assert losses(out)[-1] < losses(out)[0], out


def test_without_a_launcher_it_names_the_missing_variables(tmp_path):
    proc = run([sys.executable, DDP, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert (
        "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start this script "
        "with torchrun or srun" in proc.stderr
    )
    assert proc.stderr.count("\n") == 1


def test_in_a_pbs_job_without_torchrun_it_says_how_pbs_starts_it(tmp_path):
    env = example_env(PBS_JOBID="12.pbs-n1", NCPUS=4)
    proc = run([sys.executable, DDP, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert (
        "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start this script "
        "with torchrun, one per node (see ddp_torchrun.pbs)" in proc.stderr
    ), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_srun_without_master_variables_names_them(tmp_path):
    env = example_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    proc = run([sys.executable, DDP, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert "MASTER_ADDR, MASTER_PORT not set: export them in the job script" in proc.stderr


def test_rank_outside_the_world_is_refused(tmp_path):
    env = example_env(RANK=2, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    proc = run([sys.executable, DDP, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert "rank 2 is outside a world of 2 processes" in proc.stderr


def test_a_missing_process_stops_the_run_within_seconds(tmp_path):
    """WORLD_SIZE says 2, one process starts: a clear message after --init-timeout, no hang."""
    env = example_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    start = time.monotonic()
    proc = run([sys.executable, DDP, *TINY, "--init-timeout", "3"], cwd=tmp_path, env=env,
               expect_rc=2, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 30  # imports under load take most of it; no hang
    assert "rank 0: not all 2 processes reached 127.0.0.1:" in proc.stderr
    assert "check that the world size matches the processes started" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_without_data_it_says_how_to_fetch_it(tmp_path):
    args = ["--device", "cpu", "--data-dir", tmp_path / "none"]
    proc = run([*TORCHRUN, "--nproc-per-node=1", DDP, *args], cwd=tmp_path, expect_rc=None)
    assert proc.returncode != 0
    assert "ddp.py: error: no CIFAR-10 in" in proc.stderr and "on a login node" in proc.stderr


def test_scaling_writes_the_csv_the_page_shows(tmp_path):
    output = tmp_path / "scaling.csv"
    args = ["--processes", "1", "2", "--epochs", "2", "--fake-size", "1024", "--output", output]
    out = run([sys.executable, SCALING, *args], cwd=tmp_path, timeout=300).stdout
    assert re.search(r"^2 processes: \d+ images/s$", out, re.M), out
    committed = (EXAMPLES / "ddp" / "ddp_scaling.csv").read_text().splitlines()
    written = output.read_text().splitlines()
    for lines in (committed, written):  # same layout: command, machine, then the columns
        assert lines[0].startswith("# torchrun --standalone --nproc-per-node=N ddp.py")
        assert lines[1].startswith("# ") and lines[2] == "processes,images_per_s,speedup"
    rows = list(csv.DictReader(committed[2:]))
    assert [row["processes"] for row in rows] == ["1", "2"] and rows[0]["speedup"] == "1.00"


@pytest.mark.gpu
def test_torchrun_on_the_gpus(tmp_path):
    gpus = torch.cuda.device_count()
    args = ["--device", "cuda", "--fake-data", "--epochs", "2"]
    out = run([*TORCHRUN, f"--nproc-per-node={gpus}", DDP, *args], cwd=tmp_path,
              timeout=300).stdout  # fmt: skip
    assert f"{gpus} processes, cuda (nccl)" in out and losses(out)[-1] < losses(out)[0]
    # One line per process, each naming its own GPU: site-check counts them.
    assert gpus_used(out)[0] == gpus, out
