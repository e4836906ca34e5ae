"""Drop obsolete (#~) entries that `sphinx-intl update` keeps, so catalogs match the English,
and the python-format flags that Babel guesses from a "%" in prose ("100 % does" reads as the
directive "% d"): the pages' messages are never format strings, and with the flag msgfmt
--check rejects a translation that writes "100%" its own way.

python tests/tools/clean_catalogs.py locale
"""

import sys
from pathlib import Path

import polib


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for root in argv or ["locale"]:
        for path in sorted(Path(root).glob("*/LC_MESSAGES/**/*.po")):
            catalog = polib.pofile(str(path), wrapwidth=0)
            obsolete = catalog.obsolete_entries()
            for entry in obsolete:
                catalog.remove(entry)
            flagged = [e for e in catalog if {"python-format", "no-python-format"} & set(e.flags)]
            for entry in flagged:
                entry.flags = [f for f in entry.flags if not f.endswith("python-format")]
            if obsolete or flagged:
                catalog.save()
                print(f"{path}: removed {len(obsolete)} obsolete messages, "
                      f"{len(flagged)} python-format flags")  # fmt: skip


if __name__ == "__main__":
    main()
