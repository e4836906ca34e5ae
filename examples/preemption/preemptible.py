"""Train a small CNN that saves a checkpoint and stops when warned, then resumes where it was.

SIGUSR1 (which the job script forwards from Slurm before the time limit) and SIGTERM (which
Slurm sends at the time limit, on preemption and on cancellation) only set a flag. At the
end of the current step, the script writes a checkpoint into --checkpoint-dir, atomically,
and exits with code 75 (EX_TEMPFAIL: "try again"), which tells the job script to requeue the
job. Ctrl-C (SIGINT) saves the same way, then exits with code 130. It also saves at the end
of every epoch. On start it resumes from the checkpoint it finds there, in the middle of an
epoch if need be, and stops after exactly --epochs epochs, however often it was interrupted.
On CPU, a resumed run ends with the same weights, bit for bit, as an uninterrupted one. A file
it cannot resume from, or a loss that is not finite, stops it with one line, and it never
replaces a folder that has the checkpoint's name. A second run on the same --checkpoint-dir is
refused while the first holds it, and a save that fails (a full disk, a quota) stops the run in
one line, leaving the last checkpoint as it was and no temporary file.

    python preemptible.py --fake-data --checkpoint-dir checkpoints
    sbatch preemptible.sbatch --fake-data
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
import signal
import sys
import time
from pathlib import Path

CHECKPOINTED = 75  # os.EX_TEMPFAIL: a checkpoint was saved, run me again to go on
INTERRUPTED = 130  # Ctrl-C: saved too, but stopped by hand
KEYS = {"model", "optimizer", "epoch", "step", "loss_sum", "images"}


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
        "--num-workers", type=non_negative_int, default=0, help="DataLoader workers"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"preemptible.py: error: {message}", file=sys.stderr)
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


class StopSignal:
    """Records that SIGUSR1, SIGTERM or SIGINT (Ctrl-C) came; the training loop acts on it after
    its step."""

    def __init__(self):
        self.name = None
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.record)

    def record(self, signum, frame):
        self.name = signal.Signals(signum).name  # nothing else: a step may be half done


def ignore_sigterm(worker_id):
    """In DataLoader workers: Slurm sends SIGTERM to every process of the job (and Ctrl-C sends
    SIGINT to every process in the terminal), and a worker that dies of it stops the training
    before it saves. The main process stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
            print(f"preemptible.py: warning: cannot lock {folder} ({error.strerror}): make "
                  "sure no other run uses it", file=sys.stderr)  # fmt: skip
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


def save_checkpoint(torch, state, path):
    """Write a temporary file, force it to disk, then rename it over the old checkpoint.

    The rename is atomic: a job killed at any moment leaves the old checkpoint or the new
    one, never half a file. A failed write (a full disk, a quota) removes the temporary file
    and stops in one line."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        reason = write_problem(error, path.parent)
        with contextlib.suppress(OSError):
            temporary.unlink()  # frees the space it took
        kept = f"{path} is as it was" if path.exists() else "no checkpoint was saved before"
        fail(f"cannot write {path}: {reason}; {kept}: free some space (df -h, or your centre's "
             "quota command) and run again")  # fmt: skip
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself reaches the disk
    finally:
        os.close(folder)


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


def load_checkpoint(torch, path, model, optimizer, device):
    """Restore the model and optimizer from path; return where the training stopped."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        reason = mismatch(state, model)  # another script's file, or another model's
        if reason is None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            return state["epoch"], state["step"], state["loss_sum"], state["images"]
    except Exception as error:  # not a checkpoint, or truncated
        reason = str(error).splitlines()[0].split(". ")[0] if str(error) else repr(error)
    fail(
        f"cannot resume from {path} ({reason}): delete it to start again, or pass "
        "another --checkpoint-dir"
    )


def make_dataset(torch, args):
    if args.fake_data:
        generator = torch.Generator().manual_seed(args.seed)
        labels = torch.randint(0, 10, (args.fake_size,), generator=generator)
        patterns = torch.randn(10, 3, 32, 32, generator=generator)
        noise = torch.randn(args.fake_size, 3, 32, 32, generator=generator)
        images = 0.3 * patterns[labels] + noise  # faint class patterns under noise
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
    )  # no random augmentation: a resumed epoch sees exactly the same images
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
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def weights_digest(model):
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(torch, args, model, optimizer, dataset, device, stop):
    """The training loop: resume, then look for a stop signal after every step."""
    path = args.checkpoint_dir / "checkpoint.pt"
    hold(args.checkpoint_dir)
    for entry in (path, path.with_name(path.name + ".tmp")):  # what every save writes
        if entry.is_dir():
            fail(f"{entry} is a folder, and this run would write a checkpoint file there: "
                 "move it away or choose another --checkpoint-dir")  # fmt: skip
    first_epoch, first_step, loss_sum, images = 0, 0, 0.0, 0
    if path.exists():
        first_epoch, first_step, loss_sum, images = load_checkpoint(
            torch, path, model, optimizer, device
        )
        if first_epoch < args.epochs:
            print(f"resumed from {path} at epoch {first_epoch + 1}, step {first_step}")
        else:
            print(f"resumed from {path}: {first_epoch} epochs done already")

    def state(epoch, step):  # tensors, ints and floats only: loads with weights_only=True
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "step": step, "loss_sum": loss_sum, "images": images}  # fmt: skip

    for epoch in range(first_epoch, args.epochs):
        # The order of an epoch depends only on the seed and the epoch: a resumed epoch skips
        # the batches it has done and sees the others in the same order.
        order = torch.randperm(
            len(dataset), generator=torch.Generator().manual_seed(args.seed + epoch)
        )
        step = first_step if epoch == first_epoch else 0
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=order[step * args.batch_size :].tolist(),
            num_workers=args.num_workers,
            worker_init_fn=ignore_sigterm,
        )
        start, seen = time.perf_counter(), 0
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step, seen = step + 1, seen + len(labels)
            value = loss.item()
            if not math.isfinite(value):  # stop before a checkpoint saves it
                fail(
                    f"loss is {value} at epoch {epoch + 1}, step {step}: start again in a "
                    "new --checkpoint-dir with a lower --lr (a resumed run keeps the learning "
                    "rate it saved)"
                )
            loss_sum, images = loss_sum + value * len(labels), images + len(labels)
            if stop.name:  # the step is complete: save it, and stop
                save_checkpoint(torch, state(epoch, step), path)
                print(f"{stop.name}: checkpoint saved at epoch {epoch + 1}, step {step}")
                sys.exit(INTERRUPTED if stop.name == "SIGINT" else CHECKPOINTED)
        print(f"epoch {epoch + 1}: loss {loss_sum / images:.4f}, "
              f"{seen / (time.perf_counter() - start):.0f} images/s")  # fmt: skip
        loss_sum, images = 0.0, 0
        save_checkpoint(torch, state(epoch + 1, 0), path)  # a crash loses one epoch at most


def main(argv=None):
    args = parse_args(argv)
    stop = StopSignal()  # before the slow imports: a signal may come at any time
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        announce_gpu(torch, device)
    dataset = make_dataset(torch, args)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(not use_cuda)  # some CUDA operations have no such version
    model = make_model(torch).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(f"{len(dataset)} images, {device.type}, checkpoints in {args.checkpoint_dir}")

    train(torch, args, model, optimizer, dataset, device, stop)
    print(f"finished: {args.epochs} epochs, weights sha256 {weights_digest(model)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before StopSignal was set up: nothing to save yet
        print("preemptible.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
