"""The site's interface strings: everything outside the page text that a reader sees or hears.

- the site's own extensions (source/_ext/*.py): their _() calls and ngettext() calls;
- the site's templates (source/_templates/*.html) and the theme's templates the site does not
  override (furo's, from the installed package): _() and {% trans %}, as Jinja extracts them.

Their translations live in locale/<lang>/LC_MESSAGES/sphinx.po, the catalog that Sphinx reads
for interface strings before its own. tests/test_translations.py checks it.

python tests/tools/interface_strings.py            # prints the msgids
python tests/tools/interface_strings.py --update   # adds new strings to sphinx.po, drops old ones
"""

import ast
import sys
from pathlib import Path

import furo
import polib
from jinja2.ext import babel_extract

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "source" / "_ext"
TEMPLATES = ROOT / "source" / "_templates"
LOCALE = ROOT / "locale"


def _from_python(folder):
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            literals = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if name == "_" and isinstance(node.args[0], ast.Constant):
                yield literals[0], None
            elif name == "ngettext" and len(literals) >= 2:
                yield literals[0], literals[1]


def _from_templates(folder, skip=()):
    for path in sorted(folder.rglob("*.html")):
        if path.relative_to(folder).as_posix() in skip:
            continue
        with path.open("rb") as handle:
            for _line, _func, message, _comments in babel_extract(
                handle, ("_", "gettext", "ngettext"), [], {"extensions": "jinja2.ext.i18n"}
            ):
                if isinstance(message, str):
                    yield message, None
                elif message:
                    yield message[0], message[1] if len(message) > 1 else None


def theme_folder():
    return Path(furo.__file__).parent / "theme" / "furo"


def entries():
    """{msgid: msgid_plural or None} for every interface string."""
    ours = {p.relative_to(TEMPLATES).as_posix() for p in TEMPLATES.rglob("*.html")}
    found = {}
    for msgid, plural in [
        *_from_python(EXT),
        *_from_templates(TEMPLATES),
        *_from_templates(theme_folder(), skip=ours),
    ]:
        found.setdefault(msgid, plural)
    return found


def msgids():
    return sorted(entries())


def update(languages):
    wanted = entries()
    for lang in languages:
        path = LOCALE / lang / "LC_MESSAGES" / "sphinx.po"
        catalog = polib.pofile(str(path), wrapwidth=0)
        have = {e.msgid: e for e in catalog}
        for entry in list(catalog):
            if entry.msgid not in wanted:
                catalog.remove(entry)
        for msgid, plural in sorted(wanted.items()):
            if msgid in have:
                continue
            if plural:
                catalog.append(
                    polib.POEntry(msgid=msgid, msgid_plural=plural, msgstr_plural={0: ""})
                )
            else:
                catalog.append(polib.POEntry(msgid=msgid, msgstr=""))
        catalog.sort(key=lambda e: e.msgid)
        catalog.save(str(path))


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update(p.name for p in sorted(LOCALE.iterdir()) if (p / "LC_MESSAGES").is_dir())
    else:
        sys.stdout.write("".join(f"{m}\n" for m in msgids()))
