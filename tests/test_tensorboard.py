"""examples/tensorboard/: metrics logged to TensorBoard event files, read back here.

The job script (tensorboard.sbatch) runs under the tests' Slurm cluster (test_slurm.py).
"""

import re
import signal
import socket
import sys
import time

import pytest
import torch
from recorded import check_recorded

from conftest import (
    EXAMPLES,
    HAS_CUDA,
    epoch_losses,
    example_env,
    on_a_small_disk,
    run,
)

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is in requirements.txt: run make venv",
)

FOLDER = EXAMPLES / "tensorboard"
TRAIN = FOLDER / "train_tensorboard.py"
# 96 images in batches of 32: 3 steps per epoch.
TINY = ["--fake-size", "96", "--batch-size", "32", "--num-workers", "0", "--device", "cpu"]
# What changes from run to run in the recording the page shows.
VOLATILE = [
    (r"^\S+, cpu: ", "…, cpu: "),
    (r"loss [\d.]+", "loss …"),
    (r"\d+ images/s", "… images/s"),
    (r"/\S*/out/runs", "…/out/runs"),
    (r"events\.out\.tfevents\.\S+", "events.out.tfevents.…"),
    (r"(--port |localhost:|-L |\(port )\d+", r"\1…"),
    (r" \S+@<login node>", " you@<login node>"),
]


def read_scalars(run_dir):
    """{tag: [(step, value)]} of every scalar in the run's event files."""
    events = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_event_file_holds_what_the_script_printed(tmp_path):
    out = run([sys.executable, TRAIN, *TINY, "--epochs", "3", "--output-dir", "out"],
              cwd=tmp_path, timeout=120).stdout  # fmt: skip
    # On the page, with the paths and the user name of a reader instead of the test's.
    shown = re.sub(
        r" \S+@<login node>", " user@<login node>", out.replace(str(tmp_path), "/home/user/project")
    )
    check_recorded(FOLDER / "train_tensorboard.out", shown, volatile=VOLATILE)
    run_dir = tmp_path / "out" / "runs" / "local-seed0"
    assert f"3 epochs of 3 steps, logging to {run_dir}" in out, out
    (event_file,) = run_dir.glob("events.out.tfevents.*")
    assert f"Event file: {event_file}\n" in out, out
    scalars = read_scalars(run_dir)
    assert sorted(scalars) == ["epoch/images_per_s", "epoch/loss", "train/loss", "train/lr"]
    assert [step for step, _ in scalars["train/loss"]] == list(range(9))
    assert [step for step, _ in scalars["train/lr"]] == list(range(9))
    # At the step of each epoch's last batch: one axis for every tag, as purge_step needs.
    assert [step for step, _ in scalars["epoch/loss"]] == [2, 5, 8]
    assert [step for step, _ in scalars["epoch/images_per_s"]] == [2, 5, 8]

    printed = epoch_losses(out)
    logged = [value for _, value in scalars["epoch/loss"]]
    assert logged == pytest.approx(printed, abs=5e-5), (logged, printed)
    steps = [value for _, value in scalars["train/loss"]]
    per_epoch = [sum(steps[i : i + 3]) / 3 for i in (0, 3, 6)]  # each epoch's mean of its steps
    assert per_epoch == pytest.approx(printed, abs=5e-5), (per_epoch, printed)
    rates = [float(r) for r in re.findall(r"^epoch \d+: loss \S+, (\d+) images/s$", out, re.M)]
    assert [value for _, value in scalars["epoch/images_per_s"]] == pytest.approx(rates, abs=0.5)

    lrs = [value for _, value in scalars["train/lr"]]
    assert lrs[0] == pytest.approx(0.05) and lrs[-1] < lrs[0], lrs  # the cosine schedule
    assert lrs == sorted(lrs, reverse=True), lrs

    port = re.search(r"^    tensorboard --logdir (\S+) --port (\d+)$", out, re.M)
    assert port and port[1] == str(tmp_path / "out" / "runs"), out
    assert re.search(rf"^    ssh -N -L {port[2]}:localhost:{port[2]} \S+@<login node>$", out, re.M)


