"""Sphinx configuration for PyTorch on HPC, shared by all four languages.

English pages live in source/; translations are gettext catalogs in locale/<lang>/LC_MESSAGES/.
Build one language with `make html SPHINXOPTS=-Dlanguage=fr`, all of them with `make html-all`.
"""

import logging
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "source" / "_ext"))  # the site's own extensions
VERSIONS = tomllib.loads((ROOT / "versions.toml").read_text(encoding="utf-8"))

project = "PyTorch on HPC"
author = "the PyTorch on HPC contributors"
copyright = "2026, " + author  # noqa: A001 (Sphinx's name)

# Languages of the site, in the order the switcher shows them.
LANGUAGES = {"en": "English", "zh_CN": "简体中文", "ja": "日本語", "fr": "Français"}
HREFLANG = {"en": "en", "zh_CN": "zh-CN", "ja": "ja", "fr": "fr"}
language = "en"

extensions = [
    "myst_parser",
    "sphinx_tabs.tabs",
    "sphinx_copybutton",
    "benchmark_results",  # the benchmark page's table and charts, from the committed CSVs
    "site_edition",  # a centre's edition: its job scripts from its site file (make html SITE=...)
    "verification",  # stamps from tests/records/, a download link under every included script
    "interface_i18n",  # the theme's and copybutton's strings in the page's language, accessibility
    "search_terms",  # readers' words for each page (locale/<lang>/search-terms.toml), indexed
]
# The repository whose examples/ folder the pages link to (verification.py).
repository_url = os.environ.get(
    "REPOSITORY_URL", "https://github.com/pytorch-on-hpc/pytorch-on-hpc"
)
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_root", "_templates", "_static", "_ext"]
templates_path = ["source/_templates"]
html_static_path = ["source/_static"]
nitpicky = True

# MyST: ::: fences (tabs stay separate messages in the catalogs), substitutions for versions.
myst_enable_extensions = ["colon_fence", "substitution", "deflist"]
myst_heading_anchors = 3
myst_substitutions = {
    "torch_version": VERSIONS["cpu"]["torch"],
}

# Translations: absolute path (Sphinx resolves relative ones from source/, sphinx-intl from
# here), one catalog per page, stable message ids.
locale_dirs = [str(ROOT / "locale")]
gettext_compact = False
gettext_uuid = False
gettext_additional_targets = ["index"]
translation_progress_classes = True

# HTML: furo, whose English interface strings (and those of source/_templates/page.html, a copy of
# furo's with every string translatable) are translated in locale/<lang>/LC_MESSAGES/sphinx.po.
html_theme = "furo"
html_title = project
html_show_sourcelink = False
html_copy_source = False
html_css_files = ["custom.css"]
html_sidebars = {
    "**": [
        "sidebar/brand.html",
        "language-switcher.html",
        "sidebar/search.html",
        "sidebar/scroll-start.html",
        "sidebar/navigation.html",
        "sidebar/scroll-end.html",
    ]
}
# Where the site is published (https://.../, the folder that holds en/, zh_CN/, ...). With it,
# every page gets a canonical link and absolute hreflang links (search engines need both);
# without it (a local build), the links are relative. The language folder is added in _site_url.
SITE_URL = os.environ.get("SITE_URL", "").rstrip("/")
html_baseurl = ""

# Copy buttons leave out prompts ($, (venv) $, [user@login ~]$, >>>) and output lines.
# copybutton wraps this in ^(...)(.*), so the groups inside must not capture.
copybutton_prompt_text = r"(?:\(\S+\) )?(?:\$ |\[[^\]]+\][$#] )|>>> |\.\.\. "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True
copybutton_remove_prompts = True

# A click on the open tab must not close it and hide the job script.
sphinx_tabs_disable_tab_closing = True

# Chinese search: Sphinx 9.0.x writes `window.Stemmer = ChineseStemmer` into language_data.js,
# a name it never defines, so search fails in the browser (sphinx-doc/sphinx#14229, fixed after
# 9.0). Chinese has no stemming anyway; use the English stemmer name that Sphinx does ship.
try:
    import jieba
    import sphinx.search.zh

    jieba.setLogLevel(logging.WARNING)
    sphinx.search.zh.SearchChinese.language_name = "English"
except ImportError:  # jieba is in requirements.txt; without it Sphinx falls back to bigrams
    pass


def _site_url(app, config):
    """The canonical address of a page is in its language's folder of SITE_URL."""
    if SITE_URL:
        config.html_baseurl = f"{SITE_URL}/{config.language}/"


def _language_links(app, pagename, templatename, context, doctree):
    """Give every page links to itself in each language, and hreflang alternates (English is
    also the x-default). The switcher's script (language-switcher.html) keeps the section."""
    current = app.config.language
    up = "../" * (pagename.count("/") + 1)
    base = f"{SITE_URL}/" if SITE_URL else up
    links = []
    for lang, name in LANGUAGES.items():
        href = f"{base}{lang}/{pagename}.html"
        links.append({"lang": lang, "name": name, "href": href, "current": lang == current})
    context["language_links"] = links
    alternates = [(HREFLANG[link["lang"]], link["href"]) for link in links]
    alternates.append(("x-default", links[0]["href"]))
    context["metatags"] = context.get("metatags", "") + "".join(
        f'<link rel="alternate" hreflang="{lang}" href="{href}" />\n' for lang, href in alternates
    )


def setup(app):
    app.connect("config-inited", _site_url)
    app.connect("html-page-context", _language_links)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
