"""Checkpoint a PyTorch Lightning training with ModelCheckpoint and resume from the last one.

ModelCheckpoint writes a checkpoint into --checkpoint-dir at the end of every epoch, or every
--checkpoint-every training steps, keeps the --keep newest ones (it monitors the global step)
and writes last.ckpt each time. On start, the script resumes from last.ckpt when there is one
(trainer.fit(..., ckpt_path="last")), or from --resume: the Trainer restores the model, the
optimizer, the scheduler, its loops and callbacks, and trains only the epochs that are left.
It loads the file with torch.load's default, weights_only=True since PyTorch 2.6. A small
CheckpointIO plugin writes each file atomically (temporary file, fsync, rename).

    python lightning_checkpoint.py --fake-data --epochs 2
    python lightning_checkpoint.py --fake-data --epochs 4    # resumes: trains epochs 3 and 4
"""

import argparse
import contextlib
import glob
import math
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from torch import nn


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


def existing_file(text):
    """An input file that must exist: here a checkpoint to resume from."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file")
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
        "--num-workers", type=non_negative_int, default=2, help="DataLoader workers"
    )
    parser.add_argument(
        "--data-dir", type=folder_path, default=Path("data"), help="CIFAR-10 folder"
    )
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints")
    parser.add_argument(
        "--checkpoint-every", type=positive_int, help="steps; without it: each epoch"
    )
    parser.add_argument(
        "--keep", type=positive_int, default=3, help="checkpoints kept, besides last"
    )
    parser.add_argument(
        "--resume", type=existing_file, help="checkpoint (default: last.ckpt, if any)"
    )
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"lightning_checkpoint.py: error: {message}", file=sys.stderr)
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


class CNN(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.save_hyperparameters()  # plain numbers only: the checkpoint loads weights-only
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}  # stepped at each epoch end


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


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write beside the target, sync, rename. Lightning's own writer (local files) makes its
    temporary file in TMPDIR and moves it: a copy, not an atomic rename, across file systems.
    Ctrl-C (SIGINT) takes effect once the file is written."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.tmp")
        with ctrl_c_waits():
            with open(temporary, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class EpochReport(L.Callback):
    """Where the training resumed, and the loss and images/s of every epoch."""

    def on_train_start(self, trainer, module):
        self.start, self.images = time.perf_counter(), 0  # a resumed run may start mid-epoch
        if module.device.type == "cuda":
            announce_gpu(torch, module.device)
        if trainer.ckpt_path:  # the loops are restored by now
            print(f"resumed from {trainer.ckpt_path} at epoch {trainer.current_epoch + 1}, "
                  f"step {trainer.global_step}")  # fmt: skip

    def on_train_epoch_start(self, trainer, module):
        self.start, self.images = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.images += len(batch[1])

    def on_train_epoch_end(self, trainer, module):  # before ModelCheckpoint's, which runs last
        loss = trainer.callback_metrics["train_loss"].item()
        if not math.isfinite(loss):  # stop before this epoch's checkpoint is saved
            fail(f"loss is {loss} at epoch {trainer.current_epoch + 1}, step "
                 f"{trainer.global_step}: lower --lr")  # fmt: skip
        speed = self.images / (time.perf_counter() - self.start)
        print(f"epoch {trainer.current_epoch + 1}: loss {loss:.4f}, {speed:.0f} images/s")


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    L.seed_everything(args.seed, verbose=False)
    loader = torch.utils.data.DataLoader(
        make_dataset(args),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    checkpoint = ModelCheckpoint(
        dirpath=args.checkpoint_dir,
        filename="{epoch}-{step}",
        every_n_train_steps=args.checkpoint_every or None,  # steps, or else:
        every_n_epochs=None if args.checkpoint_every else 1,  # at the end of each epoch
        save_top_k=args.keep,
        monitor="step",  # the highest steps: the newest checkpoints
        mode="max",
        save_last=True,  # last.ckpt, what ckpt_path="last" finds
    )
    trainer = L.Trainer(
        accelerator="gpu" if use_cuda else "cpu",
        devices=1,
        max_epochs=args.epochs,
        callbacks=[checkpoint, EpochReport()],
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=sys.stdout.isatty(),
        enable_model_summary=False,
    )
    has_last = any(args.checkpoint_dir.glob("last*.ckpt"))  # else "last" warns, then starts
    resume = args.resume or ("last" if has_last else None)
    try:
        trainer.fit(CNN(args.lr), loader, ckpt_path=resume)
    except SystemExit as stop:
        if stop.code == 1 and trainer.interrupted:  # how Lightning ends Ctrl-C: 130 instead
            raise KeyboardInterrupt from None
        raise
    kept = sorted(path.name for path in args.checkpoint_dir.glob("*.ckpt"))
    print(f"trained {trainer.current_epoch} epochs; in {args.checkpoint_dir}: {', '.join(kept)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("lightning_checkpoint.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
