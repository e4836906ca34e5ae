"""examples/containers/: the Apptainer definition file and the job script that runs an image.

Apptainer cannot be installed on the test machines (no Debian package): the definition file is
parsed here as Apptainer parses it and its shell sections are checked; the job script runs
under bash against the apptainer stand-in (tests/standins/apptainer), which checks its
arguments as the real one does. test_slurm.py submits the job script to the tests' cluster.
No image is built or pulled, and nothing runs on a GPU.
"""

import re
import shutil
import subprocess

import pytest

from conftest import EXAMPLES, TESTS, copy_example, require_command, run

DEFINITION = EXAMPLES / "containers" / "pytorch.def"
STANDIN = TESTS / "standins" / "apptainer"
# Apptainer 1.4's header keywords and sections (pkg/build/types/parser/deffile.go).
HEADER_KEYS = set(
    "bootstrap from stage registry namespace includecmd include mirrorurl updateurl osversion "
    "library fingerprints setopt".split()
)
SECTIONS = set("%post %environment %runscript %test %labels %help %files %setup".split())
# Sections that Apptainer runs (or, %environment, sources) with the image's /bin/sh.
SHELL_SECTIONS = ("%post", "%environment", "%test")


def parse_definition(text):
    """(header {key: value}, {section: body}): lines up to the first one whose first word starts
    with %, then one body per section, as Apptainer splits a definition file."""
    header, sections, current = {}, {}, None
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("%"):
            current = words[0]
            assert current not in sections, f"{current} twice"
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
        elif words and not words[0].startswith("#"):
            key, colon, value = line.split("#")[0].partition(":")
            assert colon and value.strip(), f"header line without a value: {line}"
            header[key.strip().lower()] = value.strip()
    return header, sections


def test_definition_file_has_a_known_header_and_sections():
    header, sections = parse_definition(DEFINITION.read_text(encoding="utf-8"))
    assert set(header) <= HEADER_KEYS, sorted(set(header) - HEADER_KEYS)
    assert header["bootstrap"] == "docker"
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", header["from"]), header
    assert set(sections) <= SECTIONS, sorted(set(sections) - SECTIONS)
    assert {"%post", "%environment", "%test", "%labels", "%help"} <= set(sections)
    # pip must keep the image's own torch: a constraint with its version, for pip in %post
    # and in the container (a venv on top of the image).
    assert "PIP_CONSTRAINT=/opt/constraints.txt python -m pip install" in sections["%post"]
    assert "export PIP_CONSTRAINT=/opt/constraints.txt" in sections["%environment"]


