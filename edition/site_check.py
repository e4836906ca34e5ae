"""Verify a centre's edition on its own cluster: submit every job script, wait, write a record.

Run by a centre's staff on a login node, from the repository, with the venv active:

    make site-check SITE=site.toml                     (python3 edition/site_check.py site.toml)
    make site-check SITE=site.toml CHECK_ARGS=--dry-run

It generates the centre's job scripts (edition/generate.py), prints what it will submit, and
(without --dry-run) submits each job script of the centre's scheduler with the shortest
settings of edition/checks.toml, at most --max-jobs at a time, each in a folder of its own
under --work-dir (with sbatch, or qsub: Grid Engine's, or PBS's, which passes the options for a
script in the variable ARGS). It waits for them (scontrol; qstat and qacct; PBS's qstat -x),
prints a report (a failed job with the last lines of its log, a refused submission with the
scheduler's message), and writes the record that the centre's edition shows as "Verified at
<centre> on <date>" (default: beside the site file, <name>.record.json), in the format of
tests/records/<suite>.json. Ctrl-C cancels its jobs. Standard library only.
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import EXAMPLES, GenerateError, generate, omitted  # noqa: E402
from sitefile import SiteFileError, load  # noqa: E402

CHECKS = Path(__file__).resolve().parent / "checks.toml"
SUFFIX = {"slurm": ".sbatch", "gridengine": ".qsub", "pbs": ".pbs"}
CHECK_KEYS = {"files", "prepare", "args", "gpu_args", "options", "env", "after", "expect",
              "server", "root_args"}  # fmt: skip
SLURM_DONE = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL",
              "PREEMPTED", "BOOT_FAIL", "DEADLINE"}  # fmt: skip
# Variables a reader's login environment may set and the job scripts read: qsub passes them
# on with -v (sbatch passes the whole environment). PBS passes a script no arguments: they
# travel in ARGS, which the PBS job scripts split on spaces.
PASSED_ON = ("VENV", "CONDA_ENV", "MODULEPATH", "SHARDS")
LOG_LINES = 15
# The line each process of the examples prints once it runs on a GPU: the GPU's UUID (or, from
# LibTorch, its index), its model, the node. A GPU counts once however many processes share it.
GPU_IN_USE = re.compile(r"GPU in use: (\S+)(?: \(([^)\n]*)\))? on (\S+)")


class CheckError(Exception):
    """One line for the caller."""


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def load_checks(scheduler, only=()):
    """{job script: settings} for the scheduler's job scripts, in the file's order."""
    checks = tomllib.loads(CHECKS.read_text(encoding="utf-8"))
    scripts = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob(f"*{SUFFIX[scheduler]}"))
    missing = sorted(set(scripts) - set(checks))
    if missing:
        raise CheckError(f"{CHECKS}: no entry for {', '.join(missing)}")
    for name, settings in checks.items():
        unknown = set(settings) - CHECK_KEYS
        if unknown:
            raise CheckError(f"{CHECKS}: [{name}] has unknown keys {', '.join(sorted(unknown))}")
    chosen = {name: s for name, s in checks.items() if name.endswith(SUFFIX[scheduler])}
    if only:
        unknown = [name for name in only if name not in chosen]
        if unknown:
            raise CheckError(f"--only: no job script {', '.join(unknown)} for {scheduler}")
        keep = set(only) | {chosen[name]["after"] for name in only if "after" in chosen[name]}
        chosen = {name: s for name, s in chosen.items() if name in keep}
    return chosen


class Job:
    def __init__(self, name, settings, folder):
        self.name, self.settings, self.folder = name, settings, folder
        self.job_id = None
        self.outcome = None  # passed, failed, refused
        self.message = ""
        self.info = {}
        self.log = ""
        self.start = None
        self.seconds = 0.0
        self.cancelled_by_us = False


def asks_for_the_gpu(site, job):
    """Whether the job is run with its gpu_args: a GPU job where PyTorch is a GPU build."""
    return bool(job.settings.get("gpu_args")) and site.get("pytorch.build") != "cpu"


def gpus_used(log):
    """(how many GPUs the job's output says ran, their model or None), from GPU_IN_USE lines."""
    found = GPU_IN_USE.findall(log)
    models = [model for _, model, _ in found if model]
    return len({(gpu, node) for gpu, _, node in found}), models[0] if models else None


def command_for(site, job, after=None):
    """The submission command, run in the job's folder; after: the id of the job it waits for."""
    script = Path(job.name).name
    args = list(job.settings.get("args", []))
    if asks_for_the_gpu(site, job):
        args[:0] = job.settings["gpu_args"]
    if os.geteuid() == 0:
        args += job.settings.get("root_args", [])
    options = list(job.settings.get("options", []))
    waits = dependency(site, after) if after else []
    if site.scheduler == "slurm":
        return ["sbatch", "--parsable", *waits, *options, script, *args]
    passed = [(name, os.environ[name]) for name in PASSED_ON if name in os.environ]
    passed += list(job.settings.get("env", {}).items())
    if site.scheduler == "pbs" and args:
        passed.append(("ARGS", " ".join(args)))
    # qsub -v splits on commas: a value with one is quoted (PBS reads the quotes, not a shell).
    variables = ",".join(f"{name}={pbs_quoted(value) if site.scheduler == 'pbs' else value}"
                         for name, value in passed)  # fmt: skip
    variables = ["-v", variables] if passed else []
    if site.scheduler == "pbs":
        return ["qsub", *waits, *variables, *options, script]
    return ["qsub", "-terse", *waits, *variables, *options, script, *args]


def pbs_quoted(value):
    return f"'{value}'" if "," in value and "'" not in value else value


def dependency(site, job_id):
    if site.scheduler == "slurm":
        return ["--dependency=afterok:" + job_id, "--kill-on-invalid-dep=yes"]
    if site.scheduler == "pbs":  # however the array's subjobs ended, as submit_sweep_pbs.sh
        return ["-W", f"depend=afterany:{job_id}"]
    return ["-hold_jid", job_id]


def prepare_folder(edition, job, jobs):
    """The job script and its files side by side, as a reader puts them."""
    after = job.settings.get("after")
    if after:
        job.folder = jobs[after].folder
    job.folder.mkdir(parents=True, exist_ok=True)
    for name in [job.name, *job.settings.get("files", [])]:
        shutil.copy2(edition / name, job.folder / Path(name).name)


def run_prepare(job):
    for command in job.settings.get("prepare", []):
        proc = subprocess.run(["bash", "-c", command], cwd=job.folder, capture_output=True,
                              text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            return f"preparing it failed: {command}: {lines[-1] if lines else proc.returncode}"
    return None


def submit(site, job, jobs):
    env = {**os.environ, **job.settings.get("env", {})}
    after = job.settings.get("after")
    command = command_for(site, job, jobs[after].job_id if after else None)
    proc = subprocess.run(command, cwd=job.folder, capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines()
        job.outcome, job.message = "refused", lines[-1] if lines else f"exit {proc.returncode}"
        return
    job.job_id = proc.stdout.strip().split(";")[0]
    if site.scheduler != "pbs":  # PBS's ids keep their server: 12.server, 13[].server
        job.job_id = job.job_id.split(".")[0]
    job.start = time.monotonic()


def slurm_state(job):
    """(finished, [records]) from scontrol; an array job has one record per task."""
    proc = subprocess.run(["scontrol", "show", "job", "--oneliner", job.job_id],
                          capture_output=True, text=True, check=False)  # fmt: skip
    records = [dict(f.split("=", 1) for f in line.split() if "=" in f)
               for line in proc.stdout.splitlines() if line.strip()]  # fmt: skip
    if proc.returncode != 0 or not records:
        return True, []
    return all(r.get("JobState") in SLURM_DONE for r in records), records


def gridengine_state(job):
    if (
        subprocess.run(["qstat", "-j", job.job_id], capture_output=True, check=False).returncode
        == 0
    ):
        return False, []
    proc = subprocess.run(["qacct", "-j", job.job_id], capture_output=True, text=True, check=False)
    if proc.returncode != 0:  # left the queue, not yet in the accounting file
        return False, []
    blocks = [block for block in re.split(r"^=+$", proc.stdout, flags=re.M) if block.strip()]
    records = [dict(re.findall(r"^(\w+)\s+(.*?)\s*$", block, re.M)) for block in blocks]
    return True, records


def pbs_state(job):
    """(finished, [records]) from qstat -x (job history): an array job's are its subjobs'.
    A job qstat no longer knows (history off, or expired) has finished, without a record."""
    proc = subprocess.run(["qstat", "-x", "-f", "-F", "json", "-t", job.job_id],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        return True, []
    try:
        found = json.loads(proc.stdout, strict=False).get("Jobs", {})
    except json.JSONDecodeError:
        return False, []  # read again next time
    main = found.get(job.job_id, {})
    if main.get("job_state") != "F":
        return False, []
    subjobs = [record for name, record in found.items() if name != job.job_id]
    return True, subjobs or [main]


def read_logs(site, job, records):
    if site.scheduler == "slurm":
        paths = {r["StdOut"] for r in records if r.get("StdOut")}
    elif site.scheduler == "pbs":  # <name>.o<number>, a subjob's <name>.o<number>.<index>
        number = job.job_id.split(".")[0].split("[")[0]
        paths = {str(p) for pattern in (f"*.o{number}", f"*.o{number}.*")
                 for p in job.folder.glob(pattern)}  # fmt: skip
    else:
        paths = {str(p) for p in job.folder.glob(f"*.o{job.job_id}*")}
    texts = []
    for path in sorted(paths):
        try:
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return "\n".join(texts)


def slurm_gpus(record):
    """The GPUs a Slurm job was given: from TRES where accounting tracks them, else from what
    it asked for per node (TresPerNode) times its nodes."""
    tres = record.get("AllocTRES") or record.get("TRES") or ""
    if m := re.search(r"gres/gpu=(\d+)", tres):
        return int(m[1])
    per_node = re.search(r"gres[:/]gpu(?::[\w.-]+)?[:=](\d+)", record.get("TresPerNode", ""))
    if per_node:
        return int(per_node[1]) * int(record.get("NumNodes", "1").split("-")[0])
    per_job = re.search(r"gres[:/]gpu(?::[\w.-]+)?[:=](\d+)", record.get("TresPerJob", ""))
    return int(per_job[1]) if per_job else 0


def gridengine_gpus(site, record):
    """The GPUs a Grid Engine job asked for: the count of the site's own GPU resource (-l
    gpu=2, -l rt_G.small=1, ...) in the request that qacct shows (category)."""
    resource = re.fullmatch(r"-l ([\w.]+)=\{n\}", site.get("scheduler.gpus"))[1]
    found = re.search(rf"(?<![\w.]){re.escape(resource)}=(\d+)", record.get("category", ""))
    return int(found[1]) if found else 0


def pbs_gpus(site, record):
    """The GPUs a PBS job was given: the site's GPU resource (ngpus) over the vnodes of its
    chunks, as qstat shows them (exec_vnode: (n1:ncpus=8:ngpus=2)+(n2:ncpus=8:ngpus=2))."""
    resource = re.fullmatch(r"(\w+)=\{n\}", site.get("scheduler.gpus"))[1]
    counts = re.findall(rf"(?<![\w.]){re.escape(resource)}=(\d+)", record.get("exec_vnode", ""))
    return sum(int(count) for count in counts)


def judge(site, job, records):
    job.seconds = time.monotonic() - job.start
    job.log = read_logs(site, job, records)
    missing = [line for line in job.settings.get("expect", []) if line not in job.log]
    if site.scheduler == "slurm":
        states = sorted({f"{r.get('JobState')} {r.get('ExitCode')}" for r in records})
        ok = records and all(
            (r.get("JobState"), r.get("ExitCode")) == ("COMPLETED", "0:0") for r in records
        )
        nodes = sorted({r.get("NodeList", "") for r in records} - {"", "(null)"})
        given = max((slurm_gpus(r) for r in records), default=0)
        job.info = {"state": ", ".join(states) or "gone", "nodes": ",".join(nodes)}
    elif site.scheduler == "pbs":
        ok = records and all(r.get("Exit_status") == 0 for r in records)
        states = sorted({f"Exit_status {r.get('Exit_status')}" for r in records})
        hosts = "+".join(r.get("exec_host", "") for r in records)
        nodes = sorted({host.split("/")[0] for host in hosts.split("+")} - {""})
        given = max((pbs_gpus(site, r) for r in records), default=0)
        job.info = {"state": "; ".join(states) or "gone (no record: is job history on?)",
                    "nodes": ",".join(nodes)}  # fmt: skip
    else:
        ok = records and all((r.get("failed"), r.get("exit_status")) == ("0", "0") for r in records)
        states = sorted({f"exit_status {r.get('exit_status')}, failed {r.get('failed')}"
                         for r in records})  # fmt: skip
        nodes = sorted({r.get("hostname", "") for r in records} - {""})
        given = max((gridengine_gpus(site, r) for r in records), default=0)
        job.info = {"state": "; ".join(states), "nodes": ",".join(nodes)}
    # The stamp counts the GPUs that ran, from the job's own output, not what it was given.
    used, model = gpus_used(job.log)
    job.info.update(gpus=used, gpus_given=given, gpu_model=model)
    if job.settings.get("server"):
        ok = not missing  # cancelled by us once it served
    job.outcome = "failed"
    if not ok:
        job.message = job.info["state"]
    elif missing:
        job.message = f"its output lacks {missing[0]!r}"
    elif asks_for_the_gpu(site, job) and used == 0:
        job.message = "it was given the GPU but its output names none that ran ('GPU in use:')"
    else:
        job.outcome = "passed"


def cancel(site, ids):
    if ids:
        tool = ["scancel"] if site.scheduler == "slurm" else ["qdel"]
        subprocess.run([*tool, *ids], capture_output=True, check=False)


def versions(jobs):
    """What the jobs ran with, from check_pytorch.py's lines in the first job that printed them."""
    found = {"torch": None, "python": None, "cuda": None, "gpu": None}
    for job in jobs.values():
        if "PyTorch:" not in job.log:
            continue
        patterns = {"torch": r"^PyTorch:\s+(\S+)", "python": r"^Python:\s+(\S+)",
                    "cuda": r"^CUDA build:\s+(\d\S*)", "gpu": r"^GPU 0:\s+([^,]+),"}  # fmt: skip
        for key, pattern in patterns.items():
            if m := re.search(pattern, job.log, re.M):
                found[key] = m[1]
        break
    return found


def scheduler_version(site):
    command = {"slurm": ["sinfo", "--version"], "gridengine": ["qstat", "-help"],
               "pbs": ["qstat", "--version"]}[site.scheduler]  # fmt: skip
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_record(path, site, edition, jobs):
    today = datetime.date.today().isoformat()
    env = versions(jobs)
    scheduler = scheduler_version(site)
    examples = {}
    for name, job in sorted(jobs.items()):
        examples[name] = {
            "sha256": sha256(EXAMPLES / name),
            "edition_sha256": sha256(edition / name),
            "date": today,
            **env,
            "scheduler": scheduler,
            "job_id": job.job_id,
            **job.info,
            "message": job.message,
            "log_tail": job.log.strip().splitlines()[-LOG_LINES:]
            if job.outcome == "failed"
            else [],
            "tests": {"site-check": [job.outcome, round(job.seconds, 1)]},
        }
    record = {
        "suite": "site",
        "site": {
            "name": site.name,
            "documentation": site.get("centre.documentation"),
            "file": site.path.name,
            "sha256": sha256(site.path),
        },  # fmt: skip
        "examples": examples,
    }
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def report(jobs):
    for name, job in jobs.items():
        where = f"job {job.job_id}" if job.job_id else "not submitted"
        if job.info.get("nodes"):
            where += f" on {job.info['nodes']}"
        if job.info.get("gpus"):
            where += f", {job.info['gpus']} GPU(s) ran"
        print(f"{job.outcome:8} {name}  ({where}, {job.seconds:.0f} s)")
        if job.outcome != "passed":
            print(f"         {job.message}")
            for line in job.log.strip().splitlines()[-LOG_LINES:]:
                print(f"         | {line}")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="site_check.py",
        description="Submit every job script of a centre's edition and record what passed.",
    )
    parser.add_argument("site", help="the centre's site file (site.toml)")
    parser.add_argument("--dry-run", action="store_true", help="print what it would submit")
    parser.add_argument("--max-jobs", type=positive_int, default=4, help="jobs queued at once")
    parser.add_argument(
        "--only",
        nargs="+",
        default=(),
        metavar="SCRIPT",
        help="these job scripts only, e.g. ddp/ddp_srun.sbatch",
    )
    parser.add_argument("--work-dir", type=Path, help="default: _build/site-check/<site file name>")
    parser.add_argument(
        "--record", type=Path, help="default: beside the site file, <name>.record.json"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=3600, help="seconds to wait for all the jobs"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        site = load(args.site)
        checks = load_checks(site.scheduler, args.only)
        checks = {name: s for name, s in checks.items() if name not in omitted(site)}
        for settings in checks.values():  # {project}: the site's project space (storage.project)
            settings["prepare"] = [command.replace("{project}", site.get("storage.project"))
                                   for command in settings.get("prepare", [])]  # fmt: skip
    except (SiteFileError, CheckError) as error:
        sys.exit(f"site_check.py: error: {error}")
    tool = "sbatch" if site.scheduler == "slurm" else "qsub"
    if not args.dry_run and shutil.which(tool) is None:
        sys.exit(f"site_check.py: error: {tool} not found: run it on a login node of {site.name}")
    root = Path(__file__).resolve().parent.parent
    work = (args.work_dir or root / "_build" / "site-check" / site.slug).resolve()
    record_path = args.record or site.path.with_name(
        site.path.name.removesuffix(".toml") + ".record.json"
    )
    try:
        generate(site, work)
    except GenerateError as error:
        sys.exit(f"site_check.py: error: {error}")
    edition = work / "examples"
    if not args.dry_run:  # every check starts afresh, as a new user would (no warm caches)
        shutil.rmtree(work / "jobs", ignore_errors=True)
    jobs = {name: Job(name, s, work / "jobs" / name.replace("/", "-").rsplit(".", 1)[0])
            for name, s in checks.items()}  # fmt: skip
    print(
        f"{site.name}: {len(jobs)} job scripts, at most {args.max_jobs} at a time, in {work}/jobs/"
    )
    for name, job in jobs.items():
        after = job.settings.get("after")
        command = command_for(site, job, f"<id of {after}>" if after else None)
        folder = jobs[job.settings["after"]].folder if job.settings.get("after") else job.folder
        prepare = "".join(f"{c}; " for c in job.settings.get("prepare", []))
        print(f"  {name}: cd {folder.relative_to(work)} && {prepare}{shlex.join(command)}")
    if args.dry_run:
        print("Dry run: nothing submitted.")
        return 0
    pending = list(jobs.values())
    running = []

    def interrupted(signum, frame):
        ids = [job.job_id for job in running if job.job_id]
        cancel(site, ids)
        print(
            f"\nsite_check.py: interrupted (Ctrl-C): cancelled {len(ids)} job(s)"
            + (f" ({', '.join(ids)})" if ids else "")
            + "; no record written",
            file=sys.stderr,
        )
        sys.exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    deadline = time.monotonic() + args.timeout
    while pending or running:
        for job in list(pending):
            if len(running) >= args.max_jobs:
                break
            after = job.settings.get("after")
            if after and jobs[after].job_id is None:
                if jobs[after].outcome is not None:  # never submitted: neither is this one
                    job.outcome, job.message = "failed", f"not submitted: {after} was not"
                    pending.remove(job)
                continue
            pending.remove(job)
            prepare_folder(edition, job, jobs)
            problem = run_prepare(job)
            if problem:
                job.outcome, job.message = "failed", problem
                continue
            submit(site, job, jobs)
            if job.job_id:
                running.append(job)
                print(f"submitted {job.name}: job {job.job_id}", flush=True)
            else:
                print(f"refused   {job.name}: {job.message}", flush=True)
        for job in list(running):
            state = {"slurm": slurm_state, "gridengine": gridengine_state, "pbs": pbs_state}
            finished, records = state[site.scheduler](job)
            if job.settings.get("server") and not finished:
                log = read_logs(site, job, records)
                if all(line in log for line in job.settings.get("expect", [])):
                    cancel(site, [job.job_id])
                    job.cancelled_by_us = True
                continue
            if finished:
                judge(site, job, records)
                running.remove(job)
                print(
                    f"{job.outcome:9} {job.name}: job {job.job_id}, {job.seconds:.0f} s", flush=True
                )
        if time.monotonic() > deadline:
            cancel(site, [job.job_id for job in running])
            for job in running + pending:
                job.outcome, job.message = (
                    "failed",
                    f"not finished within --timeout {args.timeout} s",
                )
            break
        time.sleep(1)
    print()
    report(jobs)
    write_record(record_path, site, edition, jobs)
    passed = sum(job.outcome == "passed" for job in jobs.values())
    print(f"\n{site.name}: {passed} of {len(jobs)} job scripts passed. Record: {record_path}")
    return 0 if passed == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
