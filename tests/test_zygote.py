"""tests/zygote.py ends a run as its own process would: the same exit code and the same output,
for what conftest.run() sends it (a script whose exit code the test names), and it takes no
other run."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import conftest
from conftest import example_env, launch, run


def forked_runs():
    """How many runs this test process's zygote has forked so far."""
    return conftest._zygote.runs if conftest._zygote else 0


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
    "trains with DataLoader workers and ends well": (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "torch.manual_seed(0)\ndata = TensorDataset(torch.arange(8.0).unsqueeze(1))\n"
        "model = torch.nn.Linear(1, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for (x,) in DataLoader(data, batch_size=2, num_workers=2):\n"
        "    loss = model(x).pow(2).mean()\n    opt.zero_grad()\n    loss.backward()\n"
        "    opt.step()\nprint(f'{loss.item():.6f}', torch.get_num_threads())\n"
    ),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_forked_run_ends_as_its_own_process(tmp_path, name):
    script = tmp_path / "script.py"
    script.write_text(SCRIPTS[name])
    # OMP_NUM_THREADS=1: torch reads it on import; the forked child is given it before the start.
    env = example_env(RANK=1, OMP_NUM_THREADS=1)
    own = subprocess.run([sys.executable, script, "--x"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    before = forked_runs()
    forked = run([sys.executable, script, "--x"], cwd=tmp_path, env=env,
                 expect_rc=own.returncode)  # fmt: skip
    assert forked_runs() == before + 1, "the run was not forked"
    assert forked.stdout == own.stdout
    # A traceback has runpy's frames in the forked run: compare its last line.
    assert forked.stderr.splitlines()[-1:] == own.stderr.splitlines()[-1:], (forked, own)


def test_which_runs_are_forked(tmp_path, monkeypatch):
    """Forked: a run whose exit code the test names, success or failure, with a whole number of
    threads. Not forked: a run whose exit code the test does not name, another environment that
    torch reads on import, an interpreter option. The script prints its process id's parent:
    the test process, when it ran as its own process."""
    script = tmp_path / "parent.py"
    script.write_text("import os, sys\nprint(os.getppid())\nsys.exit(int(sys.argv[1]))\n")
    own = str(os.getpid())

    def parent(*args, env=None, rc=1):
        cmd = [sys.executable, *args, script, str(rc or 0)]
        return run(cmd, cwd=tmp_path, env=env, expect_rc=rc).stdout.strip()

    assert parent() != own  # forked from tests/zygote.py
    assert parent(rc=0) != own
    assert parent(rc=None) == own
    assert parent(env=example_env(OMP_NUM_THREADS=3)) != own
    assert parent(env=example_env(OMP_NUM_THREADS="3,1")) == own
    assert parent(env=example_env(ATEN_CPU_CAPABILITY="default")) == own
    assert parent("-X", "utf8") == own
    monkeypatch.setenv("TESTS_NO_ZYGOTE", "1")
    assert parent() == own


ALL_REDUCE = """import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(os.environ["RANK"], dist.get_world_size(), total.item(), torch.get_num_threads())
dist.destroy_process_group()
"""


def test_the_ranks_of_a_launch_are_forked_and_meet(tmp_path, monkeypatch):
    """launch() forks every rank at once, and they meet in one process group, as processes of
    their own do: the same outputs."""
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    before = forked_runs()
    forked = launch([sys.executable, script], cwd=tmp_path, world=3, launcher="torchrun")
    assert forked_runs() == before + 3, "the ranks were not forked"
    monkeypatch.setenv("TESTS_NO_ZYGOTE", "1")
    own = launch([sys.executable, script], cwd=tmp_path, world=3, launcher="torchrun")
    assert forked_runs() == before + 3
    assert forked == own == [(0, f"{rank} 3 6.0 1\n", "") for rank in range(3)], (forked, own)


def test_runs_from_several_threads_get_their_own_results(tmp_path):
    """Tests that run examples side by side from threads (run_together) each get their own
    run's exit code and output, whichever ends first."""
    script = tmp_path / "sleep.py"
    script.write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\nprint(sys.argv[1])\n")
    before = forked_runs()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(run, [sys.executable, script, str(delay)], cwd=tmp_path)
                   for delay in (0.6, 0.1, 0.3)]  # fmt: skip
        outputs = [future.result().stdout for future in futures]
    assert forked_runs() == before + 3
    assert outputs == ["0.6\n", "0.1\n", "0.3\n"]
