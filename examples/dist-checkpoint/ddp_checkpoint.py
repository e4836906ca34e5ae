"""Checkpoint DistributedDataParallel training: rank 0 writes, every rank resumes from the file.

After every epoch rank 0 writes the whole training state (model, optimizer, epochs done) to
--output-dir, atomically: a temporary file in the same folder, fsync, os.replace. It keeps the
last --keep files. A barrier then holds the other ranks until the file is complete. On start,
every rank loads the newest checkpoint onto its own device (map_location) and goes on with the
next epoch, with the same shuffle and the same random numbers as a run that was never stopped.
The model is saved without DDP's "module." prefix, so the file also loads into a plain model.
A file that does not load, or is not a checkpoint of this script, is skipped with a warning
for the one before; a folder with a checkpoint's name is never written into or deleted. A loss
that is not finite stops every rank before it saves. A second run on the same --output-dir is
refused while the first holds it, and a save that fails (a full disk, a quota) stops every rank
in one line, leaving no temporary file and the last good checkpoint. Rank 0 prints the loss
and images/s of every epoch and, at the end, a digest of the weights.

    torchrun --standalone --nproc-per-node=2 ddp_checkpoint.py --fake-data --epochs 2
    torchrun --standalone --nproc-per-node=2 ddp_checkpoint.py --fake-data --epochs 4  # resumes
    srun python ddp_checkpoint.py --fake-data      # in a job script such as ../ddp/ddp_srun.sbatch
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
import sys
import time
from pathlib import Path

NAME = re.compile(r"epoch-(\d+)\.pt")  # epoch-<epochs done>.pt
KEYS = {"model", "optimizer", "epoch"}


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--epochs", type=positive_int, default=3,
                        help="epochs in all, resumed ones too")  # fmt: skip
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per replica")
    parser.add_argument("--lr", type=positive_float, default=0.04,
                        help="for a global batch of 256")  # fmt: skip
    parser.add_argument("--num-workers", type=non_negative_int, default=2,
                        help="DataLoader workers per rank")  # fmt: skip
    parser.add_argument("--data-dir", type=folder_path, default=Path("data"),
                        help="CIFAR-10 folder")  # fmt: skip
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--output-dir", type=writable_dir, default="checkpoints",
                        help="checkpoint folder of this run, seen by all nodes")  # fmt: skip
    parser.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept on disk")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all processes"
    )
    parser.add_argument("--timeout", type=positive_int, default=1800,
                        help="seconds a collective may wait")  # fmt: skip
    parser.add_argument("--save-timeout", type=positive_int, default=1800,
                        help="seconds the others wait for rank 0 to write")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"ddp_checkpoint.py: error: {message}", file=sys.stderr)
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
        print(f"ddp_checkpoint.py: error: {message}", file=sys.stderr)
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
        how = "start this script with torchrun or srun"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see ../ddp/ddp_srun.sbatch)"
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


def weights_digest(torch, state_dict):
    """A short SHA-256 of the weights: equal digests mean bit-for-bit equal weights."""
    sha = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
    return sha.hexdigest()[:16]


def number(path):
    """The epochs done in a checkpoint's name."""
    return int(NAME.fullmatch(path.name)[1])


def named_like_checkpoints(folder):
    """What folder holds under a checkpoint's name, oldest first: files, and anything else."""
    found = [path for path in folder.glob("epoch-*.pt") if NAME.fullmatch(path.name)]
    return sorted(found, key=number)


def checkpoints(folder):
    """The checkpoints in folder, oldest first; temporary files are not among them."""
    return [path for path in named_like_checkpoints(folder) if path.is_file()]


