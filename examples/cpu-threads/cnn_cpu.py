"""Train a small CIFAR-10-style CNN on CPU cores and print its throughput in images/s.

PyTorch uses as many threads as it was given cores: from SLURM_CPUS_PER_TASK inside a Slurm
job, else from the CPU affinity of the process (never the whole node's core count, which a
shared node does not give you). --fake-data trains on generated images, so the script runs
anywhere; real data must be downloaded first, on a login node.

    python cnn_cpu.py --fake-data
    sbatch cnn_cpu.sbatch --fake-data
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path


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


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def folder_path(text):
    """A folder that may not exist yet, but cannot be a file or lie under one."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=0, help="DataLoader processes"
    )
    parser.add_argument("--data-dir", type=folder_path, default="data", help="CIFAR-10 folder")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=4096, help="generated images")
    parser.add_argument(
        "--threads", type=positive_int, help="intra-op threads (default: allocated CPUs)"
    )
    parser.add_argument("--interop-threads", type=positive_int, default=1, help="inter-op threads")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"cnn_cpu.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_count(name):
    """A count set by the scheduler (1 or more), or one line naming the variable and its value."""
    value = os.environ[name]
    if not (value.isdecimal() and int(value) > 0):
        fail(f"{name}={value!r} is not a whole number above 0 (set by Slurm, or in the job script)")
    return int(value)


def allocated_cpus():
    """The CPUs this process may use: Slurm's allocation, else the CPU affinity mask."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return env_count("SLURM_CPUS_PER_TASK"), "SLURM_CPUS_PER_TASK"
    return len(os.sched_getaffinity(0)), "CPU affinity"


def make_dataset(torch, args):
    if args.fake_data:
        # Ten classes: each image is its class's random pattern plus noise, so the model can learn.
        generator = torch.Generator().manual_seed(args.seed)
        patterns = torch.randn(10, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (args.fake_size,), generator=generator)
        images = patterns[labels] + 0.5 * torch.randn(
            args.fake_size, 3, 32, 32, generator=generator
        )
        return torch.utils.data.TensorDataset(images, labels)
    if not (args.data_dir / "cifar-10-batches-py").is_dir():
        fail(
            f"no CIFAR-10 in {args.data_dir}: download it once on a login node with "
            f"python -c \"from torchvision.datasets import CIFAR10; CIFAR10('{args.data_dir}', "
            'download=True)", or pass --fake-data'
        )
    import torchvision

    transform = torchvision.transforms.Compose(
        [
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.5,) * 3, (0.25,) * 3),
        ]
    )
    try:  # torchvision checks the MD5 sum of every file first
        return torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=transform)
    except RuntimeError:  # "Dataset not found or corrupted": its advice, download=True, needs
        fail(  # the internet, which compute nodes rarely reach
            f"CIFAR-10 in {args.data_dir} is incomplete or damaged (a file fails its checksum, "
            f"as after an interrupted download): remove {args.data_dir / 'cifar-10-batches-py'} "
            "and download it again on a login node, or pass --fake-data"
        )


def make_model(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    import torch

    cpus, source = allocated_cpus()
    threads = args.threads or cpus
    torch.set_num_threads(threads)  # intra-op: threads inside one operation
    torch.set_num_interop_threads(args.interop_threads)  # inter-op: operations side by side
    torch.manual_seed(args.seed)
    dataset = make_dataset(torch, args)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers
    )
    model = make_model(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(
        f"{len(dataset)} images, {threads} threads ({cpus} CPUs from {source}), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )

    rates, step = [], 0
    for epoch in range(1, args.epochs + 1):
        seen, total_loss, start = 0, 0.0, time.perf_counter()
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            value, step = loss.item(), step + 1
            if not math.isfinite(value):  # stop before it spoils the weights
                fail(f"loss is {value} at epoch {epoch}, step {step}: lower --lr")
            loss.backward()
            optimizer.step()
            seen += len(images)
            total_loss += value * len(images)
        rate = seen / (time.perf_counter() - start)
        rates.append(rate)
        print(f"epoch {epoch}: loss {total_loss / seen:.3f}, {rate:.0f} images/s")
    # The first epoch includes one-off start-up costs: report the best of the others.
    best = max(rates[1:] or rates)
    print(f"Throughput: {best:.0f} images/s with {threads} threads")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("cnn_cpu.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
