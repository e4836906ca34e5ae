"""Every Grid Engine job script in examples/, submitted with qsub to a real one-host cell.

The cell (tests/gridengine/cell.sh, Debian's gridengine packages) has one queue, all.q, with
4 slots, the parallel environment smp and a consumable gpu resource; it is started once for
these tests and stopped at the end.
"""

import html
import json
import os
import re
import shutil
import time

import pytest

from conftest import (
    CENTRE_SITES,
    EXAMPLES,
    ROOT,
    TEST_SITES,
    VERSIONS,
    Job,
    assert_row_1_named,
    assert_site_check_passed,
    build_edition,
    centre_edition,
    copy_example,
    run,
)

pytestmark = pytest.mark.gridengine


# One entry per Grid Engine job script in examples/ (a test fails when one is missing).
JOBS = {
    "first-job/check_pytorch.qsub": Job(
        files=("install/check_pytorch.py",),
        args=("--size", "64"),
        expect=(
            "CPU threads:     4 (from NSLOTS)",
            "Test product:    64x64 on cpu",
            "Result: PyTorch",
        ),
    ),
    "arrays/sweep.qsub": Job(files=("arrays/sweep_train.py",)),
    "arrays/collect.qsub": Job(files=("arrays/collect_results.py",)),
}
QSUB_SCRIPTS = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.qsub"))
# An array job and the job that waits for it, submitted together by submit_sweep_ge.sh: a test
# of their own at the end of this file.
ARRAYS = {"arrays/sweep.qsub", "arrays/collect.qsub"}
SINGLE_JOBS = [s for s in QSUB_SCRIPTS if s not in ARRAYS]


def qsub(script, *args, cwd, env):
    """Submit with the test's MODULEPATH and VENV (a reader's login environment has them)."""
    variables = ",".join(f"{name}={env[name]}" for name in ("MODULEPATH", "VENV"))
    return run(["qsub", "-terse", "-v", variables, script, *args], cwd=cwd, env=env).stdout.strip()


def wait_for(job_id, env, timeout=60):
    """Poll until the job has left the queue and is in the accounting file; return its record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = run(["qacct", "-j", job_id], cwd="/", env=env, expect_rc=None)
        if proc.returncode == 0:
            return dict(re.findall(r"^(\w+)\s+(.*?)\s*$", proc.stdout, re.M))
        time.sleep(0.3)
    pytest.fail(f"Grid Engine job {job_id} did not finish within {timeout} s", pytrace=False)


@pytest.fixture
def cell_env(gridengine_cell, job_env):
    return {**job_env, **gridengine_cell[0]}


def test_every_grid_engine_job_script_has_a_test():
    assert sorted(JOBS) == QSUB_SCRIPTS, (
        "add the new job script to JOBS in tests/test_gridengine.py"
    )


def test_cell_has_a_queue_with_slots_and_gpus(gridengine_cell, record_property):
    env, seconds = gridengine_cell
    record_property("timing", f"Grid Engine cell start: {seconds:.1f} s")
    env = {**os.environ, **env}
    out = run(["qstat", "-f"], cwd="/", env=env).stdout
    # The cell is shared with the page tests' jobs: some slots may be in use.
    host = re.search(r"^all\.q@(\S+)\s+BIP\s+\d+/\d+/4\s", out, re.M)
    assert host, out
    assert re.search(
        r"complex_values\s+gpu=2\b", run(["qconf", "-se", host[1]], cwd="/", env=env).stdout
    )


@pytest.mark.parametrize("script", SINGLE_JOBS)
def test_job_script_completes_under_grid_engine(cell_env, tmp_path, script, record_property):
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    start = time.perf_counter()
    job_id = qsub(script.split("/")[-1], *job.args, cwd=tmp_path, env=cell_env)
    record = wait_for(job_id, cell_env)
    record_property("timing", f"Grid Engine job {script}: {time.perf_counter() - start:.1f} s")
    output = next(tmp_path.glob(f"*.o{job_id}")).read_text()
    assert (record["failed"], record["exit_status"]) == ("0", "0"), output
    assert f"Job {job_id} on " in output
    job.assert_printed(output, job_id)


@pytest.mark.parametrize("script", SINGLE_JOBS)
def test_without_its_shell_line_a_job_script_fails_under_a_stock_queue(cell_env, tmp_path, script):
    """A stock queue (shell_start_mode posix_compliant) starts the script with the queue's
    shell, /bin/csh, not with its #! line: `#$ -S /bin/bash` is what makes it run."""
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    name = script.split("/")[-1]
    text = (tmp_path / name).read_text()
    assert "\n#$ -S /bin/bash\n" in text, f"{script}: add #$ -S /bin/bash"
    (tmp_path / name).write_text(text.replace("\n#$ -S /bin/bash\n", "\n"))
    job_id = qsub(name, *job.args, cwd=tmp_path, env=cell_env)
    record = wait_for(job_id, cell_env)
    outputs = list(tmp_path.glob(f"*.o{job_id}"))
    output = outputs[0].read_text() if outputs else ""
    assert (record["failed"], record["exit_status"]) != ("0", "0"), output
    assert "Result: PyTorch" not in output, output


