"""Benchmark the ResNet family on one GPU: training and inference in four precisions.

For each model (resnet18 to wide_resnet101_2), mode (train: forward, backward and optimizer
step; inference: forward without gradients) and precision (double, float, half, bfloat16;
amp_bf16 keeps float weights and runs under autocast), the script runs warm-up steps, then
times each step on a fresh random batch, synchronising with the GPU before reading the clock.
It prints and writes to a CSV the median milliseconds per batch, the spread (first and third
quartiles), images/s, the device, driver, torch and CUDA versions, and the command line.
An existing CSV is appended to, so runs on several GPUs can be collected in one file.

    python resnet_benchmark.py --output-dir results
    python resnet_benchmark.py --models resnet50 --modes train --precisions amp_bf16 \\
        --batch-size 256 --channels-last --output-dir results
    python resnet_benchmark.py --quick --device cpu --output-dir results   # seconds, on a CPU
    sbatch resnet_benchmark.sbatch --output-dir results
"""

import argparse
import csv
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = [
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2",
]  # fmt: skip
PRECISIONS = ["double", "float", "half", "bfloat16", "amp_bf16"]
COLUMNS = [
    "device_name", "driver", "torch", "cuda", "model", "mode", "precision", "batch_size",
    "image_size", "channels_last", "steps", "median_ms", "q1_ms", "q3_ms", "images_per_s",
    "command",
]  # fmt: skip


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def timed_steps(text):
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2: the spread needs two timings (got {text})"
        )
    return value


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def writable_dir(text):
    """An output folder: created if needed; the reason given when it cannot be."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot create {path}: {error.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {path}: permission denied")
    return path


def comma_list(choices):
    def parse(text):
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}")
        return items

    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", type=comma_list(MODELS), default=MODELS)
    parser.add_argument("--modes", type=comma_list(["train", "inference"]),
                        default=["train", "inference"])  # fmt: skip
    parser.add_argument("--precisions", type=comma_list(PRECISIONS), default=PRECISIONS[:4])
    parser.add_argument("--batch-size", type=positive_int, default=12, help="images per step")
    parser.add_argument("--image-size", type=positive_int, default=224, help="height and width")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=10, help="untimed steps per case"
    )
    parser.add_argument("--steps", type=timed_steps, default=50, help="timed steps per case")
    parser.add_argument("--lr", type=positive_float, default=0.01)
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    parser.add_argument("--output-dir", type=writable_dir, default=".")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="resnet18, 32x32 images, batches of 2: a smoke test"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.batch_size, args.image_size = ["resnet18"], 2, 32
        args.warmup, args.steps = 1, 2
    if "train" in args.modes and args.batch_size == 1 and args.image_size <= 32:
        parser.error("training on one image of 32x32 or less leaves batch norm one value per "
                     "channel: raise --batch-size or --image-size")  # fmt: skip
    return args


def fail(message):
    print(f"resnet_benchmark.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def announce_gpu(torch, device):
    """One line per process that runs on a GPU: make site-check counts the GPUs that ran."""
    props = torch.cuda.get_device_properties(device)
    print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)


def device_description(torch, device):
    """(device name, driver version, CUDA version) for the CSV."""
    if device.type == "cpu":
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cores = len(os.sched_getaffinity(0))
        return f"{names[0] if names else 'CPU'} ({cores} cores)", "n/a", "n/a"
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "--id=0"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return torch.cuda.get_device_name(device), driver, torch.version.cuda


def measure(torch, torchvision, device, model_name, mode, precision, args):
    """Milliseconds of each timed step for one case."""
    dtype = {"double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}.get(
        precision, torch.float32
    )
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = getattr(torchvision.models, model_name)(num_classes=1000)
    model = model.to(device=device, dtype=dtype, memory_format=memory_format)
    model.train(mode == "train")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=precision == "amp_bf16")
    shape = (args.batch_size, 3, args.image_size, args.image_size)

    def step():
        images = torch.randn(shape, device=device, dtype=dtype).contiguous(
            memory_format=memory_format
        )
        labels = torch.randint(0, 1000, (args.batch_size,), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the batch is ready before the clock starts
        start = time.perf_counter()
        if mode == "train":
            with autocast:
                loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        else:
            with torch.inference_mode(), autocast:
                model(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1000

    for _ in range(args.warmup):
        step()
    return [step() for _ in range(args.steps)]


def write_rows(path, rows):
    """Append rows to the CSV, through a temporary file and a rename (never half-written)."""
    old = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    if old and old[0].strip() != ",".join(COLUMNS):
        fail(f"{path} has other columns; pass another --output-dir")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8", newline="") as handle:
        handle.writelines(old)
        writer = csv.DictWriter(handle, COLUMNS, lineterminator="\n")
        if not old:
            writer.writeheader()
        writer.writerows(rows)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def main(argv=None):
    args = parse_args(argv)
    import torch

    try:
        import torchvision
    except (ImportError, RuntimeError) as error:  # missing, or built for another torch
        first_line = str(error).splitlines()[0]
        fail(f"cannot import torchvision ({first_line}); install the torchvision release "
             f"built for torch {torch.__version__}")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("no GPU is visible: request one (Slurm: --gpus-per-node=1, PBS: -l select=1:"
             "ncpus=4:ngpus=1, Grid Engine: -l gpu=1), or pass --device cpu")  # fmt: skip
    device = torch.device(args.device)
    if device.type == "cuda":
        announce_gpu(torch, device)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True  # fastest convolution kernels for the fixed shape
    name, driver, cuda = device_description(torch, device)
    command = shlex.join(["resnet_benchmark.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"{name}, driver {driver}, torch {torch.__version__}, CUDA {cuda}")
    print(f"batch {args.batch_size}, {args.image_size}x{args.image_size} images, "
          f"{args.warmup} warm-up and {args.steps} timed steps per case")  # fmt: skip

    output = args.output_dir / "resnet_benchmark.csv"
    rows = []
    for model_name in args.models:
        for mode in args.modes:
            for precision in args.precisions:
                try:
                    times = measure(torch, torchvision, device, model_name, mode, precision, args)
                except torch.OutOfMemoryError:
                    print(f"{model_name:17} {mode:9} {precision:8} out of memory: skipped")
                    torch.cuda.empty_cache()
                    continue
                q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
                rate = args.batch_size / median * 1000
                print(f"{model_name:17} {mode:9} {precision:8} {median:9.1f} ms/batch "
                      f"(quartiles {q1:.1f}-{q3:.1f}) {rate:8.1f} images/s")  # fmt: skip
                rows.append({
                    "device_name": name, "driver": driver, "torch": torch.__version__,
                    "cuda": cuda, "model": model_name, "mode": mode, "precision": precision,
                    "batch_size": args.batch_size, "image_size": args.image_size,
                    "channels_last": args.channels_last, "steps": args.steps,
                    "median_ms": f"{median:.2f}", "q1_ms": f"{q1:.2f}", "q3_ms": f"{q3:.2f}",
                    "images_per_s": f"{rate:.1f}", "command": command,
                })  # fmt: skip
    if not rows:
        fail("no case could be measured")
    write_rows(output, rows)
    print(f"Wrote {len(rows)} rows to {output}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("resnet_benchmark.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
