"""Run one example script many times in one process with bad input, and report what it did.

Used by tests/test_bad_input.py: `python tests/bad_input.py args|env|gpus|container SCRIPT...`
prints a JSON object that gives, for each script, its list of cases (each with the command line
or environment tried, the exit code, and what the script printed) or the error that stopped the
harness. A script runs its own code (runpy, as `python SCRIPT` would) in a process forked for it
from this one, which imported torch before the first: the suite pays for `import torch` once per
mode, not once per case or per script, and each script still starts from a clean process. With
one script, it runs in the working folder; with several, script N runs in the folder named N
there, which the caller made.

- `args`: every option of the script's own parser, found by asking argparse, gets values it must
  refuse: an integer option 0 (unless 0 means something, ZERO_OK) and -1; a number option -1 and
  nan; a path option a path under a regular file. The script must refuse them when it parses its
  arguments: the run stops as soon as parsing succeeds (the case is then "accepted").
- `env`: every variable of NUMERIC_VARIABLES that the script's code names (as a string) gets
  "abc", with the other variables of its launcher set to valid values. The run stops where the
  script would start its work (a process group, a store, a data loader, a forward pass): a case
  that gets there is "accepted".
- `gpus`: every script with `--device auto` runs in a job given GPUs, then with `--device cuda`;
  the caller runs the harness where a GPU device file exists (tests/test_bad_input.py).
- `container`: every script with `--device auto` runs in a job given GPUs inside a container
  started without GPU support (APPTAINER_CONTAINER set, no GPU device file: the caller runs the
  harness where none exists).
"""

import argparse
import ast
import contextlib
import io
import json
import multiprocessing
import os
import re
import runpy
import signal
import sys
import traceback
from pathlib import Path, PurePath

# Integer options for which 0 is a meaningful value (-1 is still refused).
ZERO_OK = {"--seed", "--num-workers", "--warmup", "--warmup-steps", "--task", "--fail-rank",
           "--local_rank"}  # fmt: skip
# Variables the examples read as numbers, and the launcher that sets each.
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}  # fmt: skip
SRUN = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NNODES": "1",
        "SLURM_CPUS_PER_TASK": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}  # fmt: skip
GRIDENGINE = {"NSLOTS": "1", "SGE_TASK_ID": "1", "JOB_ID": "4242"}
NUMERIC_VARIABLES = [name for name in (*TORCHRUN, *SRUN, *GRIDENGINE)
                     if name not in ("MASTER_ADDR", "SLURM_JOB_ID", "JOB_ID")]  # fmt: skip
NUMERIC_VARIABLES = list(dict.fromkeys(NUMERIC_VARIABLES))
# Variables by which a process knows it runs in a container (Apptainer/Singularity, Podman).
CONTAINER_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")
A_FILE = Path("a-file")  # a regular file in the working folder: nothing can be created under it
BAD_PATH = str(A_FILE / "sub")


class Reached(Exception):
    """The script got past the point where it should have refused the input."""


def options(parser):
    """[(flag or dest, kind, nargs, required)] of the parser: kind is int, float, path or None."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        found.append(
            (name, kind_of(action), action.nargs, action.required or not action.option_strings)
        )
    return found


def kind_of(action):
    convert = action.type
    if convert is None:
        return None
    if convert in (Path, PurePath) or isinstance(action.default, PurePath):
        return "path"
    if re.search(r"dir|file|path|folder", getattr(convert, "__name__", "")):
        return "path"
    for probe in ("100", "0.5"):
        try:
            value = convert(probe)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return "int"
        if isinstance(value, float):
            return "float"
        if isinstance(value, PurePath):
            return "path"
        return None
    return None


def bad_values(name, kind):
    if kind == "int":
        return ["-1"] if name in ZERO_OK else ["0", "-1"]
    if kind == "float":
        return ["-1", "nan"]
    if kind == "path":
        return [BAD_PATH]
    return []


def good_value(kind):
    return {"int": "1", "float": "1", "path": "good.txt"}.get(kind, "1")


def argv_for(name, value, nargs):
    values = [value] * (nargs if isinstance(nargs, int) else 1)
    return [name, *values] if name.startswith("-") else values


def run_script(script, argv):
    """Run the script as `python script *argv` would, in this process; (code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(script), *argv]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as stop:
            if isinstance(stop.code, str):
                sys.stderr.write(stop.code + "\n")
                code = 1
            else:
                code = stop.code or 0
        except Reached as reached:
            code = f"accepted: {reached}"
        except BaseException:  # noqa: BLE001 (the point: a traceback is what the test looks for)
            traceback.print_exc()
            code = "traceback"
    return code, out.getvalue(), err.getvalue()


