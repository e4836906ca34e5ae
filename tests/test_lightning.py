"""examples/lightning/: PyTorch Lightning's Trainer on CPU with gloo, alone and as srun tasks."""

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from recorded import check_recorded

from conftest import (
    EXAMPLES,
    STALL,
    epoch_losses,
    example_env,
    free_port,
    launch,
    run,
    slurm_task_env,
)

TRAIN = EXAMPLES / "lightning" / "lightning_train.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3",
        "--num-workers", "0"]  # fmt: skip


losses = epoch_losses


def srun_env(rank, tasks=2, **extra):
    """What srun gives task `rank` of a one-node step (and the job script's MASTER_*)."""
    return slurm_task_env(rank, tasks, SLURM_STEP_NUM_TASKS=tasks, **extra)


def start_tasks(args, cwd, **extra):
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, TRAIN, *args],
            cwd=cwd,
            env=srun_env(rank, MASTER_PORT=port, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


def test_lightning_starts_two_processes_and_the_loss_goes_down(tmp_path, record_property):
    start = time.perf_counter()
    proc = run([sys.executable, TRAIN, *TINY, "--devices", "2", "--output-dir", "out"],
               cwd=tmp_path, env=example_env(OMP_NUM_THREADS=1), timeout=120)  # fmt: skip
    record_property("timing", f"lightning, 2 processes: {time.perf_counter() - start:.1f} s")
    out = proc.stdout
    assert "world size 2: 1 node(s) x 2 devices, cpu (gloo), LightningEnvironment" in out, out
    assert "rank 0/2 on " in out and "rank 1/2 on " in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out
    # Not a terminal: no progress bar (it redraws its line with carriage returns).
    assert "\r" not in out and "it/s" not in out and "Epoch 0" not in out, out
    assert (tmp_path / "out" / "lightning_logs").is_dir()


def test_in_a_terminal_the_progress_bar_shows(tmp_path):
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    args = [*TINY, "--fake-size", "128", "--epochs", "1", "--output-dir", "out"]
    proc = subprocess.Popen([sys.executable, TRAIN, *args], cwd=tmp_path, env=example_env(),
                            stdout=terminal, stderr=subprocess.PIPE, text=True)  # fmt: skip
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the script has exited and closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert re.search(rb"Epoch 0: +100%.*it/s", shown), shown
    assert b"epoch 1: loss " in shown


def test_srun_tasks_stop_on_sigusr1_requeue_and_resume(tmp_path, record_property):
    """Slurm's --signal=SIGUSR1@90: both tasks save at the same step and stop, rank 0 runs
    `scontrol requeue`; the requeued job resumes from the checkpoint."""
    bin_dir = tmp_path / "bin"  # a stand-in scontrol that records its arguments
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "scontrol.log"
    path = f"{bin_dir}{os.pathsep}{example_env()['PATH']}"
    args = [*TINY, "--epochs", "4", "--output-dir", "out"]

    start = time.perf_counter()
    procs = start_tasks(args, tmp_path, PATH=path, SCONTROL_LOG=log)
    first_lines = []
    for line in procs[0].stdout:  # wait until training runs, then signal like Slurm does
        first_lines.append(line)
        if line.startswith("epoch 1:"):
            break
    for proc in procs:
        proc.send_signal(signal.SIGUSR1)
    outputs = [proc.communicate(timeout=120) for proc in procs]
    record_property("timing", f"lightning, 2 srun tasks: {time.perf_counter() - start:.1f} s")
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    out = "".join(first_lines) + outputs[0][0]
    assert "world size 2: 1 node(s) x 2 devices, cpu (gloo), SLURMEnvironment" in out, out
    assert "rank 1/2 on n1, cpu" in outputs[1][0]
    assert re.search(r"^SIGUSR1: stopped at epoch \d, step \d+, saved out/requeue.ckpt$", out, re.M)
    assert "requeuing job 4242: it will resume from out/requeue.ckpt" in out
    assert log.read_text() == "requeue 4242\n"
    assert (tmp_path / "out" / "requeue.ckpt").is_file()
    stopped_at = int(re.search(r"stopped at epoch (\d)", out)[1])

    procs = start_tasks(args, tmp_path, PATH=path, SCONTROL_LOG=log)
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    out = outputs[0][0]
    assert f"resumed from out/requeue.ckpt at epoch {stopped_at}, step " in out, out
    assert losses(out) and len(losses(out)) == 4 - stopped_at + 1, out  # the rest, not all 4
    assert log.read_text() == "requeue 4242\n"  # not requeued again


@pytest.mark.parametrize(
    ("extra", "args", "message"),
    [
        (
            {},
            ["--devices", "1"],
            "You set `devices=1` in Lightning, but the number of tasks per node configured in "
            "SLURM `--ntasks-per-node=2` does not match. HINT: Set `devices=2`.",
        ),
        (
            {},
            ["--num-nodes", "2"],
            "You set `num_nodes=2` in Lightning, but the number of nodes configured in SLURM "
            "`--nodes=1` does not match. HINT: Set `num_nodes=1`.",
        ),
        (  # srun -n 2, without --ntasks-per-node
            {"SLURM_NTASKS_PER_NODE": None},
            [],
            "You set `--ntasks=2` in your SLURM bash script, but this variable is not supported. "
            "HINT: Use `--ntasks-per-node=2` instead.",
        ),
    ],
    ids=["devices", "nodes", "ntasks"],
)
def test_a_trainer_that_differs_from_srun_stops_with_lightnings_message(
    tmp_path, extra, args, message
):
    env = srun_env(0, MASTER_PORT=free_port())
    for name, value in extra.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    proc = run([sys.executable, TRAIN, *TINY, *args], cwd=tmp_path, env=env, expect_rc=2)
    assert proc.stderr.endswith(f"lightning_train.py: error: {message}\n"), proc.stderr
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stderr


def test_leaked_slurm_variables_stop_at_once_instead_of_hanging(tmp_path):
    """`python lightning_train.py` in a job shell: SLURM_NTASKS=2 but no srun step. Lightning
    alone waits at "Initializing distributed" for the second process, for 30 minutes."""
    env = srun_env(0, MASTER_PORT=free_port())
    del env["SLURM_STEP_NUM_TASKS"]  # the batch shell, or salloc's, has no step
    start = time.monotonic()
    proc = run([sys.executable, TRAIN, *TINY], cwd=tmp_path, env=env, expect_rc=2, timeout=60)
    assert time.monotonic() - start < 30
    assert (
        "lightning_train.py: error: SLURM_NTASKS=2 but srun started 1: Lightning would wait "
        "for 1 more process(es) that never come. Run the script with srun" in proc.stderr
    )
    assert proc.stderr.count("\n") == 1 and "Initializing distributed" not in proc.stderr
    check_recorded(TRAIN.parent / "lightning_train-no-srun.out", proc.stderr)


def test_the_advice_for_one_process_in_a_job_shell_works(tmp_path):
    """What the message above suggests: SLURM_JOB_NAME=interactive, Lightning ignores Slurm."""
    env = srun_env(0, SLURM_JOB_NAME="interactive", MASTER_PORT=free_port())
    del env["SLURM_STEP_NUM_TASKS"]
    args = [*TINY, "--fake-size", "256", "--epochs", "1", "--output-dir", "out"]
    proc = run([sys.executable, TRAIN, *args], cwd=tmp_path, env=env, timeout=120)
    assert "world size 1: 1 node(s) x 1 devices, cpu (gloo), LightningEnvironment" in proc.stdout
    assert len(losses(proc.stdout)) == 1


def test_a_missing_task_stops_the_run_within_seconds(tmp_path):
    """srun says 2 tasks, only rank 0 starts: a clear message after --init-timeout."""
    env = srun_env(0, MASTER_PORT=free_port())
    start = time.monotonic()
    proc = run([sys.executable, TRAIN, *TINY, "--init-timeout", "3"], cwd=tmp_path, env=env,
               expect_rc=2, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 30
    assert "lightning_train.py: error: rank 0: not all 2 processes met within 3 s (" in proc.stderr
    assert "check that srun started one task per device on every node" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_data_it_says_how_to_fetch_it(tmp_path):
    proc = run([sys.executable, TRAIN, "--device", "cpu", "--data-dir", tmp_path / "none"],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr.startswith("lightning_train.py: error: no CIFAR-10 in ")
    assert "on a login node" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPU")
def test_without_a_gpu_it_says_how_to_request_one(tmp_path):
    proc = run([sys.executable, TRAIN, "--device", "cuda", "--fake-data"], cwd=tmp_path,
               expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "lightning_train.py: error: --device cuda but no GPU is visible: request one (Slurm: "
        "--gpus-per-node=1, PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)\n"
    )


@pytest.mark.gpu
def test_lightning_on_the_gpus(tmp_path):
    gpus = torch.cuda.device_count()
    args = ["--device", "cuda", "--devices", gpus, "--fake-data", "--epochs", "2",
            "--output-dir", "out"]  # fmt: skip
    out = run([sys.executable, TRAIN, *args], cwd=tmp_path, timeout=300).stdout
    assert (
        f"world size {gpus}: 1 node(s) x {gpus} devices, cuda (nccl), LightningEnvironment" in out
    )
    assert losses(out)[-1] < losses(out)[0], out


def test_a_task_busier_than_the_start_up_timeout_does_not_kill_the_job(tmp_path):
    """Rank 0 stalls for longer than --init-timeout at the start of epoch 2 (as when it writes
    a large checkpoint): DDPStrategy's timeout, which bounds every collective, is --timeout."""
    (tmp_path / "stall.py").write_text(STALL)
    ranks = launch(
        [sys.executable, "stall.py", TRAIN, *TINY, "--epochs", "2", "--fake-size", "256",
         "--init-timeout", "5"],
        cwd=tmp_path, env=lambda **v: srun_env(v.pop("SLURM_PROCID"), **v), STALL_SECONDS=9,
        timeout=180,
    )  # fmt: skip
    assert [rc for rc, _, _ in ranks] == [0, 0], ranks
    assert "epoch 2: loss " in ranks[0][1], ranks[0]
