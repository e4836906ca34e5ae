"""Fine-tune every weight of a language model on several nodes, sharded with FSDP2.

Full fine-tuning trains all the weights, so every GPU would hold the model, its gradients and
AdamW's two running averages: 16 bytes per parameter in float32, beyond one GPU for all but
small models. fully_shard (FSDP2) splits all of it over the processes, one per GPU: each
decoder layer is a group whose parameters are gathered just before it computes and freed
after. The layers compute in bfloat16 on GPUs while the shards and the optimizer stay in
float32, and activation checkpointing recomputes each layer's activations in the backward pass
instead of keeping them. The global batch (--global-batch sequences per optimizer step) is the
same whatever the number of GPUs: each process takes its share in micro-batches of
--micro-batch sequences and their gradients add up. The data are the token blocks made by
prepare_tokens.py. Every --checkpoint-every steps the script saves a sharded checkpoint with
torch.distributed.checkpoint, written under a temporary name and renamed; it resumes from the
newest one that loads, with any number of processes. SIGUSR1 or SIGTERM saves one after the
step under way and exits with code 75, which the Slurm job script turns into a requeue. At the
end, rank 0 writes the whole model as a Hugging Face folder that from_pretrained loads.

    torchrun --standalone --nproc-per-node=4 finetune_fsdp2.py --model Qwen/Qwen2.5-0.5B \
        --tokens tokens/qwen-1024 --steps 200 --output-dir qwen-finetuned
    sbatch finetune_fsdp2.sbatch --model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024
"""

import argparse
import atexit
import contextlib
import datetime
import errno
import fcntl
import functools
import gc
import glob
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

