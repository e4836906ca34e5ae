"""examples/arrays/: a sweep file, one training per array task, the table of results.

The job scripts run as real job arrays with a dependent job under the tests' Slurm cluster
(test_slurm.py) and Grid Engine cell (test_gridengine.py).
"""

import csv
import json
import shlex
import sys

import pytest

from conftest import EXAMPLES, copy_example, example_env, run

ARRAYS = EXAMPLES / "arrays"
MAKE = ARRAYS / "make_sweep.py"
TRAIN = ARRAYS / "sweep_train.py"
COLLECT = ARRAYS / "collect_results.py"


@pytest.fixture
def sweep(tmp_path):
    out = run([sys.executable, MAKE, "--lr", "0.1", "0.01", "--batch-size", "32", "128",
               "--max-running", "2"], cwd=tmp_path).stdout  # fmt: skip
    return tmp_path, out


def test_a_grid_has_every_combination_and_says_how_to_submit_it(sweep):
    folder, out = sweep
    with (folder / "sweep.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["lr"], r["batch_size"]) for r in rows] == [
        ("0.1", "32"), ("0.1", "128"), ("0.01", "32"), ("0.01", "128")]  # fmt: skip
    assert "Wrote 4 configurations to sweep.csv" in out
    assert "MAX_RUNNING=2 bash submit_sweep.sh     (--array=0-3%2)" in out
    assert "MAX_RUNNING=2 bash submit_sweep_ge.sh  (-t 1-4 -tc 2)" in out


def test_random_draws_stay_in_the_range_and_repeat_with_the_seed(tmp_path):
    args = [sys.executable, MAKE, "--lr", "0.001", "0.3", "--random", "6", "--seeds", "2"]
    run(args, cwd=tmp_path)
    first = (tmp_path / "sweep.csv").read_text()
    run(args, cwd=tmp_path)
    assert (tmp_path / "sweep.csv").read_text() == first
    rows = list(csv.DictReader(first.splitlines()))
    assert len(rows) == 12 and {r["seed"] for r in rows} == {"0", "1"}
    assert all(0.001 <= float(r["lr"]) <= 0.3 for r in rows)


