"""examples/mps/: several DDP replicas (gloo) sharing one GPU, here on CPU processes."""

import sys

import pytest

from conftest import EXAMPLES, TORCHRUN, epoch_losses, run

MPS_DDP = EXAMPLES / "mps" / "mps_ddp.py"


def losses(out):
    return epoch_losses(out, unit="samples/s")


def test_replicas_train_together(tmp_path):
    args = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3"]
    out = run([*TORCHRUN, "--nproc-per-node=3", MPS_DDP, *args], cwd=tmp_path, timeout=120).stdout
    assert "samples/s with 3 replicas on cpu" in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0]


def test_without_torchrun_it_names_the_missing_variables(tmp_path):
    proc = run([sys.executable, MPS_DDP, "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_without_data_it_says_what_to_pass(tmp_path):
    # torchrun reports the failed process with a summary of its own; the script's line is in it.
    proc = run([*TORCHRUN, "--nproc-per-node=1", MPS_DDP], cwd=tmp_path, expect_rc=None)
    assert proc.returncode != 0
    assert (
        "mps_ddp.py: error: this example trains on generated data only: pass --fake-data"
        in proc.stderr
    )


@pytest.mark.gpu
def test_replicas_share_the_gpu(tmp_path):
    args = ["--device", "cuda", "--fake-data", "--epochs", "2"]
    out = run([*TORCHRUN, "--nproc-per-node=2", MPS_DDP, *args], cwd=tmp_path, timeout=300).stdout
    assert "samples/s with 2 replicas on cuda:0" in out
