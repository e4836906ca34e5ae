"""A centre's PBS edition against the tests' OpenPBS complex (tests/pbs/complex.sh).

make site-check with the complex's own site file submits every .pbs script and records them;
every directive of a centre's PBS edition (tests/sites, kind = "pbs") is one that PBS's qsub
takes. The job scripts themselves run in test_pbs.py, from the complex's edition.
"""

import html
import json
import os
import re
import shutil

import pytest

from conftest import (
    CENTRE_SITES,
    PBS_SCRIPTS,
    ROOT,
    TEST_SITES,
    VERSIONS,
    assert_site_check_passed,
    build_edition,
    run,
)
from conftest import centre_edition as make_centre_edition

pytestmark = pytest.mark.pbs

PBS_CENTRES = [name for name, path in CENTRE_SITES.items() if 'kind = "pbs"' in path.read_text()]


def test_site_check_runs_every_job_script_of_the_complex_and_records_it(complex_env, tmp_path):
    """make site-check with the complex's site file: every .pbs script (the array job and the
    job that waits for it included), the record, and the stamp the complex's edition shows."""
    site = tmp_path / "site" / TEST_SITES["pbs"].name
    site.parent.mkdir()
    shutil.copy(TEST_SITES["pbs"], site)
    proc = run(["make", "--no-print-directory", "site-check", f"SITE={site}",
                f"CHECK_ARGS=--work-dir {tmp_path / 'work'} --max-jobs 3 --timeout 400"],
               cwd=ROOT, env=complex_env, timeout=600)  # fmt: skip
    total = len(PBS_SCRIPTS)
    assert f"the tests' PBS complex: {total} of {total} job scripts passed. Record: " in (
        proc.stdout
    ), proc.stdout
    record = json.loads(site.with_name("pbs-test-complex.record.json").read_text())
    entries = record["examples"]
    assert_site_check_passed(entries, PBS_SCRIPTS, "Exit_status 0")
    for entry in entries.values():
        assert entry["scheduler"].startswith("pbs_version = "), entry["scheduler"]
    # Given one GPU, ran on none: the complex's GPUs are not real and its PyTorch a CPU build.
    first = entries["first-job/check_pytorch.pbs"]
    assert (first["gpus_given"], first["gpus"]) == (1, 0), first
    # Two chunks on two nodes, two GPUs each (exec_vnode); an array job's subjobs (-J 0-1).
    ddp = entries["ddp/ddp_torchrun.pbs"]
    assert (ddp["nodes"], ddp["gpus_given"]) == ("pbs-n1,pbs-n2", 4), ddp
    assert re.fullmatch(r"\d+\[\]\.\S+", entries["arrays/sweep.pbs"]["job_id"]), entries
    assert entries["arrays/sweep.pbs"]["torch"].split("+")[0] == VERSIONS["cpu"]["torch"]
    sweep_dir = tmp_path / "work" / "jobs" / "arrays-sweep" / "sweeps" / "site-check"
    assert sorted(p.name for p in sweep_dir.glob("task-*.json")) == ["task-0.json", "task-1.json"]
    built = tmp_path / "html"
    build_edition(site, built)
    page = re.sub(r"<[^>]+>", "", (built / "workflows" / "arrays.html").read_text())
    page = re.sub(r"\s+", " ", html.unescape(page))
    page = re.search(r"Scripts on this page: .*? \(How this guide is tested\)", page)[0]
    date = entries["arrays/sweep.pbs"]["date"]
    assert f"Verified at the tests' PBS complex on {date}: 1 of 1 job script passed" in page, page


@pytest.fixture
def centre_queues(pbs_complex):
    """Creates the queues that a centre's scripts name and the complex lacks (ABCI 3.0's
    rt_HF, rt_HG, rt_HC), enabled and started; deletes them afterwards. Yields a function
    that takes the queue names."""
    env = {**os.environ, **pbs_complex[0]}
    created = []

    def create(names):
        queues = json.loads(run(["qstat", "-Q", "-f", "-F", "json"], cwd="/", env=env).stdout)
        for name in sorted(set(names) - set(queues.get("Queue", {}))):
            run(["qmgr", "-c", f"create queue {name} queue_type=execution,enabled=true,"
                 "started=true"], cwd="/", env=env)  # fmt: skip
            created.append(name)

    yield create
    for name in created:
        run(["qmgr", "-c", f"delete queue {name}"], cwd="/", env=env, expect_rc=None)


def directives(text):
    """(option, value) of each #PBS line."""
    return [tuple(m) for m in re.findall(r"^#PBS (-\w)(?: (.*))?$", text, re.M)]


def as_written(job, option, value):
    """Whether qstat's record of a held job has the directive as the script writes it."""
    if option == "-l":
        name, _, wanted = value.partition("=")
        return str(job.get("Resource_List", {}).get(name)) == wanted
    field = {"-N": "Job_Name", "-j": "Join_Path", "-q": "queue", "-P": "project",
             "-m": "Mail_Points"}  # fmt: skip
    if option == "-r":
        return job.get("Rerunable") == {"y": "True", "n": "False"}[value]
    if option == "-J":  # 0-3%2: indices 0-3, at most 2 running
        indices, _, most = value.partition("%")
        return (job.get("array_indices_submitted"), job.get("max_run_subjobs")) == (
            indices,
            int(most) if most else None,
        )
    assert option in field, f"no check for #PBS {option}: add one to as_written()"
    return str(job.get(field[option])) == value


@pytest.mark.parametrize("name", PBS_CENTRES)
def test_every_directive_of_a_centres_edition_is_one_pbs_accepts(
    pbs_complex, centre_queues, tmp_path, name
):
    """PBS has no dry run: each script of the centre's edition is submitted held (qsub -h),
    so that it never runs, in the centre's queues made on the complex. qsub parses every
    #PBS line; qstat then shows the queue, project and resources as the script writes them;
    the job is deleted."""
    env = {**os.environ, **pbs_complex[0]}
    env["PATH"] = f"{env['PBS_EXEC']}/bin{os.pathsep}{env['PATH']}"
    edition = make_centre_edition(name, tmp_path)
    scripts = sorted(edition.rglob("*.pbs"))
    assert len(scripts) == len(PBS_SCRIPTS)
    queues = {value for script in scripts for option, value in directives(script.read_text())
              if option == "-q"}  # fmt: skip
    centre_queues(queues)
    for script in scripts:
        job_id = run(["qsub", "-h", script.name], cwd=script.parent, env=env).stdout.strip()
        try:
            found = json.loads(run(["qstat", "-f", "-F", "json", "-t", job_id], cwd="/",
                                   env=env).stdout, strict=False)["Jobs"][job_id]  # fmt: skip
        finally:
            run(["qdel", job_id], cwd="/", env=env)
        for option, value in directives(script.read_text()):
            assert as_written(found, option, value), (script.name, option, value, found)
    # The check can fail: a value qsub cannot parse, a comment after a directive.
    text = scripts[0].read_text()
    for broken, message in (
        (re.sub(r"^#PBS -l walltime=\S+$", "#PBS -l walltime=soon", text, flags=re.M),
         "Illegal attribute or resource value Resource_List.walltime"),
        (text.replace("#PBS -j oe\n", "#PBS -j oe   # merged\n", 1), "directive error: -j oe"),
    ):  # fmt: skip
        assert broken != text
        (tmp_path / "broken.pbs").write_text(broken)
        proc = run(["qsub", "-h", "broken.pbs"], cwd=tmp_path, env=env, expect_rc=None)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
