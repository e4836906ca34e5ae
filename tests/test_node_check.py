"""examples/node-check/: the node health check and the all-reduce bandwidth benchmark, on CPU
with gloo. Ranks pretend to be on different nodes through SLURMD_NODENAME, the node name the
scripts prefer to the host name. The job script runs under the tests' Slurm cluster
(test_slurm.py); the NCCL run on GPUs is in the GPU suite."""

import csv
import re
import sys
import time

import pytest
import torch

from conftest import EXAMPLES, HAS_CUDA, TORCHRUN, example_env, free_port, launch, run

FOLDER = EXAMPLES / "node-check"
CHECK = FOLDER / "node_check.py"
BENCH = FOLDER / "allreduce_bench.py"
# --slow-fraction 1e-6: a pair fails as slow only when a million times slower than the
# median: loopback timings on a busy test machine vary too much for the default, 0.5.
TINY_CHECK = ["--device", "cpu", "--matrix-size", "64", "--mem-fraction", "0.001",
              "--pair-bytes", "4096", "--slow-fraction", "1e-6"]  # fmt: skip
TINY_BENCH = ["--device", "cpu", "--min-bytes", "4K", "--max-bytes", "64K", "--warmup", "1",
              "--iters", "3"]  # fmt: skip
ROW = re.compile(r"^ +(\d+) +(\d+) +float +([\d.]+) +([\d.]+) +([\d.]+)$", re.M)
HEADER = re.compile(r"^# all_reduce \(sum, float32, in place\): (\d+) ranks on \d+ node\(s\), "
                    r"gloo, cpu \(.+\), torch \d+\.\d+", re.M)  # fmt: skip


def on_nodes(*nodes):
    """An env builder for launch(): rank r runs on nodes[r]."""

    def env(**variables):
        node = nodes[int(variables["SLURM_PROCID"])]
        return example_env(SLURMD_NODENAME=node, **variables)

    return env


def table(out):
    return [(int(s), int(c), float(t), float(a), float(b)) for s, c, t, a, b in ROW.findall(out)]


def test_benchmark_prints_nccl_tests_bandwidths(tmp_path):
    """Three srun-style tasks: busbw = algbw * 2(n-1)/n = algbw * 4/3, algbw = size / time."""
    output = tmp_path / "bench.csv"
    ranks = launch([sys.executable, BENCH, *TINY_BENCH, "--csv", output], cwd=tmp_path, world=3)
    assert [rc for rc, _, _ in ranks] == [0, 0, 0], ranks
    out = ranks[0][1]
    assert ranks[1][1] == ranks[2][1] == "", "only rank 0 prints"
    assert HEADER.search(out)[1] == "3", out
    rows = table(out)
    assert [row[0] for row in rows] == [4096 * 2**i for i in range(5)], out
    for size, count, time_us, algbw, busbw in rows:
        assert count == size // 4 and time_us > 0
        assert algbw == pytest.approx(size / time_us / 1e3, rel=0.01, abs=0.002), out
        assert busbw == pytest.approx(algbw * 4 / 3, abs=0.002), out
    peak = max(rows, key=lambda row: row[4])
    size = f"{peak[0] // 1024} KiB"
    assert f"Peak bus bandwidth: {peak[4]:.3f} GB/s at {size} with 3 ranks (gloo)" in out, out
    lines = output.read_text().splitlines()
    assert lines[0] == f"# allreduce_bench.py {' '.join(map(str, TINY_BENCH))} --csv {output}"
    assert HEADER.search("# all_reduce (sum, float32, in place): " + lines[1][2:]), lines[1]
    assert lines[2] == "size_bytes,count,type,time_us,algbw_gbps,busbw_gbps"
    written = [(int(r[0]), int(r[1]), *map(float, r[3:])) for r in csv.reader(lines[3:])]
    assert written == rows


