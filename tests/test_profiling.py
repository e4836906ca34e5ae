"""examples/profiling/: a few training steps under torch.profiler, one trace per process.

The job script (profile.sbatch) runs under the tests' Slurm cluster (test_slurm.py).
"""

import json
import re
import sys

import pytest
from recorded import check_recorded

from conftest import EXAMPLES, HAS_CUDA, SOURCE, TORCHRUN, example_env, launch, load_example, run

FOLDER = EXAMPLES / "profiling"
PROFILE = FOLDER / "profile_steps.py"
TINY = ["--steps", "5", "--batch-size", "8", "--image-size", "32", "--num-workers", "1"]
LABELS = {"data", "forward", "backward", "optimizer"}
# The profiler skips step 0, warms up on step 1 and records steps 2 to 4.
RECORDED_STEPS = {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}

# What changes from run to run in the recording the page shows: the host, the times, the
# folder, and the table's rows (their times, and so their order) and column widths.
VOLATILE = [
    (r"^(rank \d+/\d+ on )\S+,", r"\1…,"),
    (r" in [\d.]+ s ", " in … s "),
    (r"loss [\d.]+$", "loss …"),
    (r"^ *\S.*? +-?[\d.]+% .*$", "<operator row>"),
    (r"^-[- ]*$", "<rule>"),
    (r" {2,}", " "),
    (r"total: [\d.]+[mun]?s$", "total: …"),
    (r"/\S*/(profile-\w+/)", r"…/\1"),
]


def trace_names(path):
    """The names of the events in a Chrome trace file (it must be valid JSON)."""
    trace = json.loads(path.read_text(encoding="utf-8"))
    assert trace["traceEvents"], f"{path.name} holds no events"
    return {event.get("name") for event in trace["traceEvents"]}


def check_trace(path):
    names = trace_names(path)
    assert names & {"aten::conv2d", "aten::convolution"}, path.name
    assert names & {"aten::addmm", "aten::linear"}, path.name
    assert LABELS <= names, f"{path.name} lacks the labels {LABELS - names}"
    steps = {name for name in names if name and name.startswith("ProfilerStep#")}
    assert steps == RECORDED_STEPS, steps
    return names


def table_rows(out):
    """The operator rows of the key_averages table: name, then the columns."""
    return re.findall(r"^ *(\S.*?) +-?[\d.]+% ", out, re.M)


def test_one_process_prints_the_table_and_writes_one_trace(tmp_path):
    args = [*TINY, "--device", "cpu", "--output-dir", "out"]
    out = run([sys.executable, PROFILE, *args], cwd=tmp_path, timeout=120).stdout
    # Shown on the profiling page; the times, and so the rows' order, change from run to run.
    # (with the paths of a reader's project folder instead of the test's)
    shown = out.replace(str(tmp_path), "/home/user/project")
    check_recorded(FOLDER / "profile_steps.out", shown, volatile=VOLATILE)
    assert "rank 0/1 on " in out and ": 5 steps of 8 images, recording ProfilerStep#2 to #4" in out
    rows = table_rows(out)
    # Which rows make the top 10 depends on the machine's load (a busy machine's data loader
    # waits longer); what kinds of row there are does not: operators, the script's ranges and
    # PyTorch's own.
    assert len(rows) == 10 and any(name.startswith("aten::") for name in rows), out
    known = ("aten::", "autograd::", "enumerate(DataLoader)", "Optimizer.", "ProfilerStep*")
    ranges = {"data", "forward", "backward", "optimizer"}
    assert [n for n in rows if not n.startswith(known) and n not in ranges] == [], out
    assert "Self CPU time total: " in out and "by self_cpu_time_total" in out
    traces = list((tmp_path / "out" / "profile-local").iterdir())
    assert [t.name.split(".")[0] for t in traces] == ["rank0"], traces
    assert traces[0].name.endswith(".pt.trace.json")
    check_trace(traces[0])
    assert f"Trace files in {tmp_path / 'out' / 'profile-local'}/: 1 (" in out
    assert "https://ui.perfetto.dev" in out


def check_two_traces(folder):
    traces = sorted(folder.iterdir())
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        names = check_trace(trace)
        assert "gloo:all_reduce" in names, f"no gradient all-reduce in {trace.name}"


