"""examples/checkpointing/train_checkpoint.py killed with SIGKILL at random points, then resumed.

Each trial trains in a child process forked from this one (which imported torch and the example
once, so that a start costs milliseconds, not the seconds of an import), kills it with SIGKILL,
checks that every checkpoint the script would consider loads with weights_only=True, resumes,
perhaps kills again, and resumes until the training ends; the final weights must equal, bit for
bit, those of a run that was never interrupted.

The first run of half of the trials is killed at a random time: after a random number of its
"saved" lines plus a random delay of up to about a step. The first run of the other half is
killed inside a checkpoint write, for certain rather than by luck: in the child only, before
main() runs, names that the example looks up at run time are wrapped, so that the child sends
itself SIGKILL at a chosen point of its n-th save_checkpoint() call:

- "write": partway through the bytes of the temporary file (the example's module-level `open`
  is shadowed by one that returns a file writing a chosen number of bytes, then dying; or
  dying at torch.save's final flush, all bytes written but not synced);
- "rename": after the temporary file is complete and synced, in os.replace;
- "renamed": right after os.replace, before the folder is synced and old checkpoints deleted;
- "prune": after the first old checkpoint is deleted.

The runs that follow a kill draw their kill at random among these, a timed one, or none. The
example has no code path for the tests. The kill points come from SEED (shown in the timings
summary and in every failure message; set CHECKPOINT_FAULTS_SEED to try another set): kills
in a write are exactly reproducible, timed kills also depend on the machine's speed.

The parent never computes with torch (it only loads checkpoints), and each child uses one
thread: a child forked after OpenMP started its threads would hang in its first parallel
region. A child that hangs anyway is killed after 60 s and fails its trial.
"""

import multiprocessing
import os
import pathlib
import random
import re
import signal
import sys
import time

import pytest
import torch
import torch._inductor.config  # noqa: F401  use_deterministic_algorithms imports it: once, here

from conftest import EXAMPLES, load_example

SCRIPT = EXAMPLES / "checkpointing" / "train_checkpoint.py"
SEED = int(os.environ.get("CHECKPOINT_FAULTS_SEED", "20260611"))
TRIALS = 24
IN_WRITE = ["write", "rename", "renamed", "prune"]  # kills inside save_checkpoint()
KEEP = 2
# 6 steps per epoch, 18 in all; checkpoints at steps 2, 4, 6 (end of epoch 1), 8, ... 18.
ARGS = ["--device", "cpu", "--fake-data", "--fake-size", "192", "--batch-size", "32",
        "--epochs", "3", "--checkpoint-every", "2", "--keep", str(KEEP)]  # fmt: skip
STEPS, SAVES = 18, 9  # steps and save_checkpoint() calls of a run from scratch
FORK = multiprocessing.get_context("fork")
DIGEST = re.compile(r"^final weights: sha256 ([0-9a-f]{64}), saved ", re.M)


