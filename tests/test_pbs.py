"""Every PBS job script in examples/, submitted with qsub to a real OpenPBS complex.

The complex (tests/pbs/complex.sh: OpenPBS built from source by tests/pbs/build.sh) has two
nodes, pbs-n1 and pbs-n2, each with 16 ncpus, 256 GB and a consumable ngpus (2), one queue,
workq, and job history, so that qstat -x reports every finished job's exit status; it is started
once for these tests and stopped at the end.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    PBS_SCRIPTS,
    ROOT,
    SESSION_START,
    Job,
    assert_row_1_named,
    copy_example,
    run,
)

pytestmark = pytest.mark.pbs

TRAIN = ("--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2")

# One entry per PBS job script in examples/ (a test fails when one is missing). args travel as
# ARGS (qsub -v): PBS passes no arguments to a job script.
JOBS = {
    "first-job/check_pytorch.pbs": Job(
        files=("install/check_pytorch.py",),
        args=("--size", "64"),
        expect=(
            "Job {job_id} on ",
            "CPU threads:     4 (from NCPUS)",
            "GPUs requested:  JOB_GPUS=1",  # the script's export: PBS sets no GPU variable
            "Test product:    64x64 on cpu",
            "Result: PyTorch",
        ),
    ),
    "one-gpu/cnn_gpu.pbs": Job(
        files=("one-gpu/cnn_gpu.py",),
        args=("--fake-data", "--fake-size", "32", "--epochs", "1", "--batch-size", "16"),
        expect=("Job {job_id} on ", "8 CPUs", "tuned: ", "workers=7"),
    ),
    # (One node: test_ddp_on_one_node_is_the_same_script_with_one_chunk.)
    "ddp/ddp_torchrun.pbs": Job(
        files=("ddp/ddp.py",),
        args=TRAIN,
        expect=(
            "Job {job_id}: 2 node(s) x 2 processes, rendezvous at pbs-n1:",
            "4 processes, cpu (gloo), global batch 256",
            "epoch 2: loss ",
        ),
    ),
}
# Scripts with a test of their own below (arrays, chained jobs).
OWN_TESTS = {"checkpointing/train_checkpoint.pbs", "arrays/sweep.pbs", "arrays/collect.pbs"}
SINGLE_JOBS = [s for s in PBS_SCRIPTS if s not in OWN_TESTS]


def qsub(script, *options, args=(), cwd, env, extra=None):
    """Submit with the test's MODULEPATH and VENV (a reader's login environment has them) and
    the script's options in ARGS; the job id (e.g. 12.pbs-n1)."""
    values = {"MODULEPATH": env["MODULEPATH"], "VENV": env["VENV"], **(extra or {})}
    if args:
        values["ARGS"] = " ".join(args)
    assert not any("," in str(value) for value in values.values()), values  # -v splits on ","
    variables = ",".join(f"{name}={value}" for name, value in values.items())
    return run(["qsub", "-v", variables, *options, script], cwd=cwd, env=env).stdout.strip()


def job_record(job_id, env):
    proc = run(["qstat", "-x", "-f", "-F", "json", job_id], cwd="/", env=env, expect_rc=None)
    if proc.returncode != 0:
        return {}
    return next(iter(json.loads(proc.stdout).get("Jobs", {}).values()), {})


def wait_for(job_id, env, timeout=120):
    """Poll until the job has finished (qstat -x: state F); return its record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = job_record(job_id, env)
        if record.get("job_state") == "F":
            return record
        time.sleep(0.3)
    pytest.fail(f"PBS job {job_id} did not finish within {timeout} s", pytrace=False)


def output_of(folder, name, job_id):
    """The job's output file, <name>.o<number> (-j oe: stderr merged into it)."""
    path = folder / f"{name}.o{job_id.split('.')[0]}"
    return path.read_text() if path.exists() else ""


def test_every_pbs_job_script_has_a_test():
    assert sorted([*JOBS, *OWN_TESTS]) == PBS_SCRIPTS, "add the new job script to tests/test_pbs.py"


