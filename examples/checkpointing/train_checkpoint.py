"""Train a small CNN with a custom loop that checkpoints its full state and resumes exactly.

Every --checkpoint-every steps and at the end of each epoch, the script saves everything the
rest of the run depends on: model, optimizer, learning-rate scheduler, epoch and step, the
random number generators and the loss so far. Each checkpoint is written to a temporary file,
synced to disk and renamed, so that a file with a checkpoint's name is always complete; the
last --keep are kept. On start, the script resumes from the newest checkpoint in
--checkpoint-dir that loads, and skips any that does not, with a warning. The data order of an
epoch comes from --seed and the epoch number, so a run resumed in the middle of an epoch goes
on with exactly the batches it had not done. On CPU, a run that was killed and resumed ends
with the same weights, bit for bit, as one that never stopped: compare the final digests.
A resumed run must have the options of its checkpoint (more --epochs is fine): another --lr,
say, is another run, refused in this folder.
A file that is not a checkpoint of this script is skipped like a damaged one; a folder with a
checkpoint's name is never written into or deleted. A loss that is not finite stops the run
before it saves, so the newest checkpoint stays the last good one. A second run on the same
--checkpoint-dir is refused while the first holds it, and a save that fails (a full disk, a
quota) stops the run in one line, leaving no temporary file and the last good checkpoint.

    python train_checkpoint.py --fake-data --checkpoint-dir checkpoints
    sbatch train_checkpoint.sbatch --fake-data      # resubmit it: it resumes
"""

import argparse
import atexit
import contextlib
import errno
import fcntl
import glob
import hashlib
import math
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

NAME = re.compile(r"checkpoint-(\d+)\.pt")  # checkpoint-<steps done>.pt
KEYS = {"model", "optimizer", "scheduler", "epoch", "step", "totals", "config", "rng"}


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
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=0.02)
    parser.add_argument(
        "--warmup-steps", type=non_negative_int, default=50, help="linear warm-up of the lr"
    )
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=0, help="DataLoader workers"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--output-dir", type=writable_dir, default="runs", help="final weights")
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints")
    parser.add_argument("--checkpoint-every", type=positive_int, default=100, help="steps")
    parser.add_argument("--keep", type=positive_int, default=3, help="checkpoints kept")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"train_checkpoint.py: error: {message}", file=sys.stderr)
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


def make_dataset(args):
    if args.fake_data:
        generator = torch.Generator().manual_seed(args.seed)
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


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def number(path):
    """The steps done in a checkpoint's name."""
    return int(NAME.fullmatch(path.name)[1])


def named_like_checkpoints(folder):
    """What folder holds under a checkpoint's name, oldest first: files, and anything else."""
    found = [path for path in folder.glob("checkpoint-*.pt") if NAME.fullmatch(path.name)]
    return sorted(found, key=number)


def checkpoints(folder):
    """The checkpoint files in folder, oldest first (temporary files are not among them)."""
    return [path for path in named_like_checkpoints(folder) if path.is_file()]


