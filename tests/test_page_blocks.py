"""The code blocks typed into the pages (not included from examples/): each is verified.

Output shown on a page comes from a recorded run: a file in examples/ that the page includes
and a test compares with what the script prints now (tests/recorded.py). What remains typed
into the pages is listed in BLOCKS with how it is verified:

- "python": pytest-examples runs it and checks its #> output (test_pages.py); where it has a
  branch that a reader's machine takes and the CPU test machine does not (a GPU), the tests
  named after it run the page's block there with stand-ins ("test_pages.py; FILE::TEST");
- "console": the tests below run its commands as they stand, in a scratch folder with the
  page's example files, and check the output lines the block shows (paths of the tests' venv
  and home shown as a reader's, READER_PATHS). The "local" blocks of a page run in one
  folder, in page order, as a reader goes through it: a build on the page serves the
  commands after it;
- "gpu": output that only a GPU prints, with no recorded run in this project: the paragraph
  above it must say that it is illustrative;
- "not run": commands that the tests cannot run as they stand (a GPU, Apptainer, a server
  they cannot reach, a reader's own path), with the reason and the test that runs the same
  thing where there is one. Such a block shows no output.

A new typed block makes test_every_typed_block_is_verified fail until it is listed here (and
verified), or replaced by an include of a tested example or recording.
"""

import os
import re
import subprocess
import sys

import pytest

# The Markdown parser comes with the venv; a GPU machine running only `make test-gpu` may lack it.
pytest.importorskip(
    "mdit_py_plugins", reason="mdit-py-plugins is in requirements.txt: run make venv"
)
from markdown_it import MarkdownIt  # noqa: E402
from mdit_py_plugins.colon_fence import colon_fence_plugin  # noqa: E402

from conftest import (
    EXAMPLES,
    LMOD_INIT,
    SITE_MODULES,
    SOURCE,
    TESTS,
    copy_example,
    example_env,
)

PAGES = sorted(SOURCE.rglob("*.md"))
MARKDOWN = MarkdownIt("commonmark").use(colon_fence_plugin)
# Directives whose content is Markdown (fences inside them are blocks of the page).
CONTAINERS = ("{tab}", "{group-tab}", "{tabs}", "{note}", "{tip}", "{warning}", "{important}")


def typed_blocks(page):
    """(first line number, language, text) of every fence that is not a directive."""
    found = []

    def scan(text, offset):
        for token in MARKDOWN.parse(text):
            info = token.info.split()[0] if token.info.strip() else ""
            if token.type == "fence" and not info.startswith("{"):
                found.append((offset + token.map[0] + 1, info, token.content))
            elif token.type == "colon_fence" or (token.type == "fence" and info in CONTAINERS):
                scan(token.content, offset + token.map[0] + 1)

    scan(page.read_text(encoding="utf-8"), 0)
    return found


def page_name(page):
    return str(page.relative_to(SOURCE))


