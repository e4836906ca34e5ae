"""Train with FSDP2 and save sharded checkpoints with torch.distributed.checkpoint (DCP).

No process ever holds the whole model, not even to save it: after every epoch each process
writes its own shards of the model and optimizer state into one folder per checkpoint
(--output-dir/epoch-N), and rank 0 adds the metadata that says where each piece lies. The
folder is written under a temporary name and renamed by rank 0 once every shard is on disk;
the last --keep folders are kept. On start, the newest checkpoint is loaded, and DCP reshards
it when the number of processes changed; one whose metadata cannot be read, or that another
script wrote, is skipped with a warning for the one before, and anything else with a
checkpoint's name is never written into or deleted. A loss that is not finite stops every rank
before it saves. A second run on the same --output-dir is refused while the first holds it; a
save that fails (a full disk, a quota) stops every rank in one line, and Ctrl-C or SIGTERM, even
repeated, during a save takes effect once it is complete: neither leaves a half-written folder.
Rank 0 prints the loss and images/s of every epoch and a digest of the
weights. --convert turns a checkpoint into one torch.save file for inference, in a single
process, without GPU or launcher.

    torchrun --standalone --nproc-per-node=2 fsdp_dcp.py --fake-data --epochs 2
    torchrun --standalone --nproc-per-node=4 fsdp_dcp.py --fake-data --epochs 3   # reshards
    sbatch fsdp_dcp.sbatch --fake-data          # two nodes, one Slurm task per GPU
    python fsdp_dcp.py --convert checkpoints/epoch-3 model.pt
"""

import argparse
import atexit
import contextlib
import datetime
import errno
import fcntl
import gc
import glob
import hashlib
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

NAME = re.compile(r"epoch-(\d+)")  # epoch-<epochs done>, a folder
KEYS = ("model", "optimizer", "epoch", "world")  # what this script saves


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


def folder_path(text):
    """A folder that may not exist yet, but cannot be a file or lie under one."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    return path


def path_not_under_a_file(text):
    """A file or folder whose parents are folders, or do not exist yet."""
    path = Path(text)
    for part in path.parents:
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
    parser.add_argument("--epochs", type=positive_int, default=3,
                        help="epochs in all, resumed ones too")  # fmt: skip
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--num-workers", type=non_negative_int, default=2,
                        help="DataLoader workers per rank")  # fmt: skip
    parser.add_argument("--data-dir", type=folder_path, default=Path("data"),
                        help="CIFAR-10 folder")  # fmt: skip
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--width", type=positive_int, default=512, help="features of each block")
    parser.add_argument("--blocks", type=positive_int, default=4, help="residual blocks")
    parser.add_argument("--output-dir", type=writable_dir, default="checkpoints",
                        help="checkpoint folder of this run, seen by all nodes")  # fmt: skip
    parser.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept on disk")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument("--timeout", type=positive_int, default=1800,
                        help="seconds a collective may wait")  # fmt: skip
    parser.add_argument("--save-timeout", type=positive_int, default=1800,
                        help="seconds a rank waits for the others to save or load")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--convert", nargs=2, type=path_not_under_a_file,
                        metavar=("CHECKPOINT", "FILE"),
                        help="write a checkpoint as one torch.save file, and stop")  # fmt: skip
    args = parser.parse_args(argv)
    if args.convert and args.convert[1].is_dir():
        parser.error(f"argument --convert: {args.convert[1]} is a folder: name the file to write")
    return args


def fail(message):
    print(f"fsdp_dcp.py: error: {message}", file=sys.stderr)
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


def stop_all(rank, message):
    """Every rank stops at once with the same error: rank 0 says why, all exit with code 2.
    os._exit tears nothing down: a process group left to interpreter shutdown can abort."""
    if rank == 0:
        print(f"fsdp_dcp.py: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    if not (text.isascii() and text.isdigit()):
        source = "srun" if name.startswith("SLURM_") else "torchrun, or in the job script"
        fail(f"{name}={text!r} is not a whole number (set by {source})")
    return int(text)


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
        how = "start this script with torchrun or srun (see fsdp_dcp.sbatch)"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see fsdp_dcp.sbatch)"
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


def make_model(torch, width, blocks):
    nn = torch.nn

    class Block(nn.Module):
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


def weights_digest(torch, named_tensors):
    """A short SHA-256 of (name, tensor) pairs: equal digests mean bit-for-bit equal weights."""
    sha = hashlib.sha256()
    for name, tensor in named_tensors:
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
    return sha.hexdigest()[:16]


def sharded_digest(torch, model):
    """The digest of a sharded model, gathering one tensor at a time (every rank calls it)."""
    state = sorted(model.state_dict().items())  # DTensors: each rank has its shards
    return weights_digest(torch, ((name, tensor.full_tensor()) for name, tensor in state))


def number(path):
    """The epochs done in a checkpoint's name."""
    return int(NAME.fullmatch(path.name)[1])