def test_committed_benchmark_run_has_the_tables_shape(tmp_path):
    """The page shows allreduce-gloo-cpu.out and .csv, one run of 2 processes on this
    machine's loopback: default sizes 8K to 64M, the header the script prints now."""
    out = (FOLDER / "allreduce-gloo-cpu.out").read_text()
    lines = (FOLDER / "allreduce-gloo-cpu.csv").read_text().splitlines()
    assert HEADER.search(out)[1] == "2" and HEADER.search(out).start() == 0, out
    rows = table(out)
    assert [row[0] for row in rows] == [8192 * 2**i for i in range(14)], out
    assert all(busbw == algbw for *_, algbw, busbw in rows)  # 2(n-1)/n = 1 for 2 ranks
    peak = max(rows, key=lambda row: row[4])
    assert out.splitlines()[-1].startswith(f"Peak bus bandwidth: {peak[4]:.3f} GB/s at ")
    assert lines[0] == "# allreduce_bench.py --device cpu --csv allreduce-gloo-cpu.csv"
    assert lines[1] == out.splitlines()[0].split(": ", 1)[1].join(["# ", ""])
    assert lines[2] == "size_bytes,count,type,time_us,algbw_gbps,busbw_gbps"
    assert [(int(r[0]), int(r[1]), *map(float, r[3:])) for r in csv.reader(lines[3:])] == rows
    # The column headings are the ones the script prints now.
    now = run([*TORCHRUN, "--nproc-per-node=1", BENCH, *TINY_BENCH], cwd=tmp_path).stdout
    assert now.splitlines()[1:3] == out.splitlines()[1:3], now


def test_node_check_passes_under_torchrun(tmp_path):
    out = run([*TORCHRUN, "--nproc-per-node=2", CHECK, *TINY_CHECK], cwd=tmp_path).stdout
    assert "Node check: 2 ranks on 1 node(s), gloo, matmul 64x64, timeout 60 s" in out
    for rank in (0, 1):
        assert re.search(rf"^rank {rank} on \S+, cpu: [\d.]+ GFLOP/s, [\d.]+ GiB checked: ok$",
                         out, re.M), out  # fmt: skip
    assert "<->" not in out and "FAILED" not in out  # one node: no pairs
    assert out.splitlines()[-1] == "All 2 ranks on 1 node passed"


def test_node_check_exchanges_between_every_pair_of_nodes(tmp_path):
    """Four tasks on three nodes: the first rank of each node (0, 1, 2) exchanges with the
    others; rank 3, local rank 1 on n3, has no peer of its local rank on n1 or n2."""
    env = on_nodes("n1", "n2", "n3", "n3")
    ranks = launch([sys.executable, CHECK, *TINY_CHECK], cwd=tmp_path, world=4, env=env)
    assert [rc for rc, _, _ in ranks] == [0, 0, 0, 0], ranks
    out = ranks[0][1]
    pairs = re.findall(r"^nodes (n\d) <-> (n\d), local rank 0: [\d.]+ GB/s: ok$", out, re.M)
    assert pairs == [("n1", "n2"), ("n1", "n3"), ("n2", "n3")], out
    assert "local rank 1" not in out, out
    assert "rank 3 on n3, cpu: " in out
    assert out.splitlines()[-1] == "All 4 ranks on 3 nodes passed"


def test_a_wrong_product_fails_the_check_and_names_the_rank(tmp_path):
    env = on_nodes("n1", "n2")
    cmd = [sys.executable, CHECK, *TINY_CHECK, "--fail-rank", "1"]
    ranks = launch(cmd, cwd=tmp_path, env=env)
    assert [rc for rc, _, _ in ranks] == [1, 1], ranks  # every rank, so srun fails too
    out = ranks[0][1]
    assert "FAILED: rank 1 on n2, cpu: matmul 64x64 wrong in 1 of 64 rows" in out, out
    assert "FAILED: rank 0" not in out and "passed" not in out
    assert "nodes n1 <-> n2, local rank 0: " in out and "Traceback" not in ranks[0][2] + ranks[1][2]