def test_two_processes_under_torchrun_write_one_trace_each(tmp_path):
    cmd = [*TORCHRUN, "--nproc-per-node=2", PROFILE, *TINY, "--device", "cpu"]
    out = run([*cmd, "--output-dir", "out"], cwd=tmp_path, env=example_env(OMP_NUM_THREADS=1),
              timeout=180).stdout  # fmt: skip
    for rank in (0, 1):
        assert f"rank {rank}/2 on " in out and "cpu (gloo): 5 steps" in out, out
    assert out.count("Self CPU time total: ") == 1, "only rank 0 prints the table"
    assert len(table_rows(out)) == 10, out
    check_two_traces(tmp_path / "out" / "profile-local")


def test_two_srun_tasks_write_into_the_jobs_folder(tmp_path):
    """As srun starts them (SLURM_PROCID, SLURM_NTASKS): the folder is named after the job."""
    cmd = [sys.executable, PROFILE, *TINY, "--device", "cpu", "--output-dir", tmp_path]
    results = launch(cmd, cwd=tmp_path, launcher="srun", SLURM_JOB_ID=4242, timeout=180)
    for code, out, err in results:
        assert code == 0, out + err
    assert f"Trace files in {tmp_path / 'profile-4242'}/: 2 (" in results[0][1], results
    check_two_traces(tmp_path / "profile-4242")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--steps", "4"], {}, "argument --steps: must be at least 5: the profiler skips 1, "
         "warms up on 1 and records 3 (got 4)"),
        (["--batch-size", "0"], {}, "argument --batch-size: must be a positive integer (got 0)"),
        (["--num-workers", "-1"], {}, "argument --num-workers: must be 0 or more (got -1)"),
        (["--lr", "inf"], {}, "argument --lr: must be a positive number (got inf)"),
        ([], {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
         "MASTER_PORT not set: start this script with torchrun or srun"),
        ([], {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}, "WORLD_SIZE='two' is not a number"),
        ([], {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}, "SLURM_LOCALID not set: start this script with torchrun "
         "or srun"),
        pytest.param(["--device", "cuda"], {}, "--device cuda but no GPU is visible: request "
                     "one (Slurm: --gpus-per-node=1, PBS: -l select=1:ncpus=4:ngpus=1, Grid "
                     "Engine: -l gpu=1)",
                     marks=pytest.mark.skipif(HAS_CUDA, reason="shows the CPU-only outcome")),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, env, message):
    cmd = [sys.executable, PROFILE, *args, "--output-dir", tmp_path]
    proc = run(cmd, cwd=tmp_path, env=example_env(**env), expect_rc=2)
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("profile-*")), "no trace folder for a run that did not start"


@pytest.mark.gpu
def test_one_gpu_trace_holds_kernels(tmp_path):
    args = ["--steps", "6", "--batch-size", "32", "--device", "cuda", "--output-dir", tmp_path]
    out = run([sys.executable, PROFILE, *args], cwd=tmp_path, timeout=300).stdout
    assert "by self_device_time_total" in out and "Self CUDA time total: " in out, out
    (trace,) = (tmp_path / "profile-local").iterdir()
    events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events), "no GPU kernels in the trace"
    assert LABELS <= {event.get("name") for event in events}


@pytest.mark.parametrize(("steps", "recorded"), [(1, None), (2, 0), (3, 1), (4, 2), (5, 3)])
def test_fewer_steps_than_the_schedule_leave_a_partial_trace(tmp_path, steps, recorded):
    """The script's own profiler (make_profiler) around `steps` steps of one matmul each: the
    trace its exit writes, and how many of the steps it recorded (None: no trace at all), as
    profiling.md says. The script itself refuses fewer than 5 steps."""
    example = load_example(PROFILE)
    torch = example.torch
    with example.make_profiler(tmp_path, 0, use_cuda=False) as prof:
        for _ in range(steps):
            torch.ones(8, 8) @ torch.ones(8, 8)
            prof.step()
    traces = list(tmp_path.glob("*.pt.trace.json"))
    if recorded is None:
        assert traces == [], traces
    else:
        (trace,) = traces
        events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
        assert sum(event.get("name") == "aten::mm" for event in events) == recorded
    page = " ".join((SOURCE / "monitoring" / "profiling.md").read_text(encoding="utf-8").split())
    assert (
        "found no trace after 1 step; a trace with no training step in it after 2 steps (only "
        "the mark of `ProfilerStep#2`, which never ran); 1 recorded step after 3 steps, 2 after "
        "4, and the full 3 after 5."
    ) in page
