"""Train a small CNN on generated images and log its metrics to TensorBoard event files.

The event files need no server and no internet while the job runs: they land in
<output-dir>/runs/<job id>-<run name>/ ("local-..." outside Slurm), one folder per run, and
TensorBoard reads them later, from a login node or your own computer. The script logs the loss
and learning rate of every step and the images/s of every epoch, saves a checkpoint after each
epoch (<output-dir>/checkpoints/<run folder>.pt), and prints the command that shows the runs.
A job that starts again under the same run folder (a requeued job) resumes from its checkpoint,
and TensorBoard drops what the first start logged after it: each step is shown once.

    python train_tensorboard.py
    sbatch tensorboard.sbatch                  # one task; the runs land in the submission folder
"""

import argparse
import contextlib
import errno
import getpass
import glob
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter


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


def run_name(text):
    if not text or "/" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"must be a plain folder name (got {text!r})")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=0.05, help="at the start")
    parser.add_argument("--fake-size", type=positive_int, default=2048, help="images generated")
    parser.add_argument("--num-workers", type=non_negative_int, default=2)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--output-dir", type=writable_dir, default=".")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--run-name", type=run_name, help="the run's folder after the job id (default: seed<N>)"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"train_tensorboard.py: error: {message}", file=sys.stderr)
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


def check_job_ids():
    """Slurm's array ids name the run's folder: whole numbers, or one line that says so."""
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        if name in os.environ and not os.environ[name].isdecimal():
            fail(f"{name}={os.environ[name]!r} is not a whole number (set by Slurm)")


def run_dir(output_dir, name):
    """<output-dir>/runs/<job>-<name>: unique per job and per array task."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:  # 1234_7: the array's id and this task's index
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job = os.environ.get("SLURM_JOB_ID", "local")
    return (output_dir / "runs" / f"{job}-{name}").resolve()


def make_model(classes=10):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 4 * 4, classes),
    )  # fmt: skip


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


def save_checkpoint(path, model, optimizer, scheduler, epoch, step, config):
    """To a temporary file, synced, then renamed: a file with the checkpoint's name is
    complete. A failed write (a full disk, a quota) removes the temporary file, leaves the
    last checkpoint as it was and stops in one line."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
             "config": config}  # fmt: skip
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the file gets its name
        os.replace(temporary, path)  # atomic: a reader sees the old file or the new one
    except (OSError, RuntimeError) as error:
        reason = write_problem(error, path.parent)
        with contextlib.suppress(OSError):
            temporary.unlink()  # frees the space it took
        kept = f"{path} is intact" if path.exists() else "no checkpoint was saved before"
        fail(f"cannot write {path}: {reason}; {kept}: free some space (df -h, or your centre's "
             "quota command) and run again")  # fmt: skip
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the new name is on disk too
    finally:
        os.close(directory)


def resume(path, model, optimizer, scheduler, config):
    """(epoch, step) the run goes on from: those of its checkpoint, or (0, 0) without one."""
    if not path.exists():
        return 0, 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        saved = state["config"]
        epoch, step = state["epoch"], state["step"]
    except Exception as error:  # noqa: BLE001 (one line: what is wrong, and what to do)
        fail(f"cannot resume from {path} ({type(error).__name__}): delete it to start again")
    for name in config:
        if saved.get(name) != config[name]:
            option = "--" + name.replace("_", "-")
            fail(f"{path} is a run with {option} {saved.get(name)}, not {config[name]}: pass "
                 "the same options, another --run-name, or delete it to start again")  # fmt: skip
    return epoch, step


def train_epoch(model, loader, optimizer, scheduler, device, writer, step):
    """One epoch; logs each step's loss and learning rate. Returns (mean loss, images, step)."""
    losses, rates, images_seen = [], [], 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        rates.append(scheduler.get_last_lr()[0])
        scheduler.step()
        losses.append(loss.detach())  # on the device: no sync in the loop
        images_seen += len(labels)
    for i, (loss, lr) in enumerate(zip(torch.stack(losses).tolist(), rates, strict=True)):
        writer.add_scalar("train/loss", loss, step + i)
        writer.add_scalar("train/lr", lr, step + i)
    return sum(losses).item() / len(losses), images_seen, step + len(losses)


