"""Shared fixtures: where things are, how an example runs, and which tests can run here."""

import atexit
import contextlib
import hashlib
import html
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path

import filelock
import pytest

# Each test run records which examples each test ran (tests/records.py, tests/records/).
import records
from records import (  # noqa: F401 (hooks: pytest finds them by name in this module)
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)
from zygote import takes as zygote_takes

ROOT = Path(__file__).resolve().parent.parent
SESSION_START = time.time()  # when this test run started (conftest is imported first)
EXAMPLES = ROOT / "examples"
SOURCE = ROOT / "source"
LOCALE = ROOT / "locale"
TESTS = ROOT / "tests"
SHIM = TESTS / "shim"
# torchrun with the tests' Python, on one node (it picks a free port itself).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
VERSIONS = tomllib.loads((ROOT / "versions.toml").read_text(encoding="utf-8"))
LANGUAGES = ["en", "zh_CN", "ja", "fr"]
TRANSLATIONS = LANGUAGES[1:]
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
# The emulated site's file that defines `module` in batch jobs (tests/site/modules.sh).
SITE_MODULES = Path("/etc/profile.d/modules.sh")

# The site files of the tests' Slurm cluster and Grid Engine cell: their job scripts are the ones
# edition/generate.py makes from these, as a centre's edition would (see test_edition()).
SITES = TESTS / "sites"
TEST_SITES = {
    "slurm": SITES / "slurm-test-cluster.toml",
    "gridengine": SITES / "gridengine-test-cell.toml",
    "pbs": SITES / "pbs-test-complex.toml",
}
# Site files of three kinds of real centre (issue 27): their editions and pages build, and their
# directives pass the parser of their scheduler on the tests' cluster and cell.
CENTRE_SITES = {
    path.stem: path for path in sorted(SITES.glob("*.toml")) if path not in TEST_SITES.values()
}
sys.path.insert(0, str(ROOT / "edition"))

# Warnings raised by the examples' own code (module __main__) are errors in the tests.
OWN_WARNINGS_AS_ERRORS = "error:::__main__"


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU and none is visible here: run `make test-gpu` on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # Longest files first, so that pytest-xdist starts them at once: the Slurm tests wait about
    # a minute for a job to overrun its time limit, the browser runs every page four times, the
    # venv tests install PyTorch three times. On a cold cache, the site builds, the Horovod
    # build and DeepSpeed's op builds take minutes: start them early.
    first = {"test_slurm.py": 0, "test_site.py": 1, "test_deepspeed.py": 2, "test_horovod.py": 3,
             "test_install_venv.py": 4, "test_gridengine.py": 5, "test_pbs.py": 6}  # fmt: skip
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    if os.environ.get("TESTS_SELECTION"):
        select(config, items, Path(os.environ["TESTS_SELECTION"]))


def selected(request, *, test=None, fixture=None):
    """(name, parameters) ({} for none) of this module's selected tests named test, or using
    fixture: a module fixture that does work for several tests (a harness, a site build, a
    browser) does it for these only (all of them in make test, a few in make test-changed)."""
    return [
        (item.originalname, getattr(getattr(item, "callspec", None), "params", {}))
        for item in request.session.items
        if item.path == request.path
        and (test is None or item.originalname == test)
        and (fixture is None or fixture in item.fixturenames)
    ]


def _forms(value):
    """The names a test parameter goes by: a path as it stands, from the repository's root,
    from examples/ and from source/ (without its suffix, as tests/test_site.py names pages)."""
    forms = {str(value)}
    if isinstance(value, Path):
        for base in (ROOT, EXAMPLES, SOURCE):
            if base in value.parents:
                forms.add(value.relative_to(base).as_posix())
        if SOURCE in value.parents:
            forms.add(value.relative_to(SOURCE).with_suffix("").as_posix())
    return forms


def _matches(item, selector):
    if "id" in selector:
        return item.nodeid == selector["id"]
    if item.nodeid.split("::")[0] != selector["file"]:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key, wanted in selector.get("where", {}).items():
        if key == "originalname":
            if item.originalname not in wanted:
                return False
        elif key in params:
            if not _forms(params[key]) & set(wanted):
                return False
        elif selector.get("strict"):
            return False
    return True


