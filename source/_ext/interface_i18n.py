"""The site's interface in the page's language, where the theme and the extensions leave English.

- Long names in the sidebars and headings wrap between their parts.
- Sidebar captions get the heading level that their role="heading" needs (axe:
  aria-required-attr), and code blocks that scroll can be reached with the keyboard (axe:
  scrollable-region-focusable), and so can tables that scroll sideways.
- sphinx-copybutton knows no Japanese and types its strings into copybutton.js; Sphinx's own
  Japanese catalog leaves the search summary empty in translations.js. After the build, both
  files get this site's translations, from locale/<lang>/LC_MESSAGES/sphinx.po like every other
  interface string (python tests/tools/interface_strings.py lists them).
"""

import json
import re
from pathlib import Path

from sphinx.errors import ExtensionError
from sphinx.locale import _

# The key of the search summary in translations.js: its singular message.
SEARCH_SUMMARY = "Search finished, found one page matching the search query."


def copy_messages():
    """sphinx-copybutton's four strings, in the language being built."""
    return {
        "copy": _("Copy"),
        "copy_to_clipboard": _("Copy to clipboard"),
        "copy_success": _("Copied!"),
        "copy_failure": _("Failed to copy"),
    }


def search_summary_forms(app, count):
    """The search summary's `count` plural forms (as many as Sphinx's catalog has), from this
    site's catalog: the first for one page, the others for several."""

    def summary(n):
        return app.translator.ngettext(
            "Search finished, found one page matching the search query.",
            "Search finished, found ${resultCount} pages matching the search query.",
            n,
        )

    return [summary(1)] + [summary(2)] * (count - 1)


def _break_names(html):
    """Let long names wrap between their parts, not anywhere inside them, in the narrow
    sidebars and in headings on a phone: <wbr> between the words of a CamelCase name
    (DistributedDataParallel) and after the dots of a dotted one (torch.distributed.checkpoint)."""

    def name(match):
        word = re.sub(r"(?<=[a-z])(?=[A-Z][a-z])", "<wbr>", match.group(0))
        return re.sub(r"(?<=\w)\.(?=\w)", ".<wbr>", word)

    def text(match):
        return re.sub(r"[\w.]{14,}", name, match.group(0))

    return re.sub(r"(?<=>)[^<>]+(?=<)", text, html)


def _accessible_html(app, pagename, templatename, context, doctree):
    caption = '<p class="caption" role="heading">'
    level = '<p class="caption" role="heading" aria-level="2">'
    nav = context.get("furo_navigation_tree")
    if nav:
        context["furo_navigation_tree"] = _break_names(nav.replace(caption, level))
    if context.get("toc"):
        context["toc"] = _break_names(context["toc"])
    # The footer's copyright holder, in the page's language (conf.py's is English).
    year = context.get("copyright", "").split(",")[0]
    context["copyright"] = _("{year}, the {project} contributors").format(
        year=year, project=app.config.project
    )
    body = context.get("body")
    if body:
        body = body.replace("<pre>", '<pre tabindex="0">').replace(caption, level)
        headings = r"<h([12])\b[^>]*>.*?</h\1>"  # translated ones have class="translated"
        body = re.sub(headings, lambda m: _break_names(m.group(0)), body, flags=re.S)
        wrapper = '<div class="table-wrapper'
        context["body"] = body.replace(wrapper, '<div tabindex="0" class="table-wrapper')


def _patch_static(app, exception):
    if exception or app.builder.format != "html" or app.config.language == "en":
        return
    static = Path(app.outdir, "_static")
    lang = app.config.language.replace("_", "-")

    copybutton = static / "copybutton.js"
    text = copybutton.read_text(encoding="utf-8")
    end = re.search(r"\n}\n+let locale = ", text)
    if not text.startswith("// Localization support\nconst messages = {") or not end:
        raise ExtensionError("interface_i18n: copybutton.js changed; update _patch_static")
    entry = f",\n  {json.dumps(lang)}: {json.dumps(copy_messages(), ensure_ascii=False)}"
    copybutton.write_text(text[: end.start()] + entry + text[end.start() :], encoding="utf-8")

    translations = static / "translations.js"
    text = translations.read_text(encoding="utf-8")
    match = re.search(r"Documentation\.addTranslations\((\{.*\})\);", text, re.S)
    if not match:
        raise ExtensionError("interface_i18n: translations.js changed; update _patch_static")
    data = json.loads(match.group(1))
    forms = data["messages"].get(SEARCH_SUMMARY)
    count = len(forms) if isinstance(forms, list) and forms else 1
    data["messages"][SEARCH_SUMMARY] = search_summary_forms(app, count)
    new = f"Documentation.addTranslations({json.dumps(data, ensure_ascii=False)});"
    translations.write_text(text[: match.start()] + new + text[match.end() :], encoding="utf-8")


def setup(app):
    # After furo's own html-page-context handler (priority 500), which builds the sidebar.
    app.connect("html-page-context", _accessible_html, priority=900)
    app.connect("build-finished", _patch_static)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