def main(argv=None):
    args = parse_args(argv)
    check_job_ids()
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        announce_gpu(torch, device)
    if args.fake_size < args.batch_size:
        fail(f"--fake-size {args.fake_size} is smaller than one batch of {args.batch_size}")

    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.fake_size, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (args.fake_size,), generator=generator)
    # Learnable: each class adds its own pattern to the noise.
    images += torch.randn(10, 3, 32, 32, generator=generator)[labels]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        drop_last=True,
        generator=generator,
    )
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(loader))

    log_dir = run_dir(args.output_dir, args.run_name or f"seed{args.seed}")
    checkpoint = log_dir.parent.parent / "checkpoints" / f"{log_dir.name}.pt"
    options = ("epochs", "batch_size", "lr", "fake_size", "seed")  # those a resume must keep
    config = {name: getattr(args, name) for name in options}
    done, step = resume(checkpoint, model, optimizer, scheduler, config)
    if log_dir.exists():  # a requeued job goes on in its run; TensorBoard shows one run
        print(f"note: {log_dir} exists: this run goes on in it from step {step}")
    if done:
        print(f"resumed from {checkpoint} after epoch {done} of {args.epochs}, step {step}")
    # purge_step: TensorBoard hides what an earlier start logged from this step on (the steps
    # after its last checkpoint), so that each step appears once in the curves.
    writer = SummaryWriter(log_dir=str(log_dir), purge_step=step)
    checkpoint.parent.mkdir(exist_ok=True)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"{host}, {device.type}: {args.epochs} epochs of {len(loader)} steps, logging to "
          f"{log_dir}")  # fmt: skip
    for epoch in range(done + 1, args.epochs + 1):
        start = time.perf_counter()
        loss, images_seen, step = train_epoch(
            model, loader, optimizer, scheduler, device, writer, step
        )
        rate = images_seen / (time.perf_counter() - start)
        if not math.isfinite(loss):
            fail(f"loss is {loss} at epoch {epoch}, step {step}: try a lower --lr")
        # Every tag on one axis, the global step (here the epoch's last): purge_step drops
        # every tag's values from the resumed step on.
        writer.add_scalar("epoch/loss", loss, step - 1)
        writer.add_scalar("epoch/images_per_s", rate, step - 1)
        writer.flush()  # on disk now: a job that ends early still has its curves
        print(f"epoch {epoch}: loss {loss:.4f}, {rate:.0f} images/s")
        save_checkpoint(checkpoint, model, optimizer, scheduler, epoch, step, config)
    writer.close()

    events = sorted(log_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not events:
        fail(f"no event file in {log_dir}")
    print(f"Event file: {events[-1]}")
    port = tensorboard_port(host)
    print(f"View the runs on a login node (port {port} is free on {host} now):")
    print(f"    tensorboard --logdir {log_dir.parent} --port {port}")
    print(f"On your own computer, a tunnel to that login node, then http://localhost:{port}:")
    print(f"    ssh -N -L {port}:localhost:{port} {getpass.getuser()}@<login node>")


def tensorboard_port(host, tries=10):
    """A port for TensorBoard: one per job (from the job id; outside a job, the user id), so
    that users of one login node differ; the next one when it is in use here."""
    job = os.environ.get("SLURM_JOB_ID", "")
    first = 16000 + (int(job) if job.isdecimal() else os.getuid()) % 10000
    for port in range(first, first + tries):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))  # what TensorBoard will do
            except OSError:
                continue
        return port
    print(f"note: ports {first} to {first + tries - 1} are all in use on {host}: choose "
          "another with --port and in the tunnel")  # fmt: skip
    return first


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("train_tensorboard.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
