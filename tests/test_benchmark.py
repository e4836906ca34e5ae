"""examples/benchmark/: the ResNet-family benchmark, its CSV, and the directives that show it."""

import csv
import re
import statistics
import sys

import pytest
import torch

from conftest import EXAMPLES, SOURCE, example_env, load_example, run

BENCHMARK = EXAMPLES / "benchmark" / "resnet_benchmark.py"
COMMITTED = EXAMPLES / "benchmark" / "resnet_benchmark.csv"
REFERENCE = EXAMPLES / "benchmark" / "source_figures.csv"
ALL_PRECISIONS = "double,float,half,bfloat16,amp_bf16"
CASE = re.compile(
    r"^(\w+) +(train|inference) +(\w+) +([\d.]+) ms/batch \(quartiles ([\d.]+)-([\d.]+)\) +"
    r"([\d.]+) images/s$",
    re.M,
)


def load_extension():
    return load_example(SOURCE / "_ext" / "benchmark_results.py")


def read_csv(path):
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def test_quick_run_measures_every_case_and_appends_to_the_csv(tmp_path):
    args = [sys.executable, BENCHMARK, "--quick", "--device", "cpu", "--precisions", ALL_PRECISIONS]
    out = run([*args, "--output-dir", "out"], cwd=tmp_path, timeout=300).stdout
    cases = CASE.findall(out)
    assert [(c[0], c[1], c[2]) for c in cases] == [
        ("resnet18", mode, precision)
        for mode in ("train", "inference")
        for precision in ALL_PRECISIONS.split(",")
    ], out
    for *_, median, q1, q3, rate in cases:
        assert float(q1) <= float(median) <= float(q3)
        # The printed median has one decimal: 3.6 ms may be 3.55 to 3.65 ms, 548 to 563 images/s.
        slowest, fastest = 2000 / (float(median) + 0.05), 2000 / max(float(median) - 0.05, 1e-9)
        assert slowest - 0.05 <= float(rate) <= fastest + 0.05, (median, rate)
    assert "driver n/a, torch 2.13.0" in out and "batch 2, 32x32 images" in out
    written = tmp_path / "out" / "resnet_benchmark.csv"
    assert f"Wrote 10 rows to {written.relative_to(tmp_path)}" in out
    rows = read_csv(written)
    assert list(rows[0]) == list(read_csv(COMMITTED)[0]), "the committed CSV has other columns"
    assert rows[0]["command"].startswith("resnet_benchmark.py --quick --device cpu")
    medians = [float(row["median_ms"]) for row in rows]  # 2 decimals; the printed ones have 1
    assert medians == pytest.approx([float(c[3]) for c in cases], abs=0.051)

    run([*args[:5], "--modes", "inference", "--output-dir", "out"], cwd=tmp_path, timeout=300)
    lines = written.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 + 10 + 4 and lines.count(lines[0]) == 1


def test_committed_csv_holds_full_runs_at_the_source_settings():
    rows = read_csv(COMMITTED)
    extension = load_extension()
    runs = {}  # the page averages the runs at the source's settings over the nine models
    for row in rows:
        if (row["batch_size"], row["image_size"]) == ("12", "224"):
            key = (row["device_name"], row["mode"], row["precision"])
            runs.setdefault(key, set()).add(row["model"])
    assert runs and all(models == set(extension.MODELS) for models in runs.values()), runs
    assert all(row["command"].startswith("resnet_benchmark.py ") for row in rows)
    for row in rows:
        assert float(row["q1_ms"]) <= float(row["median_ms"]) <= float(row["q3_ms"]), row


def test_summary_is_the_mean_of_the_nine_models():
    extension = load_extension()
    measured, reference = read_csv(COMMITTED), read_csv(REFERENCE)
    summary = extension.summarise(measured, reference, 12, 224)
    assert [row[:4] for row in summary[:2]] == [
        ("NVIDIA V100 (DGX-2)", "1.6.0", "reference", "train"),
        ("NVIDIA V100 (DGX-2)", "1.6.0", "reference", "inference"),
    ]
    assert summary[0][4] == {"double": 188, "float": 84, "half": 52}
    device, _, origin, mode, figures = summary[-1]
    assert origin == "measured"
    for precision, mean in figures.items():
        medians = [
            float(row["median_ms"])
            for row in measured
            if (row["device_name"], row["mode"], row["precision"]) == (device, mode, precision)
        ]
        assert len(medians) == 9 and mean == pytest.approx(statistics.fmean(medians))