def test_runs_are_named_after_the_job_and_array_task(tmp_path):
    env = example_env(SLURM_JOB_ID=4243, SLURM_ARRAY_JOB_ID=4242, SLURM_ARRAY_TASK_ID=1)
    cmd = [sys.executable, TRAIN, *TINY, "--epochs", "1", "--run-name", "wide"]
    run([*cmd, "--output-dir", tmp_path], cwd=tmp_path, env=env)
    run([*cmd, "--output-dir", tmp_path], cwd=tmp_path, env=example_env(SLURM_JOB_ID=4250))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["4242_1-wide", "4250-wide"]


def test_a_second_run_with_the_same_name_adds_to_it(tmp_path):
    cmd = [sys.executable, TRAIN, *TINY, "--epochs", "1", "--output-dir", tmp_path]
    run(cmd, cwd=tmp_path)
    out = run(cmd, cwd=tmp_path).stdout
    assert f"note: {tmp_path / 'runs' / 'local-seed0'} exists: " in out, out


# Runs train_tensorboard.py (python -c KILLED SCRIPT ARGS...) and kills it with SIGKILL in its
# KILL_AT_SAVE-th torch.save: a job that ends (time limit, node failure) after it logged an
# epoch, before that epoch's checkpoint was saved.
KILLED = """
import os, runpy, signal, sys
import torch

calls, original = 0, torch.save

def save(*args, **kwargs):
    global calls
    calls += 1
    if calls == int(os.environ["KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)

torch.save = save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_resumed_run_shows_each_step_once(tmp_path):
    cmd = [TRAIN, *TINY, "--epochs", "3", "--output-dir", "out"]
    killed = run([sys.executable, "-c", KILLED, *cmd], cwd=tmp_path,
                 env=example_env(KILL_AT_SAVE=3), expect_rc=-signal.SIGKILL).stdout  # fmt: skip
    assert "epoch 3: loss " in killed, killed  # logged, but its checkpoint never saved
    run_dir = tmp_path / "out" / "runs" / "local-seed0"
    (first,) = run_dir.glob("events.out.tfevents.*")
    assert sorted(read_scalars(run_dir)["train/loss"]) != [], "the killed run logged nothing"
    # TensorBoard reads a run's event files in the order of their names, which begin with
    # the second each was opened in: the resumed run's file must sort after the first.
    while time.time() < int(first.name.split(".")[3]) + 1:
        time.sleep(0.05)

    out = run([sys.executable, *cmd], cwd=tmp_path).stdout
    checkpoint = tmp_path / "out" / "checkpoints" / "local-seed0.pt"
    assert f"resumed from {checkpoint} after epoch 2 of 3, step 6\n" in out, out
    assert f"note: {run_dir} exists: this run goes on in it from step 6\n" in out, out
    assert len(epoch_losses(out)) == 1 and "epoch 3: loss " in out, out
    scalars = read_scalars(run_dir)
    for tag, values in scalars.items():
        steps = [step for step, _ in values]
        assert sorted(steps) == sorted(set(steps)), f"{tag}: a step logged twice: {steps}"
    assert [step for step, _ in scalars["train/loss"]] == list(range(9))
    assert [step for step, _ in scalars["epoch/loss"]] == [2, 5, 8]
    # Epoch 3's values are the resumed run's, not the killed run's.
    assert scalars["epoch/loss"][-1][1] == pytest.approx(epoch_losses(out)[0], abs=5e-5)


def test_a_checkpoint_of_other_options_is_refused(tmp_path):
    cmd = [sys.executable, TRAIN, *TINY, "--output-dir", tmp_path]
    run([*cmd, "--epochs", "1"], cwd=tmp_path)
    proc = run([*cmd, "--epochs", "2"], cwd=tmp_path, expect_rc=2)
    checkpoint = tmp_path / "checkpoints" / "local-seed0.pt"
    assert proc.stderr.splitlines() == [
        f"train_tensorboard.py: error: {checkpoint} is a run with --epochs 1, not 2: pass the "
        "same options, another --run-name, or delete it to start again"
    ], proc.stderr
    checkpoint.write_bytes(b"not a checkpoint")
    proc = run([*cmd, "--epochs", "1"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr.splitlines() == [
        f"train_tensorboard.py: error: cannot resume from {checkpoint} (UnpicklingError): "
        "delete it to start again"
    ], proc.stderr


def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_checkpoint(tmp_path):
    """The output folder is a small tmpfs (in a private mount namespace): the first epoch's
    checkpoint (242 kB with torch 2.13) fits, the second's, written beside it, does not."""
    command = [sys.executable, TRAIN, *TINY, "--epochs", "2", "--output-dir", "out"]
    proc, kept = on_a_small_disk(command, tmp_path, "out", "400k")
    assert proc.returncode == 2 and "epoch 2: loss " in proc.stdout, (proc.stdout, proc.stderr)
    checkpoint = tmp_path / "out" / "checkpoints" / "local-seed0.pt"
    path = re.escape(str(checkpoint))
    assert re.fullmatch(
        rf"train_tensorboard.py: error: cannot write {path}: no space left \(the file system"
        rf"[^)]*\); {path} is intact: free some space \(df -h, or your centre's quota command\) "
        r"and run again\n",
        proc.stderr,
    ), proc.stderr
    left = sorted(p.name for p in (kept / "checkpoints").iterdir())
    assert left == ["local-seed0.pt"], left  # no .tmp file
    state = torch.load(kept / "checkpoints" / "local-seed0.pt", weights_only=True)
    assert state["epoch"] == 1