@pytest.mark.parametrize("script", SINGLE_JOBS)
def test_a_broken_job_script_fails_under_grid_engine(cell_env, tmp_path, script):
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    name = script.split("/")[-1]
    text = (tmp_path / name).read_text()
    module = re.search(r"^module load (\S+)", text, re.M)
    (tmp_path / name).write_text(text.replace(module[0], module[0] + "-typo", 1))
    job_id = qsub(name, *job.args, cwd=tmp_path, env=cell_env)
    record = wait_for(job_id, cell_env)
    output = next(tmp_path.glob(f"*.o{job_id}")).read_text()
    assert record["exit_status"] != "0", output
    assert "unknown" in output and "Result: PyTorch" not in output, output


SWEEP_NAMES = ("sweep.qsub", "collect.qsub", "submit_sweep_ge.sh", "make_sweep.py",
               "sweep_train.py", "collect_results.py")  # fmt: skip


def submit_sweep(cell_env, tmp_path, *defaults):
    """submit_sweep_ge.sh on the sweep.csv in tmp_path, with these qsub options by default
    (.sge_request, as a reader's login environment would give MODULEPATH and VENV):
    (array id, collect id, the sweep's own folder)."""
    variables = ",".join(f"{name}={cell_env[name]}" for name in ("MODULEPATH", "VENV"))
    (tmp_path / ".sge_request").write_text(
        f"-v {variables}\n" + "".join(f"{d}\n" for d in defaults)
    )
    out = run(["bash", "submit_sweep_ge.sh", "--epochs", "1"], cwd=tmp_path,
              env={**cell_env, "MAX_RUNNING": "2"}).stdout  # fmt: skip
    ids = re.search(r"^Submitted array job (\d+) \(\d tasks\) and collect job (\d+) ", out, re.M)
    folder = re.search(r"^Sweep and results in (sweeps/[\w-]+); ", out, re.M)
    assert ids and folder, out
    return ids[1], ids[2], folder[1]


def test_a_sweep_runs_as_an_array_job_then_one_job_collects_it(cell_env, tmp_path):
    """submit_sweep_ge.sh: qsub -t 1-4 -tc 2, then qsub -hold_jid. Submitted held (-h), and
    released once make_sweep.py has rewritten sweep.csv with other values: every task trains
    its row as submitted, from the sweep's own folder."""
    copy_example(tmp_path, *(f"arrays/{name}" for name in SWEEP_NAMES))
    run(["python", "make_sweep.py"], cwd=tmp_path, env=cell_env)
    array, collect, sweep_dir = submit_sweep(cell_env, tmp_path, "-h")
    run(["python", "make_sweep.py", "--lr", "0.5", "0.05", "--batch-size", "64", "256"],
        cwd=tmp_path, env=cell_env)  # fmt: skip
    run(["qrls", array, collect], cwd=tmp_path, env=cell_env)
    record = wait_for(collect, cell_env, timeout=180)
    output = (tmp_path / f"collect.o{collect}").read_text()
    assert (record["failed"], record["exit_status"]) == ("0", "0"), output
    table = re.findall(r"^ +(\d) +0\.0?1 +(?:32|128) +0 +[\d.]+ +[\d.]+ +[\d.]+$", output, re.M)
    assert sorted(table) == ["0", "1", "2", "3"], output
    for task in range(1, 5):  # Grid Engine counts tasks from 1: task N trains row N-1
        out = (tmp_path / f"sweep.o{array}.{task}").read_text()
        assert f"Job {array}, task {task} of 1-4 on " in out, out
        assert f"task {task - 1}: lr=" in out, out
    assert (tmp_path / sweep_dir / "summary.csv").is_file()
    assert not (tmp_path / "results").exists()