def test_complex_has_two_nodes_with_gpus(pbs_complex, record_property):
    env, seconds = pbs_complex
    built = Path(env["PBS_EXEC"], ".built").stat().st_mtime > SESSION_START
    how = "OpenPBS built by this run" if built else "OpenPBS from the cache"
    record_property("timing", f"OpenPBS complex start ({how}): {seconds:.1f} s")
    nodes = json.loads(run(["pbsnodes", "-a", "-F", "json"], cwd="/",
                           env={**os.environ, **env}).stdout)["nodes"]  # fmt: skip
    assert sorted(nodes) == ["pbs-n1", "pbs-n2"], nodes
    for node in nodes.values():
        assert node["resources_available"]["ngpus"] == 2, node


@pytest.mark.parametrize("script", SINGLE_JOBS)
def test_job_script_completes_under_pbs(complex_env, tmp_path, script, record_property):
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    name = script.split("/")[-1]
    start = time.perf_counter()
    job_id = qsub(name, args=job.args, cwd=tmp_path, env=complex_env)
    record = wait_for(job_id, complex_env)
    record_property("timing", f"PBS job {script}: {time.perf_counter() - start:.1f} s")
    output = output_of(tmp_path, record["Job_Name"], job_id)
    assert record.get("Exit_status") == 0, output
    job.assert_printed(output, job_id)


@pytest.mark.parametrize("script", SINGLE_JOBS)
def test_a_broken_job_script_fails_under_pbs(complex_env, tmp_path, script):
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    name = script.split("/")[-1]
    text = (tmp_path / name).read_text()
    module = re.search(r"^module load (\S+)", text, re.M)
    (tmp_path / name).write_text(text.replace(module[0], module[0] + "-typo", 1))
    job_id = qsub(name, args=job.args, cwd=tmp_path, env=complex_env)
    record = wait_for(job_id, complex_env)
    output = output_of(tmp_path, record["Job_Name"], job_id)
    assert record.get("Exit_status") not in (0, None), output
    assert "unknown" in output and "epoch 2" not in output, output


CHECKPOINT_ARGS = (
    "--device",
    "cpu",
    "--fake-data",
    "--fake-size",
    "256",
    "--checkpoint-every",
    "4",
)


def test_a_chain_of_jobs_goes_on_from_the_last_checkpoint(complex_env, tmp_path):
    """train_checkpoint.pbs twice, the second with -W depend=afterany on the first: the second
    starts only once the first has ended and resumes its run from the newest checkpoint."""
    copy_example(
        tmp_path, "checkpointing/train_checkpoint.pbs", "checkpointing/train_checkpoint.py"
    )
    root = {"CHECKPOINT_ROOT": tmp_path / "scratch"}
    first = qsub("train_checkpoint.pbs", args=(*CHECKPOINT_ARGS, "--epochs", "1"), cwd=tmp_path,
                 env=complex_env, extra=root)  # fmt: skip
    second = qsub("train_checkpoint.pbs", "-W", f"depend=afterany:{first}",
                  args=(*CHECKPOINT_ARGS, "--epochs", "2"), cwd=tmp_path, env=complex_env,
                  extra=root)  # fmt: skip
    record = wait_for(second, complex_env, timeout=240)
    before = wait_for(first, complex_env)
    out1 = output_of(tmp_path, "train-checkpoint", first)
    out2 = output_of(tmp_path, "train-checkpoint", second)
    assert before.get("Exit_status") == 0 and record.get("Exit_status") == 0, out1 + out2
    folder = tmp_path / "scratch" / "train-checkpoint" / "checkpoints"
    assert f"Job {first} on " in out1 and "starting from scratch" in out1, out1
    assert "epoch 1: loss " in out1 and "epoch 2" not in out1, out1
    # The second started once the first had ended, and went on from where it stopped.
    assert pbs_time(record["stime"]) >= pbs_time(before["obittime"]), (record, before)
    resumed = re.search(rf"resumed from {re.escape(str(folder))}/\S+ after (\d+) of (\d+) steps",
                        out2)  # fmt: skip
    assert resumed and 0 < int(resumed[1]) < int(resumed[2]), out2
    assert "epoch 2: loss " in out2 and "epoch 1: loss " not in out2, out2