CHECKPOINTED = 75  # os.EX_TEMPFAIL: a checkpoint was saved, run me again to go on
INTERRUPTED = 130  # Ctrl-C: saved too, but stopped by hand
NAME = re.compile(r"checkpoint-(\d{8})")  # checkpoint-<optimizer steps done>, a folder
KEYS = ("model", "optimizer", "step", "world", "config")  # what a checkpoint holds


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    accumulation = accumulation_steps(args.global_batch, world, args.micro_batch)
    check_output_dir(args.output_dir)
    import torch
    import torch.distributed as dist

    device = choose_device(torch, args.device, local_rank)  # a job given GPUs uses them
    if args.param_dtype == "auto":
        args.param_dtype = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, args.param_dtype)
    folder = model_folder(args.model)  # a local folder, or the model's copy in the cache
    blocks, meta = open_tokens(args.tokens)
    quiet_transformers()
    check_tokens(meta, folder, args.model)
    group = join(torch, dist, rank, world, device, args)  # the process group; saves use group
    nodes = [None] * world
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    # What a resumed run must keep (the number of processes and --micro-batch may change).
    config = {"model": args.model, "tokens": meta["tokenizer_sha256"], "blocks": meta["blocks"],
              "seq_len": meta["seq_len"], "steps": args.steps, "global_batch": args.global_batch,
              "lr": args.lr, "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay,
              "max_grad_norm": args.max_grad_norm, "seed": args.seed}  # fmt: skip
    found = [None, None]  # the checkpoints to try, newest first; why the run cannot start
    if rank == 0:
        found[1] = hold(args.checkpoint_dir)  # a second run on this folder stops here
        if found[1] is None:
            found = list(choose_checkpoints(args.checkpoint_dir, config))
    dist.broadcast_object_list(found, src=0, group=group)  # rank 0 decides, all ranks agree
    if found[1] is not None:
        stop_all(rank, found[1])

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    # Every process reads the whole model into CPU memory in float32, the precision of the
    # weights the optimizer updates; fully_shard moves each layer's shard to the GPU.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if not args.no_activation_checkpointing:  # keep each layer's input, recompute the rest
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world,))  # the processes, each with its device
    layers = shard_model(torch, model, mesh, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    held = sum(p.to_local().numel() for p in model.parameters())  # this process's shard
    total = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{processes(world)} on {len(set(nodes))} node(s) ({', '.join(sorted(set(nodes)))}), "
              f"{device.type} ({dist.get_backend()}), compute in {str(dtype)[6:]}, activation "
              f"checkpointing {'off' if args.no_activation_checkpointing else 'on'}")  # fmt: skip
        print(f"{model.config.model_type}, {total:,} parameters, all trained: {len(layers)} "
              f"decoder layers sharded over {processes(world)}, rank 0 holds {held:,}")  # fmt: skip
        print(
            f"global batch {args.global_batch} sequences of {meta['seq_len']} tokens = "
            f"{processes(world)} x {accumulation} micro-batches of {args.micro_batch}"
        )

    step = resume(model, optimizer, found[0], group, args.checkpoint_dir)
    stop = StopSignal()  # from here, SIGUSR1, SIGTERM and Ctrl-C stop after the step under way
    model.train()
    while step < args.steps:
        start = time.perf_counter()
        torch.manual_seed(hash((args.seed, step, rank)) % 2**32)  # dropout, if any
        loss_sum = torch.zeros((), device=device)
        for micro in range(accumulation):
            batch = batch_of(torch, blocks, step, micro, rank, world, args).to(device)
            if args.defer_gradient_sync:  # reduce-scatter once, after the last micro-batch
                model.set_requires_gradient_sync(micro == accumulation - 1)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            (loss / accumulation).backward()  # gradients add up over the micro-batches
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        for param_group in optimizer.param_groups:
            param_group["lr"] = learning_rate(step, args)
        optimizer.step()  # each process updates its own shard
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = loss_sum / accumulation
        dist.all_reduce(loss_value, op=dist.ReduceOp.AVG)  # the mean over the global batch
        stopping = torch.tensor(stop.signum, device=device)
        dist.all_reduce(stopping, op=dist.ReduceOp.MAX)  # all ranks stop at the same step
        loss_value, stopping = loss_value.item(), int(stopping)
        if not math.isfinite(loss_value):  # every rank, before anything is saved
            stop_all(rank, f"loss is {loss_value} at step {step}: start again in a new "
                     "--checkpoint-dir with a lower --lr")  # fmt: skip
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            tokens = args.global_batch * meta["seq_len"] / (time.perf_counter() - start)
            print(f"step {step}/{args.steps}: loss {loss_value:.4f}, {tokens:,.0f} tokens/s")
        if step % args.checkpoint_every == 0 or step == args.steps or stopping:
            save_checkpoint(model, optimizer, step, config, args, group)
        if stopping:
            break

    if step == args.steps:
        export(torch, dist, model, folder, args.output_dir, group)
    elif rank == 0:
        print(f"{signal.Signals(stopping).name}: checkpoint saved after step {step} of "
              f"{args.steps}; run again to resume")  # fmt: skip
    del model, optimizer, mesh  # they hold the process group: free them while Python runs
    gc.collect()  # and the reference cycles among FSDP's hooks
    dist.barrier()  # no rank tears its groups down while another still communicates
    dist.destroy_process_group()
    if step < args.steps:
        sys.exit(INTERRUPTED if stopping == signal.SIGINT else CHECKPOINTED)


def shard_model(torch, model, mesh, dtype):
    """fully_shard on each decoder layer, then on the whole model, which takes the rest (the
    embeddings, the final norm, the output layer). Each call moves its parameters to the
    mesh's device and keeps this process's shard of them. Returns the layers."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The layers compute in dtype; the shards, the optimizer step and the gradient reduction
    # stay in float32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return layers


def decoder_layers(model):
    """The repeated blocks of a Hugging Face model: the classes its _no_split_modules names
    (LlamaDecoderLayer, Qwen2DecoderLayer, ...), which must stay whole on one device."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        import torch.distributed as dist

        stop_all(dist.get_rank(), f"cannot tell the decoder layers of {type(model).__name__} "
                 "(no _no_split_modules): shard its blocks by hand in shard_model()")  # fmt: skip
    return layers