def test_wrong_data_from_a_node_names_its_pairs(tmp_path):
    env = on_nodes("n1", "n2", "n3")
    cmd = [sys.executable, CHECK, *TINY_CHECK, "--fail-node", "n3"]
    ranks = launch(cmd, cwd=tmp_path, world=3, env=env)
    assert [rc for rc, _, _ in ranks] == [1, 1, 1], ranks
    failed = re.findall(r"^FAILED: (.*)$", ranks[0][1], re.M)
    assert failed == [
        "nodes n1 <-> n3, local rank 0: n1 received wrong data from n3 (1 of 1024)",
        "nodes n2 <-> n3, local rank 0: n2 received wrong data from n3 (1 of 1024)",
    ], ranks[0][1]
    assert re.search(r"^nodes n1 <-> n2, local rank 0: [\d.]+ GB/s: ok$", ranks[0][1], re.M)


# Two nodes with two ranks each, as on nodes with one network card per GPU (rails).
TWO_BY_TWO = on_nodes("n1", "n1", "n2", "n2")


def test_every_local_rank_exchanges_with_its_peer_on_the_other_node(tmp_path):
    ranks = launch([sys.executable, CHECK, *TINY_CHECK], cwd=tmp_path, world=4, env=TWO_BY_TWO)
    assert [rc for rc, _, _ in ranks] == [0, 0, 0, 0], ranks
    out = ranks[0][1]
    pairs = re.findall(r"^nodes n1 <-> n2, local rank (\d): [\d.]+ GB/s: ok$", out, re.M)
    assert pairs == ["0", "1"], out  # both rails, not only the first rank's
    assert out.splitlines()[-1] == "All 4 ranks on 2 nodes passed", out


def test_wrong_data_on_one_rail_names_the_nodes_and_the_local_rank(tmp_path):
    cmd = [sys.executable, CHECK, *TINY_CHECK, "--fail-node", "n2:1"]
    ranks = launch(cmd, cwd=tmp_path, world=4, env=TWO_BY_TWO)
    assert [rc for rc, _, _ in ranks] == [1, 1, 1, 1], ranks
    out = ranks[0][1]
    failed = re.findall(r"^FAILED: (.*)$", out, re.M)
    assert failed == ["nodes n1 <-> n2, local rank 1: n1 received wrong data from n2 (1 of 1024)"]
    assert re.search(r"^nodes n1 <-> n2, local rank 0: [\d.]+ GB/s: ok$", out, re.M), out


def test_a_slow_rail_names_the_nodes_and_the_local_rank(tmp_path):
    """Local rank 1 of n2 waits 1 s in its timed exchange: its pair is far below the median of
    the two (half of the sum), local rank 0's is the faster of the two and cannot be."""
    cmd = [sys.executable, CHECK, *TINY_CHECK, "--slow-node", "n2:1", "--slow-fraction", "0.5"]
    ranks = launch(cmd, cwd=tmp_path, world=4, env=TWO_BY_TWO)
    assert [rc for rc, _, _ in ranks] == [1, 1, 1, 1], ranks
    out = ranks[0][1]
    speeds = dict(re.findall(r"^nodes n1 <-> n2, local rank (\d): ([\d.]+) GB/s: ", out, re.M))
    (failed,) = re.findall(r"^FAILED: (.*)$", out, re.M)
    slow = re.fullmatch(
        rf"nodes n1 <-> n2, local rank 1: slow: {re.escape(speeds['1'])} GB/s, under 0.5 x the "
        r"median of all pairs, ([\d.]+) GB/s",
        failed,
    )
    assert slow, out
    median = (float(speeds["0"]) + float(speeds["1"])) / 2  # of the printed, rounded speeds
    assert float(slow[1]) == pytest.approx(median, abs=0.01), out
    assert re.search(r"^nodes n1 <-> n2, local rank 0: [\d.]+ GB/s: ok$", out, re.M), out