def find_parser(script):
    """The script's argument parser, caught when the script asks it to parse."""
    found = []
    original = argparse.ArgumentParser.parse_known_args

    def catch(self, args=None, namespace=None):
        found.append(self)
        raise Reached("parser found")

    argparse.ArgumentParser.parse_known_args = catch
    try:
        code, out, err = run_script(script, [])
    finally:
        argparse.ArgumentParser.parse_known_args = original
    if not found:
        raise SystemExit(f"{script} did not parse arguments: {code}\n{out}\n{err}")
    return found[0]


def args_cases(script):
    table = options(find_parser(script))
    required = [(name, kind, nargs) for name, kind, nargs, needed in table if needed]
    original = argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_then_stop(self, args=None, namespace=None):
        depth[0] += 1
        try:
            result = original(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise Reached("the arguments were accepted")
        return result

    argparse.ArgumentParser.parse_known_args = parse_then_stop
    Path("good.txt").write_text("good\n")
    cases = []
    for name, kind, nargs, _ in table:
        for value in bad_values(name, kind):
            argv = []
            for other, other_kind, other_nargs in required:  # valid values for what is required
                if other != name:
                    argv += argv_for(other, good_value(other_kind), other_nargs)
            argv += argv_for(name, value, nargs)
            code, out, err = run_script(script, argv)
            cases.append({"option": name, "kind": kind, "argv": argv, "code": code,
                          "stdout": out, "stderr": err})  # fmt: skip
    argparse.ArgumentParser.parse_known_args = original
    return cases


def stop_at_the_work():
    """Make the calls that start a script's real work raise Reached."""
    import torch  # noqa: PLC0415
    import torch.distributed  # noqa: PLC0415

    def reached(what):
        def stop(*args, **kwargs):
            raise Reached(what)

        return stop

    torch.distributed.init_process_group = reached("init_process_group")
    torch.distributed.TCPStore = reached("TCPStore")
    torch.utils.data.DataLoader.__iter__ = reached("DataLoader")
    torch.nn.Module.__call__ = reached("a forward pass")
    # A script that sets the start method in each run would be refused the second time.
    multiprocessing.set_start_method = lambda method, force=False: None


def named_variables(script):
    """The variables of NUMERIC_VARIABLES that the script's code names as a string."""
    tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    return [name for name in NUMERIC_VARIABLES if name in strings]


def env_cases(script):
    names = named_variables(script)
    table = options(find_parser(script))
    argv = []
    for flag, value in (("--fake-data", None), ("--device", "cpu"), ("--epochs", "1")):
        if any(name == flag for name, *_ in table):
            argv += [flag] if value is None else [flag, value]
    stop_at_the_work()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGE_"))}
    cases = []
    for name in names:
        family = TORCHRUN if name in TORCHRUN else SRUN if name in SRUN else GRIDENGINE
        for key in (*TORCHRUN, *SRUN, *GRIDENGINE, "NSLOTS", "JOB_ID"):
            clean.pop(key, None)
        os.environ.clear()
        os.environ.update(clean, **family)
        os.environ[name] = "abc"
        code, out, err = run_script(script, argv)
        cases.append({"variable": name, "argv": argv, "code": code, "stdout": out, "stderr": err})
    return cases


# What a script needs to get as far as choosing its device, beside TORCHRUN's variables: more
# options, more variables, files in its folder.
TWO_STAGES = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
DEVICE_SETUP = {
    "compile_cache.py": {"env": {"TORCHINDUCTOR_CACHE_DIR": "inductor"}},
    "deepspeed_train.py": {"argv": ["--config", "ds_zero3.json"], "files": ["ds_zero3.json"]},
    "pipeline.py": {"env": TWO_STAGES},
    "pipeline_ddp.py": {"env": TWO_STAGES},
    "train_shards.py": {"files": ["shards/shard-000000.tar", "shards/classes.txt"]},
}


def gpu_cases(script, container=False):
    """--device auto in a job given GPUs (SLURM_JOB_GPUS=0) on a node with a GPU device file (the
    caller runs the harness where /dev/nvidia0 exists), then --device cuda: where PyTorch can use
    no GPU, each must stop in one line before any work starts. With container, --device auto
    only, in a container without GPU support (Apptainer without --nv: no device file)."""
    parser = find_parser(script)
    table = options(parser)
    setup = DEVICE_SETUP.get(Path(script).name, {})
    argv = list(setup.get("argv", []))
    for flag, value in (("--fake-data", None), ("--epochs", "1")):
        if any(name == flag for name, *_ in table):
            argv += [flag] if value is None else [flag, value]
    for name in setup.get("files", []):  # a copy of the script's own file, or an empty one
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        source = Path(script).parent / name
        empty = bytes(10240) if name.endswith(".tar") else b""  # a tar: its end blocks, padded
        Path(name).write_bytes(source.read_bytes() if source.is_file() else empty)
    choices = next(a.choices for a in parser._actions if "--device" in a.option_strings)
    stop_at_the_work()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGE_", "PBS_"))
             and k not in ("CUDA_VISIBLE_DEVICES", "JOB_GPUS", *CONTAINER_VARIABLES)}  # fmt: skip
    cases = []
    tries = [("auto", {"SLURM_JOB_GPUS": "0"}), ("cuda", {})]
    if container:
        tries = [("auto", {"SLURM_JOB_GPUS": "0", "APPTAINER_CONTAINER": "/images/pytorch.sif"})]
    for device, given in [(device, given) for device, given in tries if device in choices]:
        os.environ.clear()
        os.environ.update({**clean, **TORCHRUN, **setup.get("env", {}), **given})
        code, out, err = run_script(script, [*argv, "--device", device])
        cases.append({"device": device, "argv": [*argv, "--device", device], "code": code,
                      "stdout": out, "stderr": err})  # fmt: skip
    return cases