@contextlib.contextmanager
def ctrl_c_waits():
    """Ctrl-C (SIGINT) during the block takes effect after it: no checkpoint write is cut short."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt


def hold(folder):
    """Refuse a second run on folder (a resubmission while this one runs, array tasks that share
    it): a lock on folder/.lock, which the system releases when this process ends, however.
    A crashed node's lock can outlive its job: the refusal says when to delete .lock, and the
    next run locks the new file at that name. No run deletes .lock itself."""
    lock = open(folder / ".lock", "a+")  # noqa: SIM115  held open until the process ends
    atexit.register(lock.close)  # keeps it open, and the lock held, until the process exits
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            print(f"train_checkpoint.py: warning: cannot lock {folder} ({error.strerror}): "
                  "make sure no other run uses it", file=sys.stderr)  # fmt: skip
            return
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        job = holder.split(",")[0].removeprefix("job ") if holder.startswith("job ") else None
        gone = (f"job {job} is no longer running (squeue -j {job} / qstat {job})" if job
                else "that process is no longer running")  # fmt: skip
        fail(f"{folder} is in use by {holder}: wait for that run to end (or cancel it), or give "
             f"this one another --checkpoint-dir; if {gone}, delete {folder}/.lock")  # fmt: skip
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


def save_atomically(state, path, last_good=None):
    """Write state to path.tmp, sync it and rename it to path: path is complete or absent. A
    failed write (a full disk, a quota) removes the .tmp file and stops in one line."""
    temporary = path.with_name(f"{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the file gets its name
        os.replace(temporary, path)  # atomic: readers see the old file or the new one
    except (OSError, RuntimeError) as error:
        reason = write_problem(error, path.parent)
        with contextlib.suppress(OSError):
            temporary.unlink()  # frees the space it took
        kept = f"{last_good} is intact" if last_good else "no checkpoint was saved before"
        fail(f"cannot write {path}: {reason}; {kept}: free some space (df -h, or your centre's "
             "quota command) and run again")  # fmt: skip
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the new name is on disk too
    finally:
        os.close(directory)


def save_checkpoint(state, folder, steps_done, keep):
    """Write atomically: a crash leaves the previous checkpoints and at most a .tmp file."""
    path = folder / f"checkpoint-{steps_done:08d}.pt"
    previous = checkpoints(folder)
    save_atomically(state, path, previous[-1] if previous else None)
    done = [old for old in checkpoints(folder) if number(old) <= steps_done]
    for old in done[:-keep]:  # only once the new one is in place; not the newer ones skipped
        old.unlink()
    return path


def mismatch(state, model):
    """Why a file that loads is not a checkpoint of this script and model; None if it is."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return "not a checkpoint of this script: no model weights in it"
    if missing := sorted(KEYS - state.keys()):
        return f"not a checkpoint of this script: no {', '.join(missing)}"
    ours = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    saved = {name: tuple(getattr(value, "shape", ())) for name, value in state["model"].items()}
    for name in sorted(ours.keys() | saved.keys(), key=str):
        if saved.get(name) != ours.get(name):  # a missing name, or another shape
            return f"another model: {name} is {saved.get(name)} in the file, {ours.get(name)} here"
    return None


def signature(model):
    """The model's parameter and buffer names and shapes: a resumed run must have the same."""
    return [f"{name} {list(tensor.shape)}" for name, tensor in model.state_dict().items()]


def changes(saved, config):
    """What this run changes in the options a checkpoint was written with, in words."""
    said = []
    for key, value in config.items():
        if saved.get(key) == value:
            continue
        if key == "model":
            said.append("another model (make_model() was changed)")
        elif key == "samples":
            said.append(f"{saved.get(key)} images, this run has {value}")
        else:
            said.append(f"--{key.replace('_', '-')} {saved.get(key)}, this run has {value}")
    return "; ".join(said)


def load_checkpoint(folder, model):
    """(path, state) of the newest checkpoint that loads and fits model, or (None, None); and
    those skipped, with the reason."""
    skipped = []
    for path in reversed(named_like_checkpoints(folder)):
        if path.is_dir():
            skipped.append(f"{path} (a folder, not a checkpoint file)")
            continue
        try:
            # Tensors, numbers, strings, lists, tuples and dicts only: no code runs.
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # truncated or corrupted: try the one before
            reason = str(error).split(". ")[0].splitlines()[0] if str(error) else "empty"
            skipped.append(f"{path} ({type(error).__name__}: {reason})")
            continue
        reason = mismatch(state, model)  # another script's file, or another model's
        if reason is None:
            return path, state, skipped
        skipped.append(f"{path} ({reason})")
    return None, None, skipped


