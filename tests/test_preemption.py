"""examples/preemption/: save a checkpoint on SIGUSR1 or SIGTERM, requeue, resume (no Slurm).

The job script's test under a real Slurm cluster, with `scancel --signal=USR1 --batch` and a
real requeue, is in test_slurm.py.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import EXAMPLES, copy_example, epoch_losses, example_env, run

SCRIPT = EXAMPLES / "preemption" / "preemptible.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "3"]
CHECKPOINTED = 75  # the exit code the page documents


def digest(out):
    return re.search(r"^finished: \d+ epochs, weights sha256 ([0-9a-f]{16})$", out, re.M)[1]


def signal_after_first_epoch(cmd, signum, *, cwd, env, group=False):
    """Start cmd, send signum once it has printed its first epoch line, to the process or to
    all the processes of its group (as Slurm signals all of a job's); return (rc, out, err)."""
    proc = subprocess.Popen(
        [str(part) for part in cmd], cwd=cwd, env=env, text=True, start_new_session=group,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    shown = []
    for line in proc.stdout:  # a line at a time: the script runs unbuffered
        shown.append(line)
        if line.startswith("epoch 1:"):
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            break
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(shown) + out, err


def test_sigusr1_saves_and_the_resumed_run_ends_like_an_uninterrupted_one(
    tmp_path, record_property
):
    start = time.perf_counter()
    straight = run([sys.executable, SCRIPT, *TINY, "--checkpoint-dir", "straight"], cwd=tmp_path)
    assert "512 images, cpu, checkpoints in straight" in straight.stdout
    losses = epoch_losses(straight.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0], straight.stdout

    cmd = [sys.executable, SCRIPT, *TINY, "--checkpoint-dir", "ckpt"]
    rc, out, err = signal_after_first_epoch(cmd, signal.SIGUSR1, cwd=tmp_path, env=example_env())
    assert rc == CHECKPOINTED, out + err
    saved = re.search(r"^SIGUSR1: checkpoint saved at epoch 2, step (\d+)$", out, re.M)
    assert saved and "epoch 2:" not in out and not err, out + err
    step = int(saved[1])
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)  # plain data only
    assert (state["epoch"], state["step"]) == (1, step)  # 0-based epoch, steps done in it
    assert sorted(state) == ["epoch", "images", "loss_sum", "model", "optimizer", "step"]
    assert not list((tmp_path / "ckpt").glob("*.tmp"))  # the temporary file was renamed

    resumed = run(cmd, cwd=tmp_path).stdout
    assert f"resumed from ckpt/checkpoint.pt at epoch 2, step {step}\n" in resumed
    assert re.findall(r"^epoch (\d+):", resumed, re.M) == ["2", "3"], resumed  # the rest only
    assert epoch_losses(resumed) == losses[1:]  # the interrupted epoch's loss counts all steps
    assert "finished: 3 epochs" in resumed and digest(resumed) == digest(straight.stdout)

    again = run(cmd, cwd=tmp_path).stdout  # a job requeued once too often trains no more
    assert "resumed from ckpt/checkpoint.pt: 3 epochs done already" in again
    assert "epoch " not in again.replace("epochs", "") and digest(again) == digest(resumed)
    record_property(
        "timing", f"preemption, 4 runs of preemptible.py: {time.perf_counter() - start:.1f} s"
    )


def test_sigterm_to_every_process_spares_the_dataloader_workers(tmp_path):
    """At the time limit or the end of a preemption's grace time, Slurm sends SIGTERM to all
    the processes of the job: a DataLoader worker that died of it would stop the training
    with "DataLoader worker (pid(s) ...) exited unexpectedly" before the checkpoint."""
    cmd = [sys.executable, SCRIPT, *TINY, "--num-workers", "2", "--checkpoint-dir", "ckpt"]
    env = example_env()
    rc, out, err = signal_after_first_epoch(cmd, signal.SIGTERM, cwd=tmp_path, env=env, group=True)
    assert rc == CHECKPOINTED, out + err
    assert re.search(r"^SIGTERM: checkpoint saved at epoch 2, step \d+$", out, re.M), out + err
    assert "exited unexpectedly" not in err and "Traceback" not in err, err


def scontrol_standin(tmp_path, job_env):
    """A stand-in scontrol first on PATH that records its arguments in scontrol.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "scontrol.log"
    env = {**job_env, "PATH": f"{bin_dir}:{job_env['PATH']}", "SCONTROL_LOG": str(log)}
    env.update(SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="2")
    return env, log


def test_the_job_script_forwards_usr1_and_requeues_the_job(tmp_path, job_env):
    """What Slurm does with --signal=B:USR1@120, bash alone: the signal goes to the job script,
    which passes it on to Python, then requeues the job when Python has saved."""
    copy_example(tmp_path, "preemption/preemptible.sbatch", "preemption/preemptible.py")
    env, log = scontrol_standin(tmp_path, job_env)
    cmd = ["bash", "preemptible.sbatch", *TINY]
    rc, out, err = signal_after_first_epoch(cmd, signal.SIGUSR1, cwd=tmp_path, env=env)
    assert rc == 0, out + err
    assert "Job 4242 on " in out and "SLURM_RESTART_COUNT=0" in out
    assert f"checkpoints in {tmp_path}/preemptible-4242\n" in out  # kept after the job
    assert re.search(r"^SIGUSR1: checkpoint saved at epoch 2, step \d+$", out, re.M), out
    assert f"Requeuing job 4242: it will resume from {tmp_path}/preemptible-4242" in out
    assert log.read_text() == "requeue 4242\n"

    # The requeued job: same job id, so the same folder; Slurm counts the restarts.
    env["SLURM_RESTART_COUNT"] = "1"
    out = run(cmd, cwd=tmp_path, env=env).stdout
    assert "SLURM_RESTART_COUNT=1" in out and "resumed from " in out
    assert "epoch 1:" not in out and "finished: 3 epochs" in out
    assert log.read_text() == "requeue 4242\n"  # not requeued again


def test_on_sigterm_the_job_script_saves_but_leaves_the_requeue_to_slurm(tmp_path, job_env):
    """Preemption, scancel and the time limit send SIGTERM: save, and exit with code 75."""
    copy_example(tmp_path, "preemption/preemptible.sbatch", "preemption/preemptible.py")
    env, log = scontrol_standin(tmp_path, job_env)
    cmd = ["bash", "preemptible.sbatch", *TINY]
    rc, out, err = signal_after_first_epoch(cmd, signal.SIGTERM, cwd=tmp_path, env=env)
    assert rc == CHECKPOINTED, out + err
    assert re.search(r"^SIGTERM: checkpoint saved at epoch 2, step \d+$", out, re.M), out
    assert "Requeuing" not in out and not log.exists()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "garbage checkpoint",
            "cannot resume from ckpt/checkpoint.pt (Weights only load failed): delete it",
        ),
        ("no data", "no CIFAR-10 in none: download it once on a login node with"),
        (
            "no GPU",
            "--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, PBS: "
            "-l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, case, message):
    args = [*TINY, "--checkpoint-dir", "ckpt"]
    if case == "garbage checkpoint":
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    elif case == "no data":
        args = ["--device", "cpu", "--data-dir", "none", "--checkpoint-dir", "ckpt"]
    elif torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda works here")
    else:
        args = [*args, "--device", "cuda"]
    proc = run([sys.executable, SCRIPT, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr.startswith(f"preemptible.py: error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_sigusr1_and_resume_on_the_gpu(tmp_path):
    args = ["--device", "cuda", "--fake-data", "--fake-size", "4096", "--epochs", "3"]
    straight = run([sys.executable, SCRIPT, *args, "--checkpoint-dir", "straight"], cwd=tmp_path)
    assert "4096 images, cuda" in straight.stdout
    cmd = [sys.executable, SCRIPT, *args, "--checkpoint-dir", "ckpt"]
    rc, out, err = signal_after_first_epoch(cmd, signal.SIGUSR1, cwd=tmp_path, env=example_env())
    assert rc == CHECKPOINTED and "SIGUSR1: checkpoint saved at epoch 2" in out, out + err
    resumed = run(cmd, cwd=tmp_path).stdout
    assert "resumed from ckpt/checkpoint.pt at epoch 2" in resumed
    assert re.findall(r"^epoch (\d+):", resumed, re.M) == ["2", "3"], resumed
    assert "finished: 3 epochs" in resumed  # not bit for bit: CUDA is not deterministic here
