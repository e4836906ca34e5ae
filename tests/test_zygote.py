"""tests/zygote.py ends a run as its own process would: the same exit code and the same output,
for what conftest.run() sends it (a script expected to fail), and it takes no other run."""

import os
import subprocess
import sys

import pytest

from conftest import example_env, run

SCRIPTS = {
    "exits with a message": "import sys\nprint('before')\nsys.exit('prog: error: no data')\n",
    "exits with a number": "import sys\nsys.exit(3)\n",
    "raises": "import torch\nraise ValueError(torch.__name__)\n",
    "reads its argv, environment and folder": (
        "import os, sys\nfrom pathlib import Path\n"
        "print(sys.argv, os.environ.get('RANK'), Path.cwd().name, Path(__file__).name)\n"
        "print(sys.path[0] == str(Path(__file__).resolve().parent))\n"
        "import atexit\natexit.register(lambda: print('at exit'))\nraise SystemExit(2)\n"
    ),
    "warns in its own code": "import warnings\nwarnings.warn('old', DeprecationWarning)\n",
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_forked_run_ends_as_its_own_process(tmp_path, name):
    script = tmp_path / "script.py"
    script.write_text(SCRIPTS[name])
    env = example_env(RANK=1)
    own = subprocess.run([sys.executable, script, "--x"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert own.returncode != 0, own
    forked = run([sys.executable, script, "--x"], cwd=tmp_path, env=env, expect_rc=None)
    assert forked.returncode == own.returncode
    assert forked.stdout == own.stdout
    # A traceback has runpy's frames in the forked run: compare its last line.
    assert forked.stderr.splitlines()[-1:] == own.stderr.splitlines()[-1:], (forked, own)


def test_only_failing_runs_in_the_tests_environment_are_forked(tmp_path, monkeypatch):
    """What is not forked: an expected success, an environment that torch reads on import, an
    interpreter option. The script prints its process id's parent: the test process, when it
    ran as its own process."""
    script = tmp_path / "parent.py"
    script.write_text("import os, sys\nprint(os.getppid())\nsys.exit(int(sys.argv[1]))\n")
    own = str(os.getpid())

    def parent(*args, env=None, rc=1):
        cmd = [sys.executable, *args, script, str(rc)]
        return run(cmd, cwd=tmp_path, env=env, expect_rc=rc).stdout.strip()

    assert parent() != own  # forked from tests/zygote.py
    assert parent(rc=0) == own
    assert parent(env=example_env(OMP_NUM_THREADS=3)) == own
    assert parent("-X", "utf8") == own
    monkeypatch.setenv("TESTS_NO_ZYGOTE", "1")
    assert parent() == own
