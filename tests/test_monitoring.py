"""examples/monitoring/ and examples/hangs/: the GPU log and its summary, the hung job.

The job scripts run under the tests' Slurm cluster (test_slurm.py): gpu_usage.sbatch samples the
stand-in nvidia-smi beside the training, and dump_stacks.sh finds where each rank of the hung
hang_demo.sbatch waits.
"""

import re
import sys

import pytest

from conftest import EXAMPLES, TESTS, example_env, launch, run

SUMMARISE = EXAMPLES / "monitoring" / "summarise_gpu_log.py"
HANG = EXAMPLES / "hangs" / "hang_demo.py"
FIELDS = "timestamp,index,utilization.gpu,memory.used,memory.total,power.draw"


def gpu_log(tmp_path, util, gpus="0,1", **options):
    """A log of the stand-in nvidia-smi, as gpu_usage.sbatch writes it (one sample)."""
    proc = run([TESTS / "standins" / "nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,nounits"],
               cwd=tmp_path, env=example_env(CUDA_VISIBLE_DEVICES=gpus, NVIDIA_SMI_UTIL=util,
                                             **options))  # fmt: skip
    path = tmp_path / "gpu-usage.csv"
    path.write_text(proc.stdout)
    return path


def test_a_busy_gpu_log_is_summarised_per_gpu(tmp_path):
    log = gpu_log(tmp_path, 87)
    out = run([sys.executable, SUMMARISE, log], cwd=tmp_path).stdout
    rows = re.findall(r"^ +(\d) +1 +87% +87% +512W +30210 MiB$", out, re.M)
    assert rows == ["0", "1"], out
    assert out.endswith("Every GPU at 50% or more on average.\n"), out


def test_an_idle_gpu_is_named(tmp_path):
    log = gpu_log(tmp_path, 12, gpus="0")
    out = run([sys.executable, SUMMARISE, log, "--idle-below", "20"], cwd=tmp_path).stdout
    assert "Warning: GPU 0 below 20% on average: the job waits for something" in out, out


def test_a_cut_last_line_and_missing_values_are_skipped(tmp_path):
    log = gpu_log(tmp_path, 60, gpus="0")
    text = log.read_text().replace("512.34", "[N/A]")
    log.write_text(text + "2026/11/26 10:00:00.000, 0, 9")  # the job ended mid-line
    out = run([sys.executable, SUMMARISE, log], cwd=tmp_path).stdout
    assert re.search(r"^ +0 +1 +60% +60% +nanW +30210 MiB$", out, re.M), out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "gpu-usage.csv has no header with an index column"),
        ("timestamp, index, utilization.gpu [%]\n",
         "gpu-usage.csv holds no sample: did the job end before nvidia-smi's first one?"),
    ],
)  # fmt: skip
def test_an_empty_log_is_one_line(tmp_path, content, message):
    (tmp_path / "gpu-usage.csv").write_text(content)
    proc = run([sys.executable, SUMMARISE, "gpu-usage.csv"], cwd=tmp_path, expect_rc=1)
    assert proc.stderr.startswith(f"summarise_gpu_log.py: error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_missing_log_is_a_usage_error(tmp_path):
    proc = run([sys.executable, SUMMARISE, "gpu-usage.csv"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr.splitlines()[-1] == (
        "summarise_gpu_log.py: error: argument log: no log gpu-usage.csv: write one with "
        "nvidia-smi --query-gpu=... --format=csv -l N (gpu_usage.sbatch does)"
    ), proc.stderr


def test_without_the_hang_every_rank_finishes(tmp_path):
    results = launch([sys.executable, HANG, "--steps", "3", "--hang-at-step", "9"], cwd=tmp_path)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, err
        assert out.splitlines()[-2:] == [f"rank {rank}: step 3 done", f"rank {rank}: finished"]


def test_the_hang_comes_at_the_end_and_stops_at_the_timeout(tmp_path):
    """Collectives pair up by order: the rank that skipped one runs one step ahead of the other,
    and they hang when it reaches the barrier while the other waits in its last all_reduce."""
    results = launch([sys.executable, HANG, "--steps", "4", "--hang-at-step", "2",
                      "--timeout", "2"], cwd=tmp_path, timeout=60)  # fmt: skip
    for rc, out, _ in results:
        assert rc != 0 and "finished" not in out, out
    assert "rank 1: step 4 done" in results[1][1], results
    assert "rank 0: step 3 done" in results[0][1] and "step 4" not in results[0][1], results


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a number"),
        ({"SLURM_NTASKS": None}, "SLURM_NTASKS is not set: start this script with torchrun"),
    ],
)  # fmt: skip
def test_an_incomplete_distributed_environment_is_one_line(tmp_path, variables, message):
    env = example_env(SLURM_PROCID=0, SLURM_NTASKS=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29999)
    for name, value in variables.items():
        env.pop(name) if value is None else env.update({name: value})
    proc = run([sys.executable, HANG], cwd=tmp_path, env=env, expect_rc=2)
    assert (
        proc.stderr.startswith(f"hang_demo.py: error: {message}") and proc.stderr.count("\n") == 1
    )
