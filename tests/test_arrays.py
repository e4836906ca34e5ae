"""examples/arrays/: a sweep file, one training per array task, the table of results.

The job scripts run as real job arrays with a dependent job under the tests' Slurm cluster
(test_slurm.py) and Grid Engine cell (test_gridengine.py).
"""

import csv
import json
import sys

import pytest

from conftest import EXAMPLES, example_env, run

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
    assert "sbatch --array=0-3%2 sweep.sbatch" in out and "qsub -t 1-4 -tc 2 sweep.qsub" in out


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


def test_collecting_names_the_tasks_without_a_result(sweep):
    folder, _ = sweep
    run([sys.executable, TRAIN, "--task", "1", "--epochs", "1"], cwd=folder)
    proc = run([sys.executable, COLLECT], cwd=folder, expect_rc=1)
    assert proc.stderr == "collect_results.py: error: no result from task(s) 0,2,3 in results\n"
    assert "Best: task 1 " in proc.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {}, "not an array task: pass --task N, or submit with sbatch --array / qsub -t"),
        (["--task", "4"], {}, "task 4, but sweep.csv has 4 rows (tasks 0 to 3)"),
        ([], {"SLURM_ARRAY_TASK_ID": "x"}, "SLURM_ARRAY_TASK_ID='x' is not a task number"),
        ([], {"SGE_TASK_ID": "0"}, "SGE_TASK_ID='0' is not a task number"),
    ],
)  # fmt: skip
def test_bad_task_is_one_line(sweep, args, env, message):
    folder, _ = sweep
    proc = run([sys.executable, TRAIN, *args], cwd=folder, env=example_env(**env), expect_rc=1)
    assert proc.stderr == f"sweep_train.py: error: {message}\n"


@pytest.mark.parametrize("script", [TRAIN, COLLECT], ids=lambda path: path.name)
def test_a_missing_sweep_file_is_a_usage_error(sweep, script):
    folder, _ = sweep
    proc = run([sys.executable, script, "--sweep", "none.csv"], cwd=folder, expect_rc=2)
    assert proc.stderr.splitlines()[-1] == (
        f"{script.name}: error: argument --sweep: no sweep file none.csv: write it with "
        "make_sweep.py first"
    )


def test_a_diverging_configuration_fails_its_task(sweep):
    folder, _ = sweep
    (folder / "sweep.csv").write_text("lr,batch_size,seed\n1e6,32,0\n")
    proc = run([sys.executable, TRAIN, "--task", "0", "--epochs", "1"], cwd=folder, expect_rc=1)
    assert "the loss is nan; this lr (1000000.0) is too high" in proc.stderr
    assert not (folder / "results" / "task-0.json").exists()