example = load_example(SCRIPT)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class DyingFile:
    """A file that writes its first `limit` bytes, then kills the process (or at flush)."""

    def __init__(self, file, limit):
        self.file, self.left = file, limit

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) >= self.left:
            self.file.write(data[: self.left])
            self.file.flush()  # the partial file is on disk, as after a real crash
            die()
        self.left -= len(data)
        return self.file.write(data)

    def flush(self):  # torch.save flushes at its end: all bytes written, not synced
        self.file.flush()
        die()

    def fileno(self):
        return self.file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def arm(kind, nth, limit):
    """In the child: die at `kind` during the nth call of the example's save_checkpoint()."""
    calls = [0]
    save, replace, unlink = example.save_checkpoint, os.replace, pathlib.Path.unlink

    def counted_save(*args, **kwargs):
        calls[0] += 1
        return save(*args, **kwargs)

    def armed():
        return calls[0] == nth

    def dying_open(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return DyingFile(file, limit) if armed() and "w" in mode else file

    def dying_replace(source, target):
        if armed() and kind == "rename":
            die()
        replace(source, target)
        if armed() and kind == "renamed":
            die()

    def dying_unlink(path, *args, **kwargs):
        unlink(path, *args, **kwargs)
        if armed() and kind == "prune" and example.NAME.fullmatch(path.name):
            die()

    example.save_checkpoint = counted_save
    example.open = dying_open  # shadows the builtin in the example's module only
    os.replace = dying_replace  # this process only: it is a disposable child
    pathlib.Path.unlink = dying_unlink


def child(argv, log, plan):
    torch.set_num_threads(1)  # the same arithmetic in every child; no OpenMP pool after fork
    sys.stdout = sys.stderr = open(log, "a", buffering=1)  # noqa: SIM115  (the child exits)
    if plan and plan[0] in IN_WRITE:
        arm(*plan)
    example.main(argv)


def start(folder, log, plan):
    argv = [*ARGS, "--checkpoint-dir", folder / "checkpoints", "--output-dir", folder / "out"]
    process = FORK.Process(target=child, args=([str(a) for a in argv], log, plan))
    process.start()
    return process


def saved_lines(log):
    text = log.read_text() if log.exists() else ""
    return sum(line.startswith("saved ") for line in text.splitlines())


def attempt(folder, log, plan, timeout=60):
    """Run the training once with a kill plan; return its exit code (-9: killed)."""
    process = start(folder, log, plan)
    deadline = time.monotonic() + timeout
    if plan and plan[0] == "timed":
        _, after_lines, delay = plan
        while process.is_alive() and saved_lines(log) < after_lines:
            time.sleep(0.002)
        time.sleep(delay)
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
    process.join(max(0, deadline - time.monotonic()))
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
        pytest.fail(f"the training hung for {timeout} s:\n{log.read_text()}")
    return process.exitcode


def every_checkpoint_loads(folder, where=""):
    """What the script would consider on start: each loads with weights_only=True."""
    paths = example.checkpoints(folder / "checkpoints")
    for path in paths:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            pytest.fail(f"{path.name} does not load ({type(error).__name__}: {error}), {where}")
        assert {"model", "optimizer", "scheduler", "rng"} <= state.keys(), path
    return paths


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted training: its digest, the time of one step, a checkpoint's size."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    log = folder / "log"
    begin = time.perf_counter()
    assert attempt(folder, log, None) == 0, log.read_text()
    step_seconds = (time.perf_counter() - begin) / STEPS
    assert saved_lines(log) == SAVES, log.read_text()
    size = example.checkpoints(folder / "checkpoints")[-1].stat().st_size
    return DIGEST.search(log.read_text())[1], step_seconds, size


def kill_plan(rng, first, trial, step_seconds, size):
    """Where to kill: in a write (first runs of half of the trials), at a time, or not at all."""
    if first:
        kind = IN_WRITE[trial % 4] if trial < TRIALS // 2 else "timed"
    else:
        kind = rng.choice([*IN_WRITE, "timed", None, None])
    if kind == "timed":  # after 0 to SAVES - 3 "saved" lines (6 steps or more are left)
        return ("timed", rng.randint(0, SAVES - 3), rng.uniform(0, 1.5 * step_seconds))
    if kind is None:
        return None
    # A run from scratch deletes its first old checkpoint at its save number KEEP + 1.
    nth = rng.randint(KEEP + 1 if kind == "prune" and first else 1, SAVES)
    return (kind, nth, rng.randint(1, size + size // 10))  # bytes written before "write" dies


@pytest.mark.parametrize("trial", range(TRIALS))
def test_killed_and_resumed_training_ends_with_the_same_weights(
    trial, reference, tmp_path, record_property
):
    digest, step_seconds, size = reference
    begin = time.perf_counter()
    rng = random.Random(SEED * 1000 + trial)
    log = tmp_path / "log"
    history = []
    for number in range(6):
        plan = kill_plan(rng, number == 0, trial, step_seconds, size) if number < 5 else None
        history.append(plan)
        code = attempt(tmp_path, log, plan)
        where = f"seed {SEED}, trial {trial}, kills {history}:\n{log.read_text()}"
        if code == 0:
            break
        assert code == -signal.SIGKILL, f"exit code {code}, {where}"
        every_checkpoint_loads(tmp_path, where)
        if plan[0] == "write":  # the temporary file is there, cut short or not synced
            leftovers = list((tmp_path / "checkpoints").glob("*.pt.tmp"))
            assert len(leftovers) == 1, f"{leftovers}, {where}"
    assert number > 0, f"the first run was not killed: {where}"
    out = log.read_text()
    assert "warning" not in out and "Traceback" not in out, where
    assert DIGEST.findall(out)[-1:] == [digest], where
    assert every_checkpoint_loads(tmp_path, where)[-1].name == f"checkpoint-{STEPS:08d}.pt", where
    seconds = time.perf_counter() - begin
    record_property("timing", f"checkpoint faults, seed {SEED}, trial {trial:2}: {seconds:.1f} s, "
                    f"{number} kill(s), plans {[plan[0] for plan in history if plan]}")  # fmt: skip
