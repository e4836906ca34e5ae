"""Train a small CNN on images read from tar shards, in one process or several (DDP).

The shards come from make_shards.py. Each process reads its own share of the shards, and each
DataLoader worker its own share of those, one file after another from start to end: a few
large sequential reads instead of one open per image. A shuffle buffer mixes the samples of
the shards it is reading. Read the shards from node-local disk where the job has one (see
train_shards.sbatch, which copies them there first). A shard cut short (an interrupted copy, a
full disk when it was written) or with a zero-filled hole (a copy still being written) stops the
run in one line that names it, before any training or while reading.

    python train_shards.py --data-dir shards
    torchrun --standalone --nproc-per-node=2 train_shards.py --data-dir shards
    sbatch train_shards.sbatch                 # stages the shards to each node, then trains
"""

import argparse
import contextlib
import datetime
import gc
import glob
import io
import math
import os
import random
import socket
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image


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
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number (got {text})")
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
    parser.add_argument(
        "--data-dir",
        type=folder_path,
        default=Path("shards"),
        help="the folder of shards made by make_shards.py",
    )
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=2,
        help="DataLoader processes per training process",
    )
    parser.add_argument("--shuffle-buffer", type=positive_int, default=1000, help="samples")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    return parser.parse_args(argv)  # fmt: skip


def fail(message):
    print(f"train_shards.py: error: {message}", file=sys.stderr)
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


def env_int(name, default=None):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        source = "srun" if name.startswith("SLURM_") else "torchrun, or in the job script"
        fail(f"{name}={text!r} is not a whole number (set by {source})")


def gpu_index(local_rank, visible):
    """The GPU of this process, given how many it sees: its local rank's when it sees the GPUs
    of the whole node, device 0 when Slurm bound one GPU to the task (--gpus-per-task=1)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        fail(
            f"local rank {local_rank} but {visible} GPUs visible: request one GPU per process "
            "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)"
        )
    return local_rank


def distributed_env():
    """(rank, world size, local rank): torchrun's variables, srun's, or a single process."""
    if "RANK" in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif env_int("SLURM_NTASKS", "1") > 1 and "SLURM_PROCID" in os.environ:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:  # one process: srun's variables, if set, must still be numbers
        for name in ("SLURM_PROCID", "SLURM_LOCALID"):
            env_int(name, "0")
        return 0, 1, 0
    missing = [name for name in (*names, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun or srun")
    rank, world, local_rank = (env_int(name) for name in names)
    if not 0 < env_int("MASTER_PORT") < 65536:  # checked here: torch's error is a traceback
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not 0 <= rank < world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    return rank, world, local_rank


def list_shards(data_dir):
    shards = sorted(data_dir.glob("*.tar"))
    if not shards or not (data_dir / "classes.txt").is_file():
        fail(
            f"no shards in {data_dir}: pack the dataset once, on a login node, with "
            f"python make_shards.py --input-dir <image folder> --output-dir {data_dir}"
        )
    for path in shards:  # one small read each: a complete tar ends in two zero blocks
        size = path.stat().st_size
        with open(path, "rb") as file:
            file.seek(max(size - 1024, 0))
            end = file.read(1024)
        if size % 512 or size < 1024 or end.count(0) != 1024:
            fail(damaged(path, "it does not end as a tar file does"))
    return shards


def zeros_to_end(path, offset):
    """Whether path holds only zero bytes from offset to its end, as a tar's last record does."""
    with open(path, "rb") as file:
        file.seek(offset)
        while chunk := file.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
    return True


def damaged(path, why):
    return (f"shard {path} is damaged ({why}): copy it again, or pack the dataset again "
            "with make_shards.py")  # fmt: skip


class DamagedShard(Exception):
    """A shard that ends too early: raised in a DataLoader worker, reported by main()."""


