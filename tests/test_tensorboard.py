"""examples/tensorboard/: metrics logged to TensorBoard event files, read back here.

The job script (tensorboard.sbatch) runs under the tests' Slurm cluster (test_slurm.py).
"""

import re
import sys

import pytest
from recorded import check_recorded

from conftest import EXAMPLES, HAS_CUDA, epoch_losses, example_env, run

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
    (r"(--port |localhost:|-L )\d+", r"\1…"),
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
    assert [step for step, _ in scalars["epoch/loss"]] == [1, 2, 3]
    assert [step for step, _ in scalars["epoch/images_per_s"]] == [1, 2, 3]

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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "argument --epochs: must be a positive integer (got 0)"),
        (["--lr", "-1"], "argument --lr: must be a positive number (got -1)"),
        (["--run-name", "a/b"], "argument --run-name: must be a plain folder name (got 'a/b')"),
        (["--fake-size", "10"], "--fake-size 10 is smaller than one batch of 64"),
        pytest.param(["--device", "cuda"], "--device cuda but no GPU is visible: request one "
                     "(e.g. #SBATCH --gpus-per-node=1)",
                     marks=pytest.mark.skipif(HAS_CUDA, reason="shows the CPU-only outcome")),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run([sys.executable, TRAIN, *args, "--output-dir", tmp_path], cwd=tmp_path, expect_rc=2)
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists(), "no run folder for a run that did not start"