def test_summary_refuses_a_run_that_lacks_a_model():
    extension = load_extension()
    measured = [row for row in read_csv(COMMITTED) if row["model"] != "resnet152"]
    with pytest.raises(extension.BenchmarkError, match="no figures for resnet152"):
        extension.summarise(measured, [], 12, 224)


def test_chart_draws_one_bar_per_figure():
    extension = load_extension()
    summary = extension.summarise(read_csv(COMMITTED), read_csv(REFERENCE), 12, 224)
    train = [row for row in summary if row[3] == "train"]
    svg = extension.svg_chart(train)
    legend = len(extension.PRECISIONS)
    assert svg.count("<rect") == legend + sum(len(row[4]) for row in train)
    assert "NVIDIA A100" in svg and ">188<" in svg


def test_chart_draws_no_zero_wide_bar_and_has_a_text_alternative():
    """A figure on a decade (100 ms) lies above the axis' origin, not on it; the chart is an
    image with a name screen readers announce."""
    extension = load_extension()
    summary = [("GPU", "2.13.0", "measured", "train", {"float": 100.0, "half": 1000.0})]
    svg = extension.svg_chart(summary, "en", "Training time")
    bars = re.findall(r'width="([\d.]+)" height="9"', svg)  # the legend's squares are 12 high
    assert len(bars) == 2 and all(float(w) > 10 for w in bars), bars
    assert 'role="img" aria-label="Training time"' in svg and "<title>Training time</title>" in svg


def test_numbers_and_cpu_names_follow_the_language():
    extension = load_extension()
    assert extension.number(5181.4, "en") == "5,181"
    assert extension.number(5181.4, "fr") == "5\u202f181"
    assert extension.number(5181.4, "ja") == "5,181"
    assert extension.device_label("NVIDIA V100 (DGX-2)") == "NVIDIA V100 (DGX-2)"
    assert extension.device_label("AMD EPYC (2 cores)") == "AMD EPYC (2 cores)"  # English build


def test_bad_model_name_is_refused(tmp_path):
    proc = run([sys.executable, BENCHMARK, "--models", "resnet19"], cwd=tmp_path, expect_rc=2)
    assert "choose from resnet18," in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only outcome")
def test_refuses_cuda_without_a_gpu(tmp_path):
    proc = run([sys.executable, BENCHMARK, "--quick"], cwd=tmp_path, expect_rc=2)
    assert "no GPU is visible: request one (Slurm: --gpus-per-node=1, PBS: " in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch")
def test_mismatched_torchvision_gets_a_one_line_message(tmp_path):
    env = example_env()
    del env["PYTHONPATH"]  # without the tests' shim, torchvision's CUDA build cannot load
    proc = run([sys.executable, BENCHMARK, "--quick", "--device", "cpu"], cwd=tmp_path,
               env=env, expect_rc=2)  # fmt: skip
    assert "cannot import torchvision (operator torchvision::nms does not exist)" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.gpu
def test_quick_run_on_the_gpu(tmp_path):
    args = ["--quick", "--precisions", ALL_PRECISIONS, "--output-dir", tmp_path]
    out = run([sys.executable, BENCHMARK, *args], cwd=tmp_path, timeout=300).stdout
    assert len(CASE.findall(out)) == 10, out
    row = read_csv(tmp_path / "resnet_benchmark.csv")[0]
    assert row["cuda"] == torch.version.cuda and row["driver"] not in ("n/a", "unknown")


@pytest.mark.gpu
def test_resnet50_mixed_precision_training_throughput(tmp_path, record_property):
    args = ["--models", "resnet50", "--modes", "train", "--precisions", "amp_bf16", "--steps", "30",
            "--batch-size", "256", "--channels-last", "--output-dir", tmp_path]  # fmt: skip
    run([sys.executable, BENCHMARK, *args], cwd=tmp_path, timeout=600)
    row = read_csv(tmp_path / "resnet_benchmark.csv")[0]
    rate = float(row["images_per_s"])
    device = row["device_name"]
    record_property("timing", f"ResNet-50 bf16 AMP training: {rate:.0f} images/s ({device})")
    if "H100" in device:
        assert rate >= 2700, f"{rate:.0f} images/s on {device}, target 2,700"