def test_a_job_put_back_in_the_queue_resumes(complex_env, tmp_path):
    """qrerun, as an operator or PBS after a node failure: the job (-r y) is stopped, queued
    again and started from the top, and the new start resumes from the newest checkpoint."""
    copy_example(
        tmp_path, "checkpointing/train_checkpoint.pbs", "checkpointing/train_checkpoint.py"
    )
    job = qsub("train_checkpoint.pbs", args=(*CHECKPOINT_ARGS, "--epochs", "40"), cwd=tmp_path,
               env=complex_env, extra={"CHECKPOINT_ROOT": tmp_path / "scratch"})  # fmt: skip
    folder = tmp_path / "scratch" / "train-checkpoint" / "checkpoints"
    deadline = time.monotonic() + 120
    while not [p for p in folder.glob("*.pt")] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(folder.glob("*.pt")), f"no checkpoint in {folder} within 120 s"
    # Stopped where it is, so that qrerun finds it running however fast this machine trains,
    # and let go once qrerun has signalled it. The lock file names the training process.
    holder = re.search(r"process (\d+)", (folder / ".lock").read_text())
    assert holder, (folder / ".lock").read_text()
    os.kill(int(holder[1]), signal.SIGSTOP)
    try:
        run(["qrerun", job], cwd=tmp_path, env=complex_env)
    finally:
        os.kill(int(holder[1]), signal.SIGCONT)
    record = wait_for(job, complex_env, timeout=300)
    output = output_of(tmp_path, "train-checkpoint", job)
    assert record.get("Exit_status") == 0 and int(record["run_count"]) >= 2, (record, output)
    assert re.search(rf"resumed from {re.escape(str(folder))}/\S+ after [1-9]\d* of \d+ steps",
                     output), output  # fmt: skip
    assert "epoch 40: loss " in output, output


def pbs_time(text):
    """A time qstat -F json prints ("Sat Nov 28 20:55:01 2026"), as seconds."""
    return time.mktime(time.strptime(text, "%a %b %d %H:%M:%S %Y"))


SWEEP_NAMES = ("sweep.pbs", "collect.pbs", "submit_sweep_pbs.sh", "make_sweep.py",
               "sweep_train.py", "collect_results.py")  # fmt: skip


def submit_sweep(env, tmp_path, *options):
    """submit_sweep_pbs.sh on the sweep.csv in tmp_path, its qsub exporting the submitting
    shell's environment (-V), as a reader's login environment gives MODULEPATH and VENV, plus
    these options (e.g. -h): (array id, collect id, the sweep's own folder)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "qsub").write_text(
        f'#!/bin/bash\nexec {env["PBS_EXEC"]}/bin/qsub -V {" ".join(options)} "$@"\n'
    )
    (shim / "qsub").chmod(0o755)
    env = {**env, "PATH": f"{shim}{os.pathsep}{env['PATH']}", "MAX_RUNNING": "2"}
    out = run(["bash", "submit_sweep_pbs.sh", "--epochs", "1"], cwd=tmp_path, env=env).stdout
    ids = re.search(r"^Submitted array job (\S+) \(\d rows\) and collect job (\S+) ", out, re.M)
    folder = re.search(r"^Sweep and results in (sweeps/[\w-]+); ", out, re.M)
    assert ids and folder, out
    return ids[1], ids[2], folder[1]


def test_a_sweep_runs_as_an_array_job_then_one_job_collects_it(complex_env, tmp_path):
    """submit_sweep_pbs.sh: qsub -J 0-3%2, then qsub -W depend=afterany. Submitted held (-h),
    and released once make_sweep.py has rewritten sweep.csv with other values: every subjob
    trains its row as submitted, from the sweep's own folder."""
    copy_example(tmp_path, *(f"arrays/{name}" for name in SWEEP_NAMES))
    run(["python", "make_sweep.py"], cwd=tmp_path, env=complex_env)
    array, collect, sweep_dir = submit_sweep(complex_env, tmp_path, "-h")
    run(["python", "make_sweep.py", "--lr", "0.5", "0.05", "--batch-size", "64", "256"],
        cwd=tmp_path, env=complex_env)  # fmt: skip
    run(["qrls", array], cwd=tmp_path, env=complex_env)
    run(["qrls", collect], cwd=tmp_path, env=complex_env)
    record = wait_for(collect, complex_env, timeout=240)
    output = output_of(tmp_path, "collect", collect)
    assert record.get("Exit_status") == 0, output
    table = re.findall(r"^ +(\d) +0\.0?1 +(?:32|128) +0 +[\d.]+ +[\d.]+ +[\d.]+$", output, re.M)
    assert sorted(table) == ["0", "1", "2", "3"], output
    number = array.split("[")[0]
    for index in range(4):  # -J 0-3: index N trains row N
        out = (tmp_path / f"sweep.o{number}.{index}").read_text()
        assert f"Job {array}, index {index} on " in out, out
        assert f"task {index}: lr=" in out, out
    assert (tmp_path / sweep_dir / "summary.csv").is_file()
    assert not (tmp_path / "results").exists()


