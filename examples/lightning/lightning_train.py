"""Train a CNN with PyTorch Lightning on every GPU of a Slurm allocation, one task per GPU.

Lightning's Trainer runs DistributedDataParallel for you. Under srun, every task is one
process: Lightning reads its rank from the Slurm variables (SLURMEnvironment), and the script
takes the Trainer's devices and nodes from the same allocation (SLURM_NTASKS_PER_NODE,
SLURM_NNODES), so that the two always match. When Slurm sends SIGUSR1 before the time limit,
all processes stop at the same step, save a checkpoint in --output-dir and requeue the job,
which resumes from it. Ctrl-C (SIGINT) saves the same checkpoint at the same step, then
exits with 130: run the same command again to resume. Outside Slurm, Lightning starts
--devices processes itself. Rank 0 prints the loss and images/s of every epoch, and a loss
that is not finite stops every process at the end of its epoch, before any checkpoint; the
progress bar is shown only in a terminal, never in a batch log.

    python lightning_train.py --fake-data --devices 2
    sbatch lightning.sbatch --fake-data             # two nodes, one task per GPU
"""

import argparse
import datetime
import gc
import glob
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def fail(message):
    print(f"lightning_train.py: error: {message}", file=sys.stderr)
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


def env_int(name, default=None):
    """The whole number in environment variable `name` (default: when it is not set), or one
    line that names it."""
    if default is not None and name not in os.environ:
        return default
    value = os.environ[name]
    if not value.isdecimal():
        source = "srun" if name.startswith("SLURM_") else "the launcher, or in the job script"
        fail(f"{name}={value!r} is not a whole number (set by {source})")
    return int(value)


# Numbers Lightning reads with int(), the rank as soon as it is imported: checked before, so
# that a wrong value is one line, not a traceback.
for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
             "NODE_RANK", "MASTER_PORT", "SLURM_JOB_ID"):  # fmt: skip
    if name in os.environ:
        env_int(name)
if "MASTER_PORT" in os.environ and not 0 < int(os.environ["MASTER_PORT"]) < 65536:
    fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.environments import (  # noqa: E402
    LightningEnvironment,
    SLURMEnvironment,
)
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402


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
    parser.add_argument(
        "--devices", type=positive_int, help="per node (default: from srun, else 1)"
    )
    parser.add_argument("--num-nodes", type=positive_int, help="(default: from srun, else 1)")
    parser.add_argument("--epochs", type=positive_int, default=3)  # never -1: "no limit"
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.02, help="for a global batch of 256")
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="DataLoader workers per process"
    )
    parser.add_argument("--data-dir", type=folder_path, default="data", help="CIFAR-10 folder")
    parser.add_argument("--output-dir", type=writable_dir, default="runs", help="logs, checkpoints")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=positive_int, default=8192, help="generated images")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to start all tasks"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=1800, help="seconds a collective may wait"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def slurm_allocation():
    """(tasks per node, nodes) when srun started this process, None outside Slurm."""
    interactive = os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    if "SLURM_NTASKS" not in os.environ or interactive:
        return None  # Lightning's own rule: no Slurm job, or an interactive shell in one
    tasks = env_int("SLURM_NTASKS")
    started = env_int("SLURM_STEP_NUM_TASKS", 1)  # set by srun, not in the batch shell
    if started != tasks:
        fail(
            f"SLURM_NTASKS={tasks} but srun started {started}: Lightning would wait for "
            f"{tasks - started} more process(es) that never come. Run the script with srun "
            "(srun python lightning_train.py), or train on this node alone with "
            "SLURM_JOB_NAME=interactive python lightning_train.py"
        )
    return env_int("SLURM_NTASKS_PER_NODE", tasks), env_int("SLURM_NNODES")


def make_dataset(args):
    if args.fake_data:
        generator = torch.Generator().manual_seed(args.seed)  # the same data in every process
        labels = torch.randint(0, 10, (args.fake_size,), generator=generator)
        patterns = torch.randn(10, 3, 32, 32, generator=generator)
        images = patterns[labels] + torch.randn(args.fake_size, 3, 32, 32, generator=generator)
        return torch.utils.data.TensorDataset(images, labels)
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


class NonFiniteLoss(Exception):
    """A loss that is nan or infinite: raised in every process at once (the value is the same
    in all of them), before any checkpoint is saved."""