def test_a_missing_rank_fails_the_check_within_the_timeout(tmp_path):
    """WORLD_SIZE says 2, one process starts: exit 1 after --timeout seconds, no hang."""
    env = example_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    start = time.monotonic()
    cmd = [sys.executable, CHECK, *TINY_CHECK, "--timeout", "3"]
    proc = run(cmd, cwd=tmp_path, env=env, expect_rc=1, timeout=60)
    assert time.monotonic() - start < 30
    assert "node_check.py: error: rank 0 on " in proc.stderr
    assert "the start (all 2 ranks reaching 127.0.0.1) did not complete within 3 s" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (BENCH, ["--min-bytes", "0"], "argument --min-bytes: must be a size of 4 bytes or more"),
        (BENCH, ["--min-bytes", "1M", "--max-bytes", "8K"],
         "--min-bytes 1048576 is larger than --max-bytes 8192"),
        (BENCH, ["--iters", "0"], "argument --iters: must be a positive integer (got 0)"),
        (BENCH, ["--warmup", "-1"], "argument --warmup: must be 0 or more (got -1)"),
        (CHECK, ["--mem-fraction", "2"], "argument --mem-fraction: must be a number above 0"),
        (CHECK, ["--matrix-size", "0"], "argument --matrix-size: must be a positive integer"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_in_one_line(tmp_path, script, args, message):
    proc = run([sys.executable, script, *args], cwd=tmp_path, expect_rc=2)
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", [BENCH, CHECK], ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
         "MASTER_PORT not set: start this script with torchrun or srun"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two", "SLURM_LOCALID": "0",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         "SLURM_NTASKS='two' is not a number"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "29500"},
         "MASTER_ADDR not set"),
    ],
)  # fmt: skip
def test_an_incomplete_environment_is_named_in_one_line(tmp_path, script, env, message):
    proc = run([sys.executable, script], cwd=tmp_path, env=example_env(**env), expect_rc=2)
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is visible: --device cuda runs")
@pytest.mark.parametrize("script", [BENCH, CHECK], ids=lambda p: p.name)
def test_cuda_without_a_gpu_says_to_request_one(tmp_path, script):
    env = example_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    proc = run([sys.executable, script, "--device", "cuda"], cwd=tmp_path, env=env, expect_rc=2)
    assert (
        "no GPU is visible: request GPUs (Slurm: --gpus-per-node=N, PBS: -l "
        "select=1:ncpus=4:ngpus=N, Grid Engine: -l gpu=N)"
        in proc.stderr
        and proc.stderr.count("\n") == 1
    ), proc.stderr


@pytest.mark.gpu
def test_nccl_on_the_gpus(tmp_path):
    gpus = torch.cuda.device_count()
    torchrun = [*TORCHRUN, f"--nproc-per-node={gpus}"]
    out = run([*torchrun, CHECK, "--device", "cuda", "--matrix-size", "2048"], cwd=tmp_path,
              timeout=300).stdout  # fmt: skip
    assert f"Node check: {gpus} ranks on 1 node(s), nccl" in out
    assert out.splitlines()[-1] == f"All {gpus} ranks on 1 node passed", out
    assert (
        len(re.findall(r"^rank \d+ on \S+, cuda:\d+ .+ GFLOP/s, .+ checked: ok$", out, re.M))
        == gpus
    ), out
    args = ["--device", "cuda", "--max-bytes", "64M", "--iters", "5"]
    out = run([*torchrun, BENCH, *args], cwd=tmp_path, timeout=300).stdout
    assert f": {gpus} ranks on 1 node(s), nccl, cuda (" in out
    rows = table(out)
    assert [row[0] for row in rows] == [8192 * 2**i for i in range(14)], out
    assert f"with {gpus} ranks (nccl)" in out.splitlines()[-1]


JOB_SCRIPTS = sorted([*EXAMPLES.glob("*/*.sbatch"), *EXAMPLES.glob("*/*.qsub")])


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=lambda path: path.name)
def test_the_job_script_keeps_pytorchs_nccl_error_handling(script):
    """PyTorch's default TORCH_NCCL_ASYNC_ERROR_HANDLING, 3, ends every process after a failed
    collective without calling ncclCommAbort, which can hang in turn; 1 aborts first. A job
    script may leave it unset or set 3, nothing else (in an export, an assignment, srun
    --export)."""
    code = [line.split(" #")[0] for line in script.read_text().splitlines()
            if not line.lstrip().startswith("#")]  # fmt: skip
    settings = re.findall(r"\b(?:TORCH_)?NCCL_ASYNC_ERROR_HANDLING=(\w*)", "\n".join(code))
    assert set(settings) <= {"3"}, settings
