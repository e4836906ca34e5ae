"""examples/caches/: where the caches are (show_caches.py), moving them (cache_env.sh), and a
per-job copy of a shared torch.compile cache (compile_cache.sbatch, also under Slurm)."""

import os
import platform
import re
import shutil
import sys
import tempfile
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from conftest import EXAMPLES, copy_example, example_env, load_example, run

CACHES = EXAMPLES / "caches"
SHOW = CACHES / "show_caches.py"
VARIABLES = [
    "PIP_CACHE_DIR", "UV_CACHE_DIR", "CONDA_PKGS_DIRS", "TORCH_HOME", "HF_HOME",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "CUDA_CACHE_PATH",
    "APPTAINER_CACHEDIR",
]  # fmt: skip


def clean_env(home, **extra):
    tmp = Path(home).parent / "tmp"  # Inductor's default folder is in TMPDIR
    tmp.mkdir(exist_ok=True)
    Path(home).mkdir(exist_ok=True)
    env = example_env(HOME=home, TMPDIR=tmp)
    for name in [*VARIABLES, "XDG_CACHE_HOME"]:  # none of the machine's own cache settings
        env.pop(name, None)
    return {**env, **{key: str(value) for key, value in extra.items()}}


def test_show_caches_finds_the_defaults_in_home_and_measures_them(tmp_path):
    home = tmp_path / "home"
    pip = home / ".cache" / "pip" / "http"
    pip.mkdir(parents=True)
    for i in range(3):
        (pip / f"wheel{i}").write_bytes(b"x" * 1500)
    out = run([sys.executable, SHOW], cwd=tmp_path, env=clean_env(home)).stdout
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert re.search(r"default in \$HOME +4\.5 KB +3  \S+/\.cache/pip  <- in your home", out), out
    assert f"{home}/.cache/huggingface  <- in your home" in lines["Hugging Face models, datasets"]
    inductor = lines["torch.compile (Inductor)"]
    assert "/torchinductor_" in inductor and "in your home" not in inductor  # the default is /tmp
    assert out.splitlines()[-1] == f"Total 4.5 KB, of which 4.5 KB in your home ({home})"


def test_cache_env_moves_every_cache_out_of_home(tmp_path):
    project, local = tmp_path / "project", tmp_path / "local"
    script = f"source {CACHES / 'cache_env.sh'} && python {SHOW}"
    env = clean_env(tmp_path / "home", PROJECT_DIR=project, COMPILE_DIR=local)
    out = run(["bash", "-c", script], cwd=tmp_path, env=env).stdout
    body = out.splitlines()[1:-1]
    assert len(body) == len(VARIABLES) + 1  # Triton's two caches
    for line in body:
        what = line.split("  ")[0]
        folder = local if what.startswith(("torch.compile", "Triton")) else project / ".cache"
        assert f"  {folder}/" in line and "in your home" not in line, line
        assert "default" not in line and "Inductor's folder" not in line, line
    assert f"of which 0 B in your home ({tmp_path / 'home'})" in out


def test_show_caches_and_cache_env_name_the_same_variables():
    shown = re.findall(r'"([A-Z_]+)"', SHOW.read_text())
    exported = re.findall(r"^ *export ([A-Z_]+)=", (CACHES / "cache_env.sh").read_text(), re.M)
    assert set(VARIABLES) <= set(shown)
    assert set(exported) == set(VARIABLES)


def show(env, tmp_path):
    """show_caches.py's rows, by what each cache holds: (location from, path)."""
    out = run([sys.executable, SHOW, "--no-sizes"], cwd=tmp_path, env=env).stdout
    rows = {}
    for line in out.splitlines()[1:-1]:
        match = re.fullmatch(r"(.{31}) (.{26}) +(-|) +(-|)  (\S+)(  <- in your home)?", line)
        assert match, line
        rows[match[1].strip()] = (match[2].strip(), match[5], bool(match[6]))
    return rows


def inductor_default(env, monkeypatch):
    """Inductor's default cache folder, from torch's own code, in the environment env."""
    with monkeypatch.context() as patch:
        for name in ("TMPDIR", "TEMP", "TMP", "LOGNAME", "USER", "LNAME", "USERNAME"):
            patch.delenv(name, raising=False)
            if name in env:
                patch.setenv(name, env[name])
        patch.setattr(tempfile, "tempdir", None)  # gettempdir() looks at TMPDIR again
        return default_cache_dir()