def select(config, items, path):
    """make test-changed (tests/tools/changed.py): keep the tests its selection names. The
    files of `always` whole, but the tests `spared` names (by id, or file::function for all
    its parameters); a selector names a test by id, or
    a file's tests whose parameters match `where` (a test without that parameter matches
    unless `strict`). A named test that no longer exists brings in its whole file, which
    path + '.missing' lists."""
    selection = json.loads(path.read_text(encoding="utf-8"))
    selectors = selection["selectors"]
    ids = {item.nodeid for item in items}
    missing = sorted({s["id"] for s in selectors if "id" in s and s["id"] not in ids})
    whole = set(selection["always"]) | {test.split("::")[0] for test in missing}
    spared = set(selection.get("spared", ()))
    keep, drop = [], []
    for item in items:
        chosen = any(_matches(item, s) for s in selectors) or (
            item.nodeid.split("::")[0] in whole
            and not {item.nodeid, f"{item.nodeid.split('::')[0]}::{item.originalname}"} & spared
        )
        (keep if chosen else drop).append(item)
    if missing:
        partial = path.with_name(f"{path.name}.missing.{os.getpid()}")
        partial.write_text(json.dumps(missing), encoding="utf-8")
        partial.replace(path.with_name(f"{path.name}.missing"))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    """Print the durations tests recorded with record_property("timing", "what: N s")."""
    notes = sorted(
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "timing"
    )
    if notes:
        terminalreporter.section("timings")
        for note in notes:
            terminalreporter.write_line(note)


def example_env(**extra):
    """Environment for running an example: the tests' Python first on PATH, own warnings fatal."""
    env = dict(os.environ)
    for name in list(env):  # a test run inside a real job must not leak that job's settings
        if name.startswith(("SLURM_", "SGE_", "PBS_")) or name in (
            "CUDA_VISIBLE_DEVICES",
            "NSLOTS",
            "NCPUS",
            "JOB_GPUS",
        ):
            del env[name]
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONWARNINGS"] = OWN_WARNINGS_AS_ERRORS
    env["PYTHONUNBUFFERED"] = "1"
    # torchvision's CUDA-only build imports on a CPU torch with this shim (tests/shim).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), env.get("PYTHONPATH")]))
    env.update(COMPILER_CACHE)
    env.update({key: str(value) for key, value in extra.items()})
    return env


def _compiler_cache():
    """The variables that make CMake compile through ccache, with the cache beside the tests'
    other builds: the LibTorch example, built by the tests, build.sh, a console block and the
    Slurm and Grid Engine jobs, is compiled once per run, and a later run on this machine
    compiles it only when a source, flag or header changed. Paths count relative to the build
    folder, so that folders of different tests share entries. Empty without ccache."""
    if shutil.which("ccache") is None:
        return {}
    return {"CMAKE_CXX_COMPILER_LAUNCHER": "ccache", "CCACHE_DIR": str(CACHE / "ccache"),
            "CCACHE_BASEDIR": "/", "CCACHE_NOHASHDIR": "1", "CCACHE_MAXSIZE": "2G"}  # fmt: skip