def cases_of(script, mode):
    A_FILE.write_text("not a folder\n")
    if mode == "container":
        return gpu_cases(script, container=True)
    return {"args": args_cases, "env": env_cases, "gpus": gpu_cases}[mode](script)


def in_a_child(script, mode, folder, seconds=120):
    """{"cases": [...]} or {"error": "..."}: the script's cases, tried in a forked process in
    folder, so that what one script changes (modules, patched functions, the environment, the
    working folder) is gone for the next."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one script's cases, then exit without the parent's clean-up
        os.close(read)
        signal.alarm(seconds)  # a script that never returns ends as an error, not a hang
        try:
            os.chdir(folder)
            result = {"cases": cases_of(script, mode)}
        except BaseException as error:  # noqa: BLE001 (reported to the test as it is)
            result = {"error": "".join(traceback.format_exception(error))[-3000:]}
        with os.fdopen(write, "w", encoding="utf-8") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"the harness ended without a result ({describe(status)})"}
    return json.loads(text)


def describe(status):
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    scripts = [Path(name).resolve() for name in names]
    if mode not in ("args", "env", "gpus", "container") or not scripts:
        raise SystemExit("usage: bad_input.py args|env|gpus|container SCRIPT...")
    import torch  # noqa: F401, PLC0415 (once here, for every forked child)
    import torch.distributed  # noqa: F401, PLC0415

    folders = ["."] if len(scripts) == 1 else [str(index) for index in range(len(scripts))]
    results = {
        name: in_a_child(script, mode, folder)
        for name, script, folder in zip(names, scripts, folders, strict=True)
    }
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