class CNN(L.LightningModule):
    def __init__(self, lr, batch_size):
        super().__init__()
        self.save_hyperparameters()  # stored in checkpoints
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        # The epoch's mean over all processes, for EpochReport.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        global_batch = self.hparams.batch_size * self.trainer.world_size
        lr = self.hparams.lr * global_batch / 256  # linear scaling with the global batch
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)


class EpochReport(L.Callback):
    """Each process says where it runs; rank 0 prints the loss and images/s of every epoch."""

    def on_fit_start(self, trainer, module):
        self.start, self.images = time.perf_counter(), 0  # a resumed run starts mid-epoch
        node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
        print(f"rank {trainer.global_rank}/{trainer.world_size} on {node}, {module.device}")
        if module.device.type == "cuda":
            announce_gpu(torch, module.device)
        if trainer.is_global_zero:
            environment = type(trainer.strategy.cluster_environment).__name__
            print(f"world size {trainer.world_size}: {trainer.num_nodes} node(s) x "
                  f"{trainer.num_devices} devices, {module.device.type} "
                  f"({trainer.strategy.process_group_backend}), {environment}")  # fmt: skip

    def on_train_start(self, trainer, module):
        if trainer.ckpt_path and trainer.is_global_zero:  # the loops are restored by now
            print(f"resumed from {trainer.ckpt_path} at epoch {trainer.current_epoch + 1}, "
                  f"step {trainer.global_step}")  # fmt: skip

    def on_train_epoch_start(self, trainer, module):
        self.start, self.images = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.images += len(batch[1])

    def on_train_epoch_end(self, trainer, module):
        loss = trainer.callback_metrics["train_loss"].item()  # the mean over all processes
        if not math.isfinite(loss):  # checked before Lightning's checkpoint of the epoch
            raise NonFiniteLoss(f"loss is {loss} at epoch {trainer.current_epoch + 1}, "
                                f"step {trainer.global_step}: lower --lr")  # fmt: skip
        speed = self.images * trainer.world_size / (time.perf_counter() - self.start)
        if trainer.is_global_zero and not trainer.should_stop:  # not an epoch cut short
            print(f"epoch {trainer.current_epoch + 1}: loss {loss:.4f}, {speed:.0f} images/s")


class StopOnSignal(L.Callback):
    """SIGUSR1 or Ctrl-C (SIGINT) only sets a flag; at the end of a step, all processes agree
    to save and stop. A second Ctrl-C stops at once, without saving.

    Lightning's own SLURMEnvironment(auto_requeue=True) saves inside the signal handler,
    wherever each process happens to be, and the processes can then wait for each other
    until the timeout. Here the handler records the signal; the work waits for a step's end.
    """

    def __init__(self, checkpoint):
        self.checkpoint, self.received, self.stopped = checkpoint, None, False

    def setup(self, trainer, module, stage):
        signal.signal(signal.SIGUSR1, self.record)

    def record(self, signum, frame):
        self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C stops at once

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        # One small all-reduce per step: True in every process if any got the signal.
        if trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
            if not math.isfinite(loss):  # the last good checkpoint stays the newest
                raise NonFiniteLoss(f"loss is {loss} at epoch {trainer.current_epoch + 1}, "
                                    f"step {trainer.global_step}: lower --lr")  # fmt: skip
            trainer.save_checkpoint(self.checkpoint)  # rank 0 writes, all wait for it
            trainer.should_stop = self.stopped = True
            if trainer.is_global_zero:
                print(f"{self.received or 'signal'}: stopped at epoch "
                      f"{trainer.current_epoch + 1}, step {trainer.global_step}, "
                      f"saved {self.checkpoint}")  # fmt: skip


def cluster_environment(args):
    """Who starts the processes (Lightning's cluster environment), devices and nodes."""
    allocation = slurm_allocation()
    if allocation is None:  # Lightning starts the processes of this node itself
        return LightningEnvironment(), args.devices or 1, args.num_nodes or 1
    devices, num_nodes = args.devices or allocation[0], args.num_nodes or allocation[1]
    try:  # srun started one process per task: Lightning must not start more
        environment = SLURMEnvironment(auto_requeue=False)  # StopOnSignal requeues instead
        environment.validate_settings(devices, num_nodes)  # Lightning's check, before any wait
    except (RuntimeError, ValueError) as error:
        fail(error)
    return environment, devices, num_nodes


