"""Train a CNN on one GPU with the settings that keep the GPU busy, and print images/s.

The settings: batch size, DataLoader workers (one per allocated CPU core), pinned memory with
non-blocking copies, the channels_last memory format, mixed precision (bfloat16 by default)
and, optionally, torch.compile. --benchmark trains with the common naive loop (no workers,
float32, small batches) and with the tuned one, in the same process, and prints the ratio.

    python cnn_gpu.py --fake-data
    python cnn_gpu.py --fake-data --benchmark
    sbatch cnn_gpu.sbatch --fake-data --benchmark
"""

import argparse
import glob
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
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument(
        "--num-workers", type=non_negative_int, help="default: allocated CPUs minus one"
    )
    parser.add_argument("--data-dir", type=folder_path, default="data", help="CIFAR-10 folder")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=20000, help="generated images")
    parser.add_argument("--amp", choices=["bf16", "fp16", "none"], default="bf16")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action="store_true", help="compile the model first")
    parser.add_argument("--benchmark", action="store_true", help="naive loop, then tuned loop")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"cnn_gpu.py: error: {message}", file=sys.stderr)
    sys.exit(2)


# The scheduler's word that this job was given GPUs: lists of GPU indices ("0" is a GPU), then
# counts ("0" is none; the guide's .pbs scripts export JOB_GPUS from the job's request).
GPU_LIST_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SGE_HGR_gpu")
GPU_COUNT_VARIABLES = ("PBS_NGPUS", "JOB_GPUS")
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")
# Signs of an Apptainer/Singularity or Podman container (Docker passes no job variables in).
CONTAINER_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")
CONTAINER_FILES = ("/.singularity.d", "/run/.containerenv")


def gpus_given():
    """'NAME=value' of the first scheduler variable that gave this job GPUs, or None. Inside a
    Slurm step (srun), SLURM_JOB_GPUS is the job's, copied into every step: it does not count."""
    for name in GPU_LIST_VARIABLES + GPU_COUNT_VARIABLES:
        value = os.environ.get(name, "").strip()
        none = ("", "0") if name in GPU_COUNT_VARIABLES else ("", "(null)", "-1", "NoDevFiles")
        in_step = name == "SLURM_JOB_GPUS" and "SLURM_STEP_ID" in os.environ
        if value not in none and not in_step:
            return f"{name}={value}"
    return None


def gpu_usable(torch):
    """True when PyTorch can use a GPU. When it cannot in a job given GPUs, on a node with GPU
    device files or in a container (started without GPU support), stop in one line: a job given
    GPUs never trains on the CPU unnoticed. A bare CUDA_VISIBLE_DEVICES counts on a GPU node."""
    if torch.cuda.is_available():
        return True
    devices = any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)
    container = any(os.environ.get(name) for name in CONTAINER_VARIABLES) or any(
        os.path.exists(path) for path in CONTAINER_FILES
    )
    given = gpus_given() if devices or container else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if devices and not given and visible not in ("", "(null)", "-1", "NoDevFiles"):
        given = f"CUDA_VISIBLE_DEVICES={visible}"
    if given:
        fix = "run check_pytorch.py in the job to see why"
        if not devices:  # a container started without them
            fix = "start the container with GPU support (apptainer --nv, podman --gpus all)"
        fail(f"this job was given GPUs ({given}) but PyTorch {torch.__version__} can use none: "
             f"{fix}, or pass --device cpu")  # fmt: skip
    return False


def announce_gpu(torch, device):
    """One line per process that runs on a GPU: make site-check counts the GPUs that ran."""
    props = torch.cuda.get_device_properties(device)
    print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)


def env_count(name):
    """A count set by the scheduler (1 or more), or one line naming the variable and its value."""
    value = os.environ[name]
    if not (value.isdecimal() and int(value) > 0):
        fail(f"{name}={value!r} is not a whole number above 0 (set by the scheduler, or in the "
             "job script)")  # fmt: skip
    return int(value)


