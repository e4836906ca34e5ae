"""examples/first-job/: the Slurm and Grid Engine job scripts that run check_pytorch.py.

Here each job script runs under bash with the variables its scheduler sets and real Lmod
modules; submitting them to a scheduler is the job of the Slurm tests.
"""

import re

import pytest

from conftest import EXAMPLES, copy_example, run

SBATCH = EXAMPLES / "first-job" / "check_pytorch.sbatch"
QSUB = EXAMPLES / "first-job" / "check_pytorch.qsub"
SCHEDULERS = {
    "check_pytorch.sbatch": {"SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2"},
    "check_pytorch.qsub": {"JOB_ID": "4242", "NSLOTS": "2"},
}


@pytest.mark.parametrize("script", sorted(SCHEDULERS))
def test_job_script_runs_the_check_and_passes_options_through(tmp_path, job_env, script):
    copy_example(tmp_path, f"first-job/{script}", "install/check_pytorch.py")
    env = {**job_env, **SCHEDULERS[script]}
    out = run(["bash", script, "--size", "48"], cwd=tmp_path, env=env).stdout
    thread_source = "SLURM_CPUS_PER_TASK" if script.endswith(".sbatch") else "NSLOTS"
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
    proc = run(
        ["bash", script], cwd=tmp_path, env={**job_env, **SCHEDULERS[script]}, expect_rc=None
    )
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
    known = {"-N", "-cwd", "-j", "-l", "-pe", "-o", "-e", "-q", "-P", "-V", "-m", "-M"}
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
    out = run(
        ["bash", script, "--device", "cuda"], cwd=tmp_path, env={**job_env, **SCHEDULERS[script]}
    ).stdout
    assert "works on cuda" in out and "WARNING" not in out
