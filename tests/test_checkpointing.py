"""examples/checkpointing/: full-state checkpoints, exact resume, fallback, Lightning, interval.

The SIGKILL trials are in test_checkpoint_faults.py.
"""

import math
import pathlib
import re
import shutil
import sys
import time

import pytest
import torch
from recorded import check_recorded

from conftest import EXAMPLES, copy_example, epoch_losses, example_env, run

FOLDER = EXAMPLES / "checkpointing"
TRAIN = FOLDER / "train_checkpoint.py"
LIGHTNING = FOLDER / "lightning_checkpoint.py"
INTERVAL = FOLDER / "checkpoint_interval.py"
# 8 steps per epoch, 24 in all; a checkpoint every 3 steps and at the end of each epoch.
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "256", "--batch-size", "32",
        "--checkpoint-every", "3"]  # fmt: skip
SAVED = [3, 6, 8, 9, 12, 15, 16, 18, 21, 24]
ENV = example_env(OMP_NUM_THREADS=1)  # the same threads in every run: the same arithmetic
DIGEST = re.compile(r"^final weights: sha256 ([0-9a-f]{64}), saved ", re.M)
WARNING = "train_checkpoint.py: warning: skipped checkpoints/"


def train(folder, *args, expect_rc=0):
    return run([sys.executable, TRAIN, *TINY, "--checkpoint-dir", "checkpoints", *args],
               cwd=folder, env=ENV, expect_rc=expect_rc)  # fmt: skip


def digest(out):
    found = DIGEST.findall(out)
    assert len(found) == 1, out
    return found[0]


def checkpoint(step):
    return f"checkpoint-{step:08d}.pt"


def names(folder):
    """What the checkpoint folder holds, but the run's lock file (tests/test_cluster_faults.py)."""
    return sorted(path.name for path in (folder / "checkpoints").iterdir() if path.name != ".lock")


def seed_folder(folder, uninterrupted, *steps):
    """A checkpoint folder holding copies of some checkpoints of the uninterrupted run."""
    (folder / "checkpoints").mkdir(parents=True)
    for step in steps:
        shutil.copy(uninterrupted[1] / "checkpoints" / checkpoint(step), folder / "checkpoints")
    return folder / "checkpoints"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Three epochs in one go, keeping every checkpoint: (output, folder)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    return train(folder, "--epochs", "3", "--keep", "100").stdout, folder


def test_a_run_saves_checkpoints_and_the_loss_goes_down(uninterrupted):
    out, folder = uninterrupted
    assert "no checkpoint in checkpoints: starting from scratch" in out, out
    losses = epoch_losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0], out
    saved = [int(n) for n in re.findall(r"^saved checkpoints/checkpoint-(\d+)\.pt$", out, re.M)]
    assert saved == SAVED, out
    assert names(folder) == [checkpoint(step) for step in SAVED]
    final = torch.load(folder / "runs" / "model.pt", weights_only=True)
    last = torch.load(folder / "checkpoints" / checkpoint(24), weights_only=True)
    assert all(torch.equal(final[key], last["model"][key]) for key in final)
    digest(out)


def test_every_checkpoint_loads_weights_only(uninterrupted):
    for path in (uninterrupted[1] / "checkpoints").glob("checkpoint-*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert set(state) == {"model", "optimizer", "scheduler", "epoch", "step", "totals",
                              "config", "rng"}, path  # fmt: skip
        assert 8 * state["epoch"] + state["step"] == int(path.stem.split("-")[1]), path
        assert isinstance(state["rng"]["python"], tuple)  # what random.setstate needs


def test_resuming_for_more_epochs_gives_the_same_weights(uninterrupted, tmp_path):
    first = train(tmp_path, "--epochs", "1").stdout
    assert len(epoch_losses(first)) == 1 and digest(first) != digest(uninterrupted[0])
    out = train(tmp_path, "--epochs", "3").stdout
    assert f"resumed from checkpoints/{checkpoint(8)} after 8 of 24 steps" in out, out
    assert re.findall(r"^epoch (\d+):", out, re.M) == ["2", "3"], out  # none done twice
    assert epoch_losses(out) == epoch_losses(uninterrupted[0])[1:]
    assert digest(out) == digest(uninterrupted[0])  # bit for bit
    assert names(tmp_path) == [checkpoint(step) for step in (18, 21, 24)]  # --keep 3