# Every typed block: (page, its first line) -> (how it is verified, where or why).
BLOCKS = {
    ("cpp/libtorch.md",
     '(pytorch) [user@login ~]$ python -c "import torch; print(torch.compiled_with_cxx11_abi())"'):
        ("console", "local"),
    ("cpp/libtorch.md", "[user@login libtorch]$ bash build.sh --device cpu"): ("console", "local"),
    ("cpp/libtorch.md", "(pytorch) [user@login libtorch]$ cmake -S . -B build "
     "-DCMAKE_PREFIX_PATH=\"$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')\""):
        ("console", "local"),
    ("cpp/libtorch.md", "(pytorch) [user@login libtorch]$ readelf -d build/example | grep "
     "RUNPATH"): ("console", "local"),
    ("cpp/libtorch.md", "[user@login libtorch]$ sbatch libtorch.sbatch"): ("console", "slurm"),
    ("cpp/libtorch.md", "(pytorch) [user@login libtorch]$ python show_build_info.py"):
        ("console", "local"),
    ("about/centres.md", "$ python3 edition/sitefile.py site.toml"): ("not run", "site.toml is "
     "the centre's own: test_edition.py runs sitefile.py on the template, on the tests' site "
     "files and on broken copies, and records the message the page shows (bad-site.out)"),
    ("about/centres.md", "$ make edition SITE=site.toml"): ("not run", "the centre's site file: "
     "test_edition.py generates the editions of the template and of the tests' site files, "
     "checks what changes, and records the diff the page shows"),
    ("about/centres.md", "$ make html-all SITE=site.toml"): ("not run", "the centre's site "
     "file: test_slurm.py and test_gridengine.py build the editions of the tests' site files "
     "and check their scripts and stamps"),
    ("about/centres.md", "$ make site-check SITE=site.toml CHECK_ARGS=--dry-run"): ("not run",
     "needs the centre's login node: test_edition.py runs the dry run with the tests' site "
     "files, and test_slurm.py and test_gridengine.py run make site-check against the tests' "
     "cluster and cell"),
    ("about/centres.md", "[scheduler]"): ("compared", "test_edition.py::"
     "test_the_pbs_section_on_the_centres_page_is_the_tests_site_files"),
    ("distributed/horovod.md", "(pytorch) [user@login ~]$ bash install_horovod.sh --print-env"):
        ("console", "local"),
    ("distributed/pipeline.md", "try:"): ("python", "test_pages.py"),
    ("getting-started/first-job.md", "[user@login ~]$ sbatch check_pytorch.sbatch"):
        ("console", "slurm"),
    ("getting-started/first-job.md", "[user@login ~]$ qsub check_pytorch.qsub"):
        ("console", "gridengine"),
    ("getting-started/first-job.md", "[user@login ~]$ qsub check_pytorch.pbs"):
        ("not run", "a PBS server: test_pbs.py submits check_pytorch.pbs to the tests' OpenPBS "
         "complex and reads its output file and qstat -x -f"),
    ("getting-started/first-job.md", "[user@login ~]$ qsub -I -l select=1:ncpus=4:ngpus=1 "
     "-l walltime=00:30:00"): ("not run", "check_pytorch.py --device cuda needs a GPU, and "
     "qsub -I an interactive shell; test_pbs.py submits check_pytorch.pbs, the same module and "
     "venv"),
    ("getting-started/first-job.md", "import os"): ("python", "test_pages.py; "
     "test_first_job.py::test_the_typed_stop_rule_takes_a_working_gpu; "
     "test_first_job.py::test_the_typed_stop_rule_stops_a_job_given_gpus_it_cannot_use; "
     "test_first_job.py::test_the_typed_stop_rule_takes_the_cpu_where_no_gpu_was_given"),
    ("getting-started/pbs.md", "[user@login ~]$ qsub -P <group> -q rt_HG -l select=1 -l "
     "walltime=1:00:00 check_pytorch.pbs"): ("not run", "ABCI 3.0's own queues and a reader's "
     "group: test_pbs.py submits check_pytorch.pbs to the tests' OpenPBS complex"),
    ("getting-started/first-job.md", "[user@login ~]$ salloc --time=00:30:00 --cpus-per-task=4 "
     "--mem=8G --gpus-per-node=1"): ("not run", "check_pytorch.py --device cuda needs a GPU that "
     "PyTorch can use: the tests' cluster has fake ones; test_slurm.py submits "
     "check_pytorch.sbatch, the same module, venv and srun -c, and the sbatch block above runs"),
    ("getting-started/first-job.md", "[user@login ~]$ qrsh -l h_rt=00:30:00 -pe smp 4 -l gpu=1"):
        ("not run", "check_pytorch.py --device cuda needs a GPU, and qrsh an interactive "
         "shell; test_gridengine.py submits check_pytorch.qsub, the same module and venv"),
    ("getting-started/first-job.md",
     "(pytorch) [user@gpu-node ~]$ torchrun --standalone --nproc-per-node=2 check_distributed.py"):
        ("console", "local"),
    ("getting-started/install.md", "[user@login ~]$ TORCH_BUILD=cu128 bash make_venv.sh"):
        ("console", "local"),
    ("getting-started/install.md", "import torch"): ("python", "test_pages.py; "
     "test_install.py::test_the_typed_arch_check_on_gpus"),
    ("getting-started/install.md", "[user@login ~]$ module avail pytorch"): ("console", "local"),
    ("getting-started/install.md", "(pytorch) [user@login ~]$ python -m pip install "
     "--index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 torchvision==0.28.0"):
        ("not run", "download.pytorch.org cannot be reached from the test machines, and the "
         "tests install nothing into their venv: test_install_venv.py installs the same two "
         "pins from a copy of that index"),
    ("getting-started/install.md", "[user@login ~]$ WHEELHOUSE=/path/to/wheelhouse bash "
     "make_venv.sh"): ("not run", "/path/to/wheelhouse is the site's: test_install_venv.py runs "
     "make_venv.sh with WHEELHOUSE set to a wheelhouse it builds"),
    ("getting-started/install.md", "VENV=$SLURM_TMPDIR/venv WHEELHOUSE=/path/to/wheelhouse bash "
     "make_venv.sh"): ("not run", "a line for a job script, with the site's wheelhouse: "
     "test_install_venv.py runs make_venv.sh with VENV and WHEELHOUSE set"),
    ("getting-started/install.md", "[user@login ~]$ export "
     "APPTAINER_CACHEDIR=/path/to/project/apptainer-cache"): ("not run", "Apptainer cannot be "
     "installed on the test machines (no Debian package), and the image (10 GB) is on nvcr.io, "
     "which they cannot reach"),
    ("getting-started/containers.md", "[user@login ~]$ export "
     "APPTAINER_CACHEDIR=/path/to/project/apptainer-cache"): ("not run", "Apptainer cannot be "
     "installed on the test machines (no Debian package), and the image (10 GB) is on nvcr.io, "
     "which they cannot reach"),
    ("getting-started/containers.md", "[user@login containers]$ apptainer build pytorch.sif "
     "pytorch.def"): ("not run", "needs Apptainer and nvcr.io: test_containers.py parses "
     "pytorch.def and shellchecks its %post, %environment and %test; test_slurm.py's job "
     "builds a placeholder with the apptainer stand-in"),
    ("getting-started/containers.md", "[user@login ~]$ apptainer exec --bind /path/to/project "
     "pytorch.sif \\"): ("not run", "needs Apptainer and an image, and installs from PyPI: "
     "test_containers.py checks that pytorch.def sets PIP_CONSTRAINT for pip in the container"),
    ("getting-started/install.md", "(pytorch) [user@login ~]$ python -m pip install ipykernel"):
        ("not run", "installs from PyPI into the reader's venv: the tests install nothing into "
         "the venv they run in"),
    ("distributed/lightning.md", "$ python lightning_train.py --fake-data --devices 2"):
        ("console", "local"),
    ("performance/gpu-benchmark.md", "$ python resnet_benchmark.py --models resnet50 --modes "
     "train --precisions amp_bf16 \\"): ("not run", "amp_bf16 training of ResNet-50 at batch "
     "256 needs a GPU: test_benchmark.py runs resnet_benchmark.py with tiny settings on CPU"),
    ("reliability/preemption.md", "sbatch preemptible.sbatch --fake-data --checkpoint-dir <the "
     "old job's checkpoint folder>"): ("not run", "the folder of an earlier job: test_slurm.py's "
     "preemption test resumes a job from its checkpoint folder"),
    ("reliability/preemption.md", "$ python preemptible.py --fake-data --epochs 3 &"):
        ("not run", "the reader sends the signal while it trains, and 3 epochs of the default "
         "8,192 images take minutes on the test machines: test_preemption.py starts the script, "
         "sends SIGUSR1 after its first epoch, checks exit code 75 and resumes it"),
    ("reliability/preemption.md", "$ sbatch preemptible.sbatch --fake-data"):
        ("not run", "the default 8,192 images take minutes an epoch on the tests' cluster: "
         "test_slurm.py submits preemptible.sbatch with fewer, sends scancel --signal=USR1 "
         "--batch after the first epoch, and checks the requeue and the resumed run"),
    ("performance/precision.md", "import torch"): ("python", "test_pages.py"),
    ("reliability/troubleshooting.md",
     "torch.AcceleratorError: CUDA error: no kernel image is available for execution on the "
     "device"): ("gpu", "needs a GPU that the build lacks"),
    ("reliability/troubleshooting.md",
     "torch.distributed.DistBackendError: NCCL error in: ..., invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version ..."): ("gpu", "NCCL needs GPUs"),
    ("reliability/troubleshooting.md",
     "... Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., "
     "OpType=ALLREDUCE, ...) ran for ... milliseconds before timing out."):
        ("gpu", "NCCL's watchdog needs GPUs"),
    ("reliability/troubleshooting.md",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ..."):
        ("gpu", "only a GPU runs out of memory this way"),
}  # fmt: skip

# Commands of console blocks that the tests do not run, with the reason. A block whose every
# command is here is not run at all; the page must not claim that it was.
NOT_RUN = {
    "TORCH_BUILD=cu128 bash make_venv.sh": "installs from download.pytorch.org, which the test "
    "machines cannot reach: test_install_venv.py runs make_venv.sh with TORCH_BUILD=cu128 "
    "against a copy of that index",
}


ALL_BLOCKS = [
    (page, line, language, text) for page in PAGES for line, language, text in typed_blocks(page)
]
BLOCK_IDS = [f"{page_name(page)}:{line}" for page, line, _, _ in ALL_BLOCKS]


def key(page, text):
    return (page_name(page), text.splitlines()[0])


def test_the_pages_have_typed_blocks():
    """The parser finds blocks, inside tabs too: the checks below cannot pass vacuously."""
    assert len(ALL_BLOCKS) > 10
    assert any("sbatch check_pytorch.sbatch" in text for *_, text in ALL_BLOCKS)


@pytest.mark.parametrize(("page", "line", "language", "text"), ALL_BLOCKS, ids=BLOCK_IDS)
def test_every_typed_block_is_verified(page, line, language, text):
    where = f"{page_name(page)}:{line}"
    assert key(page, text) in BLOCKS, (
        f"{where}: a ```{language} block typed into the page. Include a file of examples/ that "
        "a test runs (or a recorded output that a test compares, tests/recorded.py), or make "
        "a test run it and list it in BLOCKS in tests/test_page_blocks.py"
    )
    kind, detail = BLOCKS[key(page, text)]
    if kind == "python":
        assert language == "python" and text in [example.source for example in PYTHON_BLOCKS]
        for test in detail.split("; ")[1:]:  # its other branches, run with stand-ins
            test_file, test_name = test.split("::")
            assert f"def {test_name}(" in (TESTS / test_file).read_text(), where
    elif kind == "console":
        assert language == "console" and detail in CONTEXTS
    elif kind == "gpu":
        above = page.read_text(encoding="utf-8").splitlines()[: line - 1]
        paragraph = "\n".join(above).rstrip().rsplit("\n\n", 1)[-1]
        assert "illustrative" in paragraph, f"{where}: say above it that it is illustrative"
    elif kind == "compared":  # a test compares the block with a file that the tests use
        test_file, test_name = detail.split("::")
        assert f"def {test_name}(" in (TESTS / test_file).read_text(), where
    elif kind == "not run":
        # Commands only: a block that is not run must not show output as if it were.
        assert language in ("console", "bash", "text") and detail, where
        if language == "console":
            assert all(not shown for _, _, shown in commands(text)), f"{where} shows output"
    else:
        pytest.fail(f"{where}: unknown kind {kind!r}")


def test_every_listed_block_is_on_its_page():
    found = {key(page, text) for page, _, _, text in ALL_BLOCKS}
    stale = sorted(set(BLOCKS) - found)
    assert not stale, f"listed in tests/test_page_blocks.py but no longer on the page: {stale}"


pytest_examples = pytest.importorskip(
    "pytest_examples", reason="pytest-examples is in requirements.txt"
)
PYTHON_BLOCKS = list(pytest_examples.find_examples(*PAGES))


def test_python_blocks_are_run_not_only_linted():
    """test_pages.py runs every ```python block with run_print_check."""
    text = (TESTS / "test_pages.py").read_text(encoding="utf-8")
    body = text.split("def test_python_block_in_page", 1)[1]
    assert "eval_example.run_print_check(example)" in body


# --- console blocks --------------------------------------------------------------------------

# A prompt as the pages write it (the copy button drops the same, conf.py).
PROMPT = re.compile(r"^(?:\(\S+\) )?(?:\$ |\[[^\]]+\][$#] )")
# The job id the pages use; the test puts the real one in its place, in commands and output.
JOB_ID = "123456"


# A prompt that shows an active venv: "(pytorch) [user@login ~]$ ".
VENV_PROMPT = re.compile(r"^\((\S+)\) ")


def commands(text):
    """[(command, the venv its prompt shows active or None, [output lines it shows])] of a
    console block; `\\` continues a command."""
    steps = []
    lines = iter(text.splitlines())
    for line in lines:
        if PROMPT.match(line):
            command = PROMPT.sub("", line)
            while command.endswith("\\"):
                command = command[:-1] + next(lines).strip()
            venv = VENV_PROMPT.match(line)
            steps.append((command, venv and venv[1], []))
        else:
            steps[-1][2].append(line)
    return steps


CONSOLE = [
    (page, line, text)
    for page, line, language, text in ALL_BLOCKS
    if BLOCKS.get(key(page, text), ("",))[0] == "console"
]
CONTEXTS = ("local", "slurm", "gridengine")


# Files a page's commands use that another page offers (a reader has saved them already).
OTHER_PAGES_FILES = {"getting-started/first-job.md": ["install/check_pytorch.py"]}


def page_files(page):
    """The example files a page includes or offers, as a reader saves them in one folder."""
    text = page.read_text(encoding="utf-8")
    names = re.findall(r"\{literalinclude\} \.\./\.\./examples/(\S+)", text)
    names += re.findall(r"\{download\}`[^`]*?<?\.\./\.\./examples/([^`>]+)>?`", text)
    names += OTHER_PAGES_FILES.get(page_name(page), [])
    return sorted({name for name in names if (EXAMPLES / name).is_file()})


def shell_env(tmp_path):
    """A reader's login shell: Lmod with the tests' modules, the venv in ~/venvs/pytorch (the
    tests' own), the tests' stand-ins for GPU tools last on PATH."""
    if not LMOD_INIT.exists() or not SITE_MODULES.exists():
        pytest.skip(f"Lmod or {SITE_MODULES} is missing: run `make system-packages` as root")
    home = tmp_path / "home"
    (home / "venvs").mkdir(parents=True)
    (home / "venvs" / "pytorch").symlink_to(sys.prefix)
    env = example_env(
        BASH_ENV=LMOD_INIT, MODULEPATH=TESTS / "modulefiles", LMOD_IGNORE_CACHE=1, HOME=home,
        VENV=home / "venvs" / "pytorch",
    )  # fmt: skip
    env["PATH"] += f"{os.pathsep}{TESTS / 'standins'}"
    return env


def reader_paths(text, env):
    """The tests' venv and home, in what a command printed, as the reader's."""
    text = text.replace(os.path.realpath(sys.prefix), "/home/user/venvs/pytorch")
    return text.replace(env["HOME"], "/home/user")


def run_block(page, text, folder, env, wait=None):
    """Run the block's commands in one bash, in order, as a reader types them; each must exit
    0 and print the output lines the block shows (with the real job id for JOB_ID). wait
    (a command template) runs after a submission, as a reader waits for the job to end."""
    copy_example(folder, *page_files(page))
    script, steps = ["set -o pipefail"], commands(text)
    for number, (command, venv, _) in enumerate(steps):
        if command in NOT_RUN:
            continue
        if venv:  # the prompt says that ~/venvs/<venv> is active
            script.append(f"[[ -n ${{VIRTUAL_ENV:-}} ]] || source ~/venvs/{venv}/bin/activate")
        command = command.replace(JOB_ID, "$JOB_ID")
        script.append(f"{{ {command}\n}} >.out-{number} 2>&1 </dev/null; echo $? >.rc-{number}")
        if wait and command.startswith(("sbatch ", "qsub ")):
            script.append(f"JOB_ID=$(grep -o '[0-9][0-9]*' .out-{number} | head -1)")
            script.append(f'echo "$JOB_ID" >.job-id; {wait}')
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=folder, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if wait:  # every job the block submitted ended well
        states = (folder / ".job-states").read_text().split()
        assert states and set(states) == {"JobState=COMPLETED"}, states
    for number, (command, _, shown) in enumerate(steps):
        if command in NOT_RUN:
            continue
        out = (folder / f".out-{number}").read_text()
        rc = (folder / f".rc-{number}").read_text().strip()
        assert rc == "0", f"{command} exited {rc}:\n{out}"
        if shown:
            if (folder / ".job-id").exists():  # the real job id where the page shows JOB_ID
                job_id = (folder / ".job-id").read_text().strip()
                out = re.sub(rf"\b{job_id}\b", JOB_ID, out)
            printed = reader_paths(out, env)
            assert printed.splitlines() == shown, f"{command} printed:\n{out}"


def blocks_in(context):
    chosen = [(p, t) for p, _, t in CONSOLE if BLOCKS[key(p, t)][1] == context]
    return pytest.mark.parametrize(
        ("page", "text"),
        chosen,
        ids=[f"{page_name(p)}:{t.splitlines()[0][-40:]}" for p, t in chosen],
    )


LOCAL = {}
for _page, _, _text in CONSOLE:
    if BLOCKS[key(_page, _text)][1] == "local":
        LOCAL.setdefault(_page, []).append(_text)


@pytest.mark.parametrize(("page", "texts"), LOCAL.items(), ids=[page_name(p) for p in LOCAL])
def test_console_blocks(page, texts, tmp_path):
    """A page's local blocks, in page order, in one folder and shell environment."""
    env = shell_env(tmp_path)
    for text in texts:
        run_block(page, text, tmp_path, env)


@pytest.mark.slurm
@blocks_in("slurm")
def test_console_block_under_slurm(page, text, tmp_path, slurm_cluster):
    env = {**shell_env(tmp_path), "SLURM_CONF": str(slurm_cluster[0])}
    wait = (
        "while squeue --noheader --jobs $JOB_ID 2>/dev/null | grep -q .; do sleep 0.5; done; "
        "scontrol show job $JOB_ID | grep -o 'JobState=[A-Z_]*' >>.job-states"
    )
    run_block(page, text, tmp_path, env, wait=wait)


@pytest.mark.gridengine
@blocks_in("gridengine")
def test_console_block_under_grid_engine(page, text, tmp_path, gridengine_cell):
    env = {**shell_env(tmp_path), **gridengine_cell[0]}
    # The site's default request file passes what a reader's login environment has to jobs.
    (tmp_path / ".sge_request").write_text(
        f"-v MODULEPATH={env['MODULEPATH']},VENV={env['VENV']}\n"
    )
    wait = (
        "until qacct -j $JOB_ID >/dev/null 2>&1; do sleep 0.5; done; "
        'qacct -j $JOB_ID | awk \'$1 == "exit_status" '
        '{print "JobState=" ($2 ? "FAILED" : "COMPLETED")}\' >>.job-states'
    )
    run_block(page, text, tmp_path, env, wait=wait)


def test_not_run_commands_are_on_the_pages():
    shown = {command for _, _, text in CONSOLE for command, _, _ in commands(text)}
    assert set(NOT_RUN) <= shown, sorted(set(NOT_RUN) - shown)
