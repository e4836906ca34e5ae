"""examples/caches/: where the caches are (show_caches.py), moving them (cache_env.sh), and a
per-job copy of a shared torch.compile cache (compile_cache.sbatch, also under Slurm)."""

import re
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, copy_example, example_env, run

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
    assert re.search(r"\(default\) +4\.5 KB +3  \S+/\.cache/pip  <- in your home", out), out
    assert f"{home}/.cache/huggingface  <- in your home" in lines["Hugging Face models, datasets"]
    inductor = lines["torch.compile (Inductor)"]
    assert "/torchinductor_" in inductor and "in your home" not in inductor  # the default is /tmp
    assert out.splitlines()[-1] == f"Total 4.5 KB, of which 4.5 KB in your home ({home})"


def test_cache_env_moves_every_cache_out_of_home(tmp_path):
    project = tmp_path / "project"
    script = f"source {CACHES / 'cache_env.sh'} && python {SHOW}"
    env = clean_env(tmp_path / "home", PROJECT_DIR=project)
    out = run(["bash", "-c", script], cwd=tmp_path, env=env).stdout
    body = out.splitlines()[1:-1]
    assert len(body) == len(VARIABLES)
    for line in body:
        assert f"{project}/.cache/" in line and "in your home" not in line, line
        assert "(default)" not in line or "Triton" in line, line  # Triton's follows Inductor's
    assert f"of which 0 B in your home ({tmp_path / 'home'})" in out


def test_show_caches_and_cache_env_name_the_same_variables():
    shown = re.findall(r'"([A-Z_]+)"', SHOW.read_text())
    exported = re.findall(r"^export ([A-Z_]+)=", (CACHES / "cache_env.sh").read_text(), re.M)
    assert set(VARIABLES) <= set(shown)
    assert set(exported) == set(VARIABLES) - {"TRITON_CACHE_DIR"}  # inside Inductor's folder


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
    outs = []
    for job_id in ("101", "102"):
        env = {**job_env, "SLURM_JOB_ID": job_id, "SLURM_CPUS_PER_TASK": "2", "TMPDIR": local}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        outs.append(run(["bash", "compile_cache.sbatch", "--device", "cpu"], cwd=tmp_path,
                        env=env, timeout=300).stdout)  # fmt: skip
    cold, warm = outs
    shared = tmp_path / "compile-cache"
    assert f"Job 101: no shared cache yet at {shared}: compiling from scratch" in cold
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
    assert not list(tmp_path.glob("compile-cache.*")), "a temporary copy was left behind"
    assert shared.is_dir()


@pytest.mark.parametrize("option", ["--width", "--steps"])
def test_compile_cache_rejects_a_zero_size(tmp_path, option):
    env = clean_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=tmp_path / "c")
    proc = run([sys.executable, CACHES / "compile_cache.py", option, "0"], cwd=tmp_path, env=env,
               expect_rc=2)  # fmt: skip
    assert f"argument {option}: must be a positive integer (got 0)" in proc.stderr