@pytest.mark.parametrize("setting", ["defaults", "job TMPDIR", "TRITON_CACHE_DIR", "TRITON_HOME"])
def test_show_caches_says_where_each_location_comes_from(tmp_path, monkeypatch, setting):
    """Inductor's default follows TMPDIR (a job's own TMPDIR makes every job cold), torch.compile
    puts its Triton kernels in Inductor's folder, and Triton's own cache is in the home, under
    TRITON_HOME, or TRITON_CACHE_DIR, which then holds both."""
    home = tmp_path / "home"
    env = clean_env(home, LOGNAME="ci/user")  # a '/' in a user name: Inductor replaces it
    if setting == "job TMPDIR":
        env["TMPDIR"] = str(tmp_path / "job-4242")  # a job's own, as many sites give
        Path(env["TMPDIR"]).mkdir()
    elif setting != "defaults":
        env[setting] = str(tmp_path / setting.lower())
    rows = show(env, tmp_path)
    inductor = inductor_default(env, monkeypatch)
    assert inductor == f"{env['TMPDIR']}/torchinductor_ci_user"
    assert rows["torch.compile (Inductor)"] == ("default in $TMPDIR", inductor, False)
    compiled, own = rows["Triton kernels (torch.compile)"], rows["Triton kernels (@triton.jit)"]
    if setting == "TRITON_CACHE_DIR":
        assert compiled == own == ("TRITON_CACHE_DIR", env["TRITON_CACHE_DIR"], False)
        return
    assert compiled == ("in Inductor's folder", f"{inductor}/triton", False)
    if setting == "TRITON_HOME":
        assert own == ("default in $TRITON_HOME", f"{env['TRITON_HOME']}/.triton/cache", False)
    else:
        assert own == ("default in $HOME", f"{home}/.triton/cache", True)


def test_show_caches_counts_a_cache_inside_another_once(tmp_path, monkeypatch):
    env = clean_env(tmp_path / "home")
    triton = Path(inductor_default(env, monkeypatch)) / "triton" / "0"
    triton.mkdir(parents=True)
    (triton / "kernel.cubin").write_bytes(b"x" * 1500)
    out = run([sys.executable, SHOW], cwd=tmp_path, env=env).stdout
    assert re.search(r"Triton kernels \(torch.compile\) +in Inductor's folder +1\.5 KB +1  ", out)
    assert re.search(r"torch.compile \(Inductor\) +default in \$TMPDIR +1\.5 KB +1  ", out)
    assert out.splitlines()[-1].startswith("Total 1.5 KB, "), out


def source_cache_env(tmp_path, **extra):
    """What cache_env.sh exports, and what it printed on stderr, when a job sources it."""
    env = clean_env(tmp_path / "home", PROJECT_DIR=tmp_path / "project", **extra)
    script = f"source {CACHES / 'cache_env.sh'} && env"
    proc = run(["bash", "-c", script], cwd=tmp_path, env=env)
    exported = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return exported, proc.stderr


def test_cache_env_keeps_torch_compile_in_a_folder_of_the_user_not_in_tmpdir(tmp_path):
    """Not in project space (shared by jobs on many nodes) nor in $TMPDIR (the job's own at
    many sites): in the site's COMPILE_DIR, /tmp/torch-compile-$USER unless set, made private."""
    user = f"pytest-{uuid.uuid4().hex[:8]}"
    default = Path(f"/tmp/torch-compile-{user}")
    try:
        exported, stderr = source_cache_env(tmp_path, USER=user, TMPDIR=tmp_path / "job-4242")
        assert stderr == ""
        assert exported["TORCHINDUCTOR_CACHE_DIR"] == f"{default}/inductor"
        assert exported["TRITON_CACHE_DIR"] == f"{default}/inductor/triton"
        assert default.is_dir() and default.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(default, ignore_errors=True)
    local = tmp_path / "local" / "me"
    local.parent.mkdir()
    exported, _ = source_cache_env(tmp_path, COMPILE_DIR=local)
    assert exported["TORCHINDUCTOR_CACHE_DIR"] == f"{local}/inductor"
    assert exported["PIP_CACHE_DIR"] == f"{tmp_path}/project/.cache/pip"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_cache_env_refuses_a_compile_folder_of_another_user(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)  # nobody's
    exported, stderr = source_cache_env(tmp_path, COMPILE_DIR=theirs)
    assert stderr == f"cache_env.sh: {theirs} is not yours: torch.compile's caches not moved\n"
    assert "TORCHINDUCTOR_CACHE_DIR" not in exported and "TRITON_CACHE_DIR" not in exported
    assert exported["HF_HOME"] == f"{tmp_path}/project/.cache/huggingface"  # the others moved