class ShardDataset(torch.utils.data.IterableDataset):
    """The samples of this process's shards, read sequentially and mixed in a buffer. Each
    DataLoader worker gets a pickled copy, so it holds only plain values (no open files)."""

    def __init__(self, shards, rank, world, seed, buffer_size):
        self.shards, self.rank, self.world = shards, rank, world
        self.seed, self.buffer_size, self.epoch = seed, buffer_size, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        order = self.shards[:]
        random.Random(self.seed + self.epoch).shuffle(order)  # the same in every process
        mine = order[self.rank :: self.world][worker::workers]
        rng = random.Random(f"{self.seed}-{self.epoch}-{self.rank}-{worker}")
        buffer = []
        for sample in self.samples(mine):
            buffer.append(sample)
            if len(buffer) >= self.buffer_size:
                yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def samples(self, files):
        for path in files:
            parts = {}
            try:
                with tarfile.open(path, mode="r|") as tar:  # a stream: one sequential read
                    for member in tar:
                        key, _, ext = member.name.partition(".")
                        if parts and key != parts["key"]:
                            yield decode(parts)
                            parts = {}
                        parts["key"] = key
                        parts[ext] = tar.extractfile(member).read()  # ReadError if cut
                    # A stream ends quietly where the data does, or at a zero block: check it
                    # reached the end, and that only zeros follow (no hole of a copy under way).
                    if tar.offset + 1024 > path.stat().st_size:
                        raise DamagedShard(damaged(path, "it ends before the end of the archive"))
                    if not zeros_to_end(path, tar.offset):
                        hole = f"zero bytes from byte {tar.offset} on, then data again"
                        raise DamagedShard(damaged(path, f"{hole}: a file still being written?"))
            except tarfile.TarError as error:
                raise DamagedShard(damaged(path, str(error))) from None
            if parts:
                yield decode(parts)


@contextlib.contextmanager
def reported(kind):
    """An error of kind, raised here or in a DataLoader worker, ends the run in its own line."""
    try:
        yield
    except kind as error:  # from a worker, its message ends the traceback DataLoader quotes
        fail(str(error).strip().splitlines()[-1].split(f"{kind.__name__}: ", 1)[-1])


def decode(parts):
    """A sample's image as a float tensor in [-1, 1], and its class."""
    image = next(data for ext, data in parts.items() if ext in ("png", "jpg", "jpeg"))
    pixels = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels).permute(2, 0, 1) / 127.5 - 1, int(parts["cls"])


def make_model(classes):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 4 * 4, classes),
    )  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    shards = list_shards(args.data_dir)
    classes = len((args.data_dir / "classes.txt").read_text().split())

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    gpu = gpu_index(local_rank, torch.cuda.device_count()) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        announce_gpu(torch, device)
    if world > 1:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            # Start-up fails fast: every process must reach rank 0 within --init-timeout. Under
            # torchrun, its agent already serves the store at MASTER_PORT: connect to it.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                env_int("MASTER_PORT"),
                world,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                timeout=datetime.timedelta(seconds=args.init_timeout),
            )
            # The group's timeout bounds every later collective: give it minutes.
            dist.init_process_group(
                "nccl" if use_cuda else "gloo",
                store=store,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=args.timeout),
                device_id=device if use_cuda else None,
            )
            dist.barrier()
        except (RuntimeError, TimeoutError) as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            fail(f"rank {rank}: not all {world} processes reached {address} within "
                 f"{args.init_timeout} s ({first_line})")  # fmt: skip
    if len(shards) < world * max(args.num_workers, 1) and rank == 0:
        print(f"warning: {len(shards)} shards for {world} x {max(args.num_workers, 1)} readers: "
              "some read nothing; make more, smaller shards")  # fmt: skip

    dataset = ShardDataset(shards, rank, world, args.seed, args.shuffle_buffer)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
    )
    torch.manual_seed(args.seed)  # the same initial weights in every replica
    model = make_model(classes).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"rank {rank}/{world} on {host}: reading {len(shards[rank::world])} of "
          f"{len(shards)} shards from {args.data_dir}")  # fmt: skip

    step = 0
    for epoch in range(1, args.epochs + 1):
        dataset.epoch = epoch
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        # Shards hold different numbers of images, so the processes may run out of batches at
        # different steps: join() lets those that finish early answer the others' all-reduces.
        with model.join() if world > 1 else contextlib.nullcontext(), reported(DamagedShard):
            for images, labels in loader:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                totals[0] += loss.detach() * len(labels)
                totals[1] += len(labels)
        if world > 1:
            dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        loss_sum, images_seen = totals.tolist()
        if not images_seen:
            fail(f"epoch {epoch} read no images from {args.data_dir}: are the shards empty?")
        if not math.isfinite(loss_sum):  # the same in every rank: all stop together
            fail(f"loss is {loss_sum / images_seen} at epoch {epoch}, step {step}: lower --lr")
        if rank == 0:
            processes = f"{world} processes" if world > 1 else "1 process"
            print(f"epoch {epoch}: loss {loss_sum / images_seen:.4f}, {images_seen:.0f} images, "
                  f"{images_seen / seconds:.0f} images/s ({processes})")  # fmt: skip
    del model, optimizer  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (DDP's reducer)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("train_shards.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
