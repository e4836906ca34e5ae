"""Train a model with DeepSpeed ZeRO stage 3, its states on the GPUs, in CPU memory or on NVMe.

ZeRO stage 3 splits the parameters, the gradients and the optimizer states of the model between
the processes: each keeps 1/N of them and gathers the parameters of a layer only while it
computes that layer. The --config file says where the shards live: ds_zero3.json keeps them on
the GPUs, ds_zero3_offload_cpu.json in CPU memory (DeepSpeedCPUAdam updates them there), and
ds_zero3_offload_nvme.json in files on the node-local disk given by --nvme-dir. The script runs
under torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK) or as one Slurm task
per GPU (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); MASTER_ADDR and MASTER_PORT say where
rank 0 waits. It trains an MLP on generated data; rank 0 prints the loss of every epoch.
The configs ask for bfloat16, which the script uses on GPUs and turns off on CPUs. With
--checkpoint-dir it saves a ZeRO checkpoint after every epoch, resumes from the newest one, and
at the end converts the shards into one plain float32 state dict, model_fp32.pt.

    torchrun --standalone --nproc-per-node=2 deepspeed_train.py --config ds_zero3.json
    torchrun --standalone --nproc-per-node=2 deepspeed_train.py --config ds_zero3_offload_cpu.json
    deepspeed --num_gpus=2 deepspeed_train.py --config ds_zero3_offload_nvme.json --nvme-dir DIR
    sbatch deepspeed.sbatch --config ds_zero3_offload_nvme.json     # one Slurm task per GPU
    sbatch deepspeed.sbatch --checkpoint-dir checkpoints             # again to resume
"""

import argparse
import datetime
import gc
import glob
import hashlib
import json
import math
import os
import sys
import time
import warnings
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


