"""make test-changed (tests/tools/changed.py): what each kind of change brings in, that a change
nobody mapped runs everything, that git's view of a change is read right, and that conftest
keeps exactly the selection."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TESTS

sys.path.insert(0, str(TESTS / "tools"))
import changed  # noqa: E402 (tests/tools/changed.py: make test-changed)

RECORDS = {
    "ddp/ddp.py": {"tests/test_ddp.py::test_torchrun_trains_two_replicas",
                   "tests/test_slurm.py::test_job_script_completes_under_slurm[ddp/ddp.sbatch]"},
    "ddp/ddp.sbatch": {"tests/test_slurm.py::test_job_script_completes_under_slurm[ddp/ddp.sbatch]",
                       "tests/test_pages.py::test_shell_script_parses_and_passes_shellcheck"
                       "[examples/ddp/ddp.sbatch]"},
}  # fmt: skip


def plan(*paths, status="M", records=RECORDS):
    return changed.plan_for([(status, path) for path in paths], records)


def test_an_example_brings_in_the_tests_that_ran_it():
    found = plan("examples/ddp/ddp.py")
    assert found.everything == []
    assert [{"id": test} for test in sorted(RECORDS["ddp/ddp.py"])] == found.selectors[:2]
    assert found.files() == sorted(
        {*changed.STATIC, "tests/test_ddp.py", "tests/test_slurm.py", "tests/test_site.py"}
    )


def test_an_example_brings_in_the_english_build_of_the_pages_that_include_it():
    found = plan(
        "examples/hangs/hang_demo.py",
        records={"hangs/hang_demo.py": {"tests/test_monitoring.py::t"}},
    )
    assert {
        "id": "tests/test_site.py::test_language_builds_strict_and_clean[en]"
    } in found.selectors
    (pages,) = [s for s in found.selectors if s.get("where", {}).get("page")]
    assert (pages["where"]["page"], pages["where"]["lang"]) == (["monitoring/hangs"], ["en"])
    assert pages["strict"]


def test_a_job_script_brings_in_its_runs_under_the_scheduler():
    found = plan("examples/ddp/ddp.sbatch")
    assert {s["id"] for s in found.selectors} == RECORDS["ddp/ddp.sbatch"]


def test_a_new_example_brings_in_the_tests_that_name_it_and_its_bad_input_cases():
    # check_pytorch.py as if no test had run it yet: the test files that name it
    found = plan("examples/install/check_pytorch.py", status="A", records={})
    assert found.everything == []
    files = {s.get("file") for s in found.selectors}
    assert {"tests/test_install.py", "tests/test_bad_input.py"} <= files
    bad_input = next(s for s in found.selectors if s.get("file") == "tests/test_bad_input.py")
    assert bad_input["where"] == {"script": ["examples/install/check_pytorch.py"]}
    assert bad_input["strict"]


def test_a_new_example_no_test_names_runs_everything():
    path = "examples/nowhere/" + "nobody_runs_" + "me.py"  # in pieces: this file names no such file
    found = plan(path, status="A", records={})
    assert found.everything == [f"{path}: no record and no test names it"]


def test_a_page_brings_in_its_build_its_tests_and_the_tests_that_read_it():
    found = plan("source/monitoring/hangs.md")
    assert found.everything == []
    assert {
        "file": "tests/test_site.py",
        "where": {"page": ["monitoring/hangs"]},
    } in found.selectors
    assert {"file": "tests/test_page_blocks.py", "where": {"page": ["monitoring/hangs"]}} in (
        found.selectors
    )
    assert {"file": "tests/test_monitoring.py"} in found.selectors  # it reads the page's text


def test_a_catalog_brings_in_its_language_and_page_and_the_languages_rules():
    found = plan("locale/fr/LC_MESSAGES/monitoring/hangs.po")
    assert found.selectors == [
        {"file": "tests/test_site.py", "where": {"page": ["monitoring/hangs"], "lang": ["fr"]}},
        {"file": "tests/test_translations_fr.py"},
    ]


def test_the_interface_catalog_brings_in_every_page_of_its_language():
    found = plan("locale/ja/LC_MESSAGES/sphinx.po")
    assert found.selectors == [{"file": "tests/test_site.py", "where": {"lang": ["ja"]}}]


def test_a_test_file_brings_in_itself_and_the_files_that_import_it():
    found = plan("tests/test_pbs.py")
    assert {s["file"] for s in found.selectors} == {
        "tests/test_pbs.py",
        "tests/test_pbs_launcher.py",
    }


@pytest.mark.parametrize(
    "path",
    ["tests/conftest.py", "tests/records.py", "tests/slurm/cluster.sh", "edition/generate.py",
     "tests/sites/pbs-test-complex.toml", "Makefile", "requirements.txt", "pyproject.toml"],
)  # fmt: skip
def test_what_every_test_shares_runs_everything(path):
    found = plan("examples/ddp/ddp.py", path)
    assert len(found.everything) == 1 and found.everything[0].startswith(f"{path}: ")


def test_a_file_no_rule_maps_runs_everything_and_says_so():
    found = plan("somewhere/new.cfg")
    assert found.everything == ["somewhere/new.cfg: no rule maps it"]


def test_documents_and_workflows_bring_in_the_static_checks():
    found = plan("README.md", ".github/workflows/ci.yml", ".ci/run")
    assert (found.everything, found.selectors) == ([], [])
    assert found.files() == sorted(changed.STATIC)


def test_records_bring_in_the_stamps_of_the_pages_that_show_them(tmp_path, monkeypatch):
    records = tmp_path / "tests" / "records"
    records.mkdir(parents=True)
    (records / "cpu.json").write_text(json.dumps({"examples": {"hangs/hang_demo.py": {"sha": 1}}}))
    monkeypatch.setattr(changed, "ROOT", tmp_path)
    monkeypatch.setattr(changed, "including", lambda path: {
        "examples/hangs/hang_demo.py": ["monitoring/hangs"]}.get(path, []))  # fmt: skip
    build, stamps = plan("tests/records/cpu.json").selectors
    assert build == {"id": "tests/test_site.py::test_language_builds_strict_and_clean[en]"}
    assert (stamps["where"]["page"], stamps["where"]["lang"]) == (["monitoring/hangs"], ["en"])


def git(folder, *args):
    subprocess.run(["git", "-C", folder, *args], check=True, capture_output=True)


def test_changes_are_commits_edits_new_files_and_renames(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "config", "user.email", "t@example.org")
    git(tmp_path, "config", "user.name", "t")
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(name)
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "base")
    git(tmp_path, "checkout", "-qb", "work")
    (tmp_path / "a.py").write_text("committed change")
    git(tmp_path, "commit", "-qam", "change")
    (tmp_path / "b.py").write_text("uncommitted change")
    git(tmp_path, "mv", "c.py", "d.py")
    (tmp_path / "e.py").write_text("new, not added")
    monkeypatch.setattr(changed, "ROOT", tmp_path)
    _, found = changed.changed_files("main")
    assert found == [("M", "a.py"), ("M", "b.py"), ("D", "c.py"), ("A", "d.py"), ("A", "e.py")]


def test_an_unknown_base_is_one_line():
    proc = subprocess.run(
        [sys.executable, TESTS / "tools" / "changed.py", "no-such-branch", "--plan"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("test-changed: error: git cannot compare with 'no-such-branch'")


def collected(tmp_path, selection, *files):
    """The test ids pytest keeps from files under selection (conftest.select)."""
    path = tmp_path / "selection.json"
    path.write_text(json.dumps(selection))
    env = {**os.environ, "TESTS_SELECTION": str(path), "PYTORCH_ON_HPC_RECORDS": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
         "-p", "no:cacheprovider", *files],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    missing = path.with_name("selection.json.missing")
    return (
        {line for line in proc.stdout.splitlines() if "::" in line},
        json.loads(missing.read_text()) if missing.is_file() else [],
    )


def test_conftest_keeps_a_pages_tests_and_the_site_wide_ones(tmp_path):
    kept, _ = collected(
        tmp_path,
        {"always": [], "selectors": [{"file": "tests/test_site.py",
                                      "where": {"page": ["monitoring/hangs"], "lang": ["fr"]}}]},
        "tests/test_site.py",
    )  # fmt: skip
    paged = [test for test in kept if "[" in test and "/" in test.split("[")[1]]
    assert paged and all("[monitoring/hangs-fr]" in test for test in paged), paged
    assert "tests/test_site.py::test_every_internal_link_resolves" in kept
    assert "tests/test_site.py::test_search_finds_the_install_page[fr]" in kept
    assert "tests/test_site.py::test_search_finds_the_install_page[en]" not in kept


def test_the_site_builds_only_the_languages_of_the_selected_tests():
    """An example's selection builds English only; a page's switcher needs every language."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import test_site\n"
         "one = 'test_page_shows_a_stamp_from_the_records'\n"
         "print(test_site.built([(one, {'lang': 'en', 'page': 'x'})]),"
         " test_site.built([('test_language_builds_strict_and_clean', {'lang': 'en'})]),"
         " test_site.built([(one, {'lang': 'en'}),"
         " ('test_page_has_switcher_alternates_and_versions', {'lang': 'fr', 'page': 'x'})]))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert proc.stdout.split("] [") == [
        "['en'", "'en'", "'en', 'zh_CN', 'ja', 'fr']\n"
    ]  # fmt: skip


