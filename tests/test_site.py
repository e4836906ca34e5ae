"""The built site, in all four languages: strict builds, switcher, tabs, search, copy, links."""

import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

# polib comes with the venv; a GPU machine running only `make test-gpu` may lack it.
polib = pytest.importorskip("polib", reason="polib is in requirements.txt: run make venv")

from conftest import (  # noqa: E402
    LANGUAGES,
    ROOT,
    SOURCE,
    TESTS,
    TRANSLATIONS,
    require_command,
    selected,
)

sys.path.insert(0, str(TESTS / "tools"))
import site_build  # noqa: E402 (tests/tools/site_build.py: make html-all builds with it too)

PAGES = sorted(str(p.relative_to(SOURCE).with_suffix("")) for p in SOURCE.rglob("*.md"))
# Tab labels that are names, the same in every language. Any other label must be translated.
NEUTRAL_TAB_LABELS = {"Slurm", "Grid Engine", "PBS", "venv", "conda", "Apptainer", "Lmod"}
# A word from the install page in each language, as a reader would type it into the search box.
SEARCH_WORDS = {"en": "wheelhouse", "zh_CN": "容器", "ja": "コンテナ", "fr": "conteneur"}


class Page(HTMLParser):
    """The parts of a built page the tests look at."""

    def __init__(self, path):
        super().__init__()
        self.lang, self.alternates, self.switcher, self.tabs = None, {}, [], []
        self.classes, self.placeholders, self._in = [], [], None
        self.text = path.read_text(encoding="utf-8")
        self.feed(self.text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.classes.extend((attrs.get("class") or "").split())
        if tag == "html":
            self.lang = attrs.get("lang")
        if tag == "link" and attrs.get("rel") == "alternate" and "hreflang" in attrs:
            self.alternates[attrs["hreflang"]] = attrs["href"]
        if tag == "nav" and "language-switcher" in (attrs.get("class") or ""):
            self._in = "switcher"
        if tag == "a" and self._in == "switcher":
            self.switcher.append(attrs)
        if tag == "button" and "sphinx-tabs-tab" in (attrs.get("class") or ""):
            self._in = "tab"
            self.tabs.append("")
        if tag == "input" and attrs.get("placeholder"):
            self.placeholders.append(attrs["placeholder"])

    def handle_endtag(self, tag):
        if (tag == "nav" and self._in == "switcher") or (tag == "button" and self._in == "tab"):
            self._in = None

    def handle_data(self, data):
        if self._in == "tab":
            self.tabs[-1] += data.strip()


# Tests that look at one language's pages only; every other test of a page (its switcher, its
# alternates) needs the other languages built too.
ONE_LANGUAGE = {"test_language_builds_strict_and_clean", "test_page_shows_a_stamp_from_the_records",
                "test_every_included_example_can_be_downloaded"}  # fmt: skip


def built(selection):
    """The languages the selected tests of the site need (selection: their names and
    parameters): all four, unless every one looks at its own language only (make test-changed
    after a change to an example: its pages in English)."""
    if not all(name in ONE_LANGUAGE and "lang" in params for name, params in selection):
        return LANGUAGES
    langs = {params["lang"] for _, params in selection}
    return [lang for lang in LANGUAGES if lang in langs]


@pytest.fixture(scope="module")
def site(tmp_path_factory, request):
    """The languages (built()) built fresh and strict (-E -W --keep-going), as make html-all
    does, and with the same tool: a build of the same content (by make html-all before, or by
    an earlier test run) is taken from the cache instead of being made again."""
    out = tmp_path_factory.mktemp("html")
    builds = {}
    for lang, (folder, result) in site_build.build_all(
        built(selected(request, fixture="site"))
    ).items():
        builds[lang] = result
        if folder is not None:
            shutil.copytree(folder, out / lang)
    shutil.copy(SOURCE / "_root" / "index.html", out / "index.html")
    return out, builds


@pytest.mark.parametrize("lang", LANGUAGES)
def test_language_builds_strict_and_clean(site, lang, record_property):
    result = site[1][lang]
    assert result["returncode"] == 0 and "WARNING" not in result["stderr"], (
        result["stdout"][-3000:] + result["stderr"]
    )
    how = "reused from the cache" if result["reused"] else "fresh, -W"
    record_property("timing", f"site build, {lang} ({how}): {result['seconds']:.1f} s")


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_page_has_switcher_alternates_and_versions(site, lang, page):
    out, _ = site
    html = Page(out / lang / f"{page}.html")
    assert html.lang == lang.replace("_", "-")
    assert [a["hreflang"] for a in html.switcher] == ["en", "zh-CN", "ja", "fr"]
    for link in html.switcher:
        target = (out / lang / page).parent / link["href"]
        assert (
            target.resolve()
            == (out / link["hreflang"].replace("-", "_") / f"{page}.html").resolve()
        )
        assert target.is_file(), link["href"]
    assert [a.get("aria-current") for a in html.switcher].count("page") == 1
    assert set(html.alternates) == {"en", "zh-CN", "ja", "fr", "x-default"}
    assert html.alternates["x-default"] == html.alternates["en"]


def stamp_of(text):
    """The text of the verification stamp under a page's title (source/_ext/verification.py)."""
    found = re.findall(r'<p class="verification-stamp[^"]*">(.*?)</p>', text, re.S)
    assert len(found) == 1, "one stamp per page"
    assert text.index("</h1>") < text.index('class="verification-stamp'), "under the title"
    return re.sub(r"<[^>]+>", "", found[0])


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_page_shows_a_stamp_from_the_records(site, lang, page):
    """The stamp's versions come from the records the build read, never from a typed line;
    a translated page shows it in its language."""
    out, _ = site
    stamp = stamp_of((out / lang / f"{page}.html").read_text(encoding="utf-8"))
    records = json.loads((TESTS / "records" / "cpu.json").read_text(encoding="utf-8"))
    torch_versions = {e["torch"].split("+")[0] for e in records["examples"].values()}
    assert any(f"torch {v}" in stamp for v in torch_versions) or "not tested" in stamp, stamp
    assert "GPU" in stamp
    if lang != "en":
        english = stamp_of((out / "en" / f"{page}.html").read_text(encoding="utf-8"))
        lead = stamp.split(":")[0].split("：")[0]
        assert lead != english.split(":")[0], f"stamp in English: {stamp}"
    if lang in ("zh_CN", "ja"):  # the language's spacing and brackets, not English ones
        assert "： " not in stamp and " (" not in stamp and stamp.strip().endswith("）"), stamp
    assert "Verified with" not in (out / lang / f"{page}.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_every_included_example_can_be_downloaded(site, lang, page):
    """Under every block included from examples/: its file, a download link to the whole file
    (which the build copied) and a link to its folder in the repository."""
    out, _ = site
    text = (out / lang / f"{page}.html").read_text(encoding="utf-8")
    includes = re.findall(
        r"^\s*`{3,}\{literalinclude\} \.\./\.\./examples/(\S+)",
        (SOURCE / f"{page}.md").read_text(encoding="utf-8"), re.M,
    )  # fmt: skip
    lines = re.findall(r'<p class="example-source">(.*?)</p>', text, re.S)
    assert len(lines) == len(includes)
    for name, line in zip(includes, lines, strict=True):
        assert f'<span class="pre">{name}</span>' in line, (name, line)
        download = re.search(r'class="reference download internal"[^>]*href="([^"]+)"', line)
        assert download and download[1].endswith("/" + name.split("/")[-1]), line
        target = (out / lang / page).parent / download[1]
        assert target.read_bytes() == (ROOT / "examples" / name).read_bytes()
        assert f"/tree/main/examples/{name.split('/')[0]}" in line


@pytest.mark.parametrize("lang", TRANSLATIONS)
@pytest.mark.parametrize("page", PAGES)
def test_translated_page_shows_no_english(site, lang, page):
    out, _ = site
    html = Page(out / lang / f"{page}.html")
    english = Page(out / "en" / f"{page}.html")
    assert "untranslated" not in html.classes, "a paragraph fell back to English"
    assert html.classes.count("translated") > 0, "the catalog was not applied"
    for label in html.tabs:
        assert label in NEUTRAL_TAB_LABELS or label not in english.tabs, (
            f"English tab label {label!r}"
        )
    # The theme's strings: every visible interface string is checked in the browser
    # (test_browser_interface_is_in_the_page_language); here, the served HTML.
    assert html.placeholders and html.placeholders != english.placeholders, (
        "theme strings in English"
    )


@pytest.mark.parametrize("lang", LANGUAGES)
def test_search_finds_the_install_page(site, lang):
    require_command("node", "run `make system-packages` as root (apt-get install nodejs)")
    out, _ = site
    word = SEARCH_WORDS[lang]
    proc = subprocess.run(
        ["node", TESTS / "node" / "search.mjs", out / lang, word],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "getting-started/install" in json.loads(proc.stdout), f"{word!r} found {proc.stdout}"


def test_copy_button_leaves_out_prompts_and_output(site):
    require_command("node", "run `make system-packages` as root (apt-get install nodejs)")
    out, _ = site
    blocks = [
        "[user@login ~]$ sbatch check_pytorch.sbatch\nSubmitted batch job 123456\n"
        "[user@login ~]$ squeue --me",
        "(pytorch) [user@gpu-node ~]$ python check_pytorch.py --device cuda",
        "$ module avail pytorch",
        ">>> import torch\n>>> torch.cuda.is_available()\nTrue",
        "#!/bin/bash\n# a script: copied whole\nset -euo pipefail",
    ]
    proc = subprocess.run(
        ["node", TESTS / "node" / "copy.mjs", out / "en"],
        input=json.dumps(blocks), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [
        "sbatch check_pytorch.sbatch\nsqueue --me",
        "python check_pytorch.py --device cuda",
        "module avail pytorch",
        "import torch\ntorch.cuda.is_available()",
        blocks[4],
    ]


def test_every_internal_link_resolves(site):
    out, _ = site
    proc = subprocess.run(
        [sys.executable, TESTS / "tools" / "check_links.py", out],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout


def test_link_checker_reports_a_broken_link(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html">b</a> <a href="a.html#nowhere">x</a>')
    proc = subprocess.run(
        [sys.executable, TESTS / "tools" / "check_links.py", tmp_path],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "a.html: b.html" in proc.stdout and "#nowhere" in proc.stdout


def test_root_page_sends_readers_to_each_language(site):
    out, _ = site
    text = (out / "index.html").read_text(encoding="utf-8")
    for lang in LANGUAGES:
        assert f'href="{lang}/index.html"' in text and (out / lang / "index.html").is_file()
    assert re.search(r"navigator\.languages", text)


@pytest.mark.parametrize("lang", LANGUAGES)
def test_benchmark_page_renders_the_csv_files(site, lang):
    out, _ = site
    text = (out / lang / "performance" / "gpu-benchmark.html").read_text(encoding="utf-8")
    table = re.search(r'<table class="[^"]*benchmark-table.*?</table>', text, re.S)
    assert table, "no benchmark table"
    rows = re.findall(r"<tr[ >]", table[0])
    # The heading, the four source rows (two GPUs, two modes) and two modes per measured device.
    assert len(rows) == 1 + 4 + 2, table[0]
    assert ">188<" in table[0] and ">AMD EPYC" in table[0]
    assert text.count('<svg class="benchmark-chart"') == 2
    # Numbers and the CPU's core count in the page's language: 5 181 in French, 2コア in Japanese.
    figures = re.findall(r"<td><p>([\d,\u202f]+)</p></td>", table[0])
    big = [f for f in figures if len(f) > 3]
    assert big, figures
    if lang == "fr":
        assert all("," not in f and "\u202f" in f for f in big), big
    else:
        assert all("," in f for f in big), big
    cores = {"en": "(2 cores)", "zh_CN": "（2 核）", "ja": "（2コア）", "fr": "(2\u00a0cœurs)"}[
        lang
    ]
    assert cores in table[0] and text.count(cores) >= 3  # the table and both charts


def test_page_template_is_a_copy_of_the_pinned_furo():
    """source/_templates/page.html copies furo's page.html: it names the furo version it was
    copied from, which must be the one requirements.txt pins and the venv has (after an
    upgrade, copy the new page.html and route its strings through _() again)."""
    copied = re.search(
        r"furo (\S+)'s page\.html", (SOURCE / "_templates" / "page.html").read_text()
    )
    pinned = re.search(r"^furo==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert copied and pinned and copied[1] == pinned[1] == importlib.metadata.version("furo")


def test_site_url_gives_absolute_alternates_and_a_canonical_link(tmp_path):
    """With SITE_URL (where the site is published), every page's hreflang links are absolute,
    English is the x-default and the page names its canonical address; without it, relative."""
    env = {**os.environ, "SITE_URL": "https://guide.example.org/pytorch/"}
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "-j", "auto", "-c", ROOT,
         "-Dlanguage=fr", SOURCE, tmp_path],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    html = Page(tmp_path / "distributed" / "ddp.html")
    base = "https://guide.example.org/pytorch"
    assert html.alternates == {
        "en": f"{base}/en/distributed/ddp.html", "zh-CN": f"{base}/zh_CN/distributed/ddp.html",
        "ja": f"{base}/ja/distributed/ddp.html", "fr": f"{base}/fr/distributed/ddp.html",
        "x-default": f"{base}/en/distributed/ddp.html",
    }  # fmt: skip
    assert f'<link rel="canonical" href="{base}/fr/distributed/ddp.html">' in html.text


# ---------------------------------------------------------------------------------------------
# The site in a real browser: Debian's Chromium, headless, driven by tests/node/browser.mjs
# (playwright-core, axe-core) over the site served on 127.0.0.1, every page in every language.

# The ten main topics, and the words a reader of each language types to find them (the English
# term too, on translated pages). locale/<lang>/search-terms.toml indexes the words a page
# does not use itself.
TOPIC_SEARCHES = {  # page: (en, zh_CN, ja, fr)
    "getting-started/install": ("install", "安装", "インストール", "installation"),
    "getting-started/first-job": ("batch job", "提交作业", "ジョブ投入", "soumettre un job"),
    "performance/precision": ("mixed precision", "混合精度", "混合精度", "précision mixte"),
    "distributed/ddp": ("DDP", "分布式", "分散", "entraînement distribué"),
    "distributed/lightning": ("Lightning", "Lightning", "Lightning", "Lightning"),
    "distributed/deepspeed": ("ZeRO", "DeepSpeed", "DeepSpeed", "DeepSpeed"),
    "distributed/fsdp": ("FSDP", "全分片", "シャーディング", "partitionnement"),
    "reliability/checkpointing": ("checkpoint", "检查点", "チェックポイント", "point de contrôle"),
    "reliability/preemption": ("preemption", "抢占", "プリエンプション", "préemption"),
    "reliability/troubleshooting": (
        "out of memory",
        "显存不足",
        "メモリ不足",
        "mémoire insuffisante",
    ),
}
ENGLISH_TERMS = {"reliability/checkpointing": "checkpoint", "distributed/ddp": "DDP",
                 "reliability/preemption": "preemption"}  # fmt: skip
# Strings that are the same in every language: names.
NAMES = {"PyTorch on HPC", "Sphinx", "Furo", *("English", "简体中文", "日本語", "Français")}


def searches(lang):
    column = LANGUAGES.index(lang)
    wanted = [(words[column], page) for page, words in TOPIC_SEARCHES.items()]
    if lang != "en":
        wanted += [(term, page) for page, term in ENGLISH_TERMS.items()]
    return wanted


# The fonts the browser tests assume, as fontconfig gives them to Chromium: Furo's font stack
# (Helvetica, Arial) resolves to Liberation Sans, Chinese and Japanese to Noto Sans CJK, and
# DejaVu Sans is the wide font of the word-break check (browser.mjs). Where lines break, and so
# the verdicts, depend on them. Pattern: the family fc-match must give, or begin with.
BROWSER_FONTS = {
    "Arial": "Liberation Sans",
    "Helvetica": "Liberation Sans",
    "sans-serif:lang=ja": "Noto Sans CJK",
    "sans-serif:lang=zh-cn": "Noto Sans CJK",
    "DejaVu Sans": "DejaVu Sans",
}


def _missing_fonts():
    """What fontconfig resolves differently from BROWSER_FONTS, one line; empty when none."""
    if shutil.which("fc-match") is None:
        return "fc-match (fontconfig) is not installed"
    wrong = []
    for pattern, family in BROWSER_FONTS.items():
        proc = subprocess.run(
            ["fc-match", "-f", "%{family[0]}", pattern], capture_output=True, text=True, check=False
        )
        if not proc.stdout.strip().startswith(family):
            wrong.append(f"{pattern} gives {proc.stdout.strip() or 'nothing'}, not {family}")
    return "; ".join(wrong)


def browsed(selection):
    """(languages, pages) the browser tests look at (selection: their names and parameters):
    every one in make test, the changed page's in make test-changed. English always:
    translated pages are compared with it."""
    langs = {"en"} | {params.get("lang", "en") for _, params in selection}
    pages = {params["page"] for _, params in selection if "page" in params}
    return [lang for lang in LANGUAGES if lang in langs], [page for page in PAGES if page in pages]


@pytest.fixture(scope="module")
def browser(site, request):
    """What Chromium saw, per language: the languages run side by side, each over the pages of
    the selected tests (browsed())."""
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed: run `make system-packages` as root")
    node_modules = TESTS / "node" / "node_modules"
    if not (node_modules / "playwright-core").is_dir() or not (node_modules / "axe-core").is_dir():
        pytest.skip("playwright-core and axe-core are not installed: run `make node-packages`")
    # Fail, not skip: with other fonts the tests would judge another page than a reader's.
    if missing := _missing_fonts():
        how = "run `make system-packages` as root"
        pytest.fail(f"the browser tests' fonts: {missing}; {how}", pytrace=False)
    out, _ = site
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", out],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    runs = {}
    try:
        port = re.search(r"port (\d+)", server.stdout.readline())[1]
        langs, pages = browsed(selected(request, fixture="browser"))
        for lang in langs:
            config = {
                "base": f"http://127.0.0.1:{port}", "lang": lang, "pages": pages,
                "searches": [query for query, _ in searches(lang)],
                "copyPage": "getting-started/install", "tabsPage": "getting-started/first-job",
                "sectionLink": ["distributed/ddp", "two-timeouts-start-up-and-collectives"],
                "redirects": lang == "en", "contrast": lang == "en",
            }  # fmt: skip
            runs[lang] = subprocess.Popen(
                ["node", TESTS / "node" / "browser.mjs", json.dumps(config)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        seen = {}
        for lang, run in runs.items():
            # A bound against a hang, not a verdict on speed: four Chromiums share the machine
            # with the other tests' workers, and a loaded machine took over 600 s (2026-12-07).
            stdout, stderr = run.communicate(timeout=1800)
            assert run.returncode == 0, stderr[-3000:]
            seen[lang] = json.loads(stdout)
        return seen
    finally:
        for run in runs.values():
            run.kill()
        server.terminate()
        server.wait()
        server.stdout.close()


def _page(seen, page):
    return next(p for p in seen["pages"] if p["page"] == page)


@functools.cache
def _same_in_catalogs(lang):
    """Strings the translators kept as they are (names such as Horovod, C++)."""
    same = set()
    for path in (ROOT / "locale" / lang / "LC_MESSAGES").rglob("*.po"):
        same |= {e.msgid for e in polib.pofile(str(path)) if e.msgstr == e.msgid}
    return same


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_browser_page_has_switcher_no_errors_and_fits_a_phone(browser, lang, page):
    seen = _page(browser[lang], page)
    assert seen["switcher"] == ["en", "zh-CN", "ja", "fr"]
    assert seen["errors"] == [], "JavaScript errors"
    assert seen["overflow"]["scroll"] <= 0, f"wider than a 390 px phone: {seen['overflow']}"


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_browser_headings_and_sidebars_break_lines_between_words(browser, lang, page):
    """At 1280 and 390 px: no word of a heading or a sidebar link is drawn across two lines
    (names wrap at the <wbr> the site puts between their parts; Japanese between phrases)."""
    assert _page(browser[lang], page)["broken"] == []


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_browser_phone_charts_legible_and_wide_content_scrolls_visibly(browser, lang, page):
    """At 390 px: chart text at least 7 px as drawn; a table, chart or code block wider than
    the screen scrolls by keyboard too, and tables and charts show a shadow where more is."""
    phone = _page(browser[lang], page)["phone"]
    assert all(size >= 7 for size in phone["chartText"]), phone["chartText"]
    if page == "performance/gpu-benchmark":
        assert len(phone["chartText"]) == 2
        assert any("table-wrapper" in s["what"] for s in phone["scrollers"]), "the table fits?"
    bad = [s for s in phone["scrollers"] if not (s["focusable"] and s["shadow"])]
    assert bad == []


@pytest.mark.parametrize("lang", LANGUAGES)
@pytest.mark.parametrize("page", PAGES)
def test_browser_axe_finds_nothing_critical_or_serious(browser, lang, page):
    """axe-core's rules, colour contrast on the English page only: the colours come from one
    stylesheet for all four languages (no rule of custom.css changes a colour by language)."""
    assert _page(browser[lang], page)["axe"] == []


@pytest.mark.parametrize("lang", TRANSLATIONS)
@pytest.mark.parametrize("page", PAGES)
def test_browser_interface_is_in_the_page_language(browser, lang, page):
    """Every visible text outside the page body, every accessible name and tooltip, at desktop
    and phone width: none may be the English page's string, unless it is a name."""
    english = _page(browser["en"], page)
    english = set(english["strings"]) | set(english["phoneStrings"])
    seen = _page(browser[lang], page)
    allowed = NAMES | _same_in_catalogs(lang)
    shown = {
        s for s in set(seen["strings"]) | set(seen["phoneStrings"]) if re.search(r"[^\W\d_]", s)
    }
    left = sorted(shown & english - allowed)
    assert left == [], f"English on the {lang} page: {left}"


@pytest.mark.parametrize("lang", LANGUAGES)
def test_browser_search_finds_each_topic_by_the_readers_words(browser, lang):
    results = {s["query"]: s for s in browser[lang]["searches"]}
    missed = [(q, page) for q, page in searches(lang) if page not in results[q]["pages"]]
    assert missed == [], f"not found: {missed}"
    english = {s["summary"] for s in browser["en"]["searches"]}
    for result in results.values():
        assert result["summary"], "the search summary is empty"
        if lang != "en":
            assert result["summary"] not in english, result["summary"]


@pytest.mark.parametrize("lang", LANGUAGES)
def test_browser_copy_button_copies_commands_without_prompts(browser, lang):
    copy = browser[lang]["copy"]
    commands = [
        re.sub(r"^\[[^\]]+\][$#] |^\$ ", "", line)
        for line in copy["shown"].splitlines()
        if re.match(r"^\[[^\]]+\][$#] |^\$ ", line)
    ]
    assert commands and copy["copied"].splitlines() == commands
    english = browser["en"]["copy"]
    if lang != "en":
        assert copy["tooltip"] != english["tooltip"] and copy["afterClick"] != english["afterClick"]


@pytest.mark.parametrize("lang", LANGUAGES)
def test_browser_open_tab_stays_open_and_others_switch(browser, lang):
    tabs = browser[lang]["tabs"]
    assert tabs["before"]["shown"][0] and tabs["againFirst"] == tabs["before"], (
        "a click on the open tab hid its panel"
    )
    assert tabs["second"]["shown"] == [False, True] + [False] * (len(tabs["second"]["shown"]) - 2)


@pytest.mark.parametrize("lang", LANGUAGES)
def test_browser_switcher_keeps_the_section(browser, lang):
    other = "fr" if lang == "en" else "en"
    assert browser[lang]["section"] == (
        f"/{other}/distributed/ddp.html#two-timeouts-start-up-and-collectives"
    )


def test_browser_root_page_follows_the_browser_language(browser):
    assert browser["en"]["redirects"] == {
        "zh-CN": "/zh_CN/index.html", "ja-JP": "/ja/index.html", "fr-FR": "/fr/index.html",
        "en-US": "/en/index.html", "de-DE": "/en/index.html",
    }  # fmt: skip


@pytest.mark.parametrize("lang", LANGUAGES)
def test_browser_nothing_leaves_the_machine(browser, lang):
    assert browser[lang]["outside"] == [], "requests to other hosts (the site must work offline)"


def test_no_colour_depends_on_the_language():
    """What lets the browser check colour contrast in English only: no rule of the site's
    stylesheets that selects by language sets a colour or a background."""
    for css in sorted((ROOT / "source" / "_static").glob("*.css")):
        text = re.sub(r"/\*.*?\*/", "", css.read_text(encoding="utf-8"), flags=re.S)
        for selector, body in re.findall(r"([^{}]*)\{([^{}]*)\}", text):
            if ":lang(" in selector or "[lang" in selector:
                assert not re.search(r"(^|[;\s])(color|background[\w-]*|opacity)\s*:", body), (
                    f"{css.name}: {selector.strip()} sets a colour: check contrast in all languages"
                )
