"""examples/precision/: the matrix-product precision table and the mixed-precision loop."""

import importlib.util
import re
import sys

import pytest
import torch

from conftest import EXAMPLES, run

PRECISION = EXAMPLES / "precision" / "precision.py"
ROW = re.compile(r"^(float64|float32|tf32|bfloat16|float16) +(\S+) +(\S+) +(\S+)$", re.M)


def rows(out):
    return {name: (float(error), float(ms)) for name, error, ms, _ in ROW.findall(out)}


@pytest.mark.parametrize("amp", ["bf16", "fp16", "none"])
def test_precision_table_and_mixed_precision_on_cpu(tmp_path, amp):
    args = [
        "--device",
        "cpu",
        "--size",
        "128",
        "--repeats",
        "2",
        "--amp",
        amp,
        "--train-steps",
        "8",
    ]
    out = run([sys.executable, PRECISION, *args], cwd=tmp_path).stdout
    table = rows(out)
    assert set(table) == {"float64", "float32", "bfloat16", "float16"}
    assert "tf32" in out and "needs an NVIDIA GPU" in out
    assert table["float64"][0] == 0
    # Fewer mantissa bits, larger errors: float32 < float16 < bfloat16.
    assert table["float32"][0] < table["float16"][0] < table["bfloat16"][0] < 0.05
    first, last = map(
        float, re.search(rf"Mixed precision \({amp}\), 8 steps: loss (\S+) -> (\S+)", out).groups()
    )
    assert last < first


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only outcome")
def test_precision_refuses_cuda_without_a_gpu(tmp_path):
    proc = run([sys.executable, PRECISION, "--device", "cuda"], cwd=tmp_path, expect_rc=2)
    assert "no GPU is visible" in proc.stderr and proc.stderr.count("\n") == 1


def test_committed_output_is_what_the_script_prints():
    """The page shows precision-cpu.txt: it must have the rows and columns the script prints."""
    measured = (EXAMPLES / "precision" / "precision-cpu.txt").read_text()
    assert measured.startswith("Matrix product of 1024x1024 on CPU, PyTorch ")
    assert set(rows(measured)) == {"float64", "float32", "bfloat16", "float16"}
    assert re.search(r"^Mixed precision \(bf16\), 20 steps: loss \S+ -> \S+$", measured, re.M)


@pytest.mark.gpu
def test_precision_on_the_gpu(tmp_path):
    out = run(
        [sys.executable, PRECISION, "--device", "cuda", "--size", "4096"], cwd=tmp_path
    ).stdout
    table = rows(out)
    assert set(table) == {"float64", "float32", "tf32", "bfloat16", "float16"}
    # TF32 keeps 10 mantissa bits: less precise than float32, and faster.
    assert table["float32"][0] < table["tf32"][0] < table["bfloat16"][0]
    assert table["tf32"][1] < table["float32"][1]


LIGHTNING_CHECK = """
import sys, types
import torch
from lightning.pytorch.accelerators.cuda import _check_cuda_matmul_precision

# An H100, as Lightning's check sees it (no GPU here: the check reads only these three).
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
module = types.ModuleType("precision")
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), module.__dict__)
module.set_tf32(torch, True)
_check_cuda_matmul_precision(torch.device("cuda", 0))
print("Lightning's check passed:", torch.get_float32_matmul_precision())
"""


def test_the_recommended_tf32_setting_survives_lightnings_check(tmp_path):
    """Lightning 2.6 reads torch.get_float32_matmul_precision() on Ampere and newer GPUs;
    after torch.backends.cuda.matmul.fp32_precision = "tf32" that raises on torch 2.9-2.13."""
    if importlib.util.find_spec("lightning") is None:  # imported in the subprocess only
        pytest.skip("lightning is in requirements.txt: run make venv")
    (tmp_path / "check.py").write_text(LIGHTNING_CHECK)
    out = run([sys.executable, "check.py", PRECISION], cwd=tmp_path).stdout
    assert "Lightning's check passed: high" in out
