"""examples/one-gpu/: the tuned single-GPU training loop and its naive-vs-tuned benchmark."""

import re
import sys

import pytest
import torch

from conftest import EXAMPLES, example_env, run

CNN = EXAMPLES / "one-gpu" / "cnn_gpu.py"
TINY = ["--fake-data", "--fake-size", "64", "--batch-size", "32", "--epochs", "1"]
RUN_LINE = r"^{}: (\d+) images/s, loss (\S+), peak GPU memory (\S+(?: GiB)?) \((.*)\)$"


def test_benchmark_runs_the_naive_and_the_tuned_loop(tmp_path):
    env = example_env(SLURM_CPUS_PER_TASK=2)
    out = run(
        [sys.executable, CNN, *TINY, "--benchmark"], cwd=tmp_path, env=env, timeout=300
    ).stdout
    naive = re.search(RUN_LINE.format("naive"), out, re.M)
    tuned = re.search(RUN_LINE.format("tuned"), out, re.M)
    assert naive and tuned, out
    assert "workers=0" in naive[4] and "amp=none" in naive[4] and "channels_last=False" in naive[4]
    assert "workers=1" in tuned[4] and "amp=bf16" in tuned[4] and "channels_last=True" in tuned[4]
    # The script prints the ratio of its exact rates to one decimal, and the rates to whole
    # images/s: the printed ratio is within 0.05 (rounding) of the printed rates' ratio, plus
    # what rounding the rates adds. Which loop is faster depends on the CPU (bf16 without
    # AVX512-BF16 or AMX is emulated and slower), so no verdict rests on it here.
    ratio = float(re.search(r"^Tuned / naive: (\S+)x$", out, re.M)[1])
    exact = int(tuned[1]) / int(naive[1])
    rounding = exact * (0.5 / int(tuned[1]) + 0.5 / int(naive[1])) * 1.01
    assert abs(ratio - exact) <= 0.05 + rounding + 1e-9, (ratio, exact, out)
    check_gpu_recording_shape(out)


HEADER = r"^(\d+) images on (.+), PyTorch (\S+)$"


def check_gpu_recording_shape(out):
    """The GPU run the page shows (cnn_gpu-h200.out, from a lent H200) has the lines that the
    script prints now, in the same order: the recording is not from an older script."""
    recorded = (EXAMPLES / "one-gpu" / "cnn_gpu-h200.out").read_text()
    shape = [r"^" + HEADER[1:], RUN_LINE.format("naive"), RUN_LINE.format("tuned"),
             r"^Tuned / naive: (\S+)x$"]  # fmt: skip
    for text in (out, recorded):
        lines = text.splitlines()
        assert len(lines) == 4, text
        assert all(re.match(p, line) for p, line in zip(shape, lines, strict=True)), text


def test_the_recorded_gpu_run_meets_the_target_ratio():
    """The page's H200 run: the tuned loop at least 5 times the naive one, as the issue asked,
    and the printed ratio is the ratio of the printed rates."""
    out = (EXAMPLES / "one-gpu" / "cnn_gpu-h200.out").read_text()
    assert re.match(HEADER, out.splitlines()[0])[2] == "NVIDIA H200"
    naive = re.search(RUN_LINE.format("naive"), out, re.M)
    tuned = re.search(RUN_LINE.format("tuned"), out, re.M)
    ratio = float(re.search(r"^Tuned / naive: (\S+)x$", out, re.M)[1])
    assert ratio == pytest.approx(int(tuned[1]) / int(naive[1]), abs=0.05)
    assert ratio >= 5, out


def test_tuned_loop_alone(tmp_path):
    out = run(
        [sys.executable, CNN, *TINY, "--num-workers", "0", "--amp", "none"], cwd=tmp_path
    ).stdout
    assert re.search(RUN_LINE.format("tuned"), out, re.M) and "naive" not in out


def test_without_data_it_says_how_to_fetch_it(tmp_path):
    proc = run([sys.executable, CNN, "--data-dir", tmp_path / "none"], cwd=tmp_path, expect_rc=2)
    assert "no CIFAR-10 in" in proc.stderr and "on a login node" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only outcome")
def test_refuses_cuda_without_a_gpu(tmp_path):
    proc = run([sys.executable, CNN, "--device", "cuda", "--fake-data"], cwd=tmp_path, expect_rc=2)
    assert "no GPU is visible" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.gpu
def test_benchmark_on_the_gpu(tmp_path, record_property):
    args = ["--device", "cuda", "--fake-data", "--benchmark", "--epochs", "2"]
    out = run([sys.executable, CNN, *args], cwd=tmp_path, timeout=600).stdout
    tuned = re.search(RUN_LINE.format("tuned"), out, re.M)
    assert tuned and tuned[3].endswith("GiB"), out
    ratio = float(re.search(r"^Tuned / naive: (\S+)x$", out, re.M)[1])
    record_property("timing", f"one GPU, tuned / naive: {ratio}x ({tuned[1]} images/s tuned)")
    assert ratio > 1, out


@pytest.mark.gpu
def test_compiled_model_on_the_gpu(tmp_path):
    args = ["--device", "cuda", "--fake-data", "--fake-size", "2048", "--epochs", "1", "--compile"]
    out = run([sys.executable, CNN, *args], cwd=tmp_path, timeout=600).stdout
    assert "compile_model=True" in out
