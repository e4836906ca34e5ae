"""examples/horovod/: Horovod 0.28.1 built by install_horovod.sh, then trained with horovodrun.

The build is slow (minutes on two idle cores, 10 to 18 minutes measured while other tests shared
them), so it runs once per test run (the session fixture horovod_venv in conftest.py, which
test_slurm.py's Horovod job uses too). It needs the package index: a build that cannot download
Horovod fails, it is not skipped.
"""

import re
import sys
import time

import pytest

from conftest import EXAMPLES, HAS_CUDA, activated, epoch_losses, example_env, run

HOROVOD = EXAMPLES / "horovod"
INSTALL = HOROVOD / "install_horovod.sh"
TRAIN = HOROVOD / "horovod_train.py"
TINY = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3",
        "--num-workers", "0"]  # fmt: skip
HOROVODRUN_VARIABLES = (
    "HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_GLOO_RENDEZVOUS_ADDR, "
    "HOROVOD_GLOO_RENDEZVOUS_PORT not set: start this script with horovodrun --gloo"
)


def losses(out):  # rank 0's lines: horovodrun puts [rank]<stdout>: before each line
    return epoch_losses(out, prefix="[0]<stdout>:")


def test_install_script_builds_horovod_with_pytorch_and_gloo(horovod_venv, record_property):
    venv, out, seconds = horovod_venv
    record_property("timing", f"Horovod build (install_horovod.sh): {seconds:.0f} s")
    assert "Horovod v0.28.1:" in out, out
    for line in ("[X] PyTorch", "[X] Gloo", "[ ] MPI", "[ ] TensorFlow"):
        assert line in out, out
    assert f"Horovod 0.28.1 installed in {venv}" in out


def horovodrun(venv, np, *command, cwd, expect_rc=0):
    """Run horovodrun -np NP on this machine, in the venv with Horovod; (process, seconds)."""
    cmd = ["horovodrun", "-np", np, "-H", f"localhost:{np}", "--gloo", *command]
    env = activated(venv, OMP_NUM_THREADS=1)
    start = time.perf_counter()
    proc = run(cmd, cwd=cwd, env=env, timeout=120, expect_rc=expect_rc)
    return proc, time.perf_counter() - start


def test_horovodrun_trains_two_processes(horovod_venv, tmp_path, record_property):
    venv, _, _ = horovod_venv
    proc, seconds = horovodrun(venv, 2, "python", TRAIN, *TINY, cwd=tmp_path)
    record_property("timing", f"horovodrun -np 2 horovod_train.py (3 epochs): {seconds:.1f} s")
    out = proc.stdout
    assert "[0]<stdout>:2 processes on 1 node(s), cpu, batch 64 per process, learning rate " \
        "0.025\n" in out, out  # fmt: skip
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0], out
    assert "[1]<stdout>:" not in out, "only rank 0 prints"
    assert "Traceback" not in out + proc.stderr


def test_horovod_and_ddp_train_the_same_model(horovod_venv, tmp_path):
    """The page's migration table: the same settings give the same losses under DDP."""
    venv, _, _ = horovod_venv
    hvd_out = horovodrun(venv, 2, "python", TRAIN, *TINY, cwd=tmp_path)[0].stdout
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           EXAMPLES / "ddp" / "ddp.py", *TINY, "--lr", "0.05"]  # fmt: skip
    ddp_out = run(ddp, cwd=tmp_path, env=example_env(OMP_NUM_THREADS=1)).stdout
    ddp_losses = [float(x) for x in re.findall(r"^epoch \d+: loss (\S+),", ddp_out, re.M)]
    assert "learning rate 0.025" in ddp_out and len(ddp_losses) == 3, ddp_out
    assert losses(hvd_out) == pytest.approx(ddp_losses, abs=2e-3), (hvd_out, ddp_out)


def test_a_process_that_never_joins_stops_the_run_within_seconds(horovod_venv, tmp_path):
    """Rank 1 never starts the script: rank 0 gives up after --init-timeout, no hang."""
    venv, _, _ = horovod_venv
    script = '[ "$HOROVOD_RANK" = 1 ] && exec sleep 60; exec python "$0" "$@" --init-timeout 3'
    proc, seconds = horovodrun(venv, 2, "bash", "-c", script, TRAIN, *TINY, cwd=tmp_path,
                               expect_rc=1)  # fmt: skip
    assert seconds < 30, f"{seconds:.0f} s: Horovod's own 30 s timeout, not --init-timeout 3"
    assert "[0]<stderr>:" in proc.stderr and "Wait timeout after 3 seconds" in proc.stderr, (
        proc.stdout + proc.stderr
    )
    assert "Terminating remaining workers after failure of Process 0." in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given where no GPU is visible")
def test_without_a_gpu_it_says_how_to_request_one(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc, _ = horovodrun(venv, 1, "python", TRAIN, "--device", "cuda", "--fake-data",
                         cwd=tmp_path, expect_rc=1)  # fmt: skip
    assert (
        "[0]<stderr>:horovod_train.py: error: local rank 0 but 0 GPUs visible: request one GPU "
        "per process (#SBATCH --gpus-per-node equal to --ntasks-per-node)\n" in proc.stderr
    )
    assert "Process 0 exit with status code 2." in proc.stdout


def test_without_data_it_says_how_to_fetch_it(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc, _ = horovodrun(venv, 1, "python", TRAIN, "--device", "cpu", "--data-dir", "none",
                         cwd=tmp_path, expect_rc=1)  # fmt: skip
    assert "[0]<stderr>:horovod_train.py: error: no CIFAR-10 in none: download it once on a " \
        "login node" in proc.stderr  # fmt: skip
    assert "Process 0 exit with status code 2." in proc.stdout


def test_without_horovodrun_it_names_the_missing_variables(horovod_venv, tmp_path):
    venv, _, _ = horovod_venv
    proc = run([venv / "bin" / "python", TRAIN, "--fake-data"], cwd=tmp_path,
               env=activated(venv), expect_rc=2)  # fmt: skip
    assert proc.stderr == f"horovod_train.py: error: {HOROVODRUN_VARIABLES}\n"


def test_without_horovod_it_says_how_to_install_it(tmp_path):
    proc = run([sys.executable, TRAIN, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "horovod_train.py: error: Horovod is not installed in this Python: "
        "build it with install_horovod.sh\n"
    )


def test_install_script_needs_an_active_venv(tmp_path):
    env = example_env()
    env.pop("VIRTUAL_ENV", None)
    proc = run(["bash", INSTALL], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr == (
        "install_horovod.sh: error: no active venv: source <venv>/bin/activate first\n"
    )
