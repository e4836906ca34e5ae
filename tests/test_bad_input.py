"""Bad input ends with one line and a non-zero exit, never a traceback or a silent success.

The cases are derived from each script, not kept by hand (tests/bad_input.py): every option
of its parser gets values it must refuse, and every number variable its source names gets a
value that is not a number. A new script or a new option is covered without touching this file.
Then the cases that need a real run: Ctrl-C, a loss that becomes nan, and checkpoint folders
holding what a script cannot use.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import records
from bad_input import NUMERIC_VARIABLES, named_variables

from conftest import (
    EXAMPLES,
    HAS_CUDA,
    TESTS,
    TORCHRUN,
    example_env,
    free_port,
    on_a_gpu_node,
    run,
    selected,
)

SCRIPTS = sorted(EXAMPLES.rglob("*.py"))
IDS = [str(path.relative_to(EXAMPLES)) for path in SCRIPTS]
HARNESS = TESTS / "bad_input.py"


def checksums(folder):
    """What the files in folder hold, but a checkpointing run's lock (test_cluster_faults.py)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".lock"
    }


def harness(folder, mode, scripts):
    """{script: its cases} of the harness run on scripts, script N in folder/N (folder itself
    for one script), each beside a checkpoint that must stay as it is."""
    folders = [folder] if len(scripts) == 1 else [folder / str(n) for n in range(len(scripts))]
    for each in folders:
        (each / "checkpoints").mkdir(parents=True)
        (each / "checkpoints" / "checkpoint.pt").write_bytes(b"a reader's checkpoint")
    before = checksums(folders[0] / "checkpoints")
    command = [sys.executable, HARNESS, mode, *scripts]
    if mode == "gpus":
        command = on_a_gpu_node(command, folder)
    proc = subprocess.run(
        command,
        cwd=folder, env=example_env(), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"the harness failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    results = {}
    for script, each in zip(scripts, folders, strict=True):
        result = json.loads(proc.stdout)[str(script)]
        if checksums(each / "checkpoints") != before:
            result = {"error": f"{script.name} changed the checkpoint beside it"}
        results[script] = result
    return results


# The test of each harness mode.
MODES = {
    "args": "test_bad_arguments_are_refused_when_parsed",
    "env": "test_variables_that_are_not_numbers_are_named",
    "gpus": "test_a_job_given_gpus_that_pytorch_cannot_use_stops_in_one_line",
    "container": "test_a_container_without_gpu_support_in_a_job_given_gpus_stops_in_one_line",
}


@pytest.fixture(scope="module")
def harnessed(tmp_path_factory, request):
    """harnessed(mode, script): the script's cases. The harness runs once per mode for the
    scripts of that mode's selected tests (one `import torch`, a forked process per script):
    all of them in make test, one for make test-changed after a change to one script."""
    runs = {}

    def cases(mode, script):
        if mode not in runs:
            chosen = {params["script"] for _, params in selected(request, test=MODES[mode])}
            scripts = sorted(chosen | {script})
            with records.followed():  # each test is credited with its own script only
                runs[mode] = harness(tmp_path_factory.mktemp(f"bad-{mode}"), mode, scripts)
        result = runs[mode][script]
        records.credit([script.relative_to(EXAMPLES).as_posix()])  # its cases, judged here
        if "error" in result:
            pytest.fail(f"the harness failed on {script.name}:\n{result['error']}", pytrace=False)
        return result["cases"]

    return cases


def one(folder, mode, script):
    """The cases of one script, the harness run for it alone."""
    result = harness(folder, mode, [script])[script]
    assert "error" not in result, result["error"]
    return result["cases"]


def problems_of(case, name, code_ok):
    """What is wrong with how a script ended a bad case: [] when it ended as it should."""
    text = case["stdout"] + case["stderr"]
    errors = [line for line in case["stderr"].splitlines() if "error:" in line]
    found = []
    if not code_ok(case["code"]):
        found.append(f"ended with {case['code']!r}")
    if "Traceback" in text:
        found.append("printed a traceback")
    if len(errors) != 1:
        found.append(f"printed {len(errors)} error lines")
    elif name not in errors[0]:
        found.append(f"its error line does not name {name}: {errors[0]}")
    return found


def report(script, cases, key):
    return "\n".join(
        f"{script.name} {case[key]} ({' '.join(case['argv'])}): {'; '.join(case['problems'])}\n"
        f"    {(case['stdout'] + case['stderr']).strip()[-600:]}"
        for case in cases
        if case["problems"]
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_bad_arguments_are_refused_when_parsed(harnessed, script):
    """0 and -1 for integer options (0 where it means nothing), -1 and nan for numbers, a path
    under a regular file for paths: argparse's usage error naming the option, exit 2."""
    cases = harnessed("args", script)
    for case in cases:
        name = case["option"] if case["option"].startswith("-") else f"argument {case['option']}"
        case["problems"] = problems_of(case, name, lambda code: code == 2)
    assert not any(case["problems"] for case in cases), report(script, cases, "option")


ENV_SCRIPTS = [path for path in SCRIPTS if named_variables(path)]


@pytest.mark.parametrize(
    "script", ENV_SCRIPTS, ids=[str(p.relative_to(EXAMPLES)) for p in ENV_SCRIPTS]
)
def test_variables_that_are_not_numbers_are_named(harnessed, script):
    """RANK=abc, MASTER_PORT=abc, SLURM_PROCID=abc, ... (each one the script names, the others of
    its launcher valid): one line naming the variable, a non-zero exit, before any work starts."""
    cases = harnessed("env", script)
    assert cases, f"{script.name} names none of {NUMERIC_VARIABLES}"
    for case in cases:
        case["problems"] = problems_of(
            case, case["variable"], lambda code: isinstance(code, int) and code != 0
        )
    assert not any(case["problems"] for case in cases), report(script, cases, "variable")


# Scripts that choose their device (--device auto, cpu, cuda, or some of them). Horovod's is
# tried in tests/test_horovod.py, where Horovod is installed.
GPU_SCRIPTS = [path for path in SCRIPTS if '"--device"' in path.read_text(encoding="utf-8")
               and path.name != "horovod_train.py"]  # fmt: skip


@pytest.mark.parametrize(
    "script", GPU_SCRIPTS, ids=[str(p.relative_to(EXAMPLES)) for p in GPU_SCRIPTS]
)
def test_a_job_given_gpus_that_pytorch_cannot_use_stops_in_one_line(harnessed, script):
    """On a node with a GPU device file (a stand-in /dev/nvidia0) and a PyTorch that can use no
    GPU there (this CPU build; on a cluster, a CUDA build newer than the driver): --device auto
    in a job given GPUs (SLURM_JOB_GPUS=0) and --device cuda each end in one line, exit non-zero,
    before any work starts; never a run on the CPU."""
    cases = harnessed("gpus", script)
    assert [case["device"] for case in cases][-1] == "cuda", cases
    for case in cases:
        name = "SLURM_JOB_GPUS=0" if case["device"] == "auto" else "GPU"
        case["problems"] = problems_of(case, name, lambda code: isinstance(code, int) and code != 0)
    assert not any(case["problems"] for case in cases), report(script, cases, "device")


# Scripts whose --device auto takes the GPU where PyTorch can use one.
AUTO_SCRIPTS = [path for path in GPU_SCRIPTS
                if re.search(r'"--device".*choices=\[[^]]*"auto"', path.read_text(encoding="utf-8"),
                             re.DOTALL)]  # fmt: skip


ON_A_GPU_NODE = HAS_CUDA or any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


@pytest.mark.skipif(ON_A_GPU_NODE, reason="needs a machine without GPU device files, as a "
                    "container without GPU support is")  # fmt: skip
@pytest.mark.parametrize(
    "script", AUTO_SCRIPTS, ids=[str(p.relative_to(EXAMPLES)) for p in AUTO_SCRIPTS]
)
def test_a_container_without_gpu_support_in_a_job_given_gpus_stops_in_one_line(harnessed, script):
    """A job given GPUs (SLURM_JOB_GPUS=0) that starts a container without GPU support
    (apptainer without --nv: APPTAINER_CONTAINER set, no /dev/nvidia*): --device auto ends in
    one line that names the variable and --nv, exits non-zero, never trains on the CPU."""
    cases = harnessed("container", script)
    assert [case["device"] for case in cases] == ["auto"], cases
    for case in cases:
        failed = lambda code: isinstance(code, int) and code != 0  # noqa: E731
        case["problems"] = problems_of(case, "SLURM_JOB_GPUS=0", failed)
        if not case["problems"] and "--nv" not in case["stderr"]:
            case["problems"] = ["its error line does not say to start the container with --nv"]
    assert not any(case["problems"] for case in cases), report(script, cases, "device")


def test_the_harness_sees_a_script_that_does_not_check(tmp_path):
    """The derived cases can fail: a script with a bare int option, a bare Path option and an
    unchecked variable is caught on each of them."""
    script = tmp_path / "careless.py"
    script.write_text(
        "import argparse, os\nfrom pathlib import Path\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--batch-size', type=int, default=8)\n"
        "parser.add_argument('--lr', type=float, default=0.1)\n"
        "parser.add_argument('--output-dir', type=Path, default=Path('out'))\n"
        "args = parser.parse_args()\n"
        "rank = int(os.environ['RANK'])\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    args = {case["argv"][-1] + case["option"]: case for case in one(work, "args", script)}
    assert set(args) == {"0--batch-size", "-1--batch-size", "-1--lr", "nan--lr",
                         "a-file/sub--output-dir"}  # fmt: skip
    assert all(case["code"] == "accepted: the arguments were accepted" for case in args.values())
    (work / "checkpoints").rename(work / "old")
    env = one(work, "env", script)
    assert [case["variable"] for case in env] == ["RANK"]
    assert env[0]["code"] == "traceback" and "ValueError" in env[0]["stderr"]


def test_the_harness_sees_a_script_that_falls_back_to_the_cpu(tmp_path):
    """The GPU node case can fail: a script whose --device auto takes the CPU when PyTorch sees
    no GPU, whatever the job was given, gets as far as its first forward pass."""
    script = tmp_path / "fallback.py"
    script.write_text(
        "import argparse, torch\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--device', choices=['auto', 'cpu'], default='auto')\n"
        "args = parser.parse_args()\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "torch.nn.Linear(2, 2).to(device)(torch.zeros(2, device=device))\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    cases = one(work, "gpus", script)
    assert [(case["device"], case["code"]) for case in cases] == [
        ("auto", "accepted: a forward pass")
    ]


# Ctrl-C: every script ends it with one line; a script that checkpoints saves first.
def test_every_script_handles_ctrl_c():
    missing = [
        str(path.relative_to(EXAMPLES))
        for path in SCRIPTS
        if not re.search(r"KeyboardInterrupt|SIGINT", path.read_text(encoding="utf-8"))
    ]
    assert missing == [], "these scripts end Ctrl-C with a traceback"


def interrupt(cmd, cwd, wait_for, settle=3, env=None):
    """Start cmd, press Ctrl-C (SIGINT to its process group) settle seconds after it printed
    wait_for (a line that comes before the work that Ctrl-C should interrupt)."""
    proc = subprocess.Popen(
        [str(part) for part in cmd], cwd=cwd, env=env or example_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    out = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        out.append(line)
        if re.search(wait_for, line) or time.monotonic() > deadline:
            break
    time.sleep(settle)
    os.killpg(proc.pid, signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(out) + rest, err


def test_ctrl_c_ends_a_training_run_with_one_line(tmp_path):
    code, out, err = interrupt(
        [sys.executable, EXAMPLES / "cpu-threads" / "cnn_cpu.py", "--fake-data", "--fake-size",
         "200000", "--batch-size", "16", "--num-workers", "2"],
        tmp_path, r"images, \d+ threads",
    )  # fmt: skip
    assert code == 130, (code, out, err)
    assert "Traceback" not in out + err, err
    assert err.strip().splitlines()[-1] == "cnn_cpu.py: interrupted (Ctrl-C)", err


# A loss that is not finite: the run stops at once, and the newest checkpoint is a good one.
TRAIN_CHECKPOINT = EXAMPLES / "checkpointing" / "train_checkpoint.py"
TINY_CHECKPOINTED = ["--device", "cpu", "--fake-data", "--fake-size", "256", "--batch-size", "32",
                     "--checkpoint-every", "3", "--keep", "10"]  # fmt: skip
NAN_RUN = [*TINY_CHECKPOINTED, "--epochs", "2", "--lr", "1e8", "--warmup-steps", "0"]


def finite_weights(path):
    import torch  # noqa: PLC0415

    state = torch.load(path, map_location="cpu", weights_only=True)
    return all(bool(torch.isfinite(value).all()) for value in state["model"].values())


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    """--lr 1e8 makes the loss nan after a few steps: one line naming epoch and step, exit 2,
    no checkpoint written after it, and the newest one loads with finite weights. The page
    shows this run (train_checkpoint-nan.out)."""
    from recorded import check_recorded, transcript  # noqa: PLC0415

    proc = run([sys.executable, TRAIN_CHECKPOINT, *NAN_RUN], cwd=tmp_path, expect_rc=2)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1, proc.stderr
    assert re.fullmatch(
        r"train_checkpoint\.py: error: loss is (nan|inf) at epoch 1, step \d+: start again in a "
        r"new --checkpoint-dir with a lower --lr .*", error[0]), error  # fmt: skip
    step = int(re.search(r"step (\d+)", error[0])[1])
    saved = sorted(path.name for path in (tmp_path / "checkpoints").glob("checkpoint-*"))
    assert saved and all(int(name[11:19]) < step for name in saved), (saved, step)
    assert finite_weights(tmp_path / "checkpoints" / saved[-1])
    assert not (tmp_path / "runs" / "model.pt").exists()  # no final weights after a failure
    command = "python train_checkpoint.py " + " ".join(NAN_RUN)
    check_recorded(
        EXAMPLES / "checkpointing" / "train_checkpoint-nan.out",
        transcript((command, proc.stdout + proc.stderr)),
        volatile=[(r"\d+ images/s", "N images/s")],
    )


def test_a_diverging_distributed_run_stops_on_every_rank(tmp_path):
    """The ranks check the loss they all-reduce, so they stop together instead of waiting for
    each other until the timeout."""
    args = ["--device", "cpu", "--fake-data", "--fake-size", "256", "--num-workers", "0",
            "--epochs", "3", "--lr", "1e30", "--timeout", "60"]  # fmt: skip
    start = time.monotonic()
    proc = run([*TORCHRUN, "--nproc-per-node=2", EXAMPLES / "ddp" / "ddp.py", *args],
               cwd=tmp_path, expect_rc=1, timeout=120)  # fmt: skip
    assert time.monotonic() - start < 50, "the ranks waited for each other"
    assert re.search(r"^ddp\.py: error: loss is (nan|inf) at epoch \d, step \d+: lower --lr",
                     proc.stderr, re.M), proc.stderr  # fmt: skip


# Checkpoint folders holding what a script cannot use: skipped with a warning, or refused.
def test_another_models_checkpoint_is_skipped_like_a_damaged_one(tmp_path):
    import torch  # noqa: PLC0415

    run([sys.executable, TRAIN_CHECKPOINT, *TINY_CHECKPOINTED, "--epochs", "1"], cwd=tmp_path)
    folder = tmp_path / "checkpoints"
    state = torch.load(folder / "checkpoint-00000008.pt", weights_only=True)
    del state["config"]
    torch.save(state, folder / "checkpoint-00000009.pt")
    state = torch.load(folder / "checkpoint-00000008.pt", weights_only=True)
    state["model"]["0.weight"] = torch.zeros(8, 3, 3, 3)  # a narrower first layer
    torch.save(state, folder / "checkpoint-00000010.pt")
    (folder / "checkpoint-00000011.pt").mkdir()  # read only: this run ends at step 8
    before = checksums(folder)
    proc = run([sys.executable, TRAIN_CHECKPOINT, *TINY_CHECKPOINTED, "--epochs", "1"],
               cwd=tmp_path)  # fmt: skip
    warnings = proc.stderr.strip().splitlines()
    fallback = f"falling back to {Path('checkpoints', 'checkpoint-00000008.pt')}"
    assert warnings == [
        "train_checkpoint.py: warning: skipped checkpoints/checkpoint-00000011.pt (a folder, not "
        f"a checkpoint file); {fallback}",
        "train_checkpoint.py: warning: skipped checkpoints/checkpoint-00000010.pt (another "
        f"model: 0.weight is (8, 3, 3, 3) in the file, (16, 3, 3, 3) here); {fallback}",
        "train_checkpoint.py: warning: skipped checkpoints/checkpoint-00000009.pt (not a "
        f"checkpoint of this script: no config); {fallback}",
    ], proc.stderr
    assert "resumed from checkpoints/checkpoint-00000008.pt after 8 of 8 steps" in proc.stdout
    assert checksums(folder) == before


def test_a_folder_where_a_checkpoint_will_be_written_is_refused(tmp_path):
    (tmp_path / "checkpoints" / "checkpoint-00000006.pt").mkdir(parents=True)
    proc = run([sys.executable, TRAIN_CHECKPOINT, *TINY_CHECKPOINTED, "--epochs", "1"],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr.strip().splitlines()[-1] == (
        "train_checkpoint.py: error: checkpoints/checkpoint-00000006.pt is a folder, and this "
        "run would write a checkpoint file there: move it away or choose another --checkpoint-dir"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        ".lock",
        "checkpoint-00000006.pt",
    ]


def test_preemptible_refuses_another_scripts_checkpoint(tmp_path):
    import torch  # noqa: PLC0415

    (tmp_path / "ck").mkdir()
    torch.save({"model": {"weight": torch.zeros(2)}}, tmp_path / "ck" / "checkpoint.pt")
    before = checksums(tmp_path / "ck")
    proc = run([sys.executable, EXAMPLES / "preemption" / "preemptible.py", "--device", "cpu",
                "--fake-data", "--fake-size", "256", "--checkpoint-dir", "ck"],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr.strip().splitlines() == [
        "preemptible.py: error: cannot resume from ck/checkpoint.pt (not a checkpoint of this "
        "script: no epoch, images, loss_sum, optimizer, step): delete it to start again, or pass "
        "another --checkpoint-dir"
    ]
    assert "Traceback" not in proc.stderr
    assert checksums(tmp_path / "ck") == before


def test_ddp_checkpoint_skips_a_file_that_is_not_its_checkpoint(tmp_path):
    import torch  # noqa: PLC0415

    script = EXAMPLES / "dist-checkpoint" / "ddp_checkpoint.py"
    args = ["--device", "cpu", "--fake-data", "--fake-size", "256", "--num-workers", "0"]
    env = example_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    run([sys.executable, script, *args, "--epochs", "2"], cwd=tmp_path, env=env)
    torch.save({"model": {}, "optimizer": {}}, tmp_path / "checkpoints" / "epoch-4.pt")
    (tmp_path / "checkpoints" / "epoch-6.pt").mkdir()
    before = checksums(tmp_path / "checkpoints")
    proc = run([sys.executable, script, *args, "--epochs", "2"], cwd=tmp_path, env=env)
    assert (
        "ddp_checkpoint.py: warning: skipped checkpoints/epoch-4.pt (not a checkpoint of this "
        "script: no epoch); falling back to checkpoints/epoch-2.pt" in proc.stderr
    ), proc.stderr
    assert (
        "ddp_checkpoint.py: warning: skipped checkpoints/epoch-6.pt (a folder, not a "
        "checkpoint file); falling back to checkpoints/epoch-2.pt" in proc.stderr
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert checksums(tmp_path / "checkpoints") == before


# Ctrl-C in a script that checkpoints: the same save as a preemption signal, then one line.
def test_ctrl_c_in_preemptible_saves_first(tmp_path):
    script = EXAMPLES / "preemption" / "preemptible.py"
    args = ["--device", "cpu", "--fake-data", "--fake-size", "100000", "--batch-size", "8",
            "--checkpoint-dir", "ck", "--epochs", "1"]  # fmt: skip
    code, out, err = interrupt([sys.executable, script, *args], tmp_path, r".", settle=4)
    assert code == 130, (code, out, err)
    assert "Traceback" not in out + err, err
    assert re.search(r"^SIGINT: checkpoint saved at epoch 1, step \d+$", out, re.M), out
    assert finite_weights(tmp_path / "ck" / "checkpoint.pt")