def full_state(model, optimizer, scheduler, epoch, step, totals, config, device):
    """Everything the rest of the run depends on, in types that torch.load(weights_only=True)
    accepts: tensors, numbers, strings, None, and lists, tuples and dicts of them."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # momentum buffers included
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,  # the epoch under way, from 0
        "step": step,  # batches of it already done
        "totals": totals,  # loss sum and images of those batches
        "config": config,  # the options a resumed run must keep
        "rng": {
            "torch": torch.get_rng_state(),  # dropout, and anything else random on the CPU
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "python": random.getstate(),  # a tuple of ints
        },
    }


def restore(state, model, optimizer, scheduler, device):
    """Put a loaded state back; return the epoch, step and loss totals to go on from."""
    model.load_state_dict(state["model"])  # copies onto the model's device
    optimizer.load_state_dict(state["optimizer"])  # moves its tensors next to the parameters
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
    random.setstate(state["rng"]["python"])
    return state["epoch"], state["step"], state["totals"]


def weights_digest(model):
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv=None):
    args = parse_args(argv)
    if (args.output_dir / "model.pt").is_dir():
        fail(f"{args.output_dir / 'model.pt'} is a folder: move it away or choose another "
             "--output-dir")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    dataset = make_dataset(args)
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:  # deterministic cuBLAS; must be set before the first CUDA call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        announce_gpu(torch, device)
    torch.use_deterministic_algorithms(True)  # the same run gives the same weights
    steps_per_epoch = -(-len(dataset) // args.batch_size)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=0.1 if args.warmup_steps else 1.0, total_iters=args.warmup_steps
    )  # stepped after every batch
    epoch, step = 0, 0  # step: batches of the epoch already done
    totals = torch.zeros(2, dtype=torch.float64)  # their loss sum and images
    # What a resumed run must keep (--epochs may grow): another --lr is another run.
    config = {"seed": args.seed, "batch_size": args.batch_size, "samples": len(dataset),
              "lr": args.lr, "warmup_steps": args.warmup_steps,
              "model": signature(model)}  # fmt: skip

    hold(args.checkpoint_dir)
    for leftover in args.checkpoint_dir.glob("checkpoint-*.pt.tmp"):
        if leftover.is_file():
            leftover.unlink()  # a write that was interrupted
    path, state, skipped = load_checkpoint(args.checkpoint_dir, model)
    if state is not None:
        if changed := changes(state["config"], config):
            fail(f"{path} was written with {changed}: resume with the same options (only "
                 "--epochs may grow), or start another run in another --checkpoint-dir "
                 "(RUN_NAME=<name> with the job scripts)")  # fmt: skip
        epoch, step, totals = restore(state, model, optimizer, scheduler, device)
    done, total = epoch * steps_per_epoch + step, args.epochs * steps_per_epoch
    saves = {f"checkpoint-{n:08d}.pt" for n in range(done + 1, total + 1)
             if n % args.checkpoint_every == 0 or n % steps_per_epoch == 0}  # fmt: skip
    for entry in sorted(args.checkpoint_dir.glob("checkpoint-*")):
        if entry.is_dir() and entry.name.removesuffix(".tmp") in saves:  # never replace it
            fail(f"{entry} is a folder, and this run would write a checkpoint file there: "
                 "move it away or choose another --checkpoint-dir")  # fmt: skip
    fallback = f"falling back to {path}" if path else "no usable checkpoint"
    for reason in skipped:
        print(f"train_checkpoint.py: warning: skipped {reason}; {fallback}", file=sys.stderr)
    if state is None:
        print(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")
    else:
        print(f"resumed from {path} after {done} of {total} steps")

    def checkpoint(steps_done):
        state = full_state(model, optimizer, scheduler, epoch, step, totals, config, device)
        with ctrl_c_waits():
            path = save_checkpoint(state, args.checkpoint_dir, steps_done, args.keep)
        print(f"saved {path}")

    model.train()
    while epoch < args.epochs:
        # The order of an epoch depends on --seed and the epoch alone.
        generator = torch.Generator().manual_seed(args.seed * 10_000 + epoch)
        order = torch.randperm(len(dataset), generator=generator)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=order[step * args.batch_size :].tolist(),  # skip the batches done
            num_workers=args.num_workers,
            pin_memory=use_cuda,
            generator=generator,  # not the global generator, which dropout uses
        )
        start, images_here = time.perf_counter(), 0
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            value = loss.item()
            if not math.isfinite(value):  # stop before a checkpoint saves it
                fail(f"loss is {value} at epoch {epoch + 1}, step {step}: start again in a new "
                     "--checkpoint-dir with a lower --lr or more --warmup-steps (a resumed run "
                     "keeps the learning rate it saved)")  # fmt: skip
            totals += torch.tensor([value * len(labels), len(labels)], dtype=torch.float64)
            images_here += len(labels)
            steps_done = epoch * steps_per_epoch + step
            if steps_done % args.checkpoint_every == 0 and step < steps_per_epoch:
                checkpoint(steps_done)
        speed = images_here / (time.perf_counter() - start)
        print(f"epoch {epoch + 1}: loss {totals[0] / totals[1]:.4f}, {speed:.0f} images/s")
        epoch, step, totals = epoch + 1, 0, torch.zeros(2, dtype=torch.float64)
        checkpoint(epoch * steps_per_epoch)  # at the start of the next epoch

    args.output_dir.mkdir(parents=True, exist_ok=True)
    save_atomically(model.state_dict(), args.output_dir / "model.pt")
    print(f"final weights: sha256 {weights_digest(model)}, saved {args.output_dir / 'model.pt'}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the checkpoints already written are complete
        print("train_checkpoint.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
