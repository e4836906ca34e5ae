"""examples/first-job/: the Slurm, Grid Engine and PBS job scripts that run check_pytorch.py.

Here each job script runs under bash with the variables its scheduler sets and real Lmod
modules; submitting them to a scheduler is the job of the Slurm tests.
"""

import re
import socket
import sys
import time

import pytest

from conftest import EXAMPLES, copy_example, example_env, page_python_block, run

SBATCH = EXAMPLES / "first-job" / "check_pytorch.sbatch"
QSUB = EXAMPLES / "first-job" / "check_pytorch.qsub"
SCHEDULERS = {
    "check_pytorch.sbatch": {"SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2"},
    "check_pytorch.qsub": {"JOB_ID": "4242", "NSLOTS": "2"},
    "check_pytorch.pbs": {"PBS_JOBID": "4242", "NCPUS": "2"},
}
THREADS = {".sbatch": "SLURM_CPUS_PER_TASK", ".qsub": "NSLOTS", ".pbs": "NCPUS"}


def scheduler_env(script, folder, job_env):
    """What the scheduler sets (PBS also the submission folder, where the script goes)."""
    return {**job_env, **SCHEDULERS[script], "PBS_O_WORKDIR": str(folder)}


def command(script, *args):
    """bash SCRIPT with options as its scheduler passes them: PBS in ARGS, the others as
    arguments."""
    if script.endswith(".pbs"):
        return ["bash", script], {"ARGS": " ".join(args)}
    return ["bash", script, *args], {}


@pytest.mark.parametrize("script", sorted(SCHEDULERS))
def test_job_script_runs_the_check_and_passes_options_through(tmp_path, job_env, script):
    copy_example(tmp_path, f"first-job/{script}", "install/check_pytorch.py")
    argv, extra = command(script, "--size", "48")
    env = {**scheduler_env(script, tmp_path, job_env), **extra}
    out = run(argv, cwd=tmp_path, env=env).stdout
    thread_source = THREADS[script[script.rindex(".") :]]
    assert "Job 4242 on " in out
    assert f"CPU threads:     2 (from {thread_source})" in out
    assert "Test product:    48x48 on " in out  # "$@" reached check_pytorch.py
    assert "Result: PyTorch" in out


@pytest.mark.parametrize("script", sorted(SCHEDULERS))
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (("module load python/3.11", "module load python/3.99"), "unknown"),
        (("python check_pytorch.py", "python check_pytorch_typo.py"), "No such file"),
    ],
)
def test_a_broken_job_script_fails(tmp_path, job_env, script, fault, message):
    copy_example(tmp_path, f"first-job/{script}", "install/check_pytorch.py")
    text = (tmp_path / script).read_text()
    assert fault[0] in text
    (tmp_path / script).write_text(text.replace(fault[0], fault[1]))
    proc = run(["bash", script], cwd=tmp_path, env=scheduler_env(script, tmp_path, job_env),
               expect_rc=None)  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Result: PyTorch" not in proc.stdout


def test_every_sbatch_directive_is_commented_and_short():
    for script in sorted(EXAMPLES.rglob("*.sbatch")):
        for line in script.read_text().splitlines():
            if line.startswith("#SBATCH"):
                assert re.match(r"#SBATCH \S+ +# \S", line), f"{script.name}: no comment: {line}"
            if line.startswith("#SBATCH --time="):
                hours, minutes, _ = line.split()[1].split("=")[1].split(":")
                assert int(hours) * 60 + int(minutes) <= 60, f"{script.name}: keep --time short"


def test_grid_engine_directives_are_valid_options():
    known = {"-S", "-N", "-cwd", "-j", "-l", "-pe", "-o", "-e", "-q", "-P", "-V", "-m", "-M",
             "-t", "-tc", "-hold_jid"}  # fmt: skip
    for script in sorted(EXAMPLES.rglob("*.qsub")):
        directives = [
            line.split()[1:] for line in script.read_text().splitlines() if line.startswith("#$")
        ]
        assert directives, f"{script.name} has no #$ directives"
        for words in directives:
            assert words[0] in known, f"{script.name}: unknown option {words[0]}"
            assert "#" not in " ".join(words), (
                f"{script.name}: Grid Engine reads comments as arguments"
            )
        assert ["-cwd"] in directives, f"{script.name}: run in the submission folder (-cwd)"
        limits = [words[1] for words in directives if words[0] == "-l"]
        assert any(limit.startswith("h_rt=") for limit in limits), f"{script.name}: no h_rt limit"


@pytest.mark.gpu
@pytest.mark.parametrize("script", sorted(SCHEDULERS))
def test_job_script_on_the_gpu(tmp_path, job_env, script):
    copy_example(tmp_path, f"first-job/{script}", "install/check_pytorch.py")
    argv, extra = command(script, "--device", "cuda")
    out = run(argv, cwd=tmp_path, env={**scheduler_env(script, tmp_path, job_env), **extra}).stdout
    assert "works on cuda" in out and "WARNING" not in out


