"""Train several data-parallel replicas of a small model on one shared GPU.

A small model leaves most of a large GPU idle. Several processes, each a replica of the model
on its own part of the data (DistributedDataParallel), can share the GPU; with NVIDIA MPS
(started by the job script) their kernels run side by side instead of taking turns. The
processes communicate with gloo: NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"). Each rank prints its throughput; rank 0 prints the total.

    torchrun --standalone --nproc-per-node=4 mps_ddp.py --fake-data
    sbatch mps_ddp.sbatch --fake-data
"""

import argparse
import datetime
import gc
import glob
import math
import os
import sys
import time


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per replica")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--fake-data", action="store_true", help="train on generated data")
    parser.add_argument("--fake-size", type=positive_int, default=8192)
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"mps_ddp.py: error: {message}", file=sys.stderr)
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
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")


def main(argv=None):
    args = parse_args(argv)
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]  # fmt: skip
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun (see the job script)")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env_int(name)  # checked here: init_process_group's own error is a traceback
    if not 0 < env_int("MASTER_PORT") < 65536:
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not args.fake_data:
        fail("this example trains on generated data only: pass --fake-data")
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")  # all ranks: one GPU
    if use_cuda:
        announce_gpu(torch, device)
    # gloo, not nccl: NCCL refuses several ranks on the same GPU. torchrun bounds the start-up;
    # the group's timeout bounds every later collective, so it is minutes, not seconds.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(args.fake_size, 128, generator=generator)
    targets = (inputs[:, :16].sum(dim=1) > 0).long()
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # the same initial weights in every replica
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2)
    ).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle in every epoch
        seen, loss_sum, start = 0, torch.zeros((), device=device), time.perf_counter()
        for batch, labels in loader:
            batch, labels = batch.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(batch), labels)
            loss.backward()  # DDP averages the gradients of all replicas here
            optimizer.step()
            seen += len(batch)
            loss_sum += loss.detach() * len(batch)
        rate = torch.tensor([seen / (time.perf_counter() - start)])
        dist.all_reduce(rate)  # sum over replicas
        mean_loss = torch.tensor([loss_sum.item() / seen])
        dist.all_reduce(mean_loss)
        if not math.isfinite(mean_loss.item()):  # the same in every rank: all stop together
            fail(f"loss is {mean_loss.item() / world} at epoch {epoch + 1}, "
                 f"step {(epoch + 1) * len(loader)}: lower --lr")  # fmt: skip
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {mean_loss.item() / world:.3f}, "
                  f"{rate.item():.0f} samples/s with {world} replicas on {device}")  # fmt: skip
    del model, optimizer  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.barrier()  # no rank tears its group down while another still communicates
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("mps_ddp.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