def test_a_corrupted_checkpoint_is_skipped_with_a_warning(uninterrupted, tmp_path):
    """The two newest are damaged: the run goes on from the third, in the middle of epoch 2,
    skips exactly the batches done before it, and ends with the same weights."""
    folder = seed_folder(tmp_path, uninterrupted, 15, 18, 21)
    newest = (folder / checkpoint(21)).read_bytes()
    (folder / checkpoint(21)).write_bytes(newest[: len(newest) // 2])  # truncated
    (folder / checkpoint(18)).write_bytes(b"\x80\x02garbage" * 1000)  # overwritten
    proc = train(tmp_path, "--epochs", "3")
    fallback = f"falling back to checkpoints/{checkpoint(15)}"
    assert proc.stderr.splitlines() == [
        f"{WARNING}{checkpoint(21)} (RuntimeError: PytorchStreamReader failed reading zip "
        f"archive: failed finding central directory); {fallback}",
        f"{WARNING}{checkpoint(18)} (UnpicklingError: Weights only load failed); {fallback}",
    ], proc.stderr
    assert f"resumed from checkpoints/{checkpoint(15)} after 15 of 24 steps" in proc.stdout
    assert epoch_losses(proc.stdout) == epoch_losses(uninterrupted[0])[1:]  # all of epoch 2
    assert digest(proc.stdout) == digest(uninterrupted[0])


def test_without_a_usable_checkpoint_it_starts_from_scratch(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / checkpoint(8)).write_bytes(b"")  # empty: a full disk
    (tmp_path / "checkpoints" / f"{checkpoint(4)}.tmp").write_bytes(b"cut short")
    proc = train(tmp_path, "--epochs", "1", "--keep", "2")
    assert proc.stderr.splitlines() == [
        f"{WARNING}{checkpoint(8)} (EOFError: empty); no usable checkpoint"
    ], proc.stderr
    assert "no checkpoint in checkpoints: starting from scratch" in proc.stdout
    assert names(tmp_path) == [checkpoint(6), checkpoint(8)]  # --keep 2; the .tmp is gone


@pytest.mark.parametrize(
    ("args", "change"),
    [
        (["--batch-size", "64"], "--batch-size 32, this run has 64"),
        (["--lr", "0.05"], "--lr 0.02, this run has 0.05"),  # else the old rate goes on unseen
        (["--warmup-steps", "10", "--lr", "0.05"],
         "--lr 0.02, this run has 0.05; --warmup-steps 50, this run has 10"),
    ],
    ids=["batch-size", "lr", "warmup-steps and lr"],
)  # fmt: skip
def test_resuming_with_other_options_is_refused(uninterrupted, tmp_path, args, change):
    """A resubmission with another --lr (say) is another run: it names the option, the old and
    the new value, and how to start that run; more --epochs resumes (the test above)."""
    seed_folder(tmp_path, uninterrupted, 8)
    proc = train(tmp_path, "--epochs", "3", *args, expect_rc=2)
    assert proc.stderr == (
        f"train_checkpoint.py: error: checkpoints/{checkpoint(8)} was written with {change}: "
        "resume with the same options (only --epochs may grow), or start another run in another "
        "--checkpoint-dir (RUN_NAME=<name> with the job scripts)\n"
    ), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("script", [TRAIN, LIGHTNING], ids=lambda path: path.name)
def test_without_data_it_says_how_to_fetch_it(tmp_path, script):
    proc = run([sys.executable, script, "--device", "cpu", "--data-dir", tmp_path / "none"],
               cwd=tmp_path, env=ENV, expect_rc=2)  # fmt: skip
    assert proc.stderr.startswith(f"{script.name}: error: no CIFAR-10 in ")
    assert "download it once on a login node" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda works")
def test_cuda_without_a_gpu_says_how_to_request_one(tmp_path):
    proc = run([sys.executable, TRAIN, "--device", "cuda", "--fake-data"], cwd=tmp_path,
               env=ENV, expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "train_checkpoint.py: error: --device cuda but no GPU is visible: request one (Slurm: "
        "--gpus-per-node=1, PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)\n"
    )


def test_job_script_resumes_the_run_of_the_same_name(uninterrupted, tmp_path, job_env):
    """Submitted again, the job finds the checkpoints of its run under $SCRATCH."""
    copy_example(
        tmp_path, "checkpointing/train_checkpoint.sbatch", "checkpointing/train_checkpoint.py"
    )
    run_dir = tmp_path / "scratch" / "checkpoints" / "cifar"
    seed_folder(run_dir, uninterrupted, 8)
    env = {**job_env, "SCRATCH": str(tmp_path / "scratch"), "RUN_NAME": "cifar",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train-checkpoint",
           "SLURM_CPUS_PER_TASK": "1"}  # fmt: skip
    args = [*TINY, "--epochs", "2"]
    out = run(["bash", "train_checkpoint.sbatch", *args], cwd=tmp_path, env=env).stdout
    assert "Job 42 on " in out and f"run cifar, checkpoints in {run_dir}/checkpoints" in out
    assert f"resumed from {run_dir}/checkpoints/{checkpoint(8)} after 8 of 16 steps" in out, out
    assert (run_dir / "model.pt").is_file() and len(epoch_losses(out)) == 1


def test_lightning_resumes_from_last_and_trains_only_the_epochs_left(tmp_path, record_property):
    args = [sys.executable, LIGHTNING, "--device", "cpu", "--fake-data", "--fake-size", "256",
            "--batch-size", "32", "--num-workers", "0", "--keep", "2"]  # fmt: skip
    start = time.perf_counter()
    first = run([*args, "--epochs", "2"], cwd=tmp_path, env=ENV).stdout
    out = run([*args, "--epochs", "3"], cwd=tmp_path, env=ENV).stdout
    record_property(
        "timing", f"lightning_checkpoint.py, 2 + 1 epochs: {time.perf_counter() - start:.1f} s"
    )
    assert re.findall(r"^epoch (\d+):", first, re.M) == ["1", "2"], first
    folder = (tmp_path / "checkpoints").resolve()
    assert f"resumed from {folder}/last.ckpt at epoch 3, step 16" in out, out
    assert re.findall(r"^epoch (\d+):", out, re.M) == ["3"], out  # epochs 1 and 2 not redone
    assert "trained 3 epochs; in checkpoints: epoch=1-step=16.ckpt, epoch=2-step=24.ckpt, " \
           "last.ckpt" in out  # fmt: skip
    for path in folder.iterdir():  # Trainer.fit(ckpt_path=...) loads them so, by default
        state = torch.load(path, weights_only=True)
        step = 24 if path.name == "last.ckpt" else int(re.search(r"step=(\d+)", path.name)[1])
        assert state["global_step"] == step, path
    losses = epoch_losses(first) + epoch_losses(out)
    assert losses[-1] < losses[0], (first, out)


def test_weights_only_refuses_other_classes_unless_allowed(tmp_path):
    """What the page says about non-tensor state: an object of a class that is not allowed
    fails to load with weights_only=True; torch.serialization.safe_globals allows it."""
    torch.save({"data_dir": pathlib.Path("data")}, tmp_path / "state.pt")
    with pytest.raises(Exception, match=r"Unsupported global: GLOBAL pathlib\.PosixPath") as info:
        torch.load(tmp_path / "state.pt", weights_only=True)
    assert "torch.serialization.add_safe_globals([pathlib.PosixPath])" in str(info.value)
    # The page shows the line that names the class.
    line = next(x for x in str(info.value).splitlines() if "WeightsUnpickler error:" in x)
    check_recorded(FOLDER / "weights_only-posixpath.out", line.strip())
    with torch.serialization.safe_globals([pathlib.PosixPath]):
        state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state == {"data_dir": pathlib.Path("data")}


INTERVAL_LINES = [
    r"# python checkpoint_interval\.py (?P<args>.*)",
    r"# .+, torch \S+",
    r"checkpoint: (?P<size>\d+) MB, (?P<repeats>\d+) writes into \S+, file system \S.*",
    r"write time: (?P<write>\d+\.\d{3}) s median \(min \d+\.\d{3} s, max \d+\.\d{3} s\), "
    r"\d+ MB/s",
    r"MTBF: (?P<mtbf>[\d.e+]+) h per node, (?P<nodes>\d+) node\(s\): (?P<job>[\d.e+]+) h for "
    r"the job",
    r"Young/Daly interval: sqrt\(2 x (?P<write_again>\d+\.\d{3}) s x (?P<seconds>\d+) s\) = "
    r"(?P<interval>\d+) s \((?P<minutes>\d+\.\d) min\)",
    r"time spent writing checkpoints: (?P<share>\d+\.\d\d)%",
]


def check_interval_output(text):
    """The lines checkpoint_interval.py prints, and the arithmetic in them."""
    lines = text.splitlines()
    assert len(lines) == len(INTERVAL_LINES), text
    fields = {}
    for line, pattern in zip(lines, INTERVAL_LINES, strict=True):
        match = re.fullmatch(pattern, line)
        assert match, f"{line!r} does not match {pattern!r}"
        fields.update(match.groupdict())
    mtbf, nodes = float(fields["mtbf"]), int(fields["nodes"])
    assert math.isclose(float(fields["job"]), mtbf / nodes, rel_tol=1e-5)
    assert abs(int(fields["seconds"]) - mtbf / nodes * 3600) <= 0.5
    assert fields["write_again"] == fields["write"]
    write, interval = float(fields["write"]), int(fields["interval"])
    low, high = (math.sqrt(2 * (write + d) * int(fields["seconds"])) for d in (-5e-4, 5e-4))
    assert low - 0.5 <= interval <= high + 0.5, (write, interval, low, high)  # sqrt(2 w M)
    assert abs(float(fields["minutes"]) - interval / 60) <= 0.06
    assert abs(float(fields["share"]) - 100 * write / interval) <= 0.01 + 100 * 5e-4 / interval
    return fields


def test_interval_script_measures_and_applies_young_daly(tmp_path):
    args = ["--dir", tmp_path, "--size-mb", "8", "--repeats", "2", "--mtbf-hours", "40000",
            "--nodes", "64"]  # fmt: skip
    out = run([sys.executable, INTERVAL, *args], cwd=tmp_path, env=ENV).stdout
    fields = check_interval_output(out)
    assert fields["size"] == "8" and fields["nodes"] == "64" and fields["job"] == "625"
    assert list(tmp_path.iterdir()) == []  # its temporary folder is gone


def test_committed_interval_output_comes_from_the_script():
    fields = check_interval_output((FOLDER / "checkpoint_interval.out").read_text())
    assert fields["args"].startswith("--dir ") and "--mtbf-hours" in fields["args"]


def test_interval_script_refuses_a_folder_it_cannot_write(tmp_path):
    proc = run([sys.executable, INTERVAL, "--dir", tmp_path / "none", "--mtbf-hours", "1"],
               cwd=tmp_path, env=ENV, expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        f"checkpoint_interval.py: error: --dir {tmp_path / 'none'} is not a folder you can "
        "write to\n"
    )


@pytest.mark.gpu
def test_resume_on_the_gpu_gives_the_same_weights(tmp_path):
    args = ["--device", "cuda", "--fake-data", "--fake-size", "256", "--batch-size", "32",
            "--checkpoint-every", "3"]  # fmt: skip
    whole = run([sys.executable, TRAIN, *args, "--epochs", "2", "--checkpoint-dir", "a"],
                cwd=tmp_path, env=ENV).stdout  # fmt: skip
    run([sys.executable, TRAIN, *args, "--epochs", "1", "--checkpoint-dir", "b"], cwd=tmp_path,
        env=ENV)  # fmt: skip
    out = run([sys.executable, TRAIN, *args, "--epochs", "2", "--checkpoint-dir", "b"],
              cwd=tmp_path, env=ENV).stdout  # fmt: skip
    assert "resumed from b/checkpoint-00000008.pt after 8 of 16 steps" in out, out
    assert digest(out) == digest(whole)