def meet_the_others(environment, seconds):
    """Under srun, every task must reach rank 0 within `seconds`: rank 0 serves the store on
    the address and port Lightning uses, and its server is shared (multi_tenant) with the one
    Lightning then creates, whose timeout is DDPStrategy's long one for every collective."""
    return torch.distributed.TCPStore(
        environment.main_address,
        environment.main_port,
        environment.world_size(),
        is_master=environment.global_rank() == 0,
        timeout=datetime.timedelta(seconds=seconds),
        multi_tenant=True,
    )


def make_trainer(args, environment, devices, num_nodes, use_cuda, callbacks):
    return L.Trainer(
        accelerator="gpu" if use_cuda else "cpu",
        devices=devices,  # processes per node: --ntasks-per-node under srun
        num_nodes=num_nodes,
        strategy=DDPStrategy(
            cluster_environment=environment,
            timeout=datetime.timedelta(seconds=args.timeout),  # every collective, not the start
        ),
        max_epochs=args.epochs,
        enable_progress_bar=sys.stdout.isatty(),  # no bar in batch logs
        enable_model_summary=False,
        default_root_dir=args.output_dir,  # logs and checkpoints
        callbacks=callbacks,
    )


def requeue(checkpoint, output_dir):
    """Rank 0, once every process has saved and stopped: put the job back in the queue."""
    job = os.environ["SLURM_JOB_ID"]
    print(f"requeuing job {job}: it will resume from {checkpoint}")
    if subprocess.run(["scontrol", "requeue", job], check=False).returncode != 0:
        fail(f"scontrol requeue {job} failed: submit again with --output-dir {output_dir}")


def main(argv=None):
    args = parse_args(argv)
    environment, devices, num_nodes = cluster_environment(args)
    if not args.fake_data and not (args.data_dir / "cifar-10-batches-py").is_dir():
        fail(
            f"no CIFAR-10 in {args.data_dir}: download it once on a login node with "
            f"python -c \"from torchvision.datasets import CIFAR10; CIFAR10('{args.data_dir}', "
            'download=True)", or pass --fake-data'
        )  # never download here: every process would write the same files at once
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    if use_cuda and torch.cuda.device_count() < devices:
        fail(
            f"{devices} processes per node but {torch.cuda.device_count()} GPUs visible: request "
            f"#SBATCH --gpus-per-node={devices}, one GPU per task, visible to all tasks of a node"
        )

    L.seed_everything(args.seed, verbose=False)  # the same initial weights in every process
    loader = torch.utils.data.DataLoader(
        make_dataset(args),
        batch_size=args.batch_size,
        shuffle=True,  # Lightning replaces this by a DistributedSampler that shuffles
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    checkpoint = args.output_dir / "requeue.ckpt"  # the same folder after a requeue
    stop_on_signal = StopOnSignal(checkpoint)  # SIGUSR1 from Slurm, or Ctrl-C
    slurm = isinstance(environment, SLURMEnvironment)
    trainer = make_trainer(
        args, environment, devices, num_nodes, use_cuda, [EpochReport(), stop_on_signal]
    )
    resume = checkpoint if checkpoint.exists() else None  # left by a requeued run
    signal.signal(signal.SIGINT, stop_on_signal.record)  # Ctrl-C: the same save and stop
    problem = None
    try:
        if slurm and environment.world_size() > 1:  # srun started every task: meet now
            store = meet_the_others(environment, args.init_timeout)  # noqa: F841 (kept open)
        trainer.fit(CNN(args.lr, args.batch_size), loader, ckpt_path=resume)
    except (torch.distributed.DistStoreError, torch.distributed.DistNetworkError) as error:
        fail(
            f"rank {trainer.global_rank}: not all {trainer.world_size} processes met within "
            f"{args.init_timeout} s ({str(error).splitlines()[0]}); check that srun started "
            "one task per device on every node"
        )
    except NonFiniteLoss as error:
        problem = str(error)  # said once the process group is freed
    rank, interrupted = trainer.global_rank, stop_on_signal.received == "SIGINT"
    if stop_on_signal.stopped and slurm and not interrupted and rank == 0:
        requeue(checkpoint, args.output_dir)  # all processes saved and stopped
    # Lightning leaves the process group to interpreter shutdown, where gloo sometimes aborts
    # ("terminate called without an active exception"): free what holds it, then destroy it.
    del trainer, loader
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if problem:  # every process stops, rank 0 says why
        if rank == 0:
            print(f"lightning_train.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    if interrupted:
        saved = f": saved {checkpoint}, run again to resume" if stop_on_signal.stopped else ""
        if rank == 0:
            print(f"lightning_train.py: interrupted (Ctrl-C){saved}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("lightning_train.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
