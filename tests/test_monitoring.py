"""examples/monitoring/ and examples/hangs/: the GPU log and its summary, the hung job.

The job scripts run under the tests' Slurm cluster (test_slurm.py): gpu_usage.sbatch samples the
stand-in nvidia-smi beside the training, and dump_stacks.sh finds where each rank of the hung
hang_demo.sbatch waits.
"""

import re
import sys

import pytest

from conftest import EXAMPLES, SOURCE, TESTS, example_env, launch, run

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


@pytest.mark.parametrize(
    ("names", "error"),
    [
        ("lo", None),  # an exact name
        ("lo,lo", None),  # a list of exact names: one device for each
        ("^docker,lo", "Unable to find address for: ^docker"),  # NCCL's syntax, not gloo's
    ],
)
def test_gloo_socket_ifname_takes_exact_interface_names(tmp_path, names, error):
    """hangs.md: GLOO_SOCKET_IFNAME takes exact names, comma separated; NCCL_SOCKET_IFNAME's
    ^ (exclude) is not understood by gloo, which looks for an interface named ^docker. The
    page says so, and gives ^ only for NCCL."""
    page = " ".join((SOURCE / "monitoring" / "hangs.md").read_text(encoding="utf-8").split())
    assert "`GLOO_SOCKET_IFNAME` takes exact interface names" in page, "hangs.md"
    assert "`GLOO_SOCKET_IFNAME=^" not in page and "or `^docker,lo` to exclude" not in page
    cmd = [sys.executable, HANG, "--steps", "1", "--hang-at-step", "9", "--timeout", "20"]
    results = launch(cmd, cwd=tmp_path, timeout=60, GLOO_SOCKET_IFNAME=names)
    for rank, (rc, out, err) in enumerate(results):
        if error is None:
            assert rc == 0 and out.splitlines()[-1] == f"rank {rank}: finished", err
        else:
            assert rc != 0 and error in err, err


def test_a_log_of_two_nodes_is_summarised_per_node(tmp_path):
    """gpu_usage.sbatch runs one sampler per node, each line led by the node's name (and each
    sampler writes its header): the same GPU index on two nodes is two GPUs."""
    busy, idle = (gpu_log(tmp_path, util).read_text().splitlines() for util in (87, 12))
    lines = [f"host, {busy[0]}", *(f"n1, {row}" for row in busy[1:]), f"host, {idle[0]}",
             *(f"n2, {row}" for row in idle[1:])]  # fmt: skip
    (tmp_path / "two-nodes.csv").write_text("\n".join(lines) + "\n")
    out = run([sys.executable, SUMMARISE, "two-nodes.csv"], cwd=tmp_path).stdout
    assert out.splitlines()[0].split() == ["host", "GPU", "samples", "mean", "util", "lowest",
                                           "mean", "power", "most", "memory"], out  # fmt: skip
    rows = re.findall(r"^(n\d) +(\d) +1 +(\d+)% ", out, re.M)
    assert rows == [("n1", "0", "87"), ("n1", "1", "87"), ("n2", "0", "12"), ("n2", "1", "12")]
    assert "Warning: GPU 0 on n2, 1 on n2 below 50% on average: " in out, out
