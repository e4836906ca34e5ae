"""examples/pipeline/ and examples/pipeline-ddp/: pipeline stages with torch.distributed.pipelining,
alone and as data-parallel replicas on a 2-D device mesh, on CPU with gloo."""

import re
import socket
import sys
import time

import pytest
import torch

from conftest import (
    EXAMPLES,
    TORCHRUN,
    copy_example,
    epoch_losses,
    example_env,
    free_port,
    launch,
    run,
)

PIPELINE = EXAMPLES / "pipeline" / "pipeline.py"
PIPELINE_DDP = EXAMPLES / "pipeline-ddp" / "pipeline_ddp.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "3",
        "--num-workers", "0"]  # fmt: skip


losses = epoch_losses


def srun_style(script, processes, args, cwd, timeout=120):
    """Start the processes as srun starts tasks; return [(returncode, stdout, stderr)]."""
    return launch([sys.executable, script, *args], cwd=cwd, world=processes, timeout=timeout)


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """pipeline.py with each schedule under torchrun: {schedule: (process, seconds)}."""
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        start = time.perf_counter()
        proc = run([*TORCHRUN, "--nproc-per-node=2", PIPELINE, *TINY, "--schedule", schedule],
                   cwd=tmp_path_factory.mktemp(schedule), env=example_env(OMP_NUM_THREADS=1),
                   timeout=120)  # fmt: skip
        runs[schedule] = proc, time.perf_counter() - start
    return runs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_with_each_schedule(schedules, schedule, record_property):
    proc, seconds = schedules[schedule]
    record_property("timing", f"pipeline.py --schedule {schedule}, 2 processes: {seconds:.1f} s")
    out = proc.stdout
    assert out.startswith(
        f"2 stages, cpu (gloo), schedule {schedule}, 4 micro-batches of 16 images, "
        "learning rate 0.025\n"
    ), out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out
    assert "Traceback" not in proc.stderr


def test_both_schedules_compute_the_same_gradients(schedules):
    gpipe, one_f_one_b = (losses(schedules[name][0].stdout) for name in ("gpipe", "1f1b"))
    assert gpipe == pytest.approx(one_f_one_b, abs=2e-4)


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """2 replicas x 2 stages, started as srun starts 4 tasks (pipeline_ddp.sbatch)."""
    start = time.perf_counter()
    results = srun_style(PIPELINE_DDP, 4, TINY, tmp_path_factory.mktemp("two-by-two"))
    return results, time.perf_counter() - start


def test_replicas_of_the_pipeline_train_on_a_2d_mesh(two_by_two, record_property):
    results, seconds = two_by_two
    record_property("timing", f"pipeline_ddp.py, 2 replicas x 2 stages: {seconds:.1f} s")
    assert [rc for rc, _, _ in results] == [0, 0, 0, 0], results
    out = results[1][1]  # the last stage of replica 0 prints; the others do not
    assert [stdout for _, stdout, _ in results] == ["", out, "", ""], results
    assert out.startswith(
        "4 processes = 2 x 2 (replicas x stages), cpu (gloo), schedule 1f1b, global batch 128, "
        "learning rate 0.05\n"
    ), out
    host = socket.gethostname()
    assert f"replica 0: stage 0 on {host} (rank 0), stage 1 on {host} (rank 1)\n" in out
    assert f"replica 1: stage 0 on {host} (rank 2), stage 1 on {host} (rank 3)\n" in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out


def test_replicas_learn_what_one_pipeline_learns_from_the_global_batch(tmp_path, two_by_two):
    """DDP averages the stages' gradients over the replicas: 2 replicas with batches of 64
    follow the same losses as 1 replica with batches of 128 (the same images per step)."""
    results, _ = two_by_two
    one = srun_style(PIPELINE_DDP, 2, [*TINY, "--batch-size", "128"], tmp_path)
    assert [rc for rc, _, _ in one] == [0, 0], one
    out = one[1][1]
    assert out.startswith("2 processes = 1 x 2 (replicas x stages), cpu (gloo), schedule 1f1b, "
                          "global batch 128, learning rate 0.05\n"), out  # fmt: skip
    assert losses(out) == pytest.approx(losses(results[1][1]), abs=2e-4), (out, results[1][1])


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (PIPELINE, "pipeline.py: error: 3 processes started, 2 needed: one per pipeline stage\n"),
        (
            PIPELINE_DDP,
            "pipeline_ddp.py: error: 3 processes started: a multiple of 2 needed "
            "(replicas x stages)\n",
        ),
    ],
    ids=["pipeline", "pipeline_ddp"],
)
def test_a_wrong_number_of_processes_stops_every_one(tmp_path, script, message):
    start = time.monotonic()
    results = srun_style(script, 3, TINY, tmp_path, timeout=60)
    assert time.monotonic() - start < 30
    assert [(rc, stderr) for rc, _, stderr in results] == [(2, message)] * 3, results