def test_a_failed_task_is_named_although_an_earlier_sweep_left_a_result(cell_env, tmp_path):
    """-hold_jid starts the collecting job after a failed task too. A results/task-1.json
    from an earlier sweep (another lr) does not stand in for row 1 of the new one, whose
    task fails (its loss diverges): the collecting job names it and fails."""
    copy_example(tmp_path, *(f"arrays/{name}" for name in SWEEP_NAMES))
    (tmp_path / "sweep.csv").write_text("lr,batch_size,seed\n0.1,32,0\n0.01,32,0\n")
    run(["python", "sweep_train.py", "--task", "1", "--epochs", "1", "--output-dir", "results"],
        cwd=tmp_path, env=cell_env)  # fmt: skip
    (tmp_path / "sweep.csv").write_text("lr,batch_size,seed\n0.1,32,0\n1e6,32,0\n")
    array, collect, sweep_dir = submit_sweep(cell_env, tmp_path)
    record = wait_for(collect, cell_env, timeout=180)
    output = (tmp_path / f"collect.o{collect}").read_text()
    assert record["exit_status"] != "0", output
    failed = (tmp_path / f"sweep.o{array}.2").read_text()
    assert_row_1_named(output, failed, sweep_dir)


def test_site_check_runs_every_job_script_of_the_cell_and_records_it(cell_env, tmp_path):
    """make site-check with the cell's site file: the three job scripts (the array and the job
    that waits for it included), the record, and the stamp the cell's edition shows."""
    site = tmp_path / "site" / TEST_SITES["gridengine"].name
    site.parent.mkdir()
    shutil.copy(TEST_SITES["gridengine"], site)
    proc = run(["make", "--no-print-directory", "site-check", f"SITE={site}",
                f"CHECK_ARGS=--work-dir {tmp_path / 'work'} --max-jobs 2"],
               cwd=ROOT, env=cell_env, timeout=600)  # fmt: skip
    assert "the tests' Grid Engine cell: 3 of 3 job scripts passed. Record: " in proc.stdout
    record = json.loads(site.with_name("gridengine-test-cell.record.json").read_text())
    entries = record["examples"]
    assert_site_check_passed(entries, QSUB_SCRIPTS, "exit_status 0, failed 0")
    # Given one GPU, ran on none: the cell's GPUs are not real and its PyTorch is a CPU build.
    assert (entries["first-job/check_pytorch.qsub"]["gpus_given"],
            entries["first-job/check_pytorch.qsub"]["gpus"]) == (1, 0)  # fmt: skip
    assert entries["arrays/sweep.qsub"]["torch"].split("+")[0] == VERSIONS["cpu"]["torch"]
    assert entries["arrays/sweep.qsub"]["scheduler"]
    built = tmp_path / "html"
    build_edition(site, built)
    page = re.sub(r"<[^>]+>", "", (built / "workflows" / "arrays.html").read_text())
    page = re.sub(r"\s+", " ", html.unescape(page))
    page = re.search(r"Scripts on this page: .*? \(How this guide is tested\)", page)[0]
    date = entries["arrays/sweep.qsub"]["date"]
    assert f"Verified at the tests' Grid Engine cell on {date}: 1 of 1 job script passed" in page, (
        page
    )


@pytest.mark.parametrize(
    "name",
    [name for name, path in CENTRE_SITES.items() if 'kind = "gridengine"' in path.read_text()],
)
def test_every_directive_of_a_centres_edition_is_one_qsub_accepts(cell_env, tmp_path, name):
    """qsub -verify parses every #$ line of the centre's scripts and prints the job it would
    submit, without asking whether the cell has the centre's resources. The cell's Grid Engine
    (SGE 8.1) lacks one option of Altair Grid Engine, which ABCI runs: -g, the group. Those
    lines are checked for their form, then left out of the parser's copy."""
    edition = centre_edition(name, tmp_path)
    scripts = sorted(edition.rglob("*.qsub"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        groups = re.findall(r"^#\$ -g .*\n", text, re.M)
        assert all(re.fullmatch(r"#\$ -g [\w.-]+\n", line) for line in groups), groups
        script.write_text("".join(line for line in text.splitlines(keepends=True)
                                  if line not in groups))  # fmt: skip
        proc = run(["qsub", "-verify", script], cwd=script.parent, env=cell_env)
        for resource in re.findall(r"^#\$ -l (\S+)$", text, re.M):
            assert re.search(rf"^hard resource_list: .*\b{re.escape(resource)}\b", proc.stdout,
                             re.M), (script.name, resource, proc.stdout)  # fmt: skip
    # The check can fail: an option qsub does not know stops it.
    broken = tmp_path / "broken.qsub"
    broken.write_text(scripts[0].read_text().replace("#$ -cwd", "#$ -cwdd", 1))
    proc = run(["qsub", "-verify", broken], cwd=tmp_path, env=cell_env, expect_rc=None)
    assert proc.returncode != 0 and "-cwdd" in proc.stderr, proc.stderr
