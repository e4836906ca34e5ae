"""Words readers type into the search box, indexed on the pages that answer them.

Readers search with the words they know: the English term in a translated site
("checkpoint", "DDP"), or another common word for a concept than the one the page uses
("point de contrôle" for « point de reprise »; 分布式 for 分布式数据并行).
locale/<lang>/search-terms.toml lists them per page; each becomes an index entry of that
page in that language only, which Sphinx's search matches (as a phrase: the query must be
at least half of the entry) and the general index lists.
"""

import tomllib
from pathlib import Path

from sphinx import addnodes
from sphinx.errors import ExtensionError


def terms_file(app):
    return Path(app.confdir, "locale", app.config.language, "search-terms.toml")


def load_terms(path):
    """{docname: [term, ...]} from a search-terms.toml."""
    if not path.is_file():
        return {}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return {doc: list(terms) for doc, terms in data.get("pages", {}).items()}


def _check(app, env, *args):
    terms = load_terms(terms_file(app))
    unknown = sorted(set(terms) - set(env.found_docs))
    if unknown:
        raise ExtensionError(f"{terms_file(app)} names pages that do not exist: {unknown}")


def _add_index_entries(app, doctree):
    if app.builder.name == "gettext":  # the terms are per language, not page text to translate
        return
    path = terms_file(app)
    if path.is_file():
        app.env.note_dependency(str(path))  # an edited list rebuilds the pages
    terms = load_terms(path).get(app.env.docname)
    if terms:
        entries = [("single", term, "", "", None) for term in terms]
        doctree.append(addnodes.index(entries=entries, inline=False))


def setup(app):
    app.connect("doctree-read", _add_index_entries)
    app.connect("env-updated", _check)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
