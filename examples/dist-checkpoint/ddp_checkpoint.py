"""Checkpoint DistributedDataParallel training: rank 0 writes, every rank resumes from the file.

After every epoch rank 0 writes the whole training state (model, optimizer, epochs done) to
--output-dir, atomically: a temporary file in the same folder, fsync, os.replace. It keeps the
last --keep files. A barrier then holds the other ranks until the file is complete. On start,
every rank loads the newest checkpoint onto its own device (map_location) and goes on with the
next epoch, with the same shuffle and the same random numbers as a run that was never stopped.
The model is saved without DDP's "module." prefix, so the file also loads into a plain model.
Rank 0 prints the loss and images/s of every epoch and, at the end, a digest of the weights.

    torchrun --standalone --nproc-per-node=2 ddp_checkpoint.py --fake-data --epochs 2
    torchrun --standalone --nproc-per-node=2 ddp_checkpoint.py --fake-data --epochs 4  # resumes
    srun python ddp_checkpoint.py --fake-data      # in a job script such as ../ddp/ddp_srun.sbatch
"""

import argparse
import datetime
import gc
import hashlib
import os
import re
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--epochs", type=int, default=3, help="epochs in all, resumed ones too")
    parser.add_argument("--batch-size", type=int, default=64, help="per replica")
    parser.add_argument("--lr", type=float, default=0.04, help="for a global batch of 256")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="CIFAR-10 folder")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=int, default=8192, help="generated images")
    parser.add_argument("--output-dir", type=Path, default=Path("checkpoints"),
                        help="checkpoint folder of this run, seen by all nodes")  # fmt: skip
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept on disk")
    parser.add_argument(
        "--init-timeout", type=int, default=60, help="seconds to start all processes"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a collective may wait")
    parser.add_argument("--save-timeout", type=int, default=1800,
                        help="seconds the others wait for rank 0 to write")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"ddp_checkpoint.py: error: {message}", file=sys.stderr)
    sys.exit(2)


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
    rank, world, local_rank = (int(os.environ[name]) for name in names)
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
    return torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=transform)


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


def checkpoints(folder):
    """The checkpoints in folder, oldest first; temporary files are not among them."""
    found = (re.fullmatch(r"epoch-(\d+)\.pt", path.name) for path in folder.glob("epoch-*.pt"))
    return [folder / m[0] for m in sorted(filter(None, found), key=lambda m: int(m[1]))]


def save_checkpoint(torch, state, folder, keep):
    """Rank 0 only: write state atomically as epoch-N.pt, then delete all but the last keep."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"epoch-{state['epoch']}.pt"
    tmp = folder / f"{path.name}.tmp"  # same folder, so same file system: the rename is atomic
    with open(tmp, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())  # the data is on disk before the file gets its name
    os.replace(tmp, path)  # readers see the old set of files or the new one, never half a file
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash of the node
    finally:
        os.close(directory)
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    if args.keep < 1:
        fail(f"--keep {args.keep}: keep at least the last checkpoint")
    import torch
    import torch.distributed as dist

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    gpu = gpu_index(local_rank, torch.cuda.device_count()) if use_cuda else None
    if use_cuda:
        torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    dataset = make_dataset(torch, args)  # before joining the others: a missing folder stops all
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # Start-up fails fast: every process must reach rank 0 within --init-timeout. Under
        # torchrun, its agent already serves the store at MASTER_PORT: connect to it.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
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
    newest = [(checkpoints(args.output_dir) or [None])[-1] if rank == 0 else None]
    dist.broadcast_object_list(newest, src=0, group=save_group)  # rank 0 decides for all
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
        if rank == 0:
            loss_sum, images_seen = totals.tolist()
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
        # --- checkpoint ---
        if rank == 0:
            state = {
                "model": model.module.state_dict(),  # without DDP's "module." prefix
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,  # epochs done: the next sampler.set_epoch()
            }
            path = save_checkpoint(torch, state, args.output_dir, args.keep)
            print(f"Saved {path}")
        dist.barrier(group=save_group)  # no rank goes on, or exits, before the file is complete
        # --- end checkpoint ---

    if rank == 0:
        print(f"Weights digest: {weights_digest(torch, model.module.state_dict())}")
    del model, optimizer  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