def test_compile_needs_a_cache_folder(tmp_path):
    env = clean_env(tmp_path)
    proc = run([sys.executable, CACHES / "compile_cache.py"], cwd=tmp_path, env=env, expect_rc=2)
    assert "TORCHINDUCTOR_CACHE_DIR is not set" in proc.stderr and "Traceback" not in proc.stderr


def test_second_job_starts_warm_from_the_published_cache(tmp_path, job_env):
    """compile_cache.sbatch twice, as two jobs of one user: the first compiles and publishes
    its cache, the second starts from a copy and adds nothing to it; neither leaves its per-job
    folder behind."""
    copy_example(tmp_path, "caches/compile_cache.sbatch", "caches/compile_cache.py")
    local = tmp_path / "local"
    local.mkdir()
    root = tmp_path / "compile-cache"
    # A cache published by an older PyTorch on this machine: no use to this one.
    old = root / f"torch-1.0.0+cpu-cpu-{platform.machine()}" / "fxgraph"
    old.mkdir(parents=True)
    (old / "entry").write_text("stale")
    outs = []
    for job_id in ("101", "102"):
        env = {**job_env, "SLURM_JOB_ID": job_id, "SLURM_CPUS_PER_TASK": "2", "TMPDIR": local}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        outs.append(run(["bash", "compile_cache.sbatch", "--device", "cpu"], cwd=tmp_path,
                        env=env, timeout=300).stdout)  # fmt: skip
    cold, warm = outs
    started = re.search(r"Job 101: no shared cache yet at (\S+): compiling from scratch", cold)
    assert started, cold
    shared = Path(started[1])
    # One shared cache per PyTorch version and device model, each in its own folder.
    assert shared.parent == root, cold
    assert shared.name.startswith(f"torch-{version('torch')}-cpu-{platform.machine()}"), cold
    assert re.search(
        r"Cache \S+/compile-101/inductor: 0 files before, [1-9]\d* after \(cold\)", cold
    )
    assert f"Published the compile cache to {shared}" in cold
    assert f"Job 102: started from the shared cache {shared}" in warm
    # Warm: the job finds every compiled artefact in its copy and adds none. (Its first step
    # is also faster, but a timing under a loaded test run is no test.)
    counts = re.search(r"compile-102/inductor: (\d+) files before, (\d+) after \(warm\)", warm)
    assert counts and int(counts[1]) > 0 and counts[1] == counts[2], warm
    assert "Published" not in warm
    assert list(local.iterdir()) == [], "a per-job cache was left on the local disk"
    assert sorted(root.iterdir()) == sorted([shared, old.parent]), "a temporary copy was left"
    assert (old / "entry").read_text() == "stale"


@pytest.mark.parametrize("option", ["--width", "--steps"])
def test_compile_cache_rejects_a_zero_size(tmp_path, option):
    env = clean_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=tmp_path / "c")
    proc = run([sys.executable, CACHES / "compile_cache.py", option, "0"], cwd=tmp_path, env=env,
               expect_rc=2)  # fmt: skip
    assert f"argument {option}: must be a positive integer (got 0)" in proc.stderr


def test_cache_key_gives_each_torch_and_gpu_model_a_folder_no_name_can_escape(tmp_path):
    """compile_cache.py's cache_key with stand-in versions and GPU names, hostile ones too: each
    key is one folder inside the shared one, and passes the job script's own check."""
    cache_key = load_example(CACHES / "compile_cache.py").cache_key
    sbatch_rule = re.search(r"=~ \^(\S+)\$ \]\]", (CACHES / "compile_cache.sbatch").read_text())[1]
    shared = tmp_path / "compile-cache"
    a100 = cache_key("2.13.0+cu130", "NVIDIA A100-SXM4-80GB", (8, 0))
    h100 = cache_key("2.13.0+cu130", "NVIDIA H100 80GB HBM3", (9, 0))
    older = cache_key("2.12.1+cu128", "NVIDIA H100 80GB HBM3", (9, 0))
    cpu = cache_key("2.13.0+cpu", "cpu-x86_64")
    assert len({a100, h100, older, cpu}) == 4
    assert "2.13.0+cu130" in h100 and "H100-80GB-HBM3" in h100 and "cc9.0" in h100
    hostile = ["../../etc", "a/b c", "..", ".", "", "-rf /", "GPU\n/../x", "/", "é\\x", "~root"]
    for name in hostile:
        for key in (cache_key("2.13.0", name, (9, 0)), cache_key(name, name)):
            assert re.fullmatch(sbatch_rule, key), (name, key)
            assert key not in (".", "..") and (shared / key).resolve().parent == shared, (name, key)
