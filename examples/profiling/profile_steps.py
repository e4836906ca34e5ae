"""Profile a few training steps of a small CNN with torch.profiler: one trace per process.

The script trains on generated images, in one process or several (DDP). The profiler skips
the first step, warms up on the second and records the next three; each process then writes
its trace, rank<N>.<timestamp>.pt.trace.json, into the job's own folder,
<output-dir>/profile-<job id>/ ("profile-local" outside Slurm). Open a trace in Perfetto UI
(https://ui.perfetto.dev) or chrome://tracing. Rank 0 prints the operators that took the most
time.

    python profile_steps.py
    torchrun --standalone --nproc-per-node=2 profile_steps.py --device cpu
    sbatch profile.sbatch                      # two processes under srun
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

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, record_function

# Steps the profiler skips, warms up on, and records (one cycle).
WAIT, WARMUP, ACTIVE = 1, 1, 3


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


def enough_steps(text):
    value = int(text)
    if value < WAIT + WARMUP + ACTIVE:
        raise argparse.ArgumentTypeError(
            f"must be at least {WAIT + WARMUP + ACTIVE}: the profiler skips {WAIT}, warms up "
            f"on {WARMUP} and records {ACTIVE} (got {text})"
        )
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=enough_steps, default=8, help="training steps")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="DataLoader processes"
    )
    parser.add_argument("--image-size", type=positive_int, default=64, help="pixels per side")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--output-dir", type=writable_dir, default=".")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"profile_steps.py: error: {message}", file=sys.stderr)
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
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "MASTER_PORT"):  # fmt: skip
        if name in os.environ and not os.environ[name].isdecimal():
            fail(f"{name}={os.environ[name]!r} is not a number (set by torchrun or srun)")
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_NTASKS" in os.environ and os.environ["SLURM_NTASKS"] != "1":
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        return 0, 1, 0
    missing = [name for name in (*names, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun or srun")
    rank, world, local_rank, port = (int(os.environ[name]) for name in (*names, "MASTER_PORT"))
    if not 0 < port < 65536:  # checked here: torch's error is a traceback
        fail(f"MASTER_PORT={port} is not a port number (1 to 65535)")
    if rank >= world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    return rank, world, local_rank


def make_model(classes=10):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 4 * 4, classes),
    )  # fmt: skip


def make_profiler(trace_dir, rank, use_cuda):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(trace_dir), worker_name=f"rank{rank}"
        ),
        record_shapes=True,  # the input sizes of each operator
        profile_memory=True,  # the memory each operator allocates
        with_stack=False,  # Python stacks make traces far larger
    )


def train(model, loader, optimizer, device, steps, prof):
    """steps training steps, each phase labelled in the trace; prof.step() ends each one."""
    batches = iter(loader)
    for _ in range(steps):
        with record_function("data"):
            images, labels = next(batches)
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
        with record_function("forward"):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        with record_function("backward"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
        prof.step()  # the profiler's schedule counts steps here
    return loss.item()  # one host-device sync, after the loop


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda:
        torch.cuda.set_device(gpu_index(local_rank, torch.cuda.device_count()))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if use_cuda:
        announce_gpu(torch, device)
    if world > 1:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            # Start-up fails fast (--init-timeout); the group's timeout bounds every collective.
            # Under torchrun, its agent already serves the store at MASTER_PORT: connect to it.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                timeout=datetime.timedelta(seconds=args.init_timeout),
            )
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
                f"{args.init_timeout} s ({first_line})"
            )

    # Generated images: enough for every step of every process.
    generator = torch.Generator().manual_seed(args.seed)
    count = args.steps * args.batch_size * world
    images = torch.randn(count, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 10, (count,), generator=generator)
    dataset = torch.utils.data.TensorDataset(images, labels)
    sampler = (
        torch.utils.data.distributed.DistributedSampler(dataset, world, rank, seed=args.seed)
        if world > 1
        else None
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        shuffle=sampler is None,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        drop_last=True,
    )
    torch.manual_seed(args.seed)  # the same initial weights in every replica
    model = make_model().to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    job = os.environ.get("SLURM_JOB_ID", "local")
    trace_dir = (args.output_dir / f"profile-{job}").resolve()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    backend = f" ({dist.get_backend()})" if world > 1 else ""
    first, last = WAIT + WARMUP, WAIT + WARMUP + ACTIVE - 1  # steps count from 0
    print(f"rank {rank}/{world} on {host}, {device.type}{backend}: {args.steps} steps of "
          f"{args.batch_size} images, recording ProfilerStep#{first} to #{last}")  # fmt: skip

    start = time.perf_counter()
    with make_profiler(trace_dir, rank, use_cuda) as prof:
        loss = train(model, loader, optimizer, device, args.steps, prof)
    seconds = time.perf_counter() - start
    if not math.isfinite(loss):
        fail(f"loss is {loss} after {args.steps} steps: try a lower --lr")
    if world > 1:
        dist.barrier()  # every trace is written
    if rank == 0:
        sort_by = "self_device_time_total" if use_cuda else "self_cpu_time_total"
        print(f"{args.steps} steps in {seconds:.1f} s (profiled: slower than without), "
              f"loss {loss:.4f}")  # fmt: skip
        print(f"The operators of rank 0 by {sort_by}, over the {ACTIVE} recorded steps:")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=10))
        traces = sorted(trace_dir.glob("rank*.pt.trace.json"))
        print(f"Trace files in {trace_dir}/: {len(traces)} "
              "(rank<N>.<timestamp>.pt.trace.json, one per process)")  # fmt: skip
        print("Copy them to your computer and open them in https://ui.perfetto.dev "
              "or chrome://tracing:")  # fmt: skip
        print(f"    rsync -av <you>@<login node>:{trace_dir}/ {trace_dir.name}/")
    del model, optimizer  # DDP holds the process group: free it while Python still runs
    gc.collect()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("profile_steps.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
