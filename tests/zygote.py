"""Run example scripts in processes forked from one that imported torch already.

Most tests of how a script refuses its input (an option, a launcher variable, missing data) see
it stop within a second of starting, after 2.5 s of CPU spent importing torch: hundreds of
such runs are a large part of the suite. conftest.run() sends those runs here instead, when
the test is about the message and the exit code, not the start:

- the command is `python SCRIPT.py ARGS...` (the tests' Python, no interpreter option) and the
  test expects a non-zero exit code;
- the environment is the one this process started with (example_env()), apart from the
  variables a launcher or a scheduler sets (SLURM_*, RANK, MASTER_PORT, ...), which torch does
  not read when it is imported.

Anything else runs as its own process, as before. The child of each run starts from the state
this process had after `import torch` (nothing else ran): it takes the run's folder,
environment, command line and output files, runs the script as `python SCRIPT` would (runpy,
`__main__`, the script's folder first on sys.path), and exits with the code Python would give:
0, SystemExit's code, or 1 after printing an uncaught exception's traceback.

Protocol: one JSON request per line on stdin ({"argv", "cwd", "env", "stdout", "stderr",
"timeout"}), one JSON reply per line on stdout ({"returncode"} or {"timeout": true}).
"""

import json
import os
import re
import runpy
import signal
import sys
import time

# Variables that differ from run to run: set by srun, torchrun, Grid Engine or a test; torch
# reads none of them on import (torch.distributed reads them when a process group starts).
LAUNCHER = re.compile(
    r"(SLURM_|SLURMD_|SGE_|PBS_|TORCHELASTIC_)\w*|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE"
    r"|GROUP_RANK|MASTER_ADDR|MASTER_PORT|NSLOTS|JOB_ID|NODE_RANK"
    r"|PYTEST_CURRENT_TEST"  # pytest's name of the test that runs now
)


def differs_only_in_launcher_variables(env, base):
    changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    return all(LAUNCHER.fullmatch(name) for name in changed)


def exit_code(stop):
    """The exit code Python gives for SystemExit(stop.code), printing a message code."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    sys.stderr.write(f"{stop.code}\n")
    return 1


def child(request):
    """Run one script as `python SCRIPT ARGS` would, then end this process."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        script = os.path.abspath(request["argv"][0])
        sys.argv = [request["argv"][0], *request["argv"][1:]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = exit_code(stop)
        except BaseException:  # noqa: BLE001 (printed as Python prints it)
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit  # noqa: PLC0415

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(requests, replies):
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            child(request)
        deadline = time.monotonic() + request["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply = {"returncode": os.waitstatus_to_exitcode(status)}
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                reply = {"timeout": True}
                break
            time.sleep(0.005)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main():
    # The protocol moves off stdin and stdout, which each child points at its own files.
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    import torch  # noqa: F401, PLC0415 (the point: once, before any fork)
    import torch.distributed  # noqa: F401, PLC0415

    serve(requests, replies)


if __name__ == "__main__":
    main()