@pytest.mark.parametrize("section", SHELL_SECTIONS)
def test_definition_shell_sections_pass_shellcheck(tmp_path, section):
    _, sections = parse_definition(DEFINITION.read_text(encoding="utf-8"))
    script = tmp_path / f"{section[1:]}.sh"
    script.write_text(sections[section])
    subprocess.run(["bash", "-n", script], check=True)
    require_command("shellcheck", "run `make system-packages` as root (apt-get install shellcheck)")
    proc = subprocess.run(
        ["shellcheck", "--shell=sh", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout


def job_script_env(job_env, tmp_path, **extra):
    """What the job script sees in a two-node, four-task job, with the stand-ins on PATH."""
    variables = dict(
        SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="2", SLURM_NTASKS="4", SLURM_NNODES="2",
        SLURM_JOB_NODELIST="localhost", SLURM_TMPDIR=str(tmp_path / "local"),
    )  # fmt: skip
    (tmp_path / "local").mkdir(exist_ok=True)
    return {**job_env, **variables, **extra}


def test_job_script_without_the_image_says_how_to_build_it(tmp_path, job_env):
    copy_example(tmp_path, "containers/apptainer.sbatch", "first-job/check_distributed.py")
    env = job_script_env(job_env, tmp_path)  # no image in $HOME/containers
    proc = run(["bash", "apptainer.sbatch"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"no image at {tmp_path}/containers/pytorch.sif" in proc.stderr
    assert "'apptainer build pytorch.sif pytorch.def'" in proc.stderr


# Stand-ins for srun (it starts the command once, as one task) and scontrol, for a run of the
# job script under bash.
SRUN = '#!/bin/bash\nwhile [[ $1 == -* ]]; do [[ $1 == -c ]] && shift; shift; done\nexec "$@"\n'
SCONTROL = '#!/bin/bash\necho "$3"\n'
# In place of check_distributed.py: what the "container" passes on.
PROBE = (
    "import os, sys\n"
    "print('in', os.environ['APPTAINER_NAME'], 'args', sys.argv[1:])\n"
    "print('tmpdir', os.path.isdir(os.environ['APPTAINER_TMPDIR']))\n"
)


def test_job_script_binds_the_folders_that_exist(tmp_path, job_env):
    copy_example(tmp_path, "containers/apptainer.sbatch")
    (tmp_path / "check_distributed.py").write_text(PROBE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "project").mkdir()
    image = tmp_path / "pytorch.sif"
    run(["apptainer", "build", image, DEFINITION], cwd=tmp_path, env=job_env)
    env = job_script_env(
        job_env, tmp_path, IMAGE=image, BIND=f"{tmp_path}/project,{tmp_path}/scratch"
    )
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = run(["bash", "apptainer.sbatch", "--device", "cpu"], cwd=tmp_path, env=env)
    assert f"bound: {tmp_path}/project\n" in proc.stdout, proc.stdout
    assert f"not binding {tmp_path}/scratch: no such folder here" in proc.stderr
    assert "in pytorch.sif args ['--device', 'cpu']" in proc.stdout  # "$@" reached the script
    assert "tmpdir True" in proc.stdout  # APPTAINER_TMPDIR exists in the task
    assert not (tmp_path / "local" / "apptainer-4242").exists()  # and is removed at the end


@pytest.fixture
def image(tmp_path, job_env):
    """A placeholder image, built by the stand-in from the definition file."""
    run(["apptainer", "build", "pytorch.sif", DEFINITION], cwd=tmp_path, env=job_env)
    return tmp_path / "pytorch.sif"


def test_standin_runs_a_command_as_in_the_container(tmp_path, job_env, image):
    out = run(
        ["apptainer", "exec", "--nv", "--bind", f"{tmp_path}:/data:ro", image, "bash", "-c",
         "echo $APPTAINER_NAME $APPTAINER_CONTAINER"], cwd=tmp_path, env=job_env,
    ).stdout  # fmt: skip
    assert out == f"pytorch.sif {image}\n"
    assert run(["apptainer", "--version"], cwd=tmp_path, env=job_env).stdout.startswith(
        "apptainer version 1.4"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["exec", "--bind", "/no/such/folder", "pytorch.sif", "true"],
         "mount source /no/such/folder doesn't exist"),
        (["exec", "--bind", "/tmp:data", "pytorch.sif", "true"],
         "destination must be an absolute path"),
        (["exec", "missing.sif", "true"], "could not open image missing.sif"),
        (["exec", "pytorch.def", "true"], "runs only local .sif images"),
        (["exec", "--gpu", "pytorch.sif", "true"], "unknown flag: --gpu"),
        (["build", "pytorch.sif", "pytorch.def"], "already exists"),
        (["build", "other.sif", "no-from.def"], "no From: line"),
        (["pull", "docker://nvcr.io/nvidia/pytorch:25.10-py3"], "unknown command: pull"),
    ],
)  # fmt: skip
def test_standin_rejects_what_apptainer_rejects(tmp_path, job_env, image, args, message):
    shutil.copy2(DEFINITION, tmp_path / "pytorch.def")
    (tmp_path / "no-from.def").write_text("Bootstrap: docker\n\n%post\n    true\n")
    proc = run(["apptainer", *args], cwd=tmp_path, env=job_env, expect_rc=255)
    assert message in proc.stderr and proc.stderr.startswith("FATAL: "), proc.stderr


# A python stand-in for %post: `pip list` prints the image's packages, `pip install` records
# PIP_CONSTRAINT and the arguments it was given.
FAKE_PYTHON = """#!/bin/sh
if [ "$*" = "-m pip list --format=freeze" ]; then
    printf 'numpy==1.26.4\\ntorch==2.9.0a0+145a3a7bda.nv25.10\\ntorchvision==0.24.0a0+nv25.10\\n'
else
    echo "PIP_CONSTRAINT=$PIP_CONSTRAINT $*" >> "$PIP_LOG"
fi
"""


@pytest.mark.parametrize("nvidia_file", [True, False], ids=["ngc-25.03-and-later", "older"])
def test_post_keeps_nvidias_constraints_and_adds_the_images_pytorch(tmp_path, nvidia_file):
    """NGC images since 25.03 pin every package of the image in /etc/pip/constraint.txt. %post
    keeps those pins and adds the image's torch builds; before, it replaced the file's pins by
    these three alone. %post runs here with its two paths moved under tmp_path."""
    _, sections = parse_definition(DEFINITION.read_text(encoding="utf-8"))
    post = sections["%post"]
    assert post.count("/etc/pip/constraint.txt") >= 1 and post.count("/opt/constraints.txt") >= 3
    nvidia, ours = tmp_path / "etc" / "pip" / "constraint.txt", tmp_path / "opt" / "constraints.txt"
    nvidia.parent.mkdir(parents=True)
    ours.parent.mkdir()
    # NVIDIA's pins; its last line without a newline, so a plain append would join two lines.
    nvidia_pins = ["numpy==1.26.4", "packaging==25.0", "torch==2.9.0a0+145a3a7bda.nv25.10"]
    if nvidia_file:
        nvidia.write_text("\n".join(nvidia_pins))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    script = tmp_path / "post.sh"
    script.write_text(
        post.replace("/etc/pip/constraint.txt", str(nvidia)).replace(
            "/opt/constraints.txt", str(ours)
        )
    )
    log = tmp_path / "pip.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_LOG": str(log)}
    out = run(["sh", script], cwd=tmp_path, env=env).stdout
    pins = ours.read_text().splitlines()
    ours_torch = ["torch==2.9.0a0+145a3a7bda.nv25.10", "torchvision==0.24.0a0+nv25.10"]
    assert pins == ((nvidia_pins if nvidia_file else []) + ours_torch), pins
    assert f"{len(pins)} constraints for pip" in out, out
    assert log.read_text() == (
        f"PIP_CONSTRAINT={ours} -m pip install --no-cache-dir lightning==2.6.6\n"
    )


def test_the_image_release_is_the_site_choice_with_a_cuda_12_one_named():
    """The NGC release is chosen by the nodes' driver: 25.10 (CUDA 13.0) needs a release-580
    driver, so the definition's site-specific block holds the From line and names the CUDA 12
    release for older drivers; the page says the same."""
    text = DEFINITION.read_text(encoding="utf-8")
    block = re.search(r"^# --- Site-specific.*?\n(.*?)^# -{20,}$", text, re.S | re.M)
    assert block, "no site-specific block in pytorch.def"
    header, _ = parse_definition(block[1])
    assert header["from"] == parse_definition(text)[0]["from"]  # the one From line is there
    assert re.search(r"CUDA 13\.0.*580", block[1], re.S), block[1]
    assert "From: nvcr.io/nvidia/pytorch:25.06-py3" in block[1]  # the CUDA 12 release, named
    page = (EXAMPLES.parent / "source" / "getting-started" / "containers.md").read_text()
    assert "`nvcr.io/nvidia/pytorch:25.06-py3`" in page and "release 580 or newer" in page
