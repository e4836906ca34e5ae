"""Train a CNN with Horovod: one process per GPU, started by horovodrun, gradients averaged.

Horovod is an older alternative to DistributedDataParallel (see ddp.py): horovodrun starts the
processes and tells each its rank; hvd.DistributedOptimizer averages the gradients of all
processes with an allreduce before every step, and rank 0 broadcasts its initial weights and
optimizer state so that every process starts from the same model. --lr is the learning rate of
one process and is multiplied by the number of processes. Rank 0 prints the loss of every
epoch, averaged over all processes. Build Horovod first with install_horovod.sh.

    horovodrun -np 2 -H localhost:2 --gloo python horovod_train.py --fake-data
    sbatch horovod.sbatch --fake-data               # one process per GPU, two nodes
"""

import argparse
import glob
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

# Set by horovodrun --gloo in every process it starts.
HOROVODRUN_VARIABLES = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
)


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
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.0125, help="for one process")
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="DataLoader workers per rank"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to wait for ranks"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"horovod_train.py: error: {message}", file=sys.stderr)
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


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        fail(f"{name}={text!r} is not a whole number (set by horovodrun)")


def import_horovod():
    if importlib.util.find_spec("horovod") is None:
        fail("Horovod is not installed in this Python: build it with install_horovod.sh")
    try:
        import horovod.torch as hvd
    except ImportError as error:  # built for another torch, or without PyTorch support
        fail(f"horovod.torch does not load ({error}): rebuild it with install_horovod.sh")
    return hvd


def make_dataset(torch, args):
    if args.fake_data:
        generator = torch.Generator().manual_seed(args.seed)  # the same data in every rank
        labels = torch.randint(0, 10, (args.fake_size,), generator=generator)
        patterns = torch.randn(10, 3, 32, 32, generator=generator)
        images = patterns[labels] + torch.randn(args.fake_size, 3, 32, 32, generator=generator)
        return torch.utils.data.TensorDataset(images, labels)
    if not (args.data_dir / "cifar-10-batches-py").is_dir():
        fail(
            f"no CIFAR-10 in {args.data_dir}: download it once on a login node with "
            f"python -c \"from torchvision.datasets import CIFAR10; CIFAR10('{args.data_dir}', "
            'download=True)", or pass --fake-data'
        )  # never download here: every rank would write the same files at once
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
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    hvd = import_horovod()
    missing = [name for name in HOROVODRUN_VARIABLES if name not in os.environ]
    if missing:  # without them, every process would train alone as rank 0 of 1
        fail(f"{', '.join(missing)} not set: start this script with horovodrun --gloo")
    for name in HOROVODRUN_VARIABLES:  # whole numbers but the address: checked before Horovod
        if name != "HOROVOD_GLOO_RENDEZVOUS_ADDR":
            env_int(name)
    import torch

    # Horovod's rendezvous waits this long for every process; when one is missing, Horovod stops
    # this one ("Wait timeout after N seconds") and horovodrun stops the others.
    os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(args.init_timeout)
    hvd.init()
    hvd.barrier()  # returns only once all processes have joined
    rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda and local_rank >= torch.cuda.device_count():
        fail(
            f"local rank {local_rank} but {torch.cuda.device_count()} GPUs visible: request one "
            "GPU per process (#SBATCH --gpus-per-node equal to --ntasks-per-node)"
        )
    if use_cuda and not hvd.cuda_built():
        fail("this Horovod was built for CPU tensors only: rebuild it with "
             "`bash install_horovod.sh --gpu`, or pass --device cpu")  # fmt: skip
    if use_cuda:
        torch.cuda.set_device(local_rank)  # one GPU per process, picked by its local rank
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        announce_gpu(torch, device)

    dataset = make_dataset(torch, args)
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=size, rank=rank, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        persistent_workers=args.num_workers > 0,
    )
    torch.manual_seed(args.seed + rank)  # different weights per rank: the broadcast fixes that
    model = make_model(torch).to(device)
    lr = args.lr * size  # linear scaling with the number of processes
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # Averages the gradients of all processes (allreduce) before each optimizer step.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    # Every process starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if rank == 0:
        print(f"{size} processes on {hvd.cross_size()} node(s), {device.type}, batch "
              f"{args.batch_size} per process, learning rate {lr:.4g}")  # fmt: skip

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle in every epoch
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()  # Horovod's zero_grad() takes no arguments
            loss.backward()  # gradients are sent to the allreduce as they are ready
            optimizer.step()  # waits for the averaged gradients, then updates
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        # The mean over all processes (every process sees as many images: DistributedSampler).
        mean_loss = hvd.allreduce(totals[0] / totals[1], name="epoch_loss").item()
        seconds = time.perf_counter() - start
        if not math.isfinite(mean_loss):  # the same in every process: all stop together
            fail(f"loss is {mean_loss} at epoch {epoch + 1}, "
                 f"step {(epoch + 1) * len(loader)}: lower --lr")  # fmt: skip
        if rank == 0:
            images_seen = totals[1].item() * size
            print(f"epoch {epoch + 1}: loss {mean_loss:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
    hvd.shutdown()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("horovod_train.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
