"""Train with FSDP2 and save sharded checkpoints with torch.distributed.checkpoint (DCP).

No process ever holds the whole model, not even to save it: after every epoch each process
writes its own shards of the model and optimizer state into one folder per checkpoint
(--output-dir/epoch-N), and rank 0 adds the metadata that says where each piece lies. The
folder is written under a temporary name and renamed by rank 0 once every shard is on disk;
the last --keep folders are kept. On start, the newest checkpoint is loaded, and DCP reshards
it when the number of processes changed. Rank 0 prints the loss and images/s of every epoch
and a digest of the weights. --convert turns a checkpoint into one torch.save file for
inference, in a single process, without GPU or launcher.

    torchrun --standalone --nproc-per-node=2 fsdp_dcp.py --fake-data --epochs 2
    torchrun --standalone --nproc-per-node=4 fsdp_dcp.py --fake-data --epochs 3   # reshards
    sbatch fsdp_dcp.sbatch --fake-data          # two nodes, one Slurm task per GPU
    python fsdp_dcp.py --convert checkpoints/epoch-3 model.pt
"""

import argparse
import datetime
import gc
import hashlib
import os
import re
import shutil
import socket
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
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="CIFAR-10 folder")
    parser.add_argument("--fake-data", action="store_true", help="train on generated images")
    parser.add_argument("--fake-size", type=int, default=8192, help="generated images")
    parser.add_argument("--width", type=int, default=512, help="features of each block")
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks")
    parser.add_argument("--output-dir", type=Path, default=Path("checkpoints"),
                        help="checkpoint folder of this run, seen by all nodes")  # fmt: skip
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept on disk")
    parser.add_argument(
        "--init-timeout", type=int, default=60, help="seconds to start all processes"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a collective may wait")
    parser.add_argument("--save-timeout", type=int, default=1800,
                        help="seconds a rank waits for the others to save or load")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--convert", nargs=2, type=Path, metavar=("CHECKPOINT", "FILE"),
                        help="write a checkpoint as one torch.save file, and stop")  # fmt: skip
    return parser.parse_args(argv)


def fail(message):
    print(f"fsdp_dcp.py: error: {message}", file=sys.stderr)
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
        how = "start this script with torchrun or srun (see fsdp_dcp.sbatch)"
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        how = "export them in the job script before srun (see fsdp_dcp.sbatch)"
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
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.5,) * 3, (0.25,) * 3),
        ]
    )
    return torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=transform)


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


def newest_checkpoint(folder):
    """The complete checkpoint of the latest epoch in folder, or None."""
    found = (re.fullmatch(r"epoch-(\d+)", path.name) for path in folder.glob("epoch-*"))
    done = [m for m in filter(None, found) if (folder / m[0] / ".metadata").is_file()]
    return folder / max(done, key=lambda m: int(m[1]))[0] if done else None


def fsync_folder(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_checkpoint(dcp, dist, state, folder, keep, group):
    """Every rank writes its shards into epoch-N.tmp; rank 0 renames it to epoch-N."""
    path = folder / f"epoch-{state['epoch']}"
    tmp = folder / f"{path.name}.tmp"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a run killed while saving
    dist.barrier(group=group)
    # Each rank writes and fsyncs its own files; rank 0 then writes .metadata. dcp.save returns
    # on every rank only after that, so the folder is complete when it returns.
    dcp.save(state, checkpoint_id=tmp, process_group=group)
    if dist.get_rank() == 0:
        fsync_folder(tmp)  # the names of the shard files
        if path.exists():
            shutil.rmtree(path)  # a checkpoint of the same epoch from an earlier run
        tmp.rename(path)  # the folder appears complete under its final name, or not at all
        fsync_folder(folder)
        done = sorted(folder.glob("epoch-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old)
    dist.barrier(group=group)  # no rank goes on, or exits, before the rename
    return path


def load_checkpoint(dcp, get_state_dict, set_state_dict, model, optimizer, path, group):
    """Read a checkpoint into the model and optimizer, resharded to this number of processes."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this run's shards
    state = {"model": model_state, "optimizer": optimizer_state, "epoch": 0, "world": 0}
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)  # fills them in place
    except dcp.CheckpointException as error:  # raised on every rank, with each rank's cause
        cause = next(iter(error.failures.values()))[0]
        fail(f"cannot resume from {path}: {cause} (--width and --blocks must be those of the "
             "run that saved it)")  # fmt: skip
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
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, target)  # all of it (optimizer state too) in this memory
    state = torch.load(target, map_location="cpu", weights_only=True)
    model = make_model(torch, args.width, args.blocks)  # a plain model, no FSDP
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        fail(f"{checkpoint} does not match --width {args.width} --blocks {args.blocks}: "
             f"{str(error).splitlines()[1].strip()}")  # fmt: skip
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
    # Saving waits for the slowest rank's writes: a group with a longer timeout, on CPU.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.save_timeout))

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
    newest = [newest_checkpoint(args.output_dir) if rank == 0 else None]
    dist.broadcast_object_list(newest, src=0, group=group)  # rank 0 decides, all ranks agree
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
        if rank == 0:
            loss_sum, images_seen = totals.tolist()
            print(f"epoch {epoch + 1}: loss {loss_sum / images_seen:.4f}, "
                  f"{images_seen / seconds:.0f} images/s")  # fmt: skip
        # --- checkpoint ---
        model_state, optimizer_state = get_state_dict(model, optimizer)  # shards, no copies
        state = {"model": model_state, "optimizer": optimizer_state, "epoch": epoch + 1,
                 "world": world}  # fmt: skip
        path = save_checkpoint(dcp, dist, state, args.output_dir, args.keep, group)
        if rank == 0:
            print(f"Saved {path}")
        # --- end checkpoint ---

    digest = sharded_digest(torch, model)
    if rank == 0:
        print(f"Weights digest: {digest}")
    del model, optimizer, mesh  # they hold the process group: free it while Python still runs
    gc.collect()  # and the reference cycles among them (hooks, DDP's reducer)
    dist.barrier()  # no rank tears its groups down while another still communicates
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