def allocated_cpus():
    """The cores the scheduler gave: Slurm's cpus-per-task, PBS's ncpus, else the affinity mask."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return env_count("SLURM_CPUS_PER_TASK")
    if os.environ.get("PBS_JOBID") and os.environ.get("NCPUS"):
        return env_count("NCPUS")
    return len(os.sched_getaffinity(0))


class FakeImages:
    """CIFAR-10-like images stored as bytes and augmented per item on the CPU, as real
    datasets are: this is the work DataLoader workers take off the training loop."""

    def __init__(self, torch, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        patterns = torch.rand(10, 3, 32, 32, generator=generator) * 255
        noise = torch.rand(size, 3, 32, 32, generator=generator) * 64
        self.images = (patterns[self.labels] * 0.75 + noise).to(torch.uint8)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        # Import here, not keep the module on self: DataLoader workers receive the dataset
        # pickled under the forkserver and spawn start methods (forkserver: Python 3.14's
        # default), and a module cannot be pickled.
        import torch

        image = self.images[index].float().div(255)
        if torch.rand(()) < 0.5:
            image = image.flip(-1)  # random horizontal flip
        image = (image - 0.5) / 0.25
        return image, self.labels[index]


def make_dataset(torch, args):
    if args.fake_data:
        return FakeImages(torch, args.fake_size, args.seed)
    if not (args.data_dir / "cifar-10-batches-py").is_dir():
        fail(
            f"no CIFAR-10 in {args.data_dir}: download it once on a login node with "
            f"python -c \"from torchvision.datasets import CIFAR10; CIFAR10('{args.data_dir}', "
            'download=True)", or pass --fake-data'
        )
    import torchvision

    transform = torchvision.transforms.Compose(
        [
            torchvision.transforms.RandomHorizontalFlip(),
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

    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    return nn.Sequential(
        block(3, 64), block(64, 128), nn.MaxPool2d(2),
        block(128, 256), nn.MaxPool2d(2), block(256, 512), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10),
    )  # fmt: skip


def train(
    torch,
    dataset,
    device,
    *,
    epochs,
    batch_size,
    workers,
    pin,
    channels_last,
    amp,
    compile_model,
    lr,
):
    """Train a fresh model; return (images/s of the fastest epoch, last epoch's mean loss).
    The loss reaches the CPU once per epoch, where the loop waits for the GPU anyway."""
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=pin,  # page-locked host memory: copies to the GPU can overlap compute
        persistent_workers=workers > 0,
        drop_last=True,
    )
    model = make_model(torch).to(device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    if compile_model:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": torch.float32}[amp]
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    best, steps = 0.0, 0
    for epoch in range(1, epochs + 1):
        seen, loss_sum = 0, torch.zeros((), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=pin, memory_format=memory_format)
            labels = labels.to(device, non_blocking=pin)
            optimizer.zero_grad(set_to_none=True)
            with torch.amp.autocast(device.type, dtype=dtype, enabled=amp != "none"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach() * len(images)  # no .item(): it would wait for the GPU
            seen, steps = seen + len(images), steps + 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, seen / (time.perf_counter() - start))
        loss = loss_sum.item() / seen
        if not math.isfinite(loss):
            hint = " (or use --amp bf16 rather than fp16)" if amp == "fp16" else ""
            fail(f"loss is {loss} at epoch {epoch}, step {steps}: lower --lr{hint}")
    return best, loss


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        announce_gpu(torch, device)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True  # pick the fastest convolution kernels for these shapes
    workers = args.num_workers if args.num_workers is not None else max(allocated_cpus() - 1, 0)
    dataset = make_dataset(torch, args)
    name = torch.cuda.get_device_name(device) if use_cuda else "CPU"
    print(f"{len(dataset)} images on {name}, PyTorch {torch.__version__}")
    tuned = {
        "batch_size": args.batch_size, "workers": workers, "pin": use_cuda,
        "channels_last": args.channels_last, "amp": args.amp, "compile_model": args.compile,
    }  # fmt: skip
    runs = {"tuned": tuned}
    if args.benchmark:
        naive = {"batch_size": 32, "workers": 0, "pin": False, "channels_last": False,
                 "amp": "none", "compile_model": False}  # fmt: skip
        runs = {"naive": naive, "tuned": tuned}
    batch = max(settings["batch_size"] for settings in runs.values())
    if len(dataset) < batch:  # every batch is full (drop_last): there would be none
        fail(f"{len(dataset)} images, fewer than one batch of {batch}: raise --fake-size")
    rates = {}
    for label, settings in runs.items():
        if use_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        rate, loss = train(torch, dataset, device, epochs=args.epochs, lr=args.lr, **settings)
        rates[label] = rate
        memory = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if use_cuda else "n/a"
        described = ", ".join(f"{key}={value}" for key, value in settings.items())
        print(
            f"{label}: {rate:.0f} images/s, loss {loss:.3f}, peak GPU memory {memory} ({described})"
        )
    if args.benchmark:
        print(f"Tuned / naive: {rates['tuned'] / rates['naive']:.1f}x")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("cnn_gpu.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
