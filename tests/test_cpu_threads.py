"""examples/cpu-threads/: the CNN trained on CPU cores and the thread-scaling measurement."""

import csv
import re
import sys

from conftest import EXAMPLES, example_env, run

CNN = EXAMPLES / "cpu-threads" / "cnn_cpu.py"
SCALING = EXAMPLES / "cpu-threads" / "thread_scaling.py"
TINY = ["--fake-data", "--fake-size", "256", "--batch-size", "64", "--epochs", "2"]


def test_cnn_trains_with_the_allocated_threads(tmp_path):
    env = example_env(SLURM_CPUS_PER_TASK=1)
    out = run([sys.executable, CNN, *TINY], cwd=tmp_path, env=env).stdout
    assert "256 images, 1 threads (1 CPUs from SLURM_CPUS_PER_TASK)" in out
    losses = [float(x) for x in re.findall(r"^epoch \d+: loss (\S+), \d+ images/s$", out, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert re.search(r"^Throughput: \d+ images/s with 1 threads$", out, re.M)


def test_cnn_falls_back_to_the_cpu_affinity(tmp_path):
    out = run([sys.executable, CNN, *TINY, "--epochs", "1"], cwd=tmp_path).stdout
    assert "CPUs from CPU affinity" in out


def test_cnn_without_data_says_how_to_fetch_it(tmp_path):
    proc = run([sys.executable, CNN, "--data-dir", tmp_path / "none"], cwd=tmp_path, expect_rc=2)
    assert "no CIFAR-10 in" in proc.stderr and "on a login node" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_thread_scaling_writes_the_csv_the_page_shows(tmp_path):
    output = tmp_path / "scaling.csv"
    args = ["--threads", "1", "--epochs", "1", "--fake-size", "256", "--output", output]
    run([sys.executable, SCALING, *args], cwd=tmp_path, timeout=300)
    committed = (EXAMPLES / "cpu-threads" / "thread_scaling.csv").read_text().splitlines()
    written = output.read_text().splitlines()
    # Same layout: two comment lines (command, machine), then the same columns.
    for lines in (committed, written):
        assert lines[0].startswith("# cnn_cpu.py --fake-data") and lines[1].startswith("# ")
        assert lines[2] == "threads,images_per_s,speedup"
    rows = list(csv.DictReader(committed[2:]))
    assert [row["threads"] for row in rows] == ["1", "2"] and rows[0]["speedup"] == "1.00"


def test_thread_scaling_refuses_more_threads_than_cpus(tmp_path):
    proc = run([sys.executable, SCALING, "--threads", "4096"], cwd=tmp_path, expect_rc=2)
    assert "ask the scheduler for more (--cpus-per-task)" in proc.stderr
