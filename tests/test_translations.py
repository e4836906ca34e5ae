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


def preferred_forms(lang):
    """The "not" column of the Preferred forms table of locale/<lang>/GLOSSARY.md."""
    text = (LOCALE / lang / "GLOSSARY.md").read_text(encoding="utf-8")
    section = re.search(r"^## Preferred forms\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, f"locale/{lang}/GLOSSARY.md has no '## Preferred forms' section"
    rows = re.findall(r"^\|(.*)\|\s*`([^`]+)`\s*\|\s*$", section[1], re.M)
    return [(preferred.strip(), wrong) for preferred, wrong in rows]


def variants_in(paths, forms):
    """(catalog, variant, preferred form) for each listed variant found in a translation."""
    found = []
    for path in paths:
        for entry in polib.pofile(str(path)):
            texts = list(entry.msgstr_plural.values()) if entry.msgid_plural else [entry.msgstr]
            for text in texts:
                prose = re.sub(r"`[^`]*`", "", text)
                found += [(path, wrong, preferred) for preferred, wrong in forms if wrong in prose]
    return found


@pytest.mark.parametrize("lang", TRANSLATIONS)
def test_translations_use_the_glossary_s_preferred_forms(lang):
    """Spellings the glossary settled (ja ほか, not 他の; zh_CN 时间上限, not 时间限制): a variant
    it lists as not preferred fails wherever it appears in a translation (code spans aside)."""
    forms = preferred_forms(lang)
    if lang in ("ja", "zh_CN"):
        assert len(forms) >= 8, "list the spelling variants the translation settled"
    found = variants_in((LOCALE / lang / "LC_MESSAGES").rglob("*.po"), forms)
    assert found == [], "use the glossary's preferred form: " + "; ".join(
        f"{rel(path)}: {wrong!r} -> {preferred!r}" for path, wrong, preferred in found[:20]
    )


def test_preferred_forms_check_catches_a_variant(tmp_path):
    """A catalog that writes a listed variant is caught; the same word in a code span is not."""
    catalog = tmp_path / "page.po"
    catalog.write_text(
        'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        'msgid "a"\nmsgstr "他のジョブ"\n\nmsgid "b"\nmsgstr "`他の`"\n',
        encoding="utf-8",
    )
    found = variants_in([catalog], preferred_forms("ja"))
    assert [(wrong, preferred) for _, wrong, preferred in found] == [("他の", "ほかの")]


def require_french_dictionary():
    require_command("hunspell", "run `make system-packages` as root (apt-get install hunspell)")
    if not any(Path("/usr/share/hunspell", name).is_file() for name in ("fr_FR.dic", "fr.dic")):
        pytest.skip("no French dictionary: run `make system-packages` as root (hunspell-fr)")


def test_french_passes_the_spell_check():
    """pospell (hunspell's French dictionary) on every French catalog: a misspelling fails;
    a legitimate word hunspell does not know goes into locale/fr/wordlist.txt."""
    require_french_dictionary()
    command = [
        Path(sys.executable).with_name("pospell"), "-l", "fr_FR",
        "-p", LOCALE / "fr" / "wordlist.txt", "--glob", "locale/fr/LC_MESSAGES/**/*.po",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), (
        "misspelt (fix it, or add a real word to locale/fr/wordlist.txt):\n" + proc.stdout[-3000:]
    )


def test_french_spell_check_catches_a_misspelling(tmp_path):
    require_french_dictionary()
    (tmp_path / "page.po").write_text(
        'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        'msgid "The job starts."\nmsgstr "Le travail démarre et l\'entraînment commence."\n',
        encoding="utf-8",
    )
    proc = subprocess.run(
        [Path(sys.executable).with_name("pospell"), "-l", "fr_FR",
         "-p", LOCALE / "fr" / "wordlist.txt", "--glob", "*.po"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "entraînment" in proc.stdout, proc.stdout + proc.stderr
