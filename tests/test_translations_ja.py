"""Rules of locale/ja/GLOSSARY.md that a "Preferred forms" row cannot express: first-mention
glosses, ジョブスケジューラ then スケジューラ, a Japanese gloss after a quoted error message."""

import re

import pytest
from test_translations import rel

from conftest import LOCALE, SOURCE

polib = pytest.importorskip("polib", reason="polib is in requirements.txt: run make venv")

PAGES = sorted(p for p in (LOCALE / "ja" / "LC_MESSAGES").rglob("*.po") if p.name != "sphinx.po")
# The English in （） at the first mention on every page that uses the term (headings aside).
GLOSSED = {
    "再投入": "（requeue）",
    "ホイール(?!ハウス|サーバー)": "（wheel）",
    "ジョブアレイ": "（job array）",
    "チャンク": "（chunk）",
    "サブジョブ": "（subjob）",
}
LR_SCHEDULER = "学習率スケジューラ|オプティマイザ、スケジューラ"
# Program output that running text quotes in a code span: each is followed by its gloss in （）.
MESSAGES = (
    r"No space left on device|Disk quota exceeded|is in use by job|interrupted \(Ctrl-C\)"
    r"|not found or corrupted|is damaged \(|Weights only load failed"
)


def problems(page):
    """What breaks the rules in one page: (kind, msgstr) in page order, kind heading/cell/text."""
    found = []
    prose = [(kind, re.sub(r"`[^`]*`", "", text)) for kind, text in page]
    for term, gloss in GLOSSED.items():
        texts = (text for kind, text in prose if kind != "heading" and re.search(term, text))
        first = next(texts, "")
        if first and not re.search(term + re.escape(gloss), first):
            found.append(f"first {term} without {gloss}: {first[:60]}")
    bare = [re.sub(LR_SCHEDULER, "", text) for _, text in prose]
    said = [m[0] for text in bare for m in re.finditer("(?:ジョブ)?スケジューラ", text)]
    if said and said[0] != "ジョブスケジューラ":
        found.append("the first mention is スケジューラ, not ジョブスケジューラ")
    if "ジョブスケジューラ" in said[1:]:
        found.append("ジョブスケジューラ after the first mention (スケジューラ)")
    for kind, text in page:
        for span in re.finditer(r"`([^`]*)`", text):
            if kind == "text" and re.search(MESSAGES, span[1]) and text[span.end() :][:1] != "（":
                found.append(f"`{span[1][:50]}` without a gloss in （）")
        if re.search(r"(?<!環境)変数`", text):
            found.append(f"変数`…` rather than 環境変数`…`: {text[:60]}")
    return found


def page_of(catalog):
    """The catalog's messages in page order, each with its kind (from the English source's line)."""
    source = {}
    units = []
    for entry in polib.pofile(str(catalog)):
        if not entry.msgstr or not entry.occurrences:
            continue
        path, line = min(entry.occurrences, key=lambda o: int(o[1] or 0))
        lines = source.setdefault(path, (SOURCE / path.split("source/", 1)[1]).read_text("utf-8"))
        starts = {ln.lstrip()[:1] for ln in lines.splitlines() if entry.msgid in ln}
        kind = "heading" if "#" in starts else "cell" if "|" in starts else "text"
        units.append((int(line or 0), kind, entry.msgstr))
    return [(kind, text) for _, kind, text in sorted(units, key=lambda u: u[0])]


@pytest.mark.parametrize("catalog", PAGES, ids=rel)
def test_ja_page_follows_the_glossary_s_page_rules(catalog):
    found = problems(page_of(catalog))
    assert found == [], f"{rel(catalog)}: " + "; ".join(found)


def test_ja_page_rules_catch_a_planted_slip():
    page = [
        ("heading", "再投入"),
        ("text", "スケジューラが再投入されたジョブを開始します。"),
        ("text", "ジョブスケジューラは`No space left on device`を出す。"),
        ("text", "変数`ARGS`を読む。"),
        ("cell", "`Disk quota exceeded`"),
    ]
    assert problems(page) == [
        "first 再投入 without （requeue）: スケジューラが再投入されたジョブを開始します。",
        "the first mention is スケジューラ, not ジョブスケジューラ",
        "ジョブスケジューラ after the first mention (スケジューラ)",
        "`No space left on device` without a gloss in （）",
        "変数`…` rather than 環境変数`…`: 変数`ARGS`を読む。",
    ]
    good = [("text", "ジョブスケジューラが再投入（requeue）し、`Disk quota exceeded`（超過）。")]
    assert problems(good) == []