class _Zygote:
    """tests/zygote.py, started once per test process, on first use: runs example scripts in
    children forked from a process that imported torch already, one or several at a time."""

    def __init__(self):
        self.base = example_env()
        self.proc = None  # started with the first run
        self.runs = 0
        self.folder = None
        # Tests may run examples from several threads at once: one lock for starting runs,
        # another for reading replies, so that a thread waiting for its run never keeps another
        # thread from starting the run that the first may need (two ends of one connection).
        self.lock = threading.Lock()
        self.reading = threading.Lock()
        self.replies = {}  # id: reply, read by one thread for another

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def takes(self, cmd, cwd, env):
        """Whether `cmd` can run forked: see tests/zygote.py."""
        if os.environ.get("TESTS_NO_ZYGOTE"):
            return False
        if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py"):
            return False
        return Path(cwd, cmd[1]).is_file() and zygote_takes(env, self.base)

    def start(self, cmd, cwd, env, timeout):
        """Start cmd (python SCRIPT ...) in a forked child; wait() gives its result."""
        # What the audit hook of tests/records.py sees for a process: the command line.
        sys.audit("subprocess.Popen", cmd[0], cmd, cwd, env)
        with self.lock:
            if self.proc is None:
                self.proc = subprocess.Popen(
                    [sys.executable, TESTS / "zygote.py"], env=self.base, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                self.folder = Path(tempfile.mkdtemp(prefix="pytorch-on-hpc-zygote-"))
                atexit.register(self.stop)
            self.runs += 1
            run_id = self.runs
            out, err = (self.folder / f"{run_id}.{name}" for name in ("stdout", "stderr"))
            request = {"id": run_id, "argv": cmd[1:], "cwd": str(cwd), "env": env,
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}  # fmt: skip
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        return run_id, cmd, timeout

    def wait(self, started):
        """The CompletedProcess of each run started, in order, once all have ended; raises
        TimeoutExpired when one was killed at its deadline."""
        replies = {}
        while len(replies) < len(started):
            with self.reading:  # whoever holds it reads the next reply, for whichever run
                for run_id, _cmd, _timeout in started:
                    if run_id in self.replies:
                        replies[run_id] = self.replies.pop(run_id)
                if len(replies) == len(started):
                    break
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"tests/zygote.py ended (exit code {self.proc.poll()})")
                reply = json.loads(line)
                self.replies[reply["id"]] = reply
        results, late = [], None
        for run_id, cmd, timeout in started:
            out, err = (self.folder / f"{run_id}.{name}" for name in ("stdout", "stderr"))
            stdout, stderr = (path.read_text(errors="replace") for path in (out, err))
            out.unlink()
            err.unlink()
            if replies[run_id].get("timeout"):
                late = late or subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            results.append(subprocess.CompletedProcess(cmd, replies[run_id].get("returncode"),
                                                       stdout, stderr))  # fmt: skip
        if late:
            raise late
        return results


_zygote = None


def zygote():
    """This test process's tests/zygote.py, started on first use."""
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote


def run(cmd, *, cwd, env=None, timeout=120, expect_rc=0):
    """Run a command, and fail with its whole output when the exit code is not expect_rc.
    `python SCRIPT.py ...` runs in a child of tests/zygote.py where it can (expect_rc=None:
    always a process of its own)."""
    cmd = [str(part) for part in cmd]
    env = env or example_env()
    if expect_rc is not None and zygote().takes(cmd, cwd, env):
        proc = zygote().wait([zygote().start(cmd, cwd, env, timeout)])[0]
    else:
        proc = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    if expect_rc is not None and proc.returncode != expect_rc:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}, expected {expect_rc}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
            pytrace=False,
        )
    return proc


@pytest.fixture
def job_env(tmp_path):
    """Environment for job scripts run by bash: Lmod with the tests' modulefile tree.

    The venv the scripts activate is the one the tests run in (VENV=sys.prefix).
    """
    return make_job_env(tmp_path)


def make_job_env(home):
    """job_env's environment, with HOME in home."""
    if not LMOD_INIT.exists() or not SITE_MODULES.exists():
        pytest.skip(f"Lmod or {SITE_MODULES} is missing: run `make system-packages` as root")
    env = example_env(
        BASH_ENV=LMOD_INIT,
        MODULEPATH=TESTS / "modulefiles",
        LMOD_IGNORE_CACHE=1,
        VENV=sys.prefix,
        HOME=home,
    )
    # Stand-ins for what a GPU site has and this machine lacks (tests/standins), last on PATH.
    env["PATH"] += f"{os.pathsep}{TESTS / 'standins'}"
    return env


@dataclass(frozen=True)
class Job:
    """How a scheduler test runs a job script: the example files it needs beside it, the
    options it passes through to the Python script, the lines its output must contain."""

    files: tuple = ()
    args: tuple = ()
    expect: tuple = ()
    venv: str = ""  # a fixture giving the venv (or conda prefix) the job activates, when not
    # the tests' own
    prepare: tuple = ()  # shell commands run in the job's folder before it is submitted, as a
    # reader prepares data or an image on a login node

    def assert_printed(self, output, job_id):
        """Every expected line is in the job's output: a string, where {job_id} is the job's
        id, or a compiled pattern it must match."""
        for line in self.expect:
            if isinstance(line, re.Pattern):
                assert line.search(output), (line.pattern, output)
            else:
                assert line.format(job_id=job_id) in output, output


_editions = {}


