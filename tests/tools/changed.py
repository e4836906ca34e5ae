"""The tests that cover what changed: `make test-changed` (BASE=main by default).

    python tests/tools/changed.py [BASE] [--plan] [-- PYTEST OPTIONS]

Compares the working tree (commits, uncommitted edits and new files) with where it left BASE
(git merge-base), maps each changed file to the tests that cover it, prints the selection and
why, runs it with pytest and ends with one verdict line. --plan prints the selection only.

How a file maps (the first rule that matches wins):

- anything the tests share (conftest, the test helpers, the schedulers' setup, the site files,
  the edition, the Makefile, requirements, pytest settings): everything, as `make test`;
- an example: the tests that ran it, from tests/records/ (the working tree's and BASE's), and
  the English build of the pages that include it; a new example no record names yet: the test
  files that name it and its bad-input cases;
- a page: its build in every language, its tests in tests/test_site.py and
  tests/test_page_blocks.py, the site-wide tests, and the test files that name the page;
- a catalog: that language's build, its pages' tests in tests/test_site.py, its rule tests;
- a test file: all of it, and the test files that import it;
- a tool in tests/tools/: the test files that name it;
- the site's extensions, templates and configuration: the whole tests/test_site.py;
- the records: the English build and the stamps of the pages whose examples' records changed;
- README, workflows, CI: the static checks.

The static checks that read every file (make test-quick: lint, includes, catalogs, records,
site files) always run, but for the French spell check, which runs when French text changed,
and the builds of the centres' editions, which run when a page or a job script changed.
A changed file no rule maps, or an example whose tests cannot be found, runs everything, and
the plan says why: a pass never covers a change nobody mapped.

The selection reaches pytest as a file (TESTS_SELECTION) that tests/conftest.py reads while it
collects: a recorded test that no longer exists brings in the whole file it was in.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests"
# The records' state: checked after the run, on the records it wrote (TESTS_RECORDS=worktree).
RECORD_STATE = [
    "tests/test_records.py::test_committed_records_describe_the_files_as_they_are",
    "tests/test_records.py::test_committed_records_are_of_passing_tests",
    "tests/test_records.py::test_every_script_has_a_record",
    "tests/test_records.py::test_job_scripts_have_scheduler_records",
]
# A static check that reads only the French catalogs: it runs when one of those changed.
SPELL_CHECK = "tests/test_translations.py::test_french_passes_the_spell_check"
# The centres' English editions (every parameter): they differ from the site in their job
# scripts and pages only, so a change to neither (a Python example, a catalog) cannot change them.
CENTRE_BUILDS = "tests/test_edition.py::test_a_centres_pages_build_strictly_with_its_scripts"
JOB_SCRIPT = re.compile(r"examples/.+\.(sbatch|qsub|pbs|sh|def|toml)$")
# make test-quick: the static checks that read every file (the Makefile's QUICK list).
STATIC = re.search(r"^QUICK := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)[1]
STATIC = STATIC.replace("\\\n", " ").split()
SUITES = ("cpu", "slurm", "gridengine", "pbs", "gpu")
LANGUAGES = ("zh_CN", "ja", "fr")
# What every test depends on: a change here runs the whole suite.
SHARED = [
    (r"tests/conftest\.py", "the tests' shared fixtures"),
    (r"tests/(records|recorded|zygote|bad_input)\.py", "a helper every example test uses"),
    (r"tests/(shim|slurm|pbs|gridengine|modulefiles|standins|node)/", "the tests' environment"),
    (r"tests/(daemons\.sh|install-system-packages\.sh)", "the tests' environment"),
    (r"tests/sites/", "the test site files generate every job script the tests submit"),
    (r"edition/", "the edition generates every job script the tests submit"),
    (
        r"(Makefile|pyproject\.toml|requirements\.txt|constraints\.txt|versions\.toml)$",
        "the build, the venv or pytest's settings",
    ),
]
SITE_WIDE = [
    r"conf\.py$",
    r"source/_(ext|static|templates|root)/",
    r"locale/[^/]+/search-terms\.toml$",
    r"locale/[^/]+/LC_MESSAGES/sphinx\.po$",
]
STATIC_ONLY = [
    (r"[^/]+\.md$", "a top-level document"),
    (r"\.github/", "a workflow (actionlint in tests/test_repo.py)"),
    (r"\.ci/", "CI's script (its plan in tests/test_repo.py; the run itself is .ci/run)"),
    (r"\.(gitignore|gitattributes|editorconfig)$", "a git setting"),
]


@dataclass
class Plan:
    """What to run: selectors for tests/conftest.py, and why each part is there."""

    everything: list = field(default_factory=list)  # reasons to run the whole suite
    spared: list = field(default_factory=list)  # static checks this change cannot affect
    selectors: list = field(default_factory=list)
    reasons: list = field(default_factory=list)  # (changed file, what it brings in)

    def add(self, path, what, *selectors):
        self.reasons.append((path, what))
        self.selectors.extend(selectors)

    def files(self):
        """The test files pytest collects."""
        found = set(STATIC)
        for selector in self.selectors:
            found.add(selector.get("file") or selector["id"].split("::")[0])
        return sorted(found)


def git(*args):
    return subprocess.run(
        ["git", "-C", ROOT, *args], capture_output=True, text=True, check=True
    ).stdout


def changed_files(base):
    """[(status, path)] of what differs from where HEAD left base, uncommitted edits and new
    files included; a rename is a deletion and an addition."""
    fork = git("merge-base", base, "HEAD").strip()
    found = []
    for line in git("diff", "--name-status", "--no-renames", fork).splitlines():
        status, path = line.split("\t", 1)
        found.append((status[0], path))
    for path in git("ls-files", "--others", "--exclude-standard").splitlines():
        found.append(("A", path))
    return fork, sorted(set(found), key=lambda item: item[1])


def load_records(fork):
    """{example: {test ids}} from the records of the working tree and of the fork point."""
    tests = {}
    for suite in SUITES:
        texts = []
        path = ROOT / TESTS / "records" / f"{suite}.json"
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
        if fork:
            try:
                texts.append(git("show", f"{fork}:tests/records/{suite}.json"))
            except subprocess.CalledProcessError:
                pass
        for text in texts:
            for name, record in json.loads(text).get("examples", {}).items():
                tests.setdefault(name, set()).update(record.get("tests", {}))
    return tests


def test_files():
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / TESTS).glob("test_*.py"))


def naming(*needles):
    """The test files whose text contains any of needles."""
    found = []
    for name in test_files():
        text = (ROOT / name).read_text(encoding="utf-8")
        if any(needle in text for needle in needles):
            found.append(name)
    return found


def importers(module):
    pattern = re.compile(rf"^\s*(from {module} import|import {module}\b)", re.M)
    return [name for name in test_files() if pattern.search((ROOT / name).read_text("utf-8"))]


INCLUDE = re.compile(r"^[ \t]*(?:`{3,}|:{3,})\{literalinclude\} (\S+)$", re.M)


def including(path):
    """The pages (source/ paths without suffix) that literalinclude path."""
    pages = []
    for page in sorted((ROOT / "source").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        if any((page.parent / found).resolve() == ROOT / path for found in INCLUDE.findall(text)):
            pages.append(page.relative_to(ROOT / "source").with_suffix("").as_posix())
    return pages


def shown_on(path):
    """The English build and the tests of the pages that include path: a slice that no longer
    finds its marker or :pyobject: fails the strict build."""
    pages = including(path)
    if not pages:
        return "", []
    where = {"page": pages, "lang": ["en"],
             "originalname": ["test_every_included_example_can_be_downloaded",
                              "test_page_shows_a_stamp_from_the_records"]}  # fmt: skip
    return f"; the English build and the pages that include it ({', '.join(pages)})", [
        {"id": "tests/test_site.py::test_language_builds_strict_and_clean[en]"},
        {"file": "tests/test_site.py", "where": where, "strict": True},
    ]


def map_example(plan, path, records, status):
    name = path.removeprefix("examples/")
    # the tests whose file still exists (a test file deleted or renamed since the record)
    recorded = sorted(t for t in records.get(name, ()) if (ROOT / t.split("::")[0]).is_file())
    if records.get(name) and not recorded and status != "D":
        plan.everything.append(f"{path}: none of the test files that ran it exists any more")
        return
    pages, builds = shown_on(path) if status != "D" else ("", [])
    if recorded:
        plan.add(
            path,
            f"{len(recorded)} tests that ran it (tests/records/){pages}",
            *({"id": test} for test in recorded),
            *builds,
        )
        return
    if status == "D":
        plan.add(path, "deleted, no test ran it: the static checks")
        return
    found = [f for f in naming(name, f'"{Path(name).name}"') if f != "tests/test_bad_input.py"]
    selectors = [{"file": f} for f in found]
    if name.endswith(".py"):
        selectors.append(
            {"file": "tests/test_bad_input.py", "where": {"script": [path]}, "strict": True}
        )
    if not found:
        plan.everything.append(f"{path}: no record and no test names it")
        return
    plan.add(
        path,
        f"no record yet; the test files that name it ({', '.join(found)})"
        + (" and its bad-input cases" if name.endswith(".py") else "")
        + pages,
        *selectors,
        *builds,
    )


def map_page(plan, path):
    page = path.removeprefix("source/").rsplit(".", 1)[0]
    where = {"page": [page]}
    if "/" in page:  # as tests name a page: "monitoring/hangs.md", "monitoring" / "hangs.md"
        folder, name = page.rsplit("/", 1)
        named = naming(f"{page}.md", f'"{folder}" / "{name}.md"')
    else:
        named = naming(f'SOURCE / "{page}.md"')
    selectors = [
        {"file": "tests/test_site.py", "where": where},
        {"file": "tests/test_page_blocks.py", "where": where},
        *(
            {"file": f}
            for f in named
            if f not in ("tests/test_site.py", "tests/test_page_blocks.py")
        ),
    ]
    plan.add(
        path,
        "its build and tests in every language (tests/test_site.py), its typed "
        "blocks (tests/test_page_blocks.py)"
        + (f", the test files that name it ({', '.join(named)})" if named else ""),
        *selectors,
    )


def map_records(plan, path, fork):
    """A record shows on the pages that include its example: their stamps, in English."""

    def examples(text):
        return json.loads(text).get("examples", {}) if text else {}

    now = examples((ROOT / path).read_text(encoding="utf-8") if (ROOT / path).is_file() else "")
    try:
        before = examples(git("show", f"{fork}:{path}")) if fork else {}
    except subprocess.CalledProcessError:
        before = {}
    names = sorted(name for name in now.keys() | before.keys() if now.get(name) != before.get(name))
    pages = sorted({page for name in names for page in including(f"examples/{name}")})
    where = {"page": pages, "lang": ["en"],
             "originalname": ["test_page_shows_a_stamp_from_the_records"]}  # fmt: skip
    plan.add(
        path,
        f"the English stamps of the pages that show its {len(names)} changed records "
        f"({', '.join(pages) or 'none'})",
        {"id": "tests/test_site.py::test_language_builds_strict_and_clean[en]"},
        *([{"file": "tests/test_site.py", "where": where, "strict": True}] if pages else []),
    )


def map_catalog(plan, path, lang):
    rest = path.split("/LC_MESSAGES/", 1)[1].rsplit(".", 1)[0]
    rules = f"tests/test_translations_{lang}.py"
    selectors = [{"file": rules}] if (ROOT / rules).is_file() else []
    plan.add(
        path,
        f"its page in {lang} (tests/test_site.py) and {lang}'s rule tests",
        {"file": "tests/test_site.py", "where": {"page": [rest], "lang": [lang]}},
        *selectors,
    )


def plan_for(changes, records, fork=None):
    """The Plan for [(status, path)]; records: {example: {test ids}}; fork: the commit the
    changes are measured from."""
    plan = Plan()
    for status, path in changes:
        shared = next((why for pattern, why in SHARED if re.match(pattern, path)), None)
        if shared:
            plan.everything.append(f"{path}: {shared}")
        elif path.startswith("examples/"):
            map_example(plan, path, records, status)
        elif re.match(r"source/.+\.(md|rst)$", path) and not path.startswith("source/_"):
            map_page(plan, path)
        elif any(re.match(pattern, path) for pattern in SITE_WIDE):
            lang = re.match(r"locale/([^/]+)/", path)
            if lang and lang[1] in LANGUAGES:
                plan.add(
                    path,
                    f"every page in {lang[1]} (tests/test_site.py)",
                    {"file": "tests/test_site.py", "where": {"lang": [lang[1]]}},
                )
            elif lang:  # English search terms
                plan.add(
                    path,
                    "every page in en (tests/test_site.py)",
                    {"file": "tests/test_site.py", "where": {"lang": [lang[1]]}},
                )
            else:
                plan.add(
                    path, "the whole site (tests/test_site.py)", {"file": "tests/test_site.py"}
                )
        elif m := re.match(r"locale/([^/]+)/LC_MESSAGES/.+\.po$", path):
            map_catalog(plan, path, m[1])
        elif m := re.match(r"locale/([^/]+)/", path):
            rules = f"tests/test_translations_{m[1]}.py"
            extra = [{"file": rules}] if (ROOT / rules).is_file() else []
            plan.add(path, f"{m[1]}'s translation checks", *extra)
        elif re.match(r"tests/records/[^/]+\.json$", path):
            map_records(plan, path, fork)
        elif re.match(r"tests/records/", path):
            plan.add(path, "a kept GPU run: the records' checks")
        elif re.match(r"tests/test_[^/]+\.py$", path):
            if status == "D":
                plan.add(path, "deleted: the static checks")
                continue
            module = Path(path).stem
            users = [f for f in importers(module) if f != path]
            plan.add(
                path,
                "all of it" + (f", and {', '.join(users)}, which import it" if users else ""),
                *({"file": f} for f in [path, *users]),
            )
        elif path.startswith("tests/tools/"):
            users = naming(Path(path).name)
            if users:
                plan.add(
                    path,
                    f"the test files that use it ({', '.join(users)})",
                    *({"file": f} for f in users),
                )
            else:
                plan.add(path, "no test runs it: lint and shellcheck (the static checks)")
        else:
            why = next((why for pattern, why in STATIC_ONLY if re.match(pattern, path)), None)
            if why:
                plan.add(path, f"{why}: the static checks")
            else:
                plan.everything.append(f"{path}: no rule maps it")
    if not any(path.startswith("locale/fr/") for _, path in changes):
        plan.spared.append(SPELL_CHECK)  # it reads the French catalogs and word list only
    if all(
        (path.startswith("examples/") and not JOB_SCRIPT.match(path))
        or path.startswith(("locale/", "tests/records/"))
        for _, path in changes
    ):
        plan.spared.append(CENTRE_BUILDS)
    return plan


def pytest_command(plan, extra):
    """The run: the selection (or everything), the records' state left for afterwards."""
    python = ROOT / ".venv" / "bin" / "python"
    python = python if python.is_file() else Path(sys.executable)
    deselect = [arg for test in RECORD_STATE for arg in ("--deselect", test)]
    return [str(python), "-m", "pytest", *([] if plan.everything else plan.files()), *deselect,
            *extra]  # fmt: skip