def accumulation_steps(global_batch, world, micro_batch):
    """Micro-batches per process and optimizer step: --global-batch stays what it is whatever
    the number of processes, and each process adds up the gradients of its share."""
    if global_batch % (world * micro_batch):
        fail(f"--global-batch {global_batch} does not split into {processes(world)} x "
             f"--micro-batch {micro_batch}: make it a multiple of {world * micro_batch}, or "
             "change --micro-batch")  # fmt: skip
    return global_batch // (world * micro_batch)


def batch_of(torch, blocks, step, micro, rank, world, args):
    """Micro-batch `micro` of this process in optimizer step `step`. The global batch of a step
    is the next --global-batch blocks of a shuffled order (a new shuffle for each pass over the
    data, from --seed); each process takes its own slice of it. Nothing here depends on what
    ran before: a resumed run reads exactly what it had not read."""
    first = step * args.global_batch + rank * (args.global_batch // world)
    first += micro * args.micro_batch
    rows = []
    for position in range(first, first + args.micro_batch):
        epoch, index = divmod(position, len(blocks))
        block = order_of(torch, len(blocks), args.seed, epoch)[index]
        rows.append(torch.from_numpy(blocks[block].astype("int64")))
    return torch.stack(rows)


@functools.lru_cache(maxsize=2)
def order_of(torch, count, seed, epoch):
    """A shuffle of the blocks for one pass over them."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 10_000 + epoch))


def learning_rate(step, args):
    """The learning rate of optimizer step `step` (from 0): a linear warm-up, then a cosine
    decay to a tenth of --lr at the last step. A function of the step alone: a checkpoint
    needs no scheduler state."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model, optimizer, step, config, args, group):
    """Each process writes its own shards of the model and the optimizer state into
    checkpoint-N.tmp, rank 0 adds the metadata and renames the folder: a folder with a
    checkpoint's name is complete. The newest --keep are kept."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # shards, no copies
    state = {"model": model_state, "optimizer": optimizer_state, "step": step,
             "world": dist.get_world_size(), "config": json.dumps(config)}  # fmt: skip
    path = args.checkpoint_dir / f"checkpoint-{step:08d}"
    temporary = path.with_name(f"{path.name}.tmp")
    rank = dist.get_rank()
    with signals_wait():  # Ctrl-C during the save takes effect after it
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)  # left by a run killed while saving
        dist.barrier(group=group)
        problem = None
        try:  # returns on every rank once all shards and the metadata are written
            dcp.save(state, checkpoint_id=temporary, process_group=group)
        except (Exception, dcp.CheckpointException) as error:  # a full disk, a quota
            problem = write_problem(error, args.checkpoint_dir)
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)  # every rank learns of it
        if problem := next((p for p in problems if p is not None), None):
            if rank == 0:
                shutil.rmtree(temporary, ignore_errors=True)  # frees the space it took
            stop_all(rank, f"cannot write {path}: {problem}; the checkpoints written before "
                     "are intact: free some space (df -h, or your centre's quota command) and "
                     "run again")  # fmt: skip
        if rank == 0:
            fsync_folder(temporary)
            if path.exists():
                shutil.rmtree(path)  # a checkpoint of this step from an earlier, damaged run
            temporary.rename(path)  # complete under its final name, or not there at all
            fsync_folder(args.checkpoint_dir)
            done = [p for p in checkpoint_folders(args.checkpoint_dir) if number(p) <= step]
            for old in done[: -args.keep]:
                shutil.rmtree(old)
            print(f"saved {path}")
        dist.barrier(group=group)  # no rank goes on, or exits, before the rename


def resume(model, optimizer, candidates, group, folder):
    """Load the newest of the candidates that reads whole into the sharded model and optimizer,
    resharded to this number of processes; return its step, or 0. One that fails to read is
    skipped, with a warning, for the one before."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    for index, path in enumerate(candidates or []):
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this run's shards
        state = {"model": model_state, "optimizer": optimizer_state, "step": 0, "world": 0}
        try:
            dcp.load(state, checkpoint_id=path, process_group=group)  # fills them in place
        except dcp.CheckpointException as error:  # on every rank, with each rank's cause
            if rank == 0:
                older = candidates[index + 1 :]
                warn(f"skipped {path} ({cause(error)}); "
                     f"{f'trying {older[0]}' if older else 'no checkpoint left'}")  # fmt: skip
            continue
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        if rank == 0:
            print(f"resumed from {path}, saved by {state['world']} processes after "
                  f"{state['step']} steps")  # fmt: skip
        return state["step"]
    if candidates:  # a checkpoint that failed may have filled part of the model
        stop_all(rank, f"no checkpoint in {folder} could be read: move them away to start "
                 "again from the model")  # fmt: skip
    if rank == 0:
        print(f"no checkpoint in {folder}: starting from the model")
    return 0


def export(torch, dist, model, folder, output_dir, group):
    """Gather the whole model into rank 0's CPU memory, one parameter at a time, and write it
    as a Hugging Face folder with the tokenizer, in the dtype the model came in. It is written
    as output_dir.tmp and renamed: output_dir is complete, or absent."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # empty on the other ranks
    names = {}  # a parameter shared by two layers (tied embeddings) is written once
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    tied = {name for shared in names.values() for name in shared[1:]}
    problem = None
    if dist.get_rank() == 0:
        from transformers import AutoConfig, AutoTokenizer

        dtype = getattr(AutoConfig.from_pretrained(folder), "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state = {name: tensor.to(dtype) for name, tensor in state.items() if name not in tied}
        digest = weights_digest(state)
        temporary = output_dir.with_name(f"{output_dir.name}.tmp")
        shutil.rmtree(temporary, ignore_errors=True)
        try:
            model.save_pretrained(temporary, state_dict=state)  # safetensors, config.json
            model.config.dtype = dtype  # save_pretrained wrote the dtype of the shards
            model.config.save_pretrained(temporary)
            if any(folder.glob("tokenizer*")):
                AutoTokenizer.from_pretrained(folder).save_pretrained(temporary)
            for path in temporary.iterdir():
                with open(path, "rb") as file:
                    os.fsync(file.fileno())
            if output_dir.exists():
                output_dir.rmdir()  # empty: check_output_dir() refused anything else
            temporary.rename(output_dir)
            fsync_folder(output_dir.parent)
        except Exception as error:  # a full disk, a quota: every rank must hear of it
            shutil.rmtree(temporary, ignore_errors=True)
            problem = (f"cannot write {output_dir}: {write_problem(error, output_dir.parent)}; "
                       "the checkpoints are intact: free some space and run again to "
                       "export")  # fmt: skip
    problems = [problem]
    dist.broadcast_object_list(problems, src=0, group=group)
    if problems[0] is not None:
        stop_all(dist.get_rank(), problems[0])
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in output_dir.iterdir()) / 2**20
        print(f"wrote {output_dir} ({size:,.1f} MiB, {str(dtype)[6:]}): weights sha256 {digest}")


# --- checks and plumbing ---------------------------------------------------------------------


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


def non_negative_float(text):
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more (got {text})")
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
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B",
                        help="model folder, or Hub name in the cache")  # fmt: skip
    parser.add_argument("--tokens", type=folder_path, default="tokens", help="prepare_tokens.py's")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps")
    parser.add_argument("--global-batch", type=positive_int, default=64,
                        help="sequences per optimizer step, over all processes")  # fmt: skip
    parser.add_argument("--micro-batch", type=positive_int, default=4,
                        help="sequences per forward pass of one process")  # fmt: skip
    parser.add_argument("--lr", type=positive_float, default=2e-5, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.0)
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0,
                        help="gradients are scaled down to this norm")  # fmt: skip
    parser.add_argument("--param-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="compute dtype; auto: bfloat16 on GPU")  # fmt: skip
    parser.add_argument("--no-activation-checkpointing", action="store_true",
                        help="keep every activation: faster, much more memory")  # fmt: skip
    parser.add_argument("--defer-gradient-sync", action="store_true",
                        help="reduce-scatter once per step: less traffic, full-size gradients "
                        "in every process")  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints",
                        help="checkpoints of this run, on storage all nodes see")  # fmt: skip
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps")
    parser.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept")
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps")
    parser.add_argument("--output-dir", type=folder_path, default="finetuned",
                        help="the fine-tuned model's folder, written at the end")  # fmt: skip
    parser.add_argument("--init-timeout", type=positive_int, default=60,
                        help="seconds to start all processes")  # fmt: skip
    parser.add_argument("--timeout", type=positive_int, default=1800,
                        help="seconds a collective may wait")  # fmt: skip
    parser.add_argument("--save-timeout", type=positive_int, default=1800,
                        help="seconds a rank waits for the others to save or load")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"finetune_fsdp2.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def warn(message):
    print(f"finetune_fsdp2.py: warning: {message}", file=sys.stderr)


def first_line(error):
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def cause(error):
    """What went wrong, in one line; DCP raises one exception for the failures of all ranks."""
    if failures := getattr(error, "failures", None):
        error = next(iter(failures.values()))[0]  # (exception, traceback) of the first rank
    return f"{type(error).__name__}: {first_line(error)}"


def stop_all(rank, message):
    """Every rank stops at once with the same error: rank 0 says why, all exit with code 2.
    os._exit tears nothing down: a process group left to interpreter shutdown can abort."""
    if rank == 0:
        print(f"finetune_fsdp2.py: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def processes(count):
    return f"{count} process{'es' if count > 1 else ''}"


def check_output_dir(path):
    """The model is written there at the end: never over anything already there."""
    if path.is_dir() and any(path.iterdir()):
        fail(f"--output-dir {path} is not empty: give a new folder (the job scripts use one "
             "per run)")  # fmt: skip


def model_folder(name):
    """The folder of --model: a local folder, or the snapshot of a Hub name in the Hugging Face
    cache. Offline: a model missing from the cache stops at once, with the command that
    downloads it, never after minutes of retries against a hub the node cannot reach."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail(f"{path} holds no config.json: not a Hugging Face model folder (give the "
                 "folder that hf download filled, or the model's Hub name)")  # fmt: skip
        return path
    if path.exists():
        fail(f"{path} is a file: --model takes a model folder or a Hub name")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except HFValidationError:
        fail(f"{name} is neither a folder nor a Hub name (organization/model)")
    except LocalEntryNotFoundError:
        fail(f"{name} is not in the Hugging Face cache {constants.HF_HUB_CACHE}: download it "
             f"on a login node with: hf download {name} (HF_HOME set as in your jobs)")  # fmt: skip


def quiet_transformers():
    """No progress bars or advice in a job's output: only the lines this script prints."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def open_tokens(folder):
    """(blocks, meta): the token blocks mapped from tokens.bin, read only where used."""
    import numpy as np

    if not (folder / "meta.json").is_file():
        fail(f"{folder} holds no tokens (no meta.json): make them on a login node with "
             "prepare_tokens.py, or pass --tokens")  # fmt: skip
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        assert meta["format"] == "pytorch-on-hpc tokens 1"
        shape, dtype = (int(meta["blocks"]), int(meta["seq_len"])), np.dtype(meta["dtype"])
    except Exception:
        fail(f"{folder / 'meta.json'} is not prepare_tokens.py's: make the tokens again")
    path = folder / "tokens.bin"
    expected = shape[0] * shape[1] * dtype.itemsize
    if not path.is_file() or path.stat().st_size != expected:
        size = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
        fail(f"{path} is {size}, meta.json says {expected:,}: it is damaged or incomplete; "
             "make the tokens again with prepare_tokens.py")  # fmt: skip
    return np.memmap(path, dtype=dtype, mode="r", shape=shape), meta


def check_tokens(meta, folder, name):
    """The tokens were made by this model's tokenizer and fit its context."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    embeddings = getattr(config, "vocab_size", None)
    if embeddings is not None and meta["vocab_size"] > embeddings:
        fail(f"the tokens come from a tokenizer of {meta['vocab_size']:,} tokens, {name} has "
             f"{embeddings:,} embeddings: tokenize again with this model's tokenizer")  # fmt: skip
    if any(folder.glob("tokenizer*")):
        vocabulary = AutoTokenizer.from_pretrained(folder).get_vocab()
        text = json.dumps(sorted(vocabulary.items()), ensure_ascii=False)
        if hashlib.sha256(text.encode()).hexdigest() != meta["tokenizer_sha256"]:
            fail(f"the tokens were made with another tokenizer than {name}'s (made for "
                 f"{meta['model']}): tokenize again with prepare_tokens.py "
                 f"--model {name}")  # fmt: skip
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and meta["seq_len"] > limit:
        fail(f"the tokens are blocks of {meta['seq_len']}, longer than the {limit} positions of "
             f"{name}: make them again with a --seq-len of {limit} or less")  # fmt: skip


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


def gpu_index(local_rank, visible):
    """The GPU of this process, given how many it sees: its local rank's when it sees the GPUs
    of the whole node, device 0 when Slurm bound one GPU to the task (--gpus-per-task=1)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        fail(f"local rank {local_rank} but {visible} GPUs visible: start one process per GPU "
             "(torchrun --nproc-per-node equal to the GPUs of a node)")  # fmt: skip
    return local_rank


def choose_device(torch, choice, local_rank):
    """This process's GPU, or the CPU (--device cpu, or auto on a job without GPUs)."""
    if choice == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request GPUs (Slurm: --gpus-per-node=N, "
             "PBS: ngpus=N in -l select, Grid Engine: -l gpu=N)")  # fmt: skip
    if choice == "cuda" or (choice == "auto" and gpu_usable(torch)):
        device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)  # make site-check counts this line
        print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)
        return device
    return torch.device("cpu")


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    if not (text.isascii() and text.isdigit()):
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")
    return int(text)


