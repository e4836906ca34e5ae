"""examples/mps/: several DDP replicas (gloo) sharing one GPU, here on CPU processes."""

import re
import sys

import pytest

from conftest import EXAMPLES, run

MPS_DDP = EXAMPLES / "mps" / "mps_ddp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def losses(out):
    return [float(x) for x in re.findall(r"^epoch \d+: loss (\S+), \d+ samples/s", out, re.M)]


def test_replicas_train_together(tmp_path):
    args = ["--device", "cpu", "--fake-data", "--fake-size", "1024", "--epochs", "3"]
    out = run([*TORCHRUN, "--nproc-per-node=3", MPS_DDP, *args], cwd=tmp_path, timeout=120).stdout
    assert "samples/s with 3 replicas on cpu" in out
    assert len(losses(out)) == 3 and losses(out)[-1] < losses(out)[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"),
     (["--via-torchrun"], "pass --fake-data")],
)  # fmt: skip
def test_clear_messages_instead_of_tracebacks(tmp_path, args, message):
    if args == ["--via-torchrun"]:
        cmd = [*TORCHRUN, "--nproc-per-node=1", MPS_DDP]
    else:
        cmd = [sys.executable, MPS_DDP]
    proc = run(cmd, cwd=tmp_path, expect_rc=None)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_replicas_share_the_gpu(tmp_path):
    args = ["--device", "cuda", "--fake-data", "--epochs", "2"]
    out = run([*TORCHRUN, "--nproc-per-node=2", MPS_DDP, *args], cwd=tmp_path, timeout=300).stdout
    assert "samples/s with 2 replicas on cuda:0" in out