def test_edition(scheduler):
    """examples/ as the tests' cluster (slurm) or cell (gridengine) edition has it: generated
    from its site file once per test process, in a folder of its own."""
    if scheduler not in _editions:
        from generate import generate
        from sitefile import load

        folder = Path(tempfile.mkdtemp(prefix=f"pytorch-on-hpc-edition-{scheduler}-")).resolve()
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        generate(load(TEST_SITES[scheduler]), folder)
        _editions[scheduler] = folder / "examples"
        records.EDITIONS.append(folder / "examples")  # a copy from there ran the example
    return _editions[scheduler]


test_edition.__test__ = False  # not a test, despite its name


def edition_file(name):
    """The file a reader of the tests' cluster's edition gets for examples/<name>: the generated
    version of a job script (.sbatch: the Slurm cluster's, .qsub: the Grid Engine cell's), else
    the file itself."""
    scheduler = {".sbatch": "slurm", ".qsub": "gridengine", ".pbs": "pbs"}.get(Path(name).suffix)
    return test_edition(scheduler) / name if scheduler else EXAMPLES / name


def build_edition(site, out):
    """The English pages of a centre's edition (as make html SITE=site builds them), strict."""
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-j", "auto",
         "-c", ROOT, SOURCE, out],
        env={**os.environ, "PYTORCH_ON_HPC_SITE": str(site)}, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    return out


def page_text(path):
    """A built page's text, without tags and with entities decoded, spaces collapsed."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", path.read_text())))


def copy_example(tmp_path, *names):
    """Copy example files into tmp_path, as a reader puts them side by side in one folder; job
    scripts come from the tests' cluster's edition (edition_file)."""
    for name in names:
        shutil.copy2(edition_file(name), tmp_path / Path(name).name)
    return tmp_path


def without_cuda_module(tmp_path, script):
    """A copy of an example with CUDA_MODULE="", as the edition of a site without a CUDA
    module writes it (tests/sites/h100-no-modules.toml)."""
    text = script.read_text()
    assert text.count("\nCUDA_MODULE=cuda ") == 1
    copy = tmp_path / script.name
    copy.write_text(text.replace("\nCUDA_MODULE=cuda ", '\nCUDA_MODULE="" '))
    return copy


def centre_edition(name, folder):
    """The examples/ of a centre's edition (CENTRE_SITES), generated into folder."""
    from generate import generate
    from sitefile import load

    generate(load(CENTRE_SITES[name]), folder)
    return folder / "examples"


def path_without(command, path):
    """PATH without the folders that hold command (a machine's own nvcc, say)."""
    return os.pathsep.join(
        folder for folder in path.split(os.pathsep) if not (Path(folder) / command).exists()
    )


# A GPU node as the scripts see it, for a command: in a private mount namespace, /dev is a
# folder that holds the real null, zero, full, random, urandom and shm, and an empty nvidia0.
GPU_NODE = """set -e
dev=$1 devices=$2
shift 2
for name in null zero full random urandom; do
    : > "$dev/$name"
    mount --bind "/dev/$name" "$dev/$name"
done
mkdir "$dev/shm"
mount --bind /dev/shm "$dev/shm"
ln -s /proc/self/fd "$dev/fd"
for name in $devices; do
    : > "$dev/$name"
done
mount --rbind "$dev" /dev
exec "$@"
"""