def distributed_env():
    """(rank, world size, local rank) from the variables torchrun sets."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if missing := [name for name in names if name not in os.environ]:
        fail(f"{', '.join(missing)} not set: start this script with torchrun (see "
             "finetune_fsdp2.sbatch)")  # fmt: skip
    rank, world, local_rank = (env_int(name) for name in names[:3])
    if not 0 < env_int("MASTER_PORT") < 65536:  # checked here: torch's error is a traceback
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not 0 <= rank < world:
        fail(f"rank {rank} is outside a world of {world} processes (RANK, WORLD_SIZE)")
    return rank, world, local_rank


def join(torch, dist, rank, world, device, args):
    """Join the process group (nccl on GPUs, gloo on CPUs) within --init-timeout; return a gloo
    group with a timeout of --save-timeout for the checkpoints' coordination."""
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # torchrun's agent already serves the store at MASTER_PORT: connect to it.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            env_int("MASTER_PORT"),
            world,
            is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
            timeout=datetime.timedelta(seconds=args.init_timeout),
        )
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
            device_id=device if device.type == "cuda" else None,
        )
        dist.barrier()  # returns only once all processes have joined
    except (RuntimeError, TimeoutError) as error:  # DistNetworkError and DistStoreError too
        fail(f"rank {rank}: not all {world} processes reached {address} within "
             f"{args.init_timeout} s ({first_line(error)}); check that the world size matches "
             "the processes started and that MASTER_ADDR is the first node of the job")  # fmt: skip
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.save_timeout))