def records_command(command):
    """The records' state, on what the run wrote (TESTS_RECORDS=worktree), in this process."""
    return [command[0], "-m", "pytest", "-q", "-n", "0", *RECORD_STATE]


def main(argv):
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    show_only = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    base = argv[0] if argv else "main"
    try:
        fork, changes = changed_files(base)
    except subprocess.CalledProcessError as error:
        sys.exit(
            f"test-changed: error: git cannot compare with {base!r}: "
            f"{error.stderr.strip().splitlines()[-1] if error.stderr.strip() else error}"
        )
    files = f"{len(changes)} file{'s' * (len(changes) != 1)}"
    print(f">>> test-changed: what differs from {base} (merge-base {fork[:9]}): {files}")
    if not changes:
        print(">>> test-changed: nothing differs: nothing to run")
        return 0
    plan = plan_for(changes, load_records(fork), fork)
    for path, what in plan.reasons:
        print(f"    {path}: {what}")
    if plan.everything:
        print(">>> test-changed: running everything (make test), because")
        for reason in plan.everything:
            print(f"    {reason}")
    else:
        print(
            f">>> test-changed: the static checks ({' '.join(Path(f).name for f in STATIC)}), "
            f"and {len(plan.selectors)} selectors over {len(plan.files())} test files"
        )
        if SPELL_CHECK in plan.spared:
            print("    not the French spell check: no French text changed")
        if CENTRE_BUILDS in plan.spared:
            print("    not the centres' page builds: no page or job script changed")
    command = pytest_command(plan, extra)
    if show_only:
        print(" ".join(command))
        return 0
    env = dict(os.environ)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-changed-") as scratch:
        if not plan.everything:
            selection = Path(scratch, "selection.json")
            selection.write_text(json.dumps(
                {"always": STATIC, "spared": plan.spared, "selectors": plan.selectors}
            ))  # fmt: skip
            env["TESTS_SELECTION"] = str(selection)
        code = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        fallback = Path(scratch, "selection.json.missing")
        missing = json.loads(fallback.read_text()) if fallback.is_file() else []
    for test in missing:
        print(f">>> test-changed: {test} no longer exists: ran all of {test.split('::')[0]}")
    print(">>> test-changed: the records this run wrote describe the files as they are now")
    checked = {**os.environ, "TESTS_RECORDS": "worktree", "PYTORCH_ON_HPC_RECORDS": "0"}
    records = subprocess.run(records_command(command), cwd=ROOT, env=checked, check=False)
    code = code or records.returncode
    minutes = (time.monotonic() - start) / 60
    what = "everything" if plan.everything else "the selection"
    verdict = "passed" if code == 0 else f"FAILED (pytest exit {code})"
    print(f">>> test-changed: {what} {verdict} in {minutes:.1f} min")
    if code == 0 and any(path.startswith("examples/") for _, path in changes):
        print(">>> test-changed: commit tests/records/ with your change")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