def test_a_failed_subjob_is_named_although_an_earlier_sweep_left_a_result(complex_env, tmp_path):
    """afterany starts the collecting job after a failed subjob too. A results/task-1.json from
    an earlier sweep (another lr) does not stand in for row 1 of the new one, whose subjob fails
    (its loss diverges): the collecting job names it and fails."""
    copy_example(tmp_path, *(f"arrays/{name}" for name in SWEEP_NAMES))
    (tmp_path / "sweep.csv").write_text("lr,batch_size,seed\n0.1,32,0\n0.01,32,0\n")
    run(["python", "sweep_train.py", "--task", "1", "--epochs", "1", "--output-dir", "results"],
        cwd=tmp_path, env=complex_env)  # fmt: skip
    (tmp_path / "sweep.csv").write_text("lr,batch_size,seed\n0.1,32,0\n1e6,32,0\n")
    array, collect, sweep_dir = submit_sweep(complex_env, tmp_path)
    record = wait_for(collect, complex_env, timeout=240)
    output = output_of(tmp_path, "collect", collect)
    assert record.get("Exit_status") not in (0, None), output
    failed = (tmp_path / f"sweep.o{array.split('[')[0]}.1").read_text()
    assert_row_1_named(output, failed, sweep_dir)


def test_a_sweep_of_one_row_is_an_array_of_one(complex_env, tmp_path):
    """PBS refuses -J 0-0: one row is submitted as -J 0-1:2, one subjob, index 0."""
    copy_example(tmp_path, *(f"arrays/{name}" for name in SWEEP_NAMES))
    (tmp_path / "sweep.csv").write_text("lr,batch_size,seed\n0.1,32,0\n")
    array, collect, sweep_dir = submit_sweep(complex_env, tmp_path)
    record = wait_for(collect, complex_env, timeout=240)
    output = output_of(tmp_path, "collect", collect)
    assert record.get("Exit_status") == 0, output
    assert re.search(r"^ +0 +0\.1 +32 +0 ", output, re.M), output
    assert (tmp_path / f"sweep.o{array.split('[')[0]}.0").is_file()


def test_ddp_on_one_node_is_the_same_script_with_one_chunk(complex_env, tmp_path):
    """qsub -l select=1:... overrides the script's two chunks: one torchrun, two processes."""
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs", "ddp/ddp.py")
    job = qsub("ddp_torchrun.pbs", "-l", "select=1:ncpus=8:ngpus=2:mem=32gb", args=TRAIN,
               cwd=tmp_path, env=complex_env)  # fmt: skip
    record = wait_for(job, complex_env, timeout=180)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert record.get("Exit_status") == 0, output
    assert f"Job {job}: 1 node(s) x 2 processes, rendezvous at pbs-n" in output, output
    assert "2 processes, cpu (gloo), global batch 128" in output and "epoch 2: loss " in output