def named_like_checkpoints(folder):
    """What folder holds under a checkpoint's name, oldest first: checkpoints, and the rest."""
    return sorted((p for p in folder.glob("epoch-*") if NAME.fullmatch(p.name)), key=number)


def is_checkpoint(path):
    """A folder that DCP completed: rank 0 writes .metadata last."""
    return (path / ".metadata").is_file()


def unusable(dcp, path):
    """Why path is not a checkpoint of this script, from its metadata alone; None if it is."""
    if not path.is_dir():
        return "a file, not a checkpoint folder"
    if not is_checkpoint(path):
        return "a folder without .metadata, not a complete checkpoint"
    try:
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:  # .metadata damaged
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'empty'}"
    missing = [k for k in KEYS if not any(key == k or key.startswith(f"{k}.") for key in keys)]
    return f"not a checkpoint of this script: no {', '.join(missing)}" if missing else None


def choose_checkpoint(dcp, folder, epochs):
    """Rank 0: (the newest checkpoint of this script in folder, or None; and why this run
    cannot start, or None). Prints a warning for each one skipped."""
    chosen, skipped = None, []
    for path in reversed(named_like_checkpoints(folder)):
        reason = unusable(dcp, path)
        if reason is None:
            chosen = path
            break
        skipped.append(f"{path} ({reason})")
    writes = {f"epoch-{epoch}" for epoch in range(number(chosen) + 1 if chosen else 1, epochs + 1)}
    for entry in sorted(folder.glob("epoch-*")):  # what the saves of this run would replace
        final = entry.name in writes and not is_checkpoint(entry)
        temporary = entry.name.removesuffix(".tmp") in writes and not entry.is_dir()
        if final or temporary:
            what = "a folder without .metadata" if entry.is_dir() else "a file"
            return None, (f"{entry} is {what}, not a checkpoint, and this run would write one "
                          "there: move it away or choose another --output-dir")  # fmt: skip
    fallback = f"falling back to {chosen}" if chosen else "no usable checkpoint"
    for reason in skipped:
        print(f"fsdp_dcp.py: warning: skipped {reason}; {fallback}", file=sys.stderr)
    return chosen, None


