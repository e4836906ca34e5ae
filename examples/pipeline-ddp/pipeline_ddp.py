"""Train a CNN with pipeline and data parallelism: replicas of a two-stage pipeline.

The processes form a 2-D device mesh of data-parallel replicas ("dp") times pipeline stages
("pp"): with 4 processes, 2 replicas of the two-stage pipeline of pipeline.py. Inside a
replica, the stages exchange activations and gradients (torch.distributed.pipelining); each
stage is wrapped in DistributedDataParallel over its "dp" group, so that the stages that hold
the same layers in different replicas average their gradients. Each replica trains on its own
part of the data (DistributedSampler). The last stage of replica 0 prints where each process
runs, then the loss of every epoch. The number of processes must be a multiple of 2; it runs
under torchrun or as Slurm tasks, with nccl on GPUs and gloo on CPUs.

    torchrun --standalone --nproc-per-node=4 pipeline_ddp.py --fake-data
    sbatch pipeline_ddp.sbatch --fake-data          # two nodes, two GPUs each
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


STAGES = 2  # pipeline stages in each replica


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument(
        "--microbatches", type=positive_int, default=4, help="micro-batches per batch"
    )
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per replica")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="for a global batch of 256")
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="DataLoader workers per rank"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"pipeline_ddp.py: error: {message}", file=sys.stderr)
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
        how = "start this script with torchrun or srun (see the job script)"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see pipeline_ddp.sbatch)"
    missing = [name for name in (*names, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        fail(f"{', '.join(missing)} not set: {how}")
    rank, world, local_rank = (env_int(name) for name in names)
    if not 0 < env_int("MASTER_PORT") < 65536:  # checked here: torch's error is a traceback
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if world % STAGES:
        fail(f"{world} processes started: a multiple of {STAGES} needed (replicas x stages)")
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


def make_stage_module(torch, stage_index, seed):
    """This rank's part of the model: the same weights in every replica."""
    torch.manual_seed(seed)
    model = make_model(torch)
    return model[:3] if stage_index == 0 else model[3:]  # cut after the first conv block


def main(argv=None):
    args = parse_args(argv)
    if args.microbatches < STAGES or args.batch_size % args.microbatches:
        fail(
            f"--batch-size {args.batch_size} must split into --microbatches {args.microbatches} "
            f"equal micro-batches, at least {STAGES} (one per stage)"
        )
    rank, world, local_rank = distributed_env()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    gpu = gpu_index(local_rank, torch.cuda.device_count()) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        announce_gpu(torch, device)
    dataset = make_dataset(torch, args)  # before waiting for the other processes
    if len(dataset) < args.batch_size * (world // STAGES):
        fail(f"{len(dataset)} images, fewer than one batch for each of {world // STAGES} replicas")
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

    # [mesh-start]
    replicas = world // STAGES
    # Rank r is stage r % 2 of replica r // 2: the stages of a replica are neighbours.
    mesh = init_device_mesh(device.type, (replicas, STAGES), mesh_dim_names=("dp", "pp"))
    stage_index = mesh["pp"].get_local_rank()
    replica = mesh["dp"].get_local_rank()
    dp_group = mesh["dp"].get_group()  # the same stage in every replica
    module = DistributedDataParallel(
        make_stage_module(torch, stage_index, args.seed).to(device),
        device_ids=[local_rank] if use_cuda else None,
        process_group=dp_group,  # averages gradients across replicas only
    )
    stage = PipelineStage(
        module,
        stage_index=stage_index,
        num_stages=STAGES,
        device=device,
        group=mesh["pp"].get_group(),  # the stages of this replica
    )
    # [mesh-end]
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_class(
        stage,
        n_microbatches=args.microbatches,
        loss_fn=torch.nn.functional.cross_entropy,  # called by the last stage only
    )
    global_batch = args.batch_size * replicas
    lr = args.lr * global_batch / 256  # linear scaling with the global batch
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)

    # [data-start]
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=replicas, rank=replica, seed=args.seed, drop_last=True
    )  # by replica, not by rank: both stages of a replica read the same batches
    # [data-end]
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,  # every batch splits into equal micro-batches
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        persistent_workers=args.num_workers > 0,
    )
    hosts = [None] * world
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    prints = stage.is_last and replica == 0
    if prints:
        print(f"{world} processes = {replicas} x {STAGES} (replicas x stages), {device.type} "
              f"({dist.get_backend()}), schedule {args.schedule}, global batch {global_batch}, "
              f"learning rate {lr:.4g}")  # fmt: skip
        for index, ranks in enumerate(mesh.mesh.tolist()):
            where = ", ".join(f"stage {s} on {hosts[r]} (rank {r})" for s, r in enumerate(ranks))
            print(f"replica {index}: {where}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle in every epoch, the same in all ranks
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            if stage.is_first:
                schedule.step(images.to(device))
            else:
                losses = []  # one loss per micro-batch
                schedule.step(target=labels.to(device), losses=losses)
                totals[0] += torch.stack(losses).mean().detach() * len(labels)
                totals[1] += len(labels)
            optimizer.step()  # gradients already averaged over the replicas
        if stage.is_last:
            dist.all_reduce(totals, group=dp_group)  # sums over the replicas
        # The first stages have no loss: the last stage of each replica sends it to its first.
        dist.broadcast(totals, group=mesh["pp"].get_group(), group_src=STAGES - 1)
        seconds = time.perf_counter() - start
        loss_sum, images_seen = totals.tolist()  # the same in every rank: all stop together
        if not math.isfinite(loss_sum):
            fail(f"loss is {loss_sum / images_seen} at epoch {epoch + 1}, "
                 f"step {(epoch + 1) * len(loader)}: lower --lr")  # fmt: skip
        if prints:
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
    # These hold the process groups: free them while Python still runs.
    del schedule, stage, module, optimizer, mesh, dp_group
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.barrier()  # no rank tears its groups down while another still communicates
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("pipeline_ddp.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