STOPPED_TORCHRUN = """#!/bin/bash
# Stand-in for the second node's torchrun: it fails at once; the first node's is the real one.
[[ " $* " == *" --rdzv-conf=is_host=0 "* ]] || exec "$VIRTUAL_ENV/bin/torchrun" "$@"
echo "stand-in torchrun of the second node: failing with status 3"
exit 3
"""


def test_a_failed_torchrun_stops_the_other_nodes_and_the_job(complex_env, tmp_path):
    """The second node's torchrun fails at once: the job ends with its status, not after the
    first node's has waited out the rendezvous timeout (600 s, past this test's wait)."""
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs", "ddp/ddp.py")
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "torchrun").write_text(STOPPED_TORCHRUN)
    (standin / "torchrun").chmod(0o755)
    # A venv whose activate puts the stand-in first, as the job's PATH reaches every node.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(
        f"source {complex_env['VENV']}/bin/activate\nPATH={standin}:$PATH\n"
    )
    env = {**complex_env, "VENV": str(venv)}
    job = qsub("ddp_torchrun.pbs", args=TRAIN, cwd=tmp_path, env=env)
    record = wait_for(job, env, timeout=90)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert record.get("Exit_status") == 3, output
    assert "2 node(s) x 2 processes" in output and "failing with status 3" in output, output
    assert "epoch 1" not in output, output


def test_a_job_without_gpus_is_refused_by_the_ddp_script(complex_env, tmp_path):
    """No ngpus in the chunk: the script stops in one line saying how to ask for GPUs."""
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs", "ddp/ddp.py")
    job = qsub("ddp_torchrun.pbs", "-l", "select=2:ncpus=8:mem=32gb", args=TRAIN, cwd=tmp_path,
               env=complex_env)  # fmt: skip
    record = wait_for(job, complex_env)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert record.get("Exit_status") not in (0, None), output
    assert "request GPUs: -l select=N:ncpus=C:ngpus=G" in output and "epoch" not in output, output


def test_a_quoted_value_with_commas_passes_through_qsub_v(complex_env, tmp_path):
    """pbs.md: -v splits its list on commas, and a value quoted inside it keeps them, as
    submit_sweep_pbs.sh passes ARGS; unquoted, the value is cut at the first comma."""
    (tmp_path / "show.pbs").write_text(
        '#!/bin/bash\n#PBS -N show\n#PBS -j oe\ncd "$PBS_O_WORKDIR"\necho "ARGS=[$ARGS]"\n'
    )
    outputs = []
    for value in ("'--tags a,b --epochs 1'", "--tags a,b"):
        job = run(["qsub", "-v", f"ARGS={value}", "show.pbs"], cwd=tmp_path, env=complex_env,
                  expect_rc=None)  # fmt: skip
        if job.returncode != 0:  # a -v list item without "=": refused
            outputs.append(f"refused: {job.stderr.strip()}")
            continue
        job_id = job.stdout.strip()
        assert wait_for(job_id, complex_env).get("Exit_status") == 0
        outputs.append(output_of(tmp_path, "show", job_id).strip())
    assert outputs[0] == "ARGS=[--tags a,b --epochs 1]", outputs
    assert outputs[1] != "ARGS=[--tags a,b]", outputs


def test_the_build_refuses_an_archive_that_is_not_the_pinned_commit(tmp_path):
    """Upstream unreachable, and the offline copy's sha256 is not the one pinned: one line."""
    if os.geteuid() != 0:
        pytest.skip("tests/pbs/build.sh needs root (apt-get); CI runs it")
    bad = tmp_path / "openpbs.tar.gz"
    bad.write_bytes(b"not the archive")
    env = {**os.environ, "PYTORCH_ON_HPC_CACHE": str(tmp_path / "cache"),
           "OPENPBS_UPSTREAM": str(tmp_path / "no-such-repository"),
           "OPENPBS_MIRROR": str(bad)}  # fmt: skip
    proc = run(["bash", ROOT / "tests" / "pbs" / "build.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert f"{bad} is not upstream commit cd7ab5edaf03 (sha256 differs)" in proc.stderr, proc.stderr
    assert not (tmp_path / "cache" / "openpbs-cd7ab5edaf03").exists()
