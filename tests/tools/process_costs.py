"""Where the test suite's CPU goes, by script: sums the log that tests/shim/sitecustomize.py
writes when TESTS_PROCESS_LOG names a file.

    TESTS_PROCESS_LOG=/tmp/processes.jsonl make test
    python tests/tools/process_costs.py /tmp/processes.jsonl

Prints, per script (the first .py of the command line, or the command), how many processes
ran it, how many imported torch, and their CPU seconds, the largest first. Only Python
processes that ran the shim and ended through Python's exit are counted: forked children that
end with os._exit are not.
"""

import collections
import json
import sys
from pathlib import Path


def script_of(argv):
    for arg in argv:
        if arg.endswith(".py"):
            return "/".join(Path(arg).parts[-2:])
    return " ".join(argv[:2]) or "python"


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: process_costs.py LOG")
    runs, imports, cpu = collections.Counter(), collections.Counter(), collections.Counter()
    with open(sys.argv[1], encoding="utf-8") as log:
        for line in log:
            entry = json.loads(line)
            name = script_of(entry["argv"])
            runs[name] += 1
            imports[name] += entry["torch"]
            cpu[name] += entry["cpu"]
    print(f"{sum(runs.values())} processes, {sum(imports.values())} imported torch, "
          f"{sum(cpu.values()):.0f} CPU-s")  # fmt: skip
    for name, seconds in cpu.most_common():
        print(f"{seconds:8.1f} s {runs[name]:5d} runs {imports[name]:5d} torch  {name}")


if __name__ == "__main__":
    main()
