"""The gettext catalogs: complete, current with the English pages, valid, wrapped the same way."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LOCALE, ROOT, SOURCE, TESTS, TRANSLATIONS, require_command

# polib comes with the venv; a GPU machine running only `make test-gpu` may lack it.
polib = pytest.importorskip("polib", reason="polib is in requirements.txt: run make venv")

CATALOGS = sorted(LOCALE.glob("*/LC_MESSAGES/**/*.po"))


def rel(path):
    return str(Path(path).relative_to(ROOT))


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """The English messages, extracted afresh from source/ (what `make gettext` writes)."""
    out = tmp_path_factory.mktemp("gettext")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "gettext", "-E", "-W", "--keep-going",
         "-c", ROOT, SOURCE, out],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {
        str(p.relative_to(out).with_suffix("")): polib.pofile(str(p)) for p in out.rglob("*.pot")
    }


@pytest.mark.parametrize("lang", TRANSLATIONS)
def test_every_page_has_a_current_catalog(templates, lang):
    catalogs = {
        str(p.relative_to(LOCALE / lang / "LC_MESSAGES").with_suffix("")): p
        for p in (LOCALE / lang / "LC_MESSAGES").rglob("*.po")
        if p.name != "sphinx.po"  # the interface strings, checked below
    }
    assert sorted(catalogs) == sorted(templates), "run `make update-po`"
    for name, template in templates.items():
        wanted = {(e.msgctxt, e.msgid) for e in template}
        have = {(e.msgctxt, e.msgid) for e in polib.pofile(str(catalogs[name])) if not e.obsolete}
        assert have == wanted, f"{lang}/{name}: stale catalog, run `make update-po` and translate"


@pytest.mark.parametrize("catalog", CATALOGS, ids=rel)
def test_catalog_is_complete(catalog):
    po = polib.pofile(str(catalog))
    assert not po.metadata_is_fuzzy, "header still marked fuzzy"
    assert [e.msgid for e in po.untranslated_entries()] == []
    assert [e.msgid for e in po.fuzzy_entries()] == []
    assert [e.msgid for e in po.obsolete_entries()] == []
    assert po.percent_translated() == 100


@pytest.mark.parametrize("catalog", CATALOGS, ids=rel)
def test_catalog_passes_msgfmt_check(catalog):
    require_command("msgfmt", "run `make system-packages` as root (apt-get install gettext)")
    proc = subprocess.run(
        ["msgfmt", "--check", "-o", "/dev/null", catalog],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_catalogs_are_wrapped_by_powrap():
    powrap = Path(sys.executable).parent / "powrap"
    proc = subprocess.run(
        [powrap, "--check", *CATALOGS], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, (
        "run `make update-po` (it runs powrap)\n" + proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("lang", TRANSLATIONS)
def test_each_language_keeps_a_glossary(lang):
    glossary = LOCALE / lang / "GLOSSARY.md"
    assert glossary.is_file(), "keep the terminology of each language in locale/<lang>/GLOSSARY.md"
    assert glossary.read_text(encoding="utf-8").count("|") > 40


@pytest.mark.parametrize("lang", TRANSLATIONS)
def test_interface_catalog_has_every_string_of_the_extensions(lang):
    """The site's interface strings (extensions, templates, the theme's templates) are
    translated through sphinx.po; each must be in it (no more, no less), translated, with its
    placeholders intact."""
    tool = TESTS / "tools" / "interface_strings.py"
    spec = importlib.util.spec_from_file_location("interface_strings", tool)
    strings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strings)
    catalog = polib.pofile(str(LOCALE / lang / "LC_MESSAGES" / "sphinx.po"))
    assert sorted(e.msgid for e in catalog) == strings.msgids(), "update sphinx.po"
    placeholder = re.compile(r"\{\w+\}|%\(\w+\)s")
    for entry in catalog:
        if entry.msgid_plural:  # a form may leave out the count ("une page"), never add one
            wanted = set(placeholder.findall(entry.msgid_plural))
            for text in entry.msgstr_plural.values():
                assert text and set(placeholder.findall(text)) <= wanted, entry.msgid
            continue
        assert entry.msgstr, f"untranslated: {entry.msgid}"
        wanted, got = (sorted(placeholder.findall(t)) for t in (entry.msgid, entry.msgstr))
        assert wanted == got, entry.msgid