def test_conftest_keeps_one_scripts_bad_input_cases_only(tmp_path):
    kept, _ = collected(
        tmp_path,
        {"always": [], "selectors": [{"file": "tests/test_bad_input.py", "strict": True,
                                      "where": {"script": ["examples/ddp/ddp.py"]}}]},
        "tests/test_bad_input.py",
    )  # fmt: skip
    assert kept and all(test.endswith("[ddp/ddp.py]") for test in kept), kept


def test_a_recorded_test_that_no_longer_exists_brings_in_its_file(tmp_path):
    gone = "tests/test_repo.py::test_that_was_renamed"
    kept, missing = collected(
        tmp_path,
        {"always": [], "selectors": [{"id": gone}]},
        "tests/test_repo.py", "tests/test_records.py",
    )  # fmt: skip
    assert missing == [gone]
    assert {test.split("::")[0] for test in kept} == {"tests/test_repo.py"}


def test_the_static_checks_are_those_of_make_test_quick():
    proc = subprocess.run(
        ["make", "-n", "test-quick"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert f"-m pytest {' '.join(changed.STATIC)}" in proc.stdout
    assert "tests/test_pages.py" in changed.STATIC


def test_the_plan_of_this_checkout_prints_and_runs_nothing():
    proc = subprocess.run(
        [sys.executable, TESTS / "tools" / "changed.py", "HEAD", "--plan"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(">>> test-changed: what differs from HEAD (merge-base ")


def test_the_french_spell_check_runs_when_french_text_changed():
    assert changed.SPELL_CHECK in plan("examples/ddp/ddp.py").spared
    assert changed.SPELL_CHECK not in plan("locale/fr/LC_MESSAGES/monitoring/hangs.po").spared
    assert changed.SPELL_CHECK not in plan("locale/fr/wordlist.txt").spared


def test_conftest_leaves_out_a_spared_static_check(tmp_path):
    file = changed.SPELL_CHECK.split("::")[0]
    kept, _ = collected(
        tmp_path, {"always": [file], "spared": [changed.SPELL_CHECK], "selectors": []}, file
    )
    assert kept and changed.SPELL_CHECK not in kept
    kept, _ = collected(tmp_path, {"always": [file], "selectors": []}, file)
    assert changed.SPELL_CHECK in kept


def test_the_centres_builds_run_when_a_page_or_job_script_changed():
    assert changed.CENTRE_BUILDS in plan("examples/ddp/ddp.py").spared
    assert changed.CENTRE_BUILDS in plan("locale/ja/LC_MESSAGES/monitoring/hangs.po").spared
    for path in ("examples/ddp/ddp.sbatch", "source/monitoring/hangs.md", "README.md"):
        assert changed.CENTRE_BUILDS not in plan("examples/ddp/ddp.py", path).spared, path


def test_conftest_leaves_out_every_parameter_of_a_spared_test(tmp_path):
    # as changed.CENTRE_BUILDS spares tests/test_edition.py's (whose collection takes longer)
    spared = "tests/test_site.py::test_search_finds_the_install_page"
    kept, _ = collected(
        tmp_path, {"always": ["tests/test_site.py"], "spared": [spared], "selectors": []},
        "tests/test_site.py",
    )  # fmt: skip
    assert kept and not [test for test in kept if test.startswith(spared)]
    assert changed.CENTRE_BUILDS.startswith("tests/test_edition.py::test_")


def test_an_example_whose_test_files_are_gone_runs_everything():
    found = plan("examples/ddp/ddp.py", records={"ddp/ddp.py": {"tests/test_gone.py::test_it"}})
    assert found.everything == [
        "examples/ddp/ddp.py: none of the test files that ran it exists any more"
    ]
