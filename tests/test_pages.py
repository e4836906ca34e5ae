"""The pages' sources: what they include, the Python blocks they show, the shell they ship."""

import ast
import atexit
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT, SOURCE, TEST_SITES, TESTS, require_command, test_edition

PAGES = sorted(SOURCE.rglob("*.md"))
# ```{literalinclude} path  followed by  :option: value  lines (indented inside a list item)
INCLUDE = re.compile(
    r"^[ \t]*(`{3,}|:{3,})\{literalinclude\} (?P<path>\S+)\n"
    r"(?P<options>(?:[ \t]*:[\w-]+:.*\n)*)",
    re.M,
)
DOWNLOAD = re.compile(r"\{download\}`(?:[^`<]*<)?(?P<path>[^`>]+)>?`")
EXAMPLE_FILES = sorted(
    path for path in EXAMPLES.rglob("*") if path.is_file() and "__pycache__" not in path.parts
)
SHELL_SCRIPTS = sorted(
    [p for p in EXAMPLE_FILES if p.suffix in (".sh", ".sbatch", ".qsub", ".pbs")]
    + list(TESTS.rglob("*.sh"))
    + sorted(p for p in (TESTS / "standins").rglob("*") if p.is_file())
)


def includes():
    """(page, target path, options) for every literalinclude and download in the pages."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in INCLUDE.finditer(text):
            options = dict(
                re.match(r"\s*:([\w-]+):\s*(.*)", line).groups()
                for line in match["options"].splitlines()
            )
            found.append((page, (page.parent / match["path"]).resolve(), options))
        for match in DOWNLOAD.finditer(text):
            found.append((page, (page.parent / match["path"]).resolve(), {}))
    return found


def rel(path):
    return str(Path(path).relative_to(ROOT))


@pytest.mark.parametrize(
    ("page", "target", "options"), includes(), ids=lambda v: rel(v) if isinstance(v, Path) else ""
)
def test_include_points_at_an_existing_file_by_name_or_marker(page, target, options):
    assert target.is_file(), f"{rel(page)} includes {target}, which does not exist"
    # examples/, or the edition tools' template and recordings, which tests/test_edition.py checks.
    assert target.is_relative_to(EXAMPLES) or target.parent == ROOT / "edition", (
        f"{rel(page)} includes {target}, outside examples/"
    )
    for option in ("lines", "emphasize-lines", "lineno-start"):
        assert option not in options, (
            f"{rel(page)}: include {rel(target)} by name or marker, not :{option}:"
        )
    text = target.read_text(encoding="utf-8")
    if "pyobject" in options:
        names = {
            node.name
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.ClassDef)
        }
        assert options["pyobject"] in names, (
            f"{rel(page)}: no {options['pyobject']} in {rel(target)}"
        )
    # A centre's edition rewrites lines of the job scripts (make html SITE=...): the markers
    # must be in its version too, for the template's site file and the tests' ones.
    versions = {"examples/": text}
    if target.is_relative_to(EXAMPLES):
        for site, folder in site_editions().items():
            versions[site] = (folder / target.relative_to(EXAMPLES)).read_text(encoding="utf-8")
    for marker in ("start-after", "end-before"):
        if marker not in options:
            continue
        for version, content in versions.items():
            assert options[marker] in content, (
                f"{rel(page)}: marker {options[marker]!r} not in {rel(target)} ({version})"
            )


@functools.cache
def site_editions():
    """{site: its edition's examples/}, for the template's site file and the tests' ones (the
    editions conftest generates once per test process)."""
    from generate import generate  # noqa: PLC0415
    from sitefile import load  # noqa: PLC0415

    folder = Path(tempfile.mkdtemp(prefix="pytorch-on-hpc-markers-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    generate(load(ROOT / "edition" / "template.toml"), folder)
    return {"template": folder / "examples",
            **{scheduler: test_edition(scheduler) for scheduler in TEST_SITES}}  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=rel)
def test_every_example_is_shown_on_a_page(example):
    shown = {target for _, target, _ in includes()}
    assert example in shown, (
        f"{rel(example)} is on no page: literalinclude it or offer it with {{download}}"
    )


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=rel)
def test_every_example_is_exercised_by_a_test(example):
    """Each example is named by a test module other than this one (which only lints)."""
    name = str(example.relative_to(EXAMPLES))
    modules = [p for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name]
    assert any(
        name in p.read_text(encoding="utf-8")
        or f'"{example.name}"' in p.read_text(encoding="utf-8")
        for p in modules
    ), f"no test runs {name}: add one to the tests of its topic"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=rel)
def test_shell_script_parses_and_passes_shellcheck(script):
    subprocess.run(["bash", "-n", script], check=True)
    require_command("shellcheck", "run `make system-packages` as root (apt-get install shellcheck)")
    proc = subprocess.run(
        ["shellcheck", "--shell=bash", "--external-sources", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout


def test_python_code_passes_ruff():
    proc = subprocess.run(
        [
            Path(__import__("sys").executable).parent / "ruff",
            "check",
            "--no-cache",
            "examples",
            "tests",
            "conf.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ```python blocks in the pages: linted, and run with their #> output comments checked.
pytest_examples = pytest.importorskip(
    "pytest_examples", reason="pytest-examples is in requirements.txt"
)
MD_EXAMPLES = list(pytest_examples.find_examples(*PAGES))


def test_pages_have_python_blocks():
    assert MD_EXAMPLES, "no ```python blocks found: the check below would pass vacuously"


@pytest.mark.parametrize("example", MD_EXAMPLES, ids=str)
def test_python_block_in_page(example, eval_example):
    eval_example.set_config(line_length=100, target_version="py311", ruff_ignore=["T201"])
    eval_example.lint_ruff(example)
    eval_example.run_print_check(example)
