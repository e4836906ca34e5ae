"""The interface strings of the site's own extensions (source/_ext/*.py), from their _() calls.

Their translations live in locale/<lang>/LC_MESSAGES/sphinx.po, the catalog that Sphinx reads
for interface strings besides the pages' catalogs. tests/test_translations.py checks it.

python tests/tools/interface_strings.py      # prints the msgids
"""

import ast
import sys
from pathlib import Path

EXT = Path(__file__).resolve().parents[2] / "source" / "_ext"


def msgids(folder=EXT):
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "_"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.append(node.args[0].value)
    return sorted(set(found))


if __name__ == "__main__":
    sys.stdout.write("".join(f"{m}\n" for m in msgids()))
