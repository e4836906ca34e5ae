"""French rules of locale/fr/GLOSSARY.md that a "Preferred forms" row cannot express."""

import re

from test_translations import polib, rel

from conftest import LOCALE

FR_CATALOGS = sorted((LOCALE / "fr" / "LC_MESSAGES").rglob("*.po"))
CODE = re.compile(r"``.*?``|`[^`]*`")
# PBS's chunk ("copied in slow chunks" in troubleshooting.md is not one).
CHUNK = re.compile(r"(?<!slow )\bchunks?\b")
CHUNK_GLOSS = re.compile(r"blocs? de ressources(?: \(chunks?\)|, ou chunks?\b)")
UNDER = re.compile(r"\bUnder (Slurm|PBS|Grid Engine)\b", re.I)


def prose(text):
    """The text without code spans, link targets and link texts (a link text is a title)."""
    return re.sub(r"\[[^\]]*\]\([^)]*\)", "L", CODE.sub("C", text))


def entries(paths):
    for path in paths:
        for entry in polib.pofile(str(path)):
            if entry.msgstr and not entry.obsolete:
                yield path, entry


def chunk_not_glossed(paths):
    """Pages whose first mention of a PBS chunk is not « bloc(s) de ressources (chunk(s)) »."""
    found, seen = [], set()
    for path, entry in entries(paths):
        if path not in seen and CHUNK.search(CODE.sub("", entry.msgid)):
            seen.add(path)
            if not CHUNK_GLOSS.search(entry.msgstr):
                found.append((path, entry.msgstr))
    return found


def under_not_sous(paths):
    """Entries where "Under Slurm/PBS/Grid Engine" is not « sous Slurm/PBS/Grid Engine »."""
    return [
        (path, entry.msgstr)
        for path, entry in entries(paths)
        for name in UNDER.findall(entry.msgid)
        if not re.search(rf"\b[Ss]ous {name}\b", entry.msgstr)
    ]


def nested_parentheses(paths):
    found = []
    for path, entry in entries(paths):
        depth = 0
        for char in prose(entry.msgstr):
            depth = max(0, depth + {"(": 1, ")": -1}.get(char, 0))
            if depth == 2:
                found.append((path, entry.msgstr))
                break
    return found


def test_french_follows_the_glossary_s_page_rules():
    problems = [
        (rule, rel(path), text[:120])
        for rule, check in [
            ("chunk: « bloc de ressources (chunk) » at first use on the page", chunk_not_glossed),
            ("Under Slurm/PBS: « Sous Slurm/PBS »", under_not_sous),
            ("no nested parentheses: « (…, ou seed) »", nested_parentheses),
        ]
        for path, text in check(FR_CATALOGS)
    ]
    assert problems == [], "\n".join(map(str, problems))


def test_french_page_rules_catch_a_planted_slip(tmp_path):
    catalog = tmp_path / "page.po"
    catalog.write_text(
        'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        'msgid "Under PBS, one chunk holds the GPU."\n'
        'msgstr "Avec PBS, un bloc contient le GPU."\n\n'
        'msgid "Two chunks (`select=2`, the default seed)."\n'
        'msgstr "Deux blocs de ressources (chunks) (`select=2`, la graine (seed))."\n',
        encoding="utf-8",
    )
    assert [text for _, text in chunk_not_glossed([catalog])] == [
        "Avec PBS, un bloc contient le GPU."
    ]
    assert len(under_not_sous([catalog])) == 1
    assert [text[:5] for _, text in nested_parentheses([catalog])] == ["Deux "]
    catalog.write_text(
        catalog.read_text(encoding="utf-8").replace(
            "Avec PBS, un bloc", "Sous PBS, un bloc de ressources (chunk)"
        ),
        encoding="utf-8",
    )
    assert chunk_not_glossed([catalog]) == [] and under_not_sous([catalog]) == []