def fsync_folder(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def hold(folder):
    """Rank 0: lock folder/.lock, which the system releases when this process ends, however; why
    this run cannot start, or None: a second run on one folder is refused, not mixed in. A
    crashed node's lock can outlive its job: the refusal says when to delete .lock, and the next
    run locks the new file at that name. No run deletes .lock itself."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / ".lock", "a+")  # noqa: SIM115  held open until the process ends
    atexit.register(lock.close)  # keeps it open, and the lock held, until the process exits
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            print(f"fsdp_dcp.py: warning: cannot lock {folder} ({error.strerror}): make sure "
                  "no other run uses it", file=sys.stderr)  # fmt: skip
            return None
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        job = holder.split(",")[0].removeprefix("job ") if holder.startswith("job ") else None
        gone = (f"job {job} is no longer running (squeue -j {job} / qstat {job})" if job
                else "that process is no longer running")  # fmt: skip
        return (f"{folder} is in use by {holder}: wait for that run to end (or cancel it), or "
                f"give this one another --output-dir; if {gone}, delete "
                f"{folder}/.lock")  # fmt: skip
    try:
        same = os.path.samestat(os.fstat(lock.fileno()), os.stat(folder / ".lock"))
    except FileNotFoundError:
        same = False
    if not same:  # .lock was deleted (a stale lock) since this run opened it: lock the new one
        lock.close()
        return hold(folder)
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("JOB_ID") or os.environ.get("PBS_JOBID")
    lock.truncate(0)
    lock.write(f"{f'job {job}, ' if job else ''}process {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    for leftover in folder.glob("epoch-*.tmp"):  # a save cut short by SIGKILL or a node crash
        if leftover.is_dir() and NAME.fullmatch(leftover.name.removesuffix(".tmp")):
            shutil.rmtree(leftover)
    return None


def write_problem(error, folder):
    """What a failed write means, in words: a full file system or quota, a read-only one. DCP
    reports a rank's OSError inside its own exception, as text."""
    code, text = getattr(error, "errno", None), str(error)
    if code in (errno.ENOSPC, errno.EDQUOT) or any(
        words in text for words in ("No space left on device", "Disk quota exceeded")
    ):
        return "no space left (the file system or your quota is full)"
    if code == errno.EROFS or "Read-only file system" in text:
        return "the file system is read-only"
    with contextlib.suppress(OSError):  # a short write can come without the errno
        if os.statvfs(folder).f_bavail == 0:
            return "no space left (the file system is full)"
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def signals_wait():
    """Ctrl-C (SIGINT) and SIGTERM during the block, however often they come, take effect once
    it is over, in the order they came: a save is never cut short by an impatient key."""
    caught = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(caught):  # once each: SIGINT raises KeyboardInterrupt
        signal.raise_signal(signum)


def save_checkpoint(dcp, dist, state, folder, keep, group):
    """Every rank writes its shards into epoch-N.tmp; rank 0 renames it to epoch-N. Returns
    (the path, None), or (None, why it could not be written) on every rank, with no .tmp left."""
    path = folder / f"epoch-{state['epoch']}"
    tmp = folder / f"{path.name}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a run killed while saving
    dist.barrier(group=group)
    # Each rank writes and fsyncs its own files; rank 0 then writes .metadata. dcp.save returns
    # on every rank only after that, so the folder is complete when it returns; when a rank's
    # write fails, it raises on every rank.
    problem = None
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
    except (Exception, dcp.CheckpointException) as error:  # a BaseException: Ctrl-C's kin
        problem = write_problem(error, folder)  # a full disk, a quota
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)  # every rank learns of any failure
    if problem := next((p for p in problems if p is not None), None):
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space it took
            done = [p for p in named_like_checkpoints(folder) if is_checkpoint(p)]
            kept = f"{done[-1]} is intact" if done else "no checkpoint was saved before"
            problem = (f"cannot write {path}: {problem}; {kept}: free some space (df -h, or your "
                       "centre's quota command) and run again")  # fmt: skip
        dist.barrier(group=group)  # the folder is gone before any rank stops
        return None, problem
    if dist.get_rank() == 0:
        fsync_folder(tmp)  # the names of the shard files
        if path.exists():
            shutil.rmtree(path)  # a checkpoint of the same epoch from an earlier run
        tmp.rename(path)  # the folder appears complete under its final name, or not at all
        fsync_folder(folder)
        done = [p for p in named_like_checkpoints(folder) if number(p) <= state["epoch"]]
        for old in [p for p in done if is_checkpoint(p)][:-keep]:  # never anything else
            shutil.rmtree(old)
    dist.barrier(group=group)  # no rank goes on, or exits, before the rename
    return path, None