def mismatch(state, model):
    """Why a file that loads is not a checkpoint of this script and model; None if it is."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return "not a checkpoint of this script: no model weights in it"
    if missing := sorted(KEYS - state.keys()):
        return f"not a checkpoint of this script: no {', '.join(missing)}"
    if not isinstance(state["epoch"], int) or state["epoch"] < 1:
        return f"not a checkpoint of this script: epoch {state['epoch']!r}"
    ours = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    saved = {name: tuple(getattr(value, "shape", ())) for name, value in state["model"].items()}
    for name in sorted(ours.keys() | saved.keys(), key=str):
        if saved.get(name) != ours.get(name):  # a missing name, or another shape
            return f"another model: {name} is {saved.get(name)} in the file, {ours.get(name)} here"
    return None


def choose_checkpoint(torch, folder, model, epochs):
    """Rank 0: (the newest checkpoint in folder that loads and fits model, or None; and why this
    run cannot start, or None). Prints a warning for each file skipped."""
    chosen, start_epoch, skipped = None, 0, []
    for path in reversed(named_like_checkpoints(folder)):
        if path.is_dir():
            skipped.append(f"{path} (a folder, not a checkpoint file)")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)  # a check, on CPU
        except Exception as error:  # truncated or corrupted: try the one before
            reason = str(error).split(". ")[0].splitlines()[0] if str(error) else "empty"
            skipped.append(f"{path} ({type(error).__name__}: {reason})")
            continue
        reason = mismatch(state, model)  # another script's file, or another model's
        if reason is None:
            chosen, start_epoch = path, state["epoch"]
            break
        skipped.append(f"{path} ({reason})")
    writes = {f"epoch-{epoch}.pt" for epoch in range(start_epoch + 1, epochs + 1)}
    for entry in sorted(folder.glob("epoch-*")):
        if entry.is_dir() and entry.name.removesuffix(".tmp") in writes:  # never replace it
            return None, (f"{entry} is a folder, and this run would write a checkpoint file "
                          "there: move it away or choose another --output-dir")  # fmt: skip
    fallback = f"falling back to {chosen}" if chosen else "no usable checkpoint"
    for reason in skipped:
        print(f"ddp_checkpoint.py: warning: skipped {reason}; {fallback}", file=sys.stderr)
    return chosen, None


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
            print(f"ddp_checkpoint.py: warning: cannot lock {folder} ({error.strerror}): make "
                  "sure no other run uses it", file=sys.stderr)  # fmt: skip
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
    return None


def write_problem(error, folder):
    """What a failed write means, in words: a full file system or quota, a read-only one."""
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "no space left (the file system or your quota is full)"
    if code == errno.EROFS:
        return "the file system is read-only"
    with contextlib.suppress(OSError):  # torch.save reports a short write without the errno
        if os.statvfs(folder).f_bavail == 0:
            return "no space left (the file system is full)"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def save_checkpoint(torch, state, folder, keep):
    """Rank 0 only: write state atomically as epoch-N.pt, then delete all but the last keep.
    Returns (the path, None), or (None, why it could not be written) with no .tmp file left."""
    path = folder / f"epoch-{state['epoch']}.pt"
    tmp = folder / f"{path.name}.tmp"  # same folder, so same file system: the rename is atomic
    try:
        with open(tmp, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the file gets its name
        os.replace(tmp, path)  # readers see the old set of files or the new one, never half
    except (OSError, RuntimeError) as error:
        reason = write_problem(error, folder)
        with contextlib.suppress(OSError):
            tmp.unlink()  # frees the space it took
        previous = checkpoints(folder)
        kept = f"{previous[-1]} is intact" if previous else "no checkpoint was saved before"
        return None, (f"cannot write {path}: {reason}; {kept}: free some space (df -h, or your "
                      "centre's quota command) and run again")  # fmt: skip
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash of the node
    finally:
        os.close(directory)
    done = [old for old in checkpoints(folder) if number(old) <= state["epoch"]]
    for old in done[:-keep]:  # files only, and not the newer ones skipped on start
        old.unlink()
    return path, None


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    import torch
    import torch.distributed as dist

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

    # --- load ---
    # The barrier after a save waits as long as rank 0 writes: a group with a longer timeout
    # than the short one above, with gloo (on the CPU, also when training uses nccl).
    save_group = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=args.save_timeout)
    )
    torch.manual_seed(args.seed)
    model = make_model(torch).to(device)
    optimizer_state, start_epoch = None, 0
    newest = [None, None]  # the file to resume from; why the run cannot start
    if rank == 0:  # skips, with a warning, what does not load or is not of this model
        newest[1] = hold(args.output_dir)
        if newest[1] is None:
            newest = list(choose_checkpoint(torch, args.output_dir, model, args.epochs))
    dist.broadcast_object_list(newest, src=0, group=save_group)  # rank 0 decides for all
    if newest[1] is not None:  # every rank stops; no model holds the process group yet
        stop_all(rank, newest[1])
    if newest[0] is not None:
        # Onto this rank's device: without map_location every rank would load the tensors onto
        # the device they were saved from, cuda:0, the GPU of rank 0.
        state = torch.load(newest[0], map_location=device, weights_only=True)
        model.load_state_dict(state["model"])  # before DDP, which copies rank 0's weights
        optimizer_state, start_epoch = state["optimizer"], state["epoch"]
        if rank == 0:
            print(f"Resumed from {newest[0]}, saved after epoch {start_epoch}")
    elif rank == 0:
        print(f"No checkpoint in {args.output_dir}: starting from scratch")
    model = torch.nn.parallel.DistributedDataParallel(model)
    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 256  # linear scaling with the global batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)  # every rank: DDP does not copy it
        for group in optimizer.param_groups:
            group["lr"] = lr  # for this run's global batch, not the saved run's
    # --- end load ---

    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=args.seed)
    generator = torch.Generator()  # seeds the loader's workers (random flips) in each epoch
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        generator=generator,
    )  # no persistent workers: their random state would carry over from epoch to epoch
    if rank == 0:
        print(f"{world} processes, {device.type} ({dist.get_backend()}), global batch "
              f"{global_batch}, epochs {start_epoch + 1} to {args.epochs}")  # fmt: skip

    problem = None  # a loss that is not finite stops every rank, before it saves
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the shuffle of this epoch, whether resumed or not
        generator.manual_seed(args.seed + 1000 * epoch + rank)  # its augmentations too
        totals = torch.zeros(2, device=device)  # loss sum, images
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        loss_sum, images_seen = totals.tolist()  # the same on every rank: all stop together
        if not math.isfinite(loss_sum):
            problem = (f"loss is {loss_sum / images_seen} at epoch {epoch + 1}, step "
                       f"{len(loader)}: lower --lr (a resumed run sets it again)")  # fmt: skip
            break
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
        # --- checkpoint ---
        saved = [None]  # why rank 0 could not save; None once the file is complete
        if rank == 0:
            state = {
                "model": model.module.state_dict(),  # without DDP's "module." prefix
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,  # epochs done: the next sampler.set_epoch()
            }
            path, saved[0] = save_checkpoint(torch, state, args.output_dir, args.keep)
            if path is not None:
                print(f"Saved {path}")
        # No rank goes on, or exits, before the file is complete; a failed write stops them all.
        dist.broadcast_object_list(saved, src=0, group=save_group)
        if saved[0] is not None:
            stop_all(rank, saved[0])
        # --- end checkpoint ---

    if rank == 0 and problem is None:
        print(f"Weights digest: {weights_digest(torch, model.module.state_dict())}")
    del model, optimizer  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.destroy_process_group()
    if problem is not None:  # the process group is gone: an ordinary exit
        if rank == 0:
            fail(problem)
        sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("ddp_checkpoint.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
