"""Recorded outputs: files in examples/ that the pages include to show what a script prints.

A test that runs the script passes what it printed to check_recorded(). Normally the committed
file must equal it, once both have had their volatile parts (addresses, timings, memory sizes,
job ids) replaced by the same placeholders: the page shows a real run, and a test fails when
the script prints something else. With RECORD_OUTPUTS=1 the test writes the file instead
(`RECORD_OUTPUTS=1 make test PYTEST_ARGS='-k ...'`), to record a new run after a change.
"""

import difflib
import os
import re

RECORD = os.environ.get("RECORD_OUTPUTS") == "1"

# Volatile parts common to most recordings: (pattern, placeholder), applied line by line.
ADDRESSES = (r"0x[0-9a-f]+", "0x…")


def normalise(text, volatile):
    for pattern, placeholder in volatile:
        text = re.sub(pattern, placeholder, text, flags=re.M)
    return text


def check_recorded(path, printed, volatile=()):
    """The committed recording at path shows what the script printed now (see the module)."""
    if not printed.endswith("\n"):
        printed += "\n"
    if RECORD:
        path.write_text(printed, encoding="utf-8")
        return
    assert path.is_file(), f"{path} is missing: run this test with RECORD_OUTPUTS=1"
    committed = normalise(path.read_text(encoding="utf-8"), volatile)
    now = normalise(printed, volatile)
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(True), now.splitlines(True), str(path), "printed now"
        )
    )
    assert committed == now, (
        f"{path.name} is not what the script prints now (re-record it with RECORD_OUTPUTS=1 "
        f"if the change is expected):\n{diff}"
    )


def transcript(*steps):
    """A shell session as a console block shows it: `$ command` then what it printed."""
    return "".join(f"$ {command}\n{output}" for command, output in steps)
