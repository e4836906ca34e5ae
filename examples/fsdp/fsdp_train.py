"""Train a model with FSDP2 (fully_shard): each process holds only a shard of the parameters.

fully_shard splits every parameter, its gradient and its optimizer state across the processes
(one per GPU), like DeepSpeed's ZeRO-3: before a block runs, its full parameters are gathered,
and freed again afterwards. Each block of the model is sharded first, then the root. Options
choose what is kept: --no-reshard keeps the gathered parameters from the forward to the
backward pass (ZeRO-2-like), --cpu-offload keeps the shards and the optimizer step on the CPU,
--replicate 2 shards within groups of processes and replicates across them (HSDP). The script
runs under torchrun or as one Slurm task per GPU, with nccl on GPUs and gloo on CPUs. It prints
how many parameters each process holds, then the loss and images/s of every epoch.

    torchrun --standalone --nproc-per-node=2 fsdp_train.py --fake-data
    sbatch fsdp.sbatch --fake-data                  # one Slurm task per GPU, two nodes
    sbatch fsdp.sbatch --fake-data --replicate 2    # HSDP: shard in a node, replicate across
"""

import argparse
import datetime
import gc
import glob
import math
import os
import socket
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
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="DataLoader workers per rank"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--width", type=positive_int, default=512, help="features of each block")
    parser.add_argument("--blocks", type=positive_int, default=4, help="residual blocks")
    parser.add_argument("--param-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="compute dtype; auto: bfloat16 on GPU")  # fmt: skip
    parser.add_argument("--no-reshard", action="store_true", help="ZeRO-2-like: keep gathered "
                        "parameters from forward to backward")  # fmt: skip
    parser.add_argument("--cpu-offload", action="store_true", help="shards, gradients and "
                        "optimizer state in CPU memory")  # fmt: skip
    parser.add_argument("--replicate", type=positive_int, default=1, help="HSDP: replicas, "
                        "each sharded over world/replicate processes")  # fmt: skip
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"fsdp_train.py: error: {message}", file=sys.stderr)
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
    """(rank, world size, local rank) from torchrun's variables, or else from srun's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        how = "start this script with torchrun or srun (see fsdp.sbatch)"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see fsdp.sbatch)"
    missing = [name for name in (*names, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        fail(f"{', '.join(missing)} not set: {how}")
    rank, world, local_rank = (env_int(name) for name in names)
    if not 0 < env_int("MASTER_PORT") < 65536:  # checked here: torch's error is a traceback
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not 0 <= rank < world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    return rank, world, local_rank


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


def make_model(torch, width, blocks):
    nn = torch.nn

    class Block(nn.Module):
        """A residual MLP block: the unit that fully_shard gathers and frees at once."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, width),
        nn.Sequential(*(Block() for _ in range(blocks))),
        nn.LayerNorm(width),
        nn.Linear(width, 10),
    )


def shard_model(torch, model, mesh, args, use_cuda):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {
        "mesh": mesh,
        "reshard_after_forward": not args.no_reshard,  # True: ZeRO-3, False: ZeRO-2-like
        # Gathered parameters in param_dtype for compute; the shards, the optimizer step and
        # the gradient reduction stay in float32.
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32
        ),
    }
    if args.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=use_cuda)
    for block in model[2]:  # the residual blocks, each gathered in one all-gather
        fully_shard(block, **options)
    # Then the root, which takes the other parameters (first and last layers). The backward
    # pass starts with the last layer: keeping them gathered saves an all-gather.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    return model


def make_mesh(device, world, replicate):
    """The processes as a 1-D mesh (FSDP) or as replicate x shard (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    # Shard along the last dimension, replicate along the first: ranks 0 to world/replicate - 1
    # form the first shard group, so that with ranks in node order a group is one node.
    shape = (replicate, world // replicate)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    if args.replicate < 1 or world % args.replicate:
        fail(f"--replicate {args.replicate} does not divide the {world} processes")
    import torch
    import torch.distributed as dist

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if args.param_dtype == "auto":
        args.param_dtype = "bfloat16" if use_cuda else "float32"
    gpu = gpu_index(local_rank, torch.cuda.device_count()) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        announce_gpu(torch, device)
    dataset = make_dataset(torch, args)  # before joining the others: a missing folder stops all
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
        # The group's timeout bounds every later collective: while rank 0 evaluates or saves,
        # the others wait in the next one. Give it minutes, not the start-up's seconds.
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
            device_id=device if use_cuda else None,
        )
        dist.barrier()  # returns only once all processes have joined
    except (RuntimeError, TimeoutError) as error:  # DistNetworkError and DistStoreError too
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        fail(
            f"rank {rank}: not all {world} processes reached {address} within "
            f"{args.init_timeout} s ({first_line}); check that the world size matches the "
            "processes started and that MASTER_ADDR is the first node of the job"
        )

    mesh = make_mesh(device, world, args.replicate)
    torch.manual_seed(args.seed)  # the same full model in every rank before it is sharded
    model = make_model(torch, args.width, args.blocks)
    model = shard_model(torch, model, mesh, args, use_cuda)
    # After fully_shard the parameters are DTensors: numel() is the full size, to_local() the
    # shard this process holds. The optimizer, created afterwards, keeps state for the shard.
    held = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    holdings = [None] * world
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    dist.all_gather_object(holdings, (node, held))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        persistent_workers=args.num_workers > 0,
    )
    if rank == 0:
        replicas = f", {args.replicate} replicas" if args.replicate > 1 else ""
        print(f"{world} processes, {device.type} ({dist.get_backend()}), shards of "
              f"1/{world // args.replicate}{replicas}, "
              f"compute in {args.param_dtype}, reshard after forward: {not args.no_reshard}, "
              f"CPU offload: {args.cpu_offload}")  # fmt: skip
        for i, (where, count) in enumerate(holdings):
            print(f"rank {i} on {where} holds {count:,} of {total:,} parameters "
                  f"({100 * count / total:.1f}%)")  # fmt: skip

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle in every epoch
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
            loss.backward()  # gradients are reduce-scattered: each rank keeps its shard
            optimizer.step()  # updates the local shard only
            optimizer.zero_grad(set_to_none=True)
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)  # sums over all processes
        seconds = time.perf_counter() - start
        memory = ""
        if use_cuda:
            memory = f", {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB peak on rank 0"
        loss_sum, images_seen = totals.tolist()  # the same in every rank: all stop together
        if not math.isfinite(loss_sum):
            hint = " (or --param-dtype float32)" if args.param_dtype == "bfloat16" else ""
            fail(f"loss is {loss_sum / images_seen} at epoch {epoch + 1}, "
                 f"step {(epoch + 1) * len(loader)}: lower --lr{hint}")  # fmt: skip
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s{memory}")  # fmt: skip
    del model, optimizer, mesh  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.barrier()  # no rank tears its groups down while another still communicates
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("fsdp_train.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