class StopSignal:
    """Records the last of SIGUSR1, SIGTERM and SIGINT (Ctrl-C) that came; the training loop
    saves and stops after the step under way."""

    def __init__(self):
        self.signum = 0
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.record)

    def record(self, signum, frame):
        self.signum = signum  # nothing else: a step may be half done


@contextlib.contextmanager
def signals_wait():
    """Signals during the block take effect after it, once each: a save is never cut short."""
    caught = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}  # fmt: skip
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(caught):
        signal.raise_signal(signum)


def hold(folder):
    """Rank 0: lock folder/.lock, which the system releases when this process ends, however; why
    this run cannot start, or None: a second run on one folder is refused, not mixed in. A
    crashed node's lock can outlive its job: the refusal says when to delete .lock."""
    lock = open(folder / ".lock", "a+")  # noqa: SIM115  held open until the process ends
    atexit.register(lock.close)  # keeps it open, and the lock held, until the process exits
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            warn(f"cannot lock {folder} ({error.strerror}): make sure no other run uses it")
            return None
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        return (f"{folder} is in use by {holder}: wait for that run to end (or cancel it), or "
                f"give this one another --checkpoint-dir; if it is no longer running, delete "
                f"{folder}/.lock")  # fmt: skip
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("JOB_ID") or os.environ.get("PBS_JOBID")
    lock.truncate(0)
    lock.write(f"{f'job {job}, ' if job else ''}process {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    for leftover in folder.glob("checkpoint-*.tmp"):  # a save cut short by SIGKILL or a crash
        if leftover.is_dir() and NAME.fullmatch(leftover.name.removesuffix(".tmp")):
            shutil.rmtree(leftover)
    return None


def number(path):
    return int(NAME.fullmatch(path.name)[1])


def checkpoint_folders(folder):
    """Complete checkpoints in folder (rank 0 writes .metadata last), oldest first."""
    return sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name) and is_checkpoint(p))