@pytest.mark.parametrize("script", [PIPELINE, PIPELINE_DDP], ids=["pipeline", "pipeline_ddp"])
def test_without_a_launcher_it_names_the_missing_variables(tmp_path, script):
    proc = run([sys.executable, script, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        f"{script.name}: error: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: "
        "start this script with torchrun or srun (see the job script)\n"
    )


def test_srun_without_master_variables_names_them(tmp_path):
    env = example_env(SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_LOCALID=0)
    proc = run([sys.executable, PIPELINE_DDP, "--fake-data"], cwd=tmp_path, env=env, expect_rc=2)
    assert proc.stderr == (
        "pipeline_ddp.py: error: MASTER_ADDR, MASTER_PORT not set: export them in the job "
        "script before srun (see pipeline_ddp.sbatch)\n"
    )


def test_a_missing_process_stops_the_run_within_seconds(tmp_path):
    """WORLD_SIZE says 4, one process starts: a clear message after --init-timeout, no hang."""
    env = example_env(RANK=0, WORLD_SIZE=4, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    start = time.monotonic()
    proc = run([sys.executable, PIPELINE_DDP, *TINY, "--init-timeout", "3"], cwd=tmp_path,
               env=env, expect_rc=2, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 40  # seconds, not the default minutes
    assert proc.stderr.startswith("pipeline_ddp.py: error: rank 0: not all 4 processes reached ")
    assert "check that the world size matches the processes started" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("microbatches", ["5", "1"])
def test_micro_batches_must_split_the_batch(tmp_path, microbatches):
    args = ["--batch-size", "64", "--microbatches", microbatches]
    proc = run([sys.executable, PIPELINE, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        f"pipeline.py: error: --batch-size 64 must split into --microbatches {microbatches} "
        "equal micro-batches, at least 2 (one per stage)\n"
    )


def one_of_two(**extra):
    """The variables torchrun gives rank 0 of 2; the other process never starts."""
    return example_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=free_port(), **extra)  # fmt: skip


@pytest.mark.parametrize("script", [PIPELINE, PIPELINE_DDP], ids=["pipeline", "pipeline_ddp"])
def test_without_data_it_says_how_to_fetch_it(tmp_path, script):
    """Checked before waiting for the other processes: one process is enough."""
    args = ["--device", "cpu", "--data-dir", tmp_path / "none"]
    proc = run([sys.executable, script, *args], cwd=tmp_path, env=one_of_two(), expect_rc=2)
    assert proc.stderr.startswith(f"{script.name}: error: no CIFAR-10 in "), proc.stderr
    assert "on a login node" in proc.stderr and proc.stderr.count("\n") == 1


ONE_GPU_EACH = "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)"


@pytest.mark.parametrize(
    ("script", "how"),
    [(PIPELINE, "one GPU per process " + ONE_GPU_EACH),
     (PIPELINE_DDP, "one GPU per process " + ONE_GPU_EACH)],
    ids=["pipeline", "pipeline_ddp"],
)  # fmt: skip
def test_without_a_gpu_it_says_how_to_request_one(tmp_path, script, how):
    env = one_of_two(CUDA_VISIBLE_DEVICES="")
    proc = run([sys.executable, script, "--device", "cuda", "--fake-data"], cwd=tmp_path,
               env=env, expect_rc=2)  # fmt: skip
    assert proc.stderr == f"{script.name}: error: local rank 0 but 0 GPUs visible: request {how}\n"


def test_one_node_job_script_runs_torchrun(tmp_path, job_env):
    """pipeline.sbatch outside Slurm, with the variables sbatch sets; the run under a real
    Slurm cluster is in test_slurm.py."""
    copy_example(tmp_path, "pipeline/pipeline.sbatch", "pipeline/pipeline.py")
    env = {**job_env, "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "4"}
    args = [*TINY, "--epochs", "2", "--schedule", "1f1b"]
    out = run(["bash", "pipeline.sbatch", *args], cwd=tmp_path, env=env, timeout=120).stdout
    assert out.startswith(f"Job 4242 on {socket.gethostname()}: 2 pipeline stages\n"), out
    assert "2 stages, cpu (gloo), schedule 1f1b" in out and len(losses(out)) == 2, out


def test_two_node_job_script_puts_a_replica_on_each_node():
    text = (EXAMPLES / "pipeline-ddp" / "pipeline_ddp.sbatch").read_text()
    setting = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert setting["nodes"] == setting["ntasks-per-node"] == setting["gpus-per-node"] == "2"
    assert (
        'srun -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python pipeline_ddp.py '
        '--num-workers=1 "$@"' in text
    )


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_on_two_gpus(tmp_path, schedule):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, one per stage; {torch.cuda.device_count()} visible")
    args = ["--device", "cuda", "--fake-data", "--epochs", "2", "--schedule", schedule]
    out = run([*TORCHRUN, "--nproc-per-node=2", PIPELINE, *args], cwd=tmp_path,
              timeout=300).stdout  # fmt: skip
    assert f"2 stages, cuda (nccl), schedule {schedule}" in out
    assert losses(out)[-1] < losses(out)[0], out


@pytest.mark.gpu
def test_replicas_of_the_pipeline_on_the_gpus(tmp_path):
    processes = torch.cuda.device_count() // 2 * 2  # whole replicas of 2 stages
    if processes < 2:
        pytest.skip(f"needs 2 GPUs or more; {torch.cuda.device_count()} visible")
    args = ["--device", "cuda", "--fake-data", "--epochs", "2"]
    out = run([*TORCHRUN, f"--nproc-per-node={processes}", PIPELINE_DDP, *args], cwd=tmp_path,
              timeout=300).stdout  # fmt: skip
    assert f"{processes} processes = {processes // 2} replicas x 2 stages, cuda (nccl)" in out
    assert losses(out)[-1] < losses(out)[0], out
