"""Watch the resident memory of a training loop, and which CPU kernels PyTorch uses.

A training loop's resident memory (VmRSS) rises during the first steps, while the allocator
and the libraries set themselves up, then stays flat. Memory that keeps growing step after step
is a leak: in your code (keeping losses with their graph in a list, for instance) or in the
libraries. Old releases had such leaks on AVX-512 nodes (PyTorch before 1.0.1 with cuDNN before
7.5 or MAGMA before 2.5), which a current release fixes. The script prints the CPU capability
PyTorch's kernels use (ATEN_CPU_CAPABILITY=avx2 or default forces a lower one, to compare) and
the resident memory after --warmup steps and after --steps more, and exits with 1 when it grew
by more than --tolerance-mb. --leak keeps every step's loss with its whole graph
(backward with retain_graph=True), to show what a leak looks like.

    python memory_growth.py
    ATEN_CPU_CAPABILITY=avx2 python memory_growth.py
    python memory_growth.py --leak
"""

import argparse
import math
import sys


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


def non_negative_float(text):
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=positive_int, default=200, help="steps measured")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=20, help="steps before the first reading"
    )
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument(
        "--tolerance-mb", type=non_negative_float, default=10, help="MiB still called flat"
    )
    parser.add_argument("--leak", action="store_true", help="keep every loss with its graph")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def resident_mb():
    """This process's resident memory now, from the kernel (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB to MiB
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv=None):
    args = parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []  # what --leak fills
    readings = {0: resident_mb()} if args.warmup == 0 else {}  # --warmup 0: before step 1
    for step in range(1, args.warmup + args.steps + 1):
        inputs = torch.randn(args.batch_size, 256)
        labels = torch.randint(0, 10, (args.batch_size,))
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward(retain_graph=args.leak)
        optimizer.step()
        kept.append(loss if args.leak else loss.item())  # a tensor keeps its whole graph
        if step in (args.warmup, args.warmup + args.steps):
            readings[step] = resident_mb()
    (first, before), (last, after) = readings.items()
    growth = after - before
    print(f"resident memory: {before:.0f} MiB after step {first}, {after:.0f} MiB after step "
          f"{last}: {growth:+.1f} MiB")  # fmt: skip
    if growth > args.tolerance_mb:
        print(f"memory grows: {growth / args.steps * 1024:.0f} KiB per step")
        sys.exit(1)
    print("no growth")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("memory_growth.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