def is_checkpoint(path):
    return (path / ".metadata").is_file()


def choose_checkpoints(folder, config):
    """Rank 0: (the checkpoints of this run to try, newest first; why this run cannot start, or
    None). Those whose metadata cannot be read, or that another script wrote, are skipped with
    a warning; one written with other options stops the run."""
    import torch.distributed.checkpoint as dcp

    named = sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name))
    candidates, skipped = [], []
    for path in reversed(named):
        try:
            keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            missing = [k for k in KEYS if not any(key == k or key.startswith(f"{k}.")
                                                  for key in keys)]  # fmt: skip
            if missing:
                raise ValueError(f"not a checkpoint of this script: no {', '.join(missing)}")
            saved = {"config": ""}
            with warnings.catch_warnings():  # that it reads in this process alone: it does
                warnings.simplefilter("ignore")
                dcp.load(saved, checkpoint_id=path, no_dist=True)  # the options it was saved with
            saved = json.loads(saved["config"])
        except (Exception, dcp.CheckpointException) as error:  # damaged, or another script's
            skipped.append(f"{path} ({cause(error)})")
            continue
        if changed := [key for key in config if saved.get(key) != config[key]]:
            said = ", ".join(f"{key} {saved.get(key)} (now {config[key]})" for key in changed)
            return None, (f"{path} was written with other options: {said}; resume with the same "
                          "options (the number of processes and --micro-batch may change), or "
                          "use another --checkpoint-dir")  # fmt: skip
        candidates.append(path)
    start = number(candidates[0]) if candidates else 0
    for entry in named:  # what the saves of this run would replace: never anything else
        if number(entry) > start and not is_checkpoint(entry):
            return None, (f"{entry} is not a checkpoint, and this run may write one there: move "
                          "it away or choose another --checkpoint-dir")  # fmt: skip
    fallback = f"trying {candidates[0]}" if candidates else "no usable checkpoint"
    for reason in skipped:
        warn(f"skipped {reason}; {fallback}")
    return candidates, None


def fsync_folder(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
    return first_line(error)


def weights_digest(state):
    """A short SHA-256 of a state dict: equal digests mean bit-for-bit equal weights."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("finetune_fsdp2.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(INTERRUPTED)