def private_mount_namespace():
    """The command prefix of a private mount namespace (an unprivileged user namespace where
    the tests do not run as root), or a skip that says why there is none."""
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run([*unshare, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here ({probe.stderr.strip()}): run as root")
    return unshare


SMALL_DISK = """set -e
folder=$1 size=$2 kept=$3
shift 3
mount -t tmpfs -o "size=$size" tmpfs "$folder"
status=0
"$@" || status=$?
cp -a "$folder/." "$kept/"
exit "$status"
"""


def on_a_small_disk(command, cwd, folder, size, timeout=120):
    """Run command in cwd where the folder cwd/folder is a tmpfs of size (e.g. "400k"), in a
    private mount namespace: a file system that fills up. Returns the completed process and a
    folder holding what the tmpfs held at the end, copied out of it."""
    (cwd / folder).mkdir()
    kept = cwd / f"{folder}.kept"
    kept.mkdir()
    shell = ["sh", "-c", SMALL_DISK, "sh", folder, size, str(kept), *map(str, command)]
    proc = subprocess.run(
        [*private_mount_namespace(), *shell], cwd=cwd, env=example_env(),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return proc, kept


def on_a_gpu_node(command, folder, devices=("nvidia0",)):
    """command, run where /dev/nvidia0 (or the other devices: "kfd" for an AMD node) exists and
    no GPU is behind it (a node whose driver or PyTorch build cannot serve it); skips, saying
    why, where no mount namespace can be made or where PyTorch can use a real GPU."""
    if HAS_CUDA:
        pytest.skip("PyTorch can use a GPU here: the stand-in GPU node needs one where it cannot")
    unshare = private_mount_namespace()
    dev = folder / "dev"
    dev.mkdir()
    node = [*unshare, "sh", "-c", GPU_NODE, "sh", str(dev), " ".join(devices)]
    return [*node, *(str(part) for part in command)]


def require_command(name, how):
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed: {how}")


def _free_port_block(count=3):
    """A first port such that it and the next count-1 are free (for slurmctld and the nodes).

    Below 15000-24999, where job scripts derive their rendezvous ports from the job id."""
    for base in range(7000, 9000, 10):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports for the Slurm cluster")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The tests' Slurm cluster (tests/slurm/cluster.sh): started once, stopped at the end.

    Returns (SLURM_CONF path, seconds it took to start). The Slurm tests live in one file, and
    pytest-xdist runs a file's tests on one worker (--dist loadfile): one cluster.
    """
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests need root to install and start slurmctld/slurmd; CI runs them")
    # Outside pytest's private tmp folders: the munge user must be able to reach its socket.
    run_dir = Path(tempfile.mkdtemp(prefix="pytorch-on-hpc-slurm-"))
    run_dir.chmod(0o755)
    env = {**os.environ, "SLURM_TEST_PORT": str(_free_port_block())}
    script = TESTS / "slurm" / "cluster.sh"
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", script, "up", run_dir], env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - start
    try:
        if proc.returncode != 0:
            logs = "".join(
                f"--- {log.name} ---\n{log.read_text()[-2000:]}" for log in run_dir.rglob("*.log")
            )
            pytest.fail(f"the Slurm cluster did not start:\n{proc.stdout}{proc.stderr}{logs}")
        yield run_dir / "etc" / "slurm.conf", seconds
    finally:
        subprocess.run(["bash", script, "down", run_dir], env=env, capture_output=True, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def shared_daemons(script, what):
    """Daemons started by `bash script up` once per machine (their ports and spools are fixed),
    shared by the pytest workers that need them, this run's and a run beside it: the first
    starts them, the last one stops them (`bash script down`). A set left by a killed run is
    stopped first. Yields the seconds it took."""
    users = Path(tempfile.gettempdir()) / f"pytorch-on-hpc-{script.parent.name}.users"
    lock = filelock.FileLock(f"{users}.lock")

    def live_users():
        pids = users.read_text().split() if users.exists() else []
        return [pid for pid in pids if Path("/proc", pid).exists() and pid != str(os.getpid())]

    start = time.perf_counter()
    with lock:
        others = live_users()
        proc = None
        if not others:
            subprocess.run(["bash", script, "down"], capture_output=True, check=False)
            proc = subprocess.run(["bash", script, "up"], capture_output=True, text=True,
                                  check=False)  # fmt: skip
        users.write_text(" ".join([*others, str(os.getpid())]))
    seconds = time.perf_counter() - start
    try:
        if proc is not None and proc.returncode != 0:
            pytest.fail(f"{what} did not start:\n{proc.stdout}{proc.stderr}")
        yield seconds
    finally:
        with lock:
            others = live_users()
            users.write_text(" ".join(others))
            if not others:
                subprocess.run(["bash", script, "down"], capture_output=True, check=False)


@pytest.fixture(scope="session")
def gridengine_cell():
    """The tests' Grid Engine cell (tests/gridengine/cell.sh): started once, stopped at the end
    (shared_daemons: test_gridengine, test_page_blocks and a run beside this one share it).

    Returns (the environment qsub needs, seconds it took to start).
    """
    if os.geteuid() != 0:
        pytest.skip(
            "the Grid Engine tests need root to install and start its daemons; CI runs them"
        )
    with shared_daemons(TESTS / "gridengine" / "cell.sh", "the Grid Engine cell") as seconds:
        yield {"SGE_ROOT": "/var/lib/gridengine", "SGE_CELL": "default"}, seconds


@pytest.fixture(scope="session")
def pbs_complex():
    """The tests' OpenPBS complex (tests/pbs/complex.sh): started once, stopped at the end
    (shared_daemons). The first start on a machine builds OpenPBS (tests/pbs/build.sh, cached).

    Returns (the environment the PBS commands need, seconds it took to start): PBS's commands
    first on PATH, before Grid Engine's qsub and qstat, which are installed too.
    """
    if os.geteuid() != 0:
        pytest.skip("the PBS tests need root to build OpenPBS and start its daemons; CI runs them")
    with shared_daemons(TESTS / "pbs" / "complex.sh", "the OpenPBS complex") as seconds:
        exec_dir = records.pbs_exec()
        path = f"{exec_dir}/bin{os.pathsep}{os.environ['PATH']}"
        yield {"PBS_CONF_FILE": str(records.PBS_CONF), "PBS_EXEC": exec_dir, "PATH": path}, seconds


PBS_SCRIPTS = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.pbs"))


@pytest.fixture
def complex_env(pbs_complex, job_env):
    """The job scripts' environment (job_env), with PBS's commands first on PATH (Grid
    Engine's qsub and qstat are installed too)."""
    env = pbs_complex[0]
    return {**job_env, **env, "PATH": f"{env['PBS_EXEC']}/bin{os.pathsep}{job_env['PATH']}"}


def assert_site_check_passed(entries, scripts, state):
    """Every job script of a test scheduler ran under site-check and passed, ending in state,
    in the test site's own version (its edition differs from the generic script)."""
    assert sorted(entries) == scripts
    for name, entry in entries.items():
        assert entry["tests"]["site-check"][0] == "passed", (name, entry)
        assert entry["state"] == state and entry["nodes"], (name, entry)
        assert entry["edition_sha256"] != entry["sha256"], name  # the site's own version ran


def assert_row_1_named(collect_output, task_output, sweep_dir):
    """A sweep whose row 1 diverged, after an earlier sweep left a result for row 1 elsewhere
    (the scheduler tests): the row's task says why it failed, and the collecting job names the
    row and fails."""
    assert f"collect_results.py: task 1: no result ({sweep_dir}/task-1.json)" in collect_output, (
        collect_output
    )
    assert (
        f"collect_results.py: error: 1 of 2 tasks have no valid result in {sweep_dir}: rerun rows 1"
    ) in collect_output, collect_output
    assert "the loss is nan; this lr (1000000.0) is too high" in task_output, task_output


def site_env(**extra):
    """example_env() plus Lmod with the tests' modulefiles, and no venv active."""
    if not LMOD_INIT.exists() or not SITE_MODULES.exists():
        pytest.skip(f"Lmod or {SITE_MODULES} is missing: run `make system-packages` as root")
    env = example_env(BASH_ENV=LMOD_INIT, MODULEPATH=TESTS / "modulefiles", LMOD_IGNORE_CACHE=1)
    env.pop("VIRTUAL_ENV", None)
    env.update({key: str(value) for key, value in extra.items()})
    return env


def activated(venv, **extra):
    """The environment `source venv/bin/activate` gives."""
    env = site_env(VIRTUAL_ENV=venv, **extra)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="session")
def conda_env(tmp_path_factory):
    """A conda environment made by examples/install/make_conda_env.sh with the tests' conda
    stand-in (tests/standins/conda): (its prefix,)."""
    folder = tmp_path_factory.mktemp("conda")
    for name in ("make_conda_env.sh", "environment.yml", "check_pytorch.py"):
        shutil.copy2(EXAMPLES / "install" / name, folder / name)
    run(["bash", "make_conda_env.sh"], cwd=folder, env=site_env(CONDA_ENV=folder / "env"))
    return (folder / "env",)


@pytest.fixture(scope="session")
def horovod_venv(tmp_path_factory, worker_id):
    """A venv that sees the tests' packages (torch), with Horovod installed by
    examples/horovod/install_horovod.sh --wheel-dir HOROVOD_WHEELS: (venv, the script's
    output, seconds it took).

    The first run on a machine builds Horovod, and the script keeps the wheel in the cache
    (HOROVOD_WHEELS, keyed by the script itself and the compiler; the script adds torch and
    Python); later runs, fresh clones too, install that wheel. One venv per test run: the xdist
    workers share it through a lock file, so that test_horovod.py and test_slurm.py's Horovod
    job never install it twice, and test runs beside this one wait for its build."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the folder all workers of this run share
    folder, built = root / "horovod", root / "horovod" / "built.json"
    with filelock.FileLock(str(root / "horovod.lock")):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            venv = folder / "venv"
            run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=folder)
            # The base interpreter's packages are not the tests' when the tests run in a venv
            # of their own: a .pth file adds the tests' site-packages (torch) to the new venv.
            ours = sysconfig.get_path("purelib")
            theirs = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
            Path(theirs, "tests-packages.pth").write_text(f"{ours}\n")
            HOROVOD_WHEELS.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            cmd = ["bash", HOROVOD_INSTALL, "--wheel-dir", HOROVOD_WHEELS]
            # Measured on 2 cores shared with other tests: a build 488 to 1075 s; from the
            # cached wheel 19 to 23 s.
            with filelock.FileLock(str(HOROVOD_WHEELS / "lock")):  # one build per machine
                proc = run(cmd, cwd=folder, env=activated(venv), timeout=1800, expect_rc=None)
            if proc.returncode != 0:
                pytest.fail(
                    f"install_horovod.sh exited {proc.returncode}{CACHE_HINT}\n"
                    f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
                    pytrace=False,
                )
            built.write_text(json.dumps([proc.stdout, time.perf_counter() - start]))
    out, seconds = json.loads(built.read_text())
    return folder / "venv", out, seconds


def epoch_losses(out, prefix="", unit="images/s"):
    """The losses of the lines `epoch N: loss X, R <unit>` a training script printed."""
    pattern = rf"^{re.escape(prefix)}epoch \d+: loss (\S+), \d+ {re.escape(unit)}"
    return [float(x) for x in re.findall(pattern, out, re.M)]


def free_port():
    """A TCP port that is free now, for a rendezvous the test sets up itself."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cmd, *, cwd, world=2, launcher="srun", env=example_env, timeout=120, **extra):
    """Start world copies of cmd as srun starts a job's tasks (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID) or as torchrun starts its workers (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE), with MASTER_ADDR and MASTER_PORT as a job script exports them and one
    thread each. env builds each environment (example_env or a test file's own); extra adds
    variables. Returns [(exit code, stdout, stderr)] of every rank once all have ended; after
    a timeout no process is left behind."""
    port = free_port()
    cmd = [str(part) for part in cmd]
    envs = []
    for rank in range(world):
        if launcher == "srun":
            ids = {"SLURM_PROCID": rank, "SLURM_NTASKS": world, "SLURM_LOCALID": rank}
        else:
            ids = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank,
                   "LOCAL_WORLD_SIZE": world}  # fmt: skip
        variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": 1,
                     **ids, **extra}  # fmt: skip
        envs.append(env(**variables))
    if all(zygote().takes(cmd, cwd, one) for one in envs):  # the ranks forked, side by side
        started = [zygote().start(cmd, cwd, one, timeout) for one in envs]
        return [(proc.returncode, proc.stdout, proc.stderr) for proc in zygote().wait(started)]
    procs, outputs = [], []
    try:
        for one in envs:
            procs.append(subprocess.Popen(
                cmd, cwd=cwd, env=one, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [(proc.returncode, *output) for proc, output in zip(procs, outputs, strict=True)]


def make_fake_shards(folder, images=64, shard_size=8):
    """Generated images packed into tar shards in folder/shards, as examples/data/make_shards.py
    writes them: the data of the examples that read shards (train_shards.py)."""
    make = [EXAMPLES / "data" / "make_shards.py", "--fake", images, "--shard-size", shard_size]
    return run([sys.executable, *make], cwd=folder).stdout


def gpus_used(out):
    """(how many GPUs a job's output says ran, their model), as make site-check counts them: a
    GPU test checks the output with the code that judges a centre's jobs, not a copy of it."""
    if str(ROOT / "edition") not in sys.path:
        sys.path.insert(0, str(ROOT / "edition"))
    import site_check

    return site_check.gpus_used(out)


def load_example(path):
    """An example as a module, to test one of its functions on its own: its main() does not
    run, and no bytecode is written into examples/."""
    module = types.ModuleType(f"example_{path.stem}")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    return module


def slurm_task_env(rank=0, tasks=2, **extra):
    """What task `rank` of a one-node, `tasks`-task Slurm job sees (job 4242 on n1), with the
    job script's MASTER_ADDR; add SLURM_STEP_NUM_TASKS=tasks for a task that srun started."""
    variables = dict(
        SLURM_JOB_ID=4242, SLURM_JOB_NAME="train", SLURM_NTASKS=tasks,
        SLURM_NTASKS_PER_NODE=tasks, SLURM_NNODES=1, SLURM_NODELIST="n1", SLURM_PROCID=rank,
        SLURM_LOCALID=rank, SLURM_NODEID=0, SLURMD_NODENAME="n1", MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS=1,
    )  # fmt: skip
    return example_env(**{**variables, **extra})


# Runs an example (python stall.py EXAMPLE ARGS...) in which rank 0 stalls at the start of its
# second epoch, as while it evaluates or saves a checkpoint, for STALL_SECONDS: longer than the
# start-up timeout. The other ranks wait for it in their next collective.
STALL = """
import os, runpy, sys, time
import torch.utils.data

calls = 0
original = torch.utils.data.DataLoader.__iter__

def stalled(self):
    global calls
    calls += 1
    if calls == 2 and os.environ["SLURM_PROCID"] == "0":
        time.sleep(float(os.environ["STALL_SECONDS"]))
    return original(self)

torch.utils.data.DataLoader.__iter__ = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# --- The cache of what the tests build, outside the clone: a fresh clone on the same machine
# reuses it. The Makefile passes its root (PYTORCH_ON_HPC_CACHE; make clean-cache removes it).
# Each part sits under a key made of the versions that built it, so that a change of any of them
# builds again instead of loading a binary made for another version.
CACHE = Path(
    os.environ.get("PYTORCH_ON_HPC_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytorch-on-hpc"
)
CACHE_HINT = f" (if a cached build is broken: make clean-cache, or rm -r {CACHE})"
COMPILER_CACHE = _compiler_cache()


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _compiler():
    """The C++ compiler torch and Horovod's CMake build with, as name and version: gcc12.2.0."""
    try:
        first = subprocess.run(
            [os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
            check=False,
        ).stdout.partition("\n")[0]  # fmt: skip
    except OSError:
        return "nocxx"
    version = re.search(r"\d+\.\d+[.\d]*", first)
    return ("clang" if "clang" in first else "gcc") + (version[0] if version else "unknown")


def _cpu_model():
    """The CPU's model, as deepspeed.sbatch names it: DeepSpeed compiles for the CPU it runs
    on (-march=native), and CI may restore the cache on another machine."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return re.sub(r"[^A-Za-z0-9]", "_", found[1].strip()) if found else os.uname().machine


CACHE_KEY = f"py{sys.version_info[0]}.{sys.version_info[1]}-{_compiler()}"
# DeepSpeed's ops, compiled on first use (torch.utils.cpp_extension); a TORCH_EXTENSIONS_DIR
# set by hand wins. Every test and the job scripts they run see it through os.environ.
TORCH_EXTENSIONS = Path(
    os.environ.get("TORCH_EXTENSIONS_DIR")
    or CACHE / "torch_extensions"
    / f"torch{_version('torch')}-deepspeed{_version('deepspeed')}-{CACHE_KEY}-{_cpu_model()}"
)  # fmt: skip
os.environ["TORCH_EXTENSIONS_DIR"] = str(TORCH_EXTENSIONS)
# Horovod's wheel, from install_horovod.sh --wheel-dir, which adds a folder for the torch and
# Python versions and the kind of build. Keyed by the script's own text too: a changed script
# (another Horovod version, other build settings) builds again.
HOROVOD_INSTALL = EXAMPLES / "horovod" / "install_horovod.sh"
HOROVOD_WHEELS = (
    CACHE / "horovod"
    / f"{CACHE_KEY}-script{hashlib.sha256(HOROVOD_INSTALL.read_bytes()).hexdigest()[:12]}"
)  # fmt: skip


def page_python_block(page, marker):
    """The code of the one ```python block of source/<page> that contains marker, as the page
    has it now: a test that runs it tests what readers copy, not a copy of it."""
    text = (SOURCE / page).read_text(encoding="utf-8")
    blocks = [block for block in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
              if marker in block]  # fmt: skip
    assert len(blocks) == 1, f"{page}: {len(blocks)} ```python blocks contain {marker!r}"
    return blocks[0]
