"""Measure how ddp.py's throughput grows with the number of processes, and write a CSV.

Runs ddp.py (beside this script) with torchrun once per process count on this node, each
process with one thread, and writes processes, images/s (of the last epoch) and the speed-up
over one process to --output, with the command and the machine in comment lines. The guide's
table is this script's output.

    python ddp_scaling.py --processes 1 2 --output ddp_scaling.csv
"""

import argparse
import csv
import os
import platform
import re
import subprocess
import sys
from pathlib import Path


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def fail(message, code=2):
    print(f"ddp_scaling.py: error: {message}", file=sys.stderr)
    sys.exit(code)


def writable_file(text):
    """An output file: its folder created if needed; the reason given when it cannot be."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise argparse.ArgumentTypeError(f"{path.parent} is a file, not a folder") from None
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot create {path.parent}: {error.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {path.parent}: permission denied")
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--processes", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--fake-size", type=positive_int, default=8192)
    parser.add_argument("--output", type=writable_file, default=Path("ddp_scaling.csv"))
    return parser.parse_args(argv)


def machine(device):
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {len(os.sched_getaffinity(0))} CPUs"
    return platform.processor() or "unknown CPU"


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda but PyTorch sees no GPU: run it in a job given GPUs "
                 "(#SBATCH --gpus-per-node=N), or with --device cpu")  # fmt: skip
    script = Path(__file__).with_name("ddp.py")
    options = [f"--device={args.device}", "--fake-data", f"--fake-size={args.fake_size}",
               f"--epochs={args.epochs}", "--num-workers=0"]  # fmt: skip
    rows = []
    for processes in args.processes:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={processes}", str(script), *options]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        rates = re.findall(r"^epoch \d+: loss \S+, (\d+) images/s$", proc.stdout, re.M)
        if proc.returncode != 0 or not rates:
            # torchrun ends with a box of ===; the processes' own one-line errors say why.
            lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ddp.py: error:")] or [
                line for line in lines if "error" in line.lower() and "=" not in line[:3]
            ]
            why = " | ".join(dict.fromkeys(errors[-3:] or lines[-1:] or ["no output"]))
            fail(f"{processes} processes failed: {why}", code=1)
        rows.append({"processes": processes, "images_per_s": int(rates[-1])})
        print(f"{processes} processes: {rates[-1]} images/s")
    for row in rows:
        row["speedup"] = f"{row['images_per_s'] / rows[0]['images_per_s']:.2f}"

    import torch

    with args.output.open("w", newline="") as file:
        file.write(f"# torchrun --standalone --nproc-per-node=N ddp.py {' '.join(options)}\n")
        file.write(f"# {machine(args.device)}, PyTorch {torch.__version__}, 1 thread each\n")
        writer = csv.DictWriter(file, fieldnames=["processes", "images_per_s", "speedup"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"Wrote {args.output}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("ddp_scaling.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
