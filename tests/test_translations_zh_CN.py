"""zh_CN rules of locale/zh_CN/GLOSSARY.md that a row of its Preferred forms table cannot state."""

import re

from test_translations import polib, rel

from conftest import LOCALE, SOURCE

ZH_CATALOGS = sorted((LOCALE / "zh_CN" / "LC_MESSAGES").rglob("*.po"))
CJK = "[\u4e00-\u9fff]"
# Glossed at the first use on each page (titles aside, table cells included).
FIRST_USE_GLOSSES = [
    "资源块（chunk）",
    "作业数组（job array）",
    "traceback（调用栈）",
    "回环地址（loopback）",
]


def prose(text):
    return re.sub(r"`[^`]*`", "``", text)


def is_heading(entry):
    """Whether the message is a page or section title in its English source."""
    for path, line in entry.occurrences:
        source = SOURCE / path.split("source/", 1)[-1]
        if source.is_file() and line:
            return source.read_text(encoding="utf-8").splitlines()[int(line) - 1].startswith("#")
    return False


def slips(path):
    """(message, slip) for each rule that a catalog breaks."""
    found = []
    seen = set()
    for entry in polib.pofile(str(path)):
        if not entry.msgid:
            continue
        text = entry.msgstr
        if re.search(r"`,\s*`", text):
            found.append((entry.msgid, "half-width comma between code spans: use 、"))
        if re.search(rf"参见 \[{CJK}", text):
            found.append((entry.msgid, "no space after 参见 before Chinese link text"))
        if is_heading(entry):
            continue
        for gloss in FIRST_USE_GLOSSES:
            term = gloss.split("（")[0]
            if term in prose(text) and term not in seen:
                seen.add(term)
                if not prose(text).split(term, 1)[1].startswith(gloss[len(term) :]):
                    found.append(
                        (entry.msgid, f"first {term} of the page needs its gloss: {gloss}")
                    )
    return found


def test_zh_cn_catalogs_follow_the_glossary_s_rules():
    found = [(rel(path), msgid[:60], slip) for path in ZH_CATALOGS for msgid, slip in slips(path)]
    assert found == [], "\n".join(map(str, found))


def test_zh_cn_rules_catch_planted_slips(tmp_path):
    catalog = tmp_path / "page.po"
    catalog.write_text(
        'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        'msgid "a"\nmsgstr "`--nodes`, `--mem`"\n\n'
        'msgid "b"\nmsgstr "详情参见 [本指南的测试方式](testing.md)。"\n\n'
        'msgid "c"\nmsgstr "每个节点一个资源块"\n\n'
        'msgid "d"\nmsgstr "资源块（chunk）；作业数组（job array）；`traceback`"\n',
        encoding="utf-8",
    )
    assert [msgid for msgid, _ in slips(catalog)] == ["a", "b", "c"]
