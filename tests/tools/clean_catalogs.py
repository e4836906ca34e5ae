"""Drop obsolete (#~) entries that `sphinx-intl update` keeps, so catalogs match the English.

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
            if obsolete:
                for entry in obsolete:
                    catalog.remove(entry)
                catalog.save()
                print(f"{path}: removed {len(obsolete)} obsolete messages")


if __name__ == "__main__":
    main()
