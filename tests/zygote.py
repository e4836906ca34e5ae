"""Run example scripts in processes forked from one that imported torch already.

Importing torch costs 2.5 to 3 s of CPU on the machines the suite runs on, and most example
runs of the tests are short: a script that refuses its input stops within a second of
starting, and a tiny training run on generated data takes a few seconds. Hundreds of such runs
are a large part of the suite. conftest.run() sends them here instead when the test is about
what the script does, not how a process starts:

- the command is `python SCRIPT.py ARGS...` (the tests' Python, no interpreter option) and the
  test names the exit code it expects;
- the environment is the one this process started with (example_env()), apart from the
  variables a launcher or a scheduler sets (SLURM_*, RANK, MASTER_PORT, ...), which torch does
  not read when it is imported, and a whole OMP_NUM_THREADS (see Threads below). A run with
  another start method or another PYTHONPATH differs in more, and runs as its own process.

Anything else runs as its own process: a launcher (torchrun, srun, mpirun, a job script) and
every process it starts, and the tests of how a script starts. The child of each run starts
from the state this process had after `import torch` (nothing else ran, no thread started): it
takes the run's folder, environment, command line and output files, runs the script as
`python SCRIPT` would (runpy, `__main__`, the script's folder first on sys.path), and exits with
the code Python would give: 0, SystemExit's code, or 1 after printing an uncaught exception's
traceback. Processes the script starts (DataLoader workers, mp.spawn) are started as they would
be from a process of its own.

Threads: OMP_NUM_THREADS is read when torch is imported, so a run that sets it (to a whole
number) gets torch.set_num_threads(N) in its child before the script starts, as the variable
would have given it; the variable itself is in the child's environment for the processes it
starts.

Protocol: one JSON request per line on stdin ({"id", "argv", "cwd", "env", "stdout", "stderr",
"timeout"}), one JSON reply per line on stdout when that run has ended ({"id", "returncode"} or
{"id", "timeout": true}). Requests may overlap: the ranks of a distributed run are started
together and run side by side.
"""

import json
import os
import re
import runpy
import select
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
THREADS = "OMP_NUM_THREADS"


def takes(env, base):
    """Whether a run with environment env can be forked from a process that started with
    base: it differs only in launcher variables and in a whole OMP_NUM_THREADS."""
    changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    threads = env.get(THREADS, "")
    return all(
        LAUNCHER.fullmatch(name) or (name == THREADS and threads.isdigit() and int(threads) > 0)
        for name in changed
    )


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
        threads = request["env"].get(THREADS)
        if threads is not None and threads != os.environ.get(THREADS):
            import torch  # noqa: PLC0415 (imported already: the point of this process)

            torch.set_num_threads(int(threads))
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
    """Fork a child per request as it comes, and reply for each when it has ended (or was
    killed at its deadline). requests: a file descriptor; replies: a text file."""
    running = {}  # pid: (request id, deadline)
    pending = b""
    reading = True
    while reading or running:
        if reading and select.select([requests], [], [], 0.005)[0]:
            data = os.read(requests, 1 << 16)
            reading = bool(data)  # end of input: the test process has gone; finish what runs
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    replies.close()
                    child(request)
                running[pid] = (request["id"], time.monotonic() + request["timeout"])
        elif not reading:
            time.sleep(0.005)
        for pid, (run_id, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply = {"id": run_id, "returncode": os.waitstatus_to_exitcode(status)}
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                reply = {"id": run_id, "timeout": True}
            else:
                continue
            del running[pid]
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


def main():
    # The protocol moves off stdin and stdout, which each child points at its own files.
    requests = os.dup(0)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    import torch  # noqa: F401, PLC0415 (the point: once, before any fork)
    import torch.distributed  # noqa: F401, PLC0415

    serve(requests, replies)


if __name__ == "__main__":
    main()