def load_checkpoint(dcp, get_state_dict, set_state_dict, model, optimizer, path, group):
    """Read a checkpoint into the model and optimizer, resharded to this number of processes."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this run's shards
    state = {"model": model_state, "optimizer": optimizer_state, "epoch": 0, "world": 0}
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)  # fills them in place
    except dcp.CheckpointException as error:  # raised on every rank, with each rank's cause
        cause = next(iter(error.failures.values()))[0]
        stop_all(group.rank(), f"cannot resume from {path}: {cause} (--width and --blocks "
                 "must be those of the run that saved it)")  # fmt: skip
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    return state["epoch"], state["world"]


def convert(args):
    """One process: the checkpoint folder becomes one torch.save file, read back for inference."""
    checkpoint, target = args.convert
    if not (checkpoint / ".metadata").is_file():
        fail(f"{checkpoint} is not a complete DCP checkpoint: it has no .metadata file")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reason = unusable(dcp, checkpoint)  # its .metadata damaged, or another script's
    if reason is not None:
        fail(f"cannot convert {checkpoint}: {reason}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written as target.tmp, checked, synced, then renamed: a file with the target's name is
    # a complete conversion that loads into the model, and a failure leaves nothing behind.
    temporary = target.with_name(f"{target.name}.tmp")

    def stop(message):
        with contextlib.suppress(OSError):
            temporary.unlink()
        fail(message)

    try:
        dcp_to_torch_save(checkpoint, temporary)  # all of it (optimizer state too) in memory
    except dcp.CheckpointException as error:  # a damaged shard file
        cause = str(next(iter(error.failures.values()))[0])
        stop(f"cannot convert {checkpoint}: {cause.splitlines()[0].split('. ')[0]}")
    except (OSError, RuntimeError) as error:  # a full disk, a quota, a read-only folder
        stop(f"cannot write {target}: {write_problem(error, target.parent)}")
    state = torch.load(temporary, map_location="cpu", weights_only=True)
    model = make_model(torch, args.width, args.blocks)  # a plain model, no FSDP
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        stop(f"{checkpoint} does not match --width {args.width} --blocks {args.blocks}: "
             f"{str(error).splitlines()[1].strip()}")  # fmt: skip
    descriptor = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the data is on disk before the file gets its name
    finally:
        os.close(descriptor)
    os.replace(temporary, target)
    fsync_folder(target.parent)
    model.eval()
    digest = weights_digest(torch, sorted(model.state_dict().items()))
    print(f"Wrote {target}: the model after epoch {state['epoch']}, weights digest {digest}")


def main(argv=None):
    args = parse_args(argv)
    if args.convert:
        return convert(args)
    rank, world, local_rank = distributed_env()
    if args.keep < 1:
        fail(f"--keep {args.keep}: keep at least the last checkpoint")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
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
    # Saving waits for the slowest rank's writes: a group with a longer timeout, on CPU.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.save_timeout))
    newest = [None, None]  # the checkpoint to resume from; why the run cannot start
    if rank == 0:  # skips, with a warning, what cannot be read or another script wrote
        newest[1] = hold(args.output_dir)
        if newest[1] is None:
            newest = list(choose_checkpoint(dcp, args.output_dir, args.epochs))
    dist.broadcast_object_list(newest, src=0, group=group)  # rank 0 decides, all ranks agree
    if newest[1] is not None:  # every rank stops; no model holds the process group yet
        stop_all(rank, newest[1])

    nodes = [None] * world  # where each rank runs: every node writes into the same folder
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(args.seed)  # the same full model in every rank before it is sharded
    model = make_model(torch, args.width, args.blocks).to(device)
    for block in model[2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start_epoch = 0
    if newest[0] is not None:
        start_epoch, saved_by = load_checkpoint(
            dcp, get_state_dict, set_state_dict, model, optimizer, newest[0], group
        )
        digest = sharded_digest(torch, model)
        if rank == 0:
            print(f"Resumed from {newest[0]}, saved by {saved_by} processes after epoch "
                  f"{start_epoch}, loaded by {world}: weights digest {digest}")  # fmt: skip
    elif rank == 0:
        print(f"No checkpoint in {args.output_dir}: starting from scratch")

    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
    )
    if rank == 0:
        todo = f"epochs {start_epoch + 1} to {args.epochs}" if start_epoch < args.epochs else (
            f"no epoch to train (--epochs {args.epochs})")  # fmt: skip
        print(f"{world} processes, {device.type} ({dist.get_backend()}), shards of 1/{world}, "
              f"{todo}")  # fmt: skip
        print(f"Nodes: {', '.join(sorted(set(nodes)))}")

    problem = None  # a loss that is not finite stops every rank, before it saves
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        loss_sum, images_seen = totals.tolist()  # the same on every rank: all stop together
        if not math.isfinite(loss_sum):
            problem = (f"loss is {loss_sum / images_seen} at epoch {epoch + 1}, step "
                       f"{len(loader)}: start again in a new --output-dir with a lower --lr (a "
                       "resumed run keeps the learning rate it saved)")  # fmt: skip
            break
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
        # --- checkpoint ---
        model_state, optimizer_state = get_state_dict(model, optimizer)  # shards, no copies
        state = {"model": model_state, "optimizer": optimizer_state, "epoch": epoch + 1,
                 "world": world}  # fmt: skip
        with signals_wait():  # Ctrl-C, even twice, cannot leave a half-written folder
            path, problem = save_checkpoint(dcp, dist, state, args.output_dir, args.keep, group)
            if problem is not None:  # every rank: the process group is still whole
                stop_all(rank, problem)
            if rank == 0:
                print(f"Saved {path}")
        # --- end checkpoint ---

    digest = sharded_digest(torch, model)
    if rank == 0 and problem is None:
        print(f"Weights digest: {digest}")
    del model, optimizer, mesh  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.barrier()  # no rank tears its groups down while another still communicates
    dist.destroy_process_group()
    if problem is not None:  # the process group is gone: an ordinary exit
        if rank == 0:
            fail(problem)
        sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("fsdp_dcp.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