def existing_file(text):
    """An input file that must exist."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"no file {path}: the configs ds_zero3*.json are beside this script"
        )
    return path


def folder_path(text):
    """A folder that may not exist yet, but cannot be a file or lie under one."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    return path


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config", type=existing_file, default=Path("ds_zero3.json"), help="DeepSpeed JSON"
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument(
        "--batch-size", type=positive_int, help="per process (default: from --config)"
    )
    parser.add_argument("--lr", type=positive_float, help="learning rate (default: from --config)")
    parser.add_argument("--fake-size", type=positive_int, default=4096, help="generated samples")
    parser.add_argument("--width", type=positive_int, default=1024, help="hidden units per layer")
    parser.add_argument("--layers", type=positive_int, default=4, help="hidden layers")
    parser.add_argument(
        "--nvme-dir", type=folder_path, help="node-local folder for NVMe offload "
        "(default: $SLURM_TMPDIR, else /tmp/$USER-ds-$SLURM_JOB_ID)",
    )  # fmt: skip
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument(
        "--checkpoint-dir", type=writable_dir, help="save a checkpoint there after every "
        "epoch, resume from the newest, and write model_fp32.pt at the end (default: none)",
    )  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0)
    # The deepspeed launcher passes --local_rank; the script reads LOCAL_RANK, which it sets too.
    parser.add_argument("--local_rank", type=non_negative_int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def fail(message):
    print(f"deepspeed_train.py: error: {message}", file=sys.stderr)
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
        source = (
            "srun" if name.startswith("SLURM_") else "torchrun or deepspeed, or in the job script"
        )
        fail(f"{name}={text!r} is not a whole number (set by {source})")


def distributed_env():
    """(rank, world size, local rank) from torchrun's variables, or else from srun's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        how = "start this script with torchrun, deepspeed or srun (see deepspeed.sbatch)"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see deepspeed.sbatch)"
    missing = [name for name in (*names, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        fail(f"{', '.join(missing)} not set: {how}")
    rank, world, local_rank = (env_int(name) for name in names)
    if not 0 < env_int("MASTER_PORT") < 65536:  # checked here: DeepSpeed's error is a traceback
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not 0 <= rank < world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    # DeepSpeed reads LOCAL_RANK itself, also when srun started the process.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    return rank, world, local_rank


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


def nvme_folder(args):
    """The node-local folder for the NVMe swap files: made by the job script, never shared."""
    if args.nvme_dir is None and "SLURM_TMPDIR" in os.environ:
        args.nvme_dir = Path(os.environ["SLURM_TMPDIR"])
    elif args.nvme_dir is None and "SLURM_JOB_ID" in os.environ:
        user = os.environ.get("USER", "user")
        args.nvme_dir = Path("/tmp") / f"{user}-ds-{os.environ['SLURM_JOB_ID']}"
    elif args.nvme_dir is None:
        fail("NVMe offload needs a folder and SLURM_TMPDIR, SLURM_JOB_ID are not set: pass "
             "--nvme-dir with a folder on a node-local disk")  # fmt: skip
    if not args.nvme_dir.is_dir():
        fail(f"NVMe folder {args.nvme_dir} does not exist: create it in the job script "
             "(see deepspeed.sbatch)")  # fmt: skip
    if not os.access(args.nvme_dir, os.W_OK | os.X_OK):
        fail(f"NVMe folder {args.nvme_dir} is not writable: pass --nvme-dir with a folder of yours")
    return args.nvme_dir


def load_config(args):
    """The JSON file, with the values of this run filled in (DeepSpeed also takes a dict)."""
    try:
        config = json.loads(args.config.read_text())
    except (OSError, ValueError) as error:
        fail(f"cannot read --config {args.config}: {error}")
    if args.batch_size:
        config["train_micro_batch_size_per_gpu"] = args.batch_size
    if args.lr:
        config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = args.lr
    zero = config.setdefault("zero_optimization", {})
    for part in ("offload_param", "offload_optimizer"):
        if zero.get(part, {}).get("device") == "nvme":
            zero[part]["nvme_path"] = str(nvme_folder(args))
    return config


def make_dataset(torch, args):
    generator = torch.Generator().manual_seed(args.seed)  # the same data in every rank
    inputs = torch.randn(args.fake_size, args.width, generator=generator)
    teacher = torch.randn(args.width, 10, generator=generator)  # labels a model can learn
    return torch.utils.data.TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def make_model(torch, args):
    nn = torch.nn
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 10))


# [checkpoint-start]
def resume(engine, args, rank):
    """Load the newest checkpoint in --checkpoint-dir, if any: the epoch to start from."""
    if args.checkpoint_dir is None or not (args.checkpoint_dir / "latest").is_file():
        if rank == 0 and args.checkpoint_dir is not None:
            print(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")
        return 0
    # All ranks load: each reads its own shards of the parameters and optimizer states.
    path, client_state = engine.load_checkpoint(args.checkpoint_dir)
    if path is None:
        fail(f"cannot load the checkpoint that {args.checkpoint_dir}/latest names")
    if rank == 0:
        print(f"resumed from {Path(path).parent} after epoch {client_state['epoch']}")
    return client_state["epoch"]


def save(engine, args, rank, epoch):
    """Every rank writes its shards into --checkpoint-dir/epoch-N; then 'latest' names it."""
    engine.save_checkpoint(args.checkpoint_dir, tag=f"epoch-{epoch}", client_state={"epoch": epoch})
    if rank == 0:
        print(f"saved {args.checkpoint_dir / f'epoch-{epoch}'}")


def export_fp32(torch, args):
    """Gather the ZeRO-3 shards of the newest checkpoint into one float32 state dict (in CPU
    memory, a whole model's worth) and save it as a plain file that loads without DeepSpeed."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir)
    path = args.checkpoint_dir / "model_fp32.pt"
    torch.save(state, path)
    model = make_model(torch, args)  # a plain model, no DeepSpeed
    model.load_state_dict(torch.load(path, weights_only=True))
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote {path}: {count:,} float32 parameters, sha256 {digest.hexdigest()[:16]}")


# [checkpoint-end]
def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    config = load_config(args)
    import torch
    import torch.distributed as dist

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda and torch.cuda.device_count() == 0:
        fail("--device cuda but no GPU is visible: request GPUs (Slurm: --gpus-per-node=2, "
             "PBS: -l select=1:ncpus=4:ngpus=2, Grid Engine: -l gpu=2)")  # fmt: skip
    gpu = gpu_index(local_rank, torch.cuda.device_count()) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(gpu)
        os.environ["LOCAL_RANK"] = str(gpu)  # the GPU the DeepSpeed engine puts itself on
        announce_gpu(torch, torch.device("cuda", gpu))
    bf16 = config.setdefault("bf16", {})
    if bf16.get("enabled") and not use_cuda:
        bf16["enabled"] = False  # bfloat16 ZeRO is for GPUs; on CPUs it is slow, not smaller
    if bf16.get("enabled") and not torch.cuda.is_bf16_supported():
        fail(f"{torch.cuda.get_device_name()} has no bfloat16 (it needs compute capability 8.0, "
             'A100 or newer): set "bf16": {"enabled": false} in --config')  # fmt: skip
    os.environ["DS_ACCELERATOR"] = "cuda" if use_cuda else "cpu"  # read when deepspeed loads
    # DeepSpeed 0.19 still calls the collectives that torch 2.13 renamed.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    import deepspeed

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
            device_id=torch.device("cuda", gpu) if use_cuda else None,
        )
        dist.barrier()  # returns only once all processes have joined
    except (RuntimeError, TimeoutError) as error:  # DistNetworkError and DistStoreError too
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        fail(
            f"rank {rank}: not all {world} processes reached {address} within "
            f"{args.init_timeout} s ({first_line}); check that the world size matches the "
            "processes started and that MASTER_ADDR is the first node of the job"
        )

    dataset = make_dataset(torch, args)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=args.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=config["train_micro_batch_size_per_gpu"], sampler=sampler
    )
    torch.manual_seed(args.seed)
    # Under zero.Init each layer is split between the processes as soon as it is created:
    # no process ever holds the whole model.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = make_model(torch, args)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if rank == 0:
        zero = config["zero_optimization"]
        params_to, states_to = (zero.get(part, {}).get("device", "none")
                                for part in ("offload_param", "offload_optimizer"))  # fmt: skip
        parameters = sum(p.ds_numel for p in model.parameters())  # full sizes, not the shards
        print(f"{world} processes, {engine.device.type} ({dist.get_backend()}), ZeRO stage "
              f"{engine.zero_optimization_stage()}, {parameters:,} parameters, optimizer "
              f"{type(engine.basic_optimizer).__name__}")  # fmt: skip
        print(f"offload: parameters {params_to}, optimizer states {states_to}")
        print(f"compute in {'bfloat16' if engine.bfloat16_enabled() else 'float32'}"
              f"{'' if use_cuda else ' (bf16 of the config is for GPUs)'}")  # fmt: skip
        if "nvme" in (params_to, states_to):
            print(f"NVMe swap files in {args.nvme_dir}")

    first = resume(engine, args, rank)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=engine.device)  # loss sum, samples
        start = time.perf_counter()
        for inputs, labels in loader:
            inputs, labels = inputs.to(engine.device, dtype), labels.to(engine.device)
            loss = torch.nn.functional.cross_entropy(engine(inputs).float(), labels)
            engine.backward(loss)  # each rank keeps the gradients of its own shard
            engine.step()  # each rank updates its own shard
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        loss_sum, samples = totals.tolist()  # the same in every rank: all stop together
        if not math.isfinite(loss_sum):  # before saving: the newest checkpoint stays a good one
            fail(f"loss is {loss_sum / samples} at epoch {epoch + 1}, "
                 f"step {(epoch + 1) * len(loader)}: lower --lr")  # fmt: skip
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss_sum / samples:.4f}, "
                  f"{samples / seconds:.0f} samples/s")  # fmt: skip
        if args.checkpoint_dir:
            save(engine, args, rank, epoch + 1)
    if args.checkpoint_dir:
        dist.barrier()  # every rank has written its shards
        if rank == 0:
            export_fp32(torch, args)
    engine.destroy()
    # They hold the process group (in reference cycles too): free it while Python still runs.
    del engine, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("deepspeed_train.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