def test_each_task_trains_its_row_and_the_table_ranks_them(sweep):
    folder, _ = sweep
    losses = {}
    for task, variable in enumerate(["SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_ID",
                                     "SGE_TASK_ID", "SGE_TASK_ID"]):  # fmt: skip
        value = task + 1 if variable == "SGE_TASK_ID" else task  # Grid Engine counts from 1
        out = run([sys.executable, TRAIN, "--epochs", "1"], cwd=folder,
                  env=example_env(**{variable: value})).stdout  # fmt: skip
        assert out.startswith(f"task {task}: "), out
        result = json.loads((folder / "results" / f"task-{task}.json").read_text())
        assert f"val_loss {result['val_loss']:.4f}" in out
        losses[task] = result["val_loss"]
    assert len(set(losses.values())) == 4  # four configurations, four results
    out = run([sys.executable, COLLECT], cwd=folder).stdout
    table = [line.split() for line in out.splitlines()[1:5]]
    assert [int(row[0]) for row in table] == sorted(losses, key=losses.get), out
    best = min(losses, key=losses.get)
    assert f"Best: task {best} " in out
    with (folder / "results" / "summary.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4
    assert not list((folder / "results").glob(".*.tmp"))  # written through a rename


def test_collecting_names_each_task_without_a_valid_result(sweep):
    """One line per task: missing, or unreadable (a task killed while writing it elsewhere);
    the valid results are still ranked, and the exit status says the table is incomplete."""
    folder, _ = sweep
    run([sys.executable, TRAIN, "--task", "1", "--epochs", "1"], cwd=folder)
    (folder / "results" / "task-2.json").write_text('{"task": 2, "lr"')
    proc = run([sys.executable, COLLECT], cwd=folder, expect_rc=1)
    lines = proc.stderr.splitlines()
    assert lines[0] == "collect_results.py: task 0: no result (results/task-0.json)", proc.stderr
    assert lines[1].startswith(
        "collect_results.py: task 2: unreadable result results/task-2.json: "
    )
    assert lines[2:] == [
        "collect_results.py: task 3: no result (results/task-3.json)",
        "collect_results.py: error: 3 of 4 tasks have no valid result in results: rerun rows 0,2,3",
    ], proc.stderr
    assert "Best: task 1 " in proc.stdout


def test_a_result_of_another_configuration_is_refused(tmp_path):
    """A task-1.json left from an earlier sweep (lr 0.01) where the sweep now has lr 0.05 in
    row 1: refused, not ranked, and the collection fails."""
    make = [sys.executable, MAKE, "--batch-size", "32", "--lr"]
    run([*make, "0.1", "0.01"], cwd=tmp_path)
    for task in (0, 1):
        run([sys.executable, TRAIN, "--task", task, "--epochs", "1"], cwd=tmp_path)
    run([*make, "0.1", "0.05"], cwd=tmp_path)  # the sweep file rewritten since: row 1 differs
    proc = run([sys.executable, COLLECT], cwd=tmp_path, expect_rc=1)
    assert proc.stderr.splitlines() == [
        "collect_results.py: task 1: results/task-1.json is the result of task=1, lr=0.01, "
        "batch_size=32, seed=0, not of its row: task=1, lr=0.05, batch_size=32, seed=0",
        "collect_results.py: error: 1 of 2 tasks have no valid result in results: rerun rows 1",
    ], proc.stderr
    table = [line.split() for line in proc.stdout.splitlines()[1:] if line.startswith(" ")]
    assert [row[:2] for row in table] == [["0", "0.1"]], proc.stdout
    assert "Best: task 0 " in proc.stdout


def fake_scheduler(folder, tool):
    """A stand-in for sbatch or qsub that keeps each submission's arguments (one line each,
    shell-quoted) and prints a job id: the test then runs the jobs itself, later."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / tool).write_text(
        '#!/bin/bash\nprintf "%q " "$@" >> submissions; echo >> submissions\n'
        "echo $((100 + $(wc -l < submissions)))\n"
    )
    (bin_dir / tool).chmod(0o755)
    return bin_dir


# tool, submit script, array job, collecting job, and what the scheduler gives each array task
# (for row N of 2) and the collecting job.
SCHEDULERS = {
    "slurm": ("sbatch", "submit_sweep.sh", "sweep.sbatch", "collect.sbatch",
              lambda row: {"SLURM_ARRAY_JOB_ID": "101", "SLURM_ARRAY_TASK_ID": str(row),
                           "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "1",
                           "SLURM_CPUS_PER_TASK": "2"},
              {"SLURM_JOB_ID": "102"}),
    "gridengine": ("qsub", "submit_sweep_ge.sh", "sweep.qsub", "collect.qsub",
                   lambda row: {"JOB_ID": "101", "SGE_TASK_ID": str(row + 1),
                                "SGE_TASK_FIRST": "1", "SGE_TASK_LAST": "2", "NSLOTS": "2"},
                   {"JOB_ID": "102"}),
}  # fmt: skip


def exported(arguments):
    """The variables a submission passes to its job: --export=ALL,NAME=VALUE,... or -v."""
    variables = {}
    for argument, following in zip(arguments, [*arguments[1:], ""], strict=True):
        if argument.startswith("--export=ALL,"):
            variables.update(item.split("=", 1) for item in argument[13:].split(","))
        elif argument == "-v":
            variables.update(item.split("=", 1) for item in following.split(","))
    return variables


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_sweep_file_rewritten_after_submission_changes_nothing_a_task_runs(
    scheduler, job_env, tmp_path
):
    """The submit script freezes the sweep file for its array: tasks that start after
    make_sweep.py rewrote sweep.csv (a throttled array's pending tasks) train the rows as
    submitted, and the collecting job ranks those. The jobs run here, under bash, with what
    the scheduler would give them; test_slurm.py and test_gridengine.py submit them for real."""
    tool, submit, array_job, collect_job, task_env, collect_env = SCHEDULERS[scheduler]
    names = (submit, array_job, collect_job, "sweep_train.py", "collect_results.py")
    copy_example(tmp_path, *(f"arrays/{name}" for name in names))
    env = {**job_env, "PATH": f"{fake_scheduler(tmp_path, tool)}:{job_env['PATH']}"}
    run([sys.executable, MAKE, "--lr", "0.1", "0.01", "--batch-size", "32"], cwd=tmp_path)
    run(["bash", submit, "--epochs", "1"], cwd=tmp_path, env=env)
    run([sys.executable, MAKE, "--lr", "0.5", "0.05", "--batch-size", "64"], cwd=tmp_path)
    lines = (tmp_path / "submissions").read_text().splitlines()
    submissions = [shlex.split(line) for line in lines]
    assert [next(a for a in args if a.endswith((".sbatch", ".qsub"))) for args in submissions] == [
        array_job,
        collect_job,
    ], lines
    sweep_dir = exported(submissions[0])["SWEEP_DIR"]
    assert [exported(args) for args in submissions] == [{"SWEEP_DIR": sweep_dir}] * 2, lines
    for row, lr in enumerate(["0.1", "0.01"]):  # the tasks start now, after the rewrite
        job = {**env, "SWEEP_DIR": sweep_dir, **task_env(row)}
        out = run(["bash", array_job, "--epochs", "1"], cwd=tmp_path, env=job).stdout
        assert f"task {row}: lr={lr} batch_size=32 seed=0: " in out, out
    job = {**env, "SWEEP_DIR": sweep_dir, **collect_env}
    out = run(["bash", collect_job], cwd=tmp_path, env=job).stdout
    table = sorted(line.split()[:3] for line in out.splitlines() if line.startswith(" " * 11))
    assert table == [["0", "0.1", "32"], ["1", "0.01", "32"]], out
    assert (tmp_path / sweep_dir / "summary.csv").is_file()
    # Without the frozen folder, the job scripts refuse in one line.
    for script in (array_job, collect_job):
        proc = run(["bash", script], cwd=tmp_path, env=env, expect_rc=1)
        assert proc.stderr == (
            f"{script}: no sweep.csv in SWEEP_DIR (unset): submit with {submit}\n"
        )


def test_a_diverging_configuration_fails_its_task(sweep):
    folder, _ = sweep
    (folder / "sweep.csv").write_text("lr,batch_size,seed\n1e6,32,0\n")
    proc = run([sys.executable, TRAIN, "--task", "0", "--epochs", "1"], cwd=folder, expect_rc=1)
    assert "the loss is nan; this lr (1000000.0) is too high" in proc.stderr
    assert not (folder / "results" / "task-0.json").exists()


def test_a_failed_rerun_leaves_no_earlier_result_in_its_place(sweep):
    """A task run again in the same folder removes its earlier result first: if the rerun
    fails, the collection names the task instead of ranking the earlier run."""
    folder, _ = sweep
    run([sys.executable, TRAIN, "--task", "0", "--epochs", "1"], cwd=folder)
    (folder / "sweep.csv").write_text("lr,batch_size,seed\n1e6,32,0\n")
    proc = run([sys.executable, TRAIN, "--task", "0", "--epochs", "1"], cwd=folder, expect_rc=1)
    assert "this lr (1000000.0) is too high" in proc.stderr
    assert not (folder / "results" / "task-0.json").exists()