def held_ports(count):
    """(job id, sockets): a job whose first TensorBoard port and the count - 1 after it are
    held busy here, by sockets listening on them, and the port after those free."""
    for job in range(20000, 30000):  # 20000: port 16000, the old port of user id 0
        first, sockets = 16000 + job % 10000, []
        try:
            for port in range(first, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
                sockets[-1].listen()
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", first + count))
            return job, sockets
        except OSError:
            for sock in sockets:
                sock.close()
    pytest.fail("no free ports from 16000 on")


def test_the_port_is_one_of_the_job_and_free(tmp_path):
    job, sockets = held_ports(1)
    first = 16000 + job % 10000
    try:
        env = example_env(SLURM_JOB_ID=job)
        cmd = [sys.executable, TRAIN, *TINY, "--epochs", "1", "--output-dir", tmp_path]
        out = run(cmd, cwd=tmp_path, env=env).stdout
    finally:
        for sock in sockets:
            sock.close()
    port = re.search(
        r"^View the runs on a login node \(port (\d+) is free on \S+ now\):$", out, re.M
    )
    assert port and int(port[1]) == first + 1, (first, out)  # the next one: the first is held
    assert f"    tensorboard --logdir {tmp_path / 'runs'} --port {first + 1}\n" in out, out
    assert f"    ssh -N -L {first + 1}:localhost:{first + 1} " in out, out


def test_when_every_port_is_in_use_it_says_so(tmp_path):
    job, sockets = held_ports(10)
    first = 16000 + job % 10000
    try:
        env = example_env(SLURM_JOB_ID=job, SLURMD_NODENAME="n1")
        cmd = [sys.executable, TRAIN, *TINY, "--epochs", "1", "--output-dir", tmp_path]
        out = run(cmd, cwd=tmp_path, env=env).stdout
    finally:
        for sock in sockets:
            sock.close()
    assert (f"note: ports {first} to {first + 9} are all in use on n1: choose another with "
            "--port and in the tunnel\n") in out, out  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "argument --epochs: must be a positive integer (got 0)"),
        (["--lr", "-1"], "argument --lr: must be a positive number (got -1)"),
        (["--run-name", "a/b"], "argument --run-name: must be a plain folder name (got 'a/b')"),
        (["--fake-size", "10"], "--fake-size 10 is smaller than one batch of 64"),
        pytest.param(["--device", "cuda"], "--device cuda but no GPU is visible: request one "
                     "(Slurm: --gpus-per-node=1, PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: "
                     "-l gpu=1)",
                     marks=pytest.mark.skipif(HAS_CUDA, reason="shows the CPU-only outcome")),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run([sys.executable, TRAIN, *args, "--output-dir", tmp_path], cwd=tmp_path, expect_rc=2)
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists(), "no run folder for a run that did not start"