# The stop rule typed into first-job.md, run as the page has it on each branch a reader's
# machine can take; the CPU test machine takes only the last one by itself.
STOP_RULE = ("getting-started/first-job.md", "raise SystemExit(")
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_STEP_ID", "SGE_HGR_gpu", "PBS_NGPUS",
                 "JOB_GPUS", "CUDA_VISIBLE_DEVICES")  # fmt: skip


def run_stop_rule(monkeypatch, cuda, **variables):
    """Run the page's block with torch.cuda.is_available() == cuda and only these scheduler
    variables; tensors are made on the CPU (this torch may have no CUDA): the device the block
    chose, and what it printed."""
    import torch  # noqa: PLC0415 (only these tests need it)

    for name in GPU_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    chosen = []
    real_ones = torch.ones

    def ones(*size, device=None, **kwargs):
        chosen.append(str(device))
        return real_ones(*size, **kwargs)

    monkeypatch.setattr(torch, "ones", ones)
    code = compile(page_python_block(*STOP_RULE), STOP_RULE[0], "exec")
    exec(code, {"__name__": "__main__"})  # noqa: S102 (the page's own code)
    return chosen


@pytest.mark.parametrize("variables", [
    {}, {"SLURM_JOB_GPUS": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}, {"JOB_GPUS": "1"},
    {"SLURM_STEP_ID": "0"},
], ids=str)  # fmt: skip
def test_the_typed_stop_rule_takes_a_working_gpu(monkeypatch, capsys, variables):
    """Where PyTorch can use a GPU, the block takes it, whatever the variables say (none at all:
    a workstation, a PBS job, a Slurm partition without GRES)."""
    assert run_stop_rule(monkeypatch, True, **variables) == ["cuda"]
    assert capsys.readouterr().out == "8.0\n"


@pytest.mark.parametrize("variables", [
    {"SLURM_JOB_GPUS": "0"}, {"SLURM_STEP_GPUS": "0,1", "SLURM_STEP_ID": "0"},
    {"SGE_HGR_gpu": "0 1"}, {"PBS_NGPUS": "1"}, {"JOB_GPUS": "2"},
], ids=str)  # fmt: skip
def test_the_typed_stop_rule_stops_a_job_given_gpus_it_cannot_use(monkeypatch, variables):
    with pytest.raises(SystemExit) as stop:
        run_stop_rule(monkeypatch, False, **variables)
    message = str(stop.value.code)
    assert "\n" not in message and f"({next(iter(variables))})" in message, message  # the first
    assert "PyTorch can use none" in message


@pytest.mark.parametrize("variables", [
    {}, {"JOB_GPUS": "0"}, {"PBS_NGPUS": "0"}, {"SLURM_JOB_GPUS": ""},
    {"SLURM_STEP_ID": "1", "SLURM_JOB_GPUS": "0"},  # a step without GPUs in a job with some
], ids=str)  # fmt: skip
def test_the_typed_stop_rule_takes_the_cpu_where_no_gpu_was_given(monkeypatch, capsys, variables):
    assert run_stop_rule(monkeypatch, False, **variables) == ["cpu"]
    assert capsys.readouterr().out == "8.0\n"


DISTRIBUTED = EXAMPLES / "first-job" / "check_distributed.py"


# The lines check_distributed.sbatch and .py print; the page shows a sample of them.
DISTRIBUTED_LINES = [
    r"Job \d+: \d+ processes on \S+, rendezvous at \S+:\d+",
    r"rank \d+/\d+ on \S+, (cpu|cuda:\d+) \((gloo|nccl)\): sum \d+",
    r"All \d+ processes on \d+ node\(s\) \(.+\) reached each other: sum \d+ as expected",
]


def test_check_distributed_with_two_processes(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = run([*torchrun, DISTRIBUTED, "--device", "cpu"], cwd=tmp_path).stdout
    assert "rank 0/2 on " in out and "rank 1/2 on " in out
    assert "All 2 processes on 1 node(s)" in out and "sum 3 as expected" in out
    # (The page shows a recorded run of the job script: test_slurm.py compares it.)
    for line in out.splitlines():
        assert any(re.fullmatch(pattern, line) for pattern in DISTRIBUTED_LINES), line


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({}, "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, MASTER_ADDR, MASTER_PORT not set"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_ADDR": "n1"},
         "MASTER_PORT not set"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "15999"}, "rank 2 is outside the world size 2"),
    ],
)  # fmt: skip
def test_check_distributed_names_what_is_missing(tmp_path, variables, message):
    proc = run(
        [sys.executable, DISTRIBUTED], cwd=tmp_path, env=example_env(**variables), expect_rc=2
    )
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_check_distributed_stops_when_the_others_never_come(tmp_path):
    """World size 2, one process: a clear message after --timeout, not a hang."""
    env = example_env(
        RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port()
    )
    start = time.monotonic()
    proc = run([sys.executable, DISTRIBUTED, "--timeout", "3"], cwd=tmp_path, env=env, expect_rc=2)
    assert time.monotonic() - start < 30
    assert "rank 0 could not join the 2 processes at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_check_distributed_on_the_gpu(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    out = run([*torchrun, DISTRIBUTED, "--device", "cuda"], cwd=tmp_path).stdout
    assert "cuda:0 (nccl)" in out and "sum 1 as expected" in out


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
