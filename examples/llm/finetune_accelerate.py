"""Fine-tune a language model with Hugging Face Accelerate, on one GPU or many, DDP or FSDP2.

The training loop holds no launcher or device code: `accelerate launch` starts one process
per GPU on each node and tells them, through environment variables, how to train (data
parallel, or FSDP2 from a config file such as accelerate_fsdp.yaml, and the mixed precision);
Accelerator() reads those variables and prepare() wraps the model, the optimizer and the
learning-rate schedule accordingly. The script reads the token blocks made by
prepare_tokens.py and keeps --global-batch sequences per optimizer step whatever the number of
processes: each process runs global / (processes x --micro-batch) micro-batches before the
gradients are averaged (gradient accumulation). Activations are recomputed in the backward pass
(gradient checkpointing). Every --checkpoint-every steps, accelerator.save_state writes the
model, optimizer, schedule and random states into a folder written under a temporary name and
renamed; a run resumes from the newest checkpoint that loads. At the end, the model and its
tokenizer are saved with save_pretrained into --output-dir/model, which from_pretrained loads.

    accelerate launch --multi_gpu --num_processes 2 finetune_accelerate.py \
        --model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024
    sbatch finetune_accelerate.sbatch --model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024
    qsub -v ARGS="--model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024" finetune_accelerate.pbs
"""

import argparse
import atexit
import contextlib
import errno
import fcntl
import functools
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
from pathlib import Path

NAME = re.compile(r"checkpoint-(\d{8})")  # checkpoint-<optimizer steps done>


def main(argv=None):
    args = parse_args(argv)
    rank, processes = launcher_env()  # as accelerate launch (or torchrun) set them
    accumulation = accumulation_steps(args.global_batch, processes, args.micro_batch)
    if rank == 0:
        hold(args.checkpoint_dir)  # a second run on this folder stops here
    import torch

    use_cuda = choose_device(torch, args.device)  # a job given GPUs uses them, or stops here
    folder = model_folder(args.model)
    blocks, meta = open_tokens(args.tokens)
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=not use_cuda,  # without it, a process that sees no GPU trains on its own
        gradient_accumulation_steps=accumulation,  # gradients averaged every N micro-batches
        step_scheduler_with_optimizer=False,  # the schedule is stepped below, once per step
    )  # DDP or FSDP, and the mixed precision: from accelerate launch's flags or config file
    check_setup(torch, accelerator, processes, use_cuda)
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    # float32 weights: Accelerate computes in bf16 when the launcher asks for mixed precision.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    check_tokens(meta, model, folder, args.model)
    model.config.use_cache = False  # no generation cache during training
    if not args.no_gradient_checkpointing:  # keep each layer's input, recompute the rest
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1))
    )
    described = describe(model, args)  # before prepare() wraps it
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    report(accelerator, described, meta, accumulation, args)

    config = {"model": str(args.model), "tokens": meta["tokenizer_sha256"],
              "seq_len": meta["seq_len"], "global_batch": args.global_batch,
              "lr": args.lr, "warmup_steps": args.warmup_steps, "seed": args.seed}  # fmt: skip
    step = resume(torch, accelerator, args.checkpoint_dir, config)
    model.train()
    while step < args.steps:
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro in range(accumulation):
            batch = batch_of(torch, blocks, step, accelerator.process_index, micro,
                             accumulation, args).to(accelerator.device)  # fmt: skip
            with accelerator.accumulate(model):  # no gradient exchange before the last one
                loss = model(input_ids=batch, labels=batch).loss  # next-token prediction
                accelerator.backward(loss)  # scaled by 1 / accumulation
                optimizer.step()  # a no-op until the last micro-batch
                optimizer.zero_grad()
            loss_sum += loss.detach()
        scheduler.step()
        step += 1
        loss_value = accelerator.reduce(loss_sum, "mean").item() / accumulation  # every process
        if not math.isfinite(loss_value):
            fail(f"loss is {loss_value} at step {step}: start again in a new --checkpoint-dir "
                 "with a lower --lr")  # fmt: skip
        tokens = args.global_batch * meta["seq_len"] / (time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps:
            say(accelerator, f"step {step}/{args.steps}: loss {loss_value:.4f}, "
                             f"{tokens:,.0f} tokens/s")  # fmt: skip
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(accelerator, step, config, args)
    export(accelerator, model, folder, args.output_dir)


def batch_of(torch, blocks, step, process, micro, accumulation, args):
    """One micro-batch of one process: the step's global batch is cut into processes x
    accumulation slices in a fixed order, so that the same blocks are read whatever the number
    of processes, and a resumed run reads exactly what it had not read."""
    first = step * args.global_batch + (process * accumulation + micro) * args.micro_batch
    rows = []
    for index in range(first, first + args.micro_batch):
        epoch, position = divmod(index, len(blocks))
        block = order_of(torch, len(blocks), args.seed, epoch)[position]
        rows.append(torch.from_numpy(blocks[block].astype("int64")))
    return torch.stack(rows)


@functools.cache
def order_of(torch, count, seed, epoch):
    """A shuffle of the blocks for one pass over them: the same in every process."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 10_000 + epoch))


def save_checkpoint(accelerator, step, config, args):
    """accelerator.save_state into checkpoint-<step>.tmp (every process writes its part: its
    random state, its shard under FSDP), then renamed by the main process once all are done:
    a folder with a checkpoint's name is complete."""
    final = args.checkpoint_dir / f"checkpoint-{step:08d}"
    temporary = final.with_name(f"{final.name}.tmp")
    with signals_wait():
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(temporary)
        except (OSError, RuntimeError) as error:
            reason = write_problem(error, args.checkpoint_dir)
            fail(f"cannot write {temporary}: {reason}; the checkpoints written before are "
                 "intact: free some space (df -h, or your quota command), run again")  # fmt: skip
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            publish(temporary, final, {"step": step, "config": config})
            for old in checkpoint_folders(args.checkpoint_dir)[: -args.keep]:
                shutil.rmtree(old)
            print(f"saved {final}", flush=True)
        accelerator.wait_for_everyone()


def resume(torch, accelerator, folder, config):
    """The steps done by the newest checkpoint in folder that every process loads, or 0. A
    damaged one is skipped with a warning; one written with other options stops the run."""
    from torch.distributed.checkpoint.api import CheckpointException  # not an Exception

    if accelerator.is_main_process:
        for leftover in folder.glob("checkpoint-*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)  # a save that was cut short
    accelerator.wait_for_everyone()
    skipped = []
    for path in reversed(checkpoint_folders(folder)):
        try:
            saved = json.loads((path / "progress.json").read_text(encoding="utf-8"))
            step, written_with = int(saved["step"]), saved["config"]
        except Exception as error:  # an unreadable progress.json: the folder is damaged
            skipped.append(f"{path} ({type(error).__name__}: {first_line(error)})")
            continue
        if changed := [key for key in config if written_with.get(key) != config[key]]:
            fail(f"{path} was written with other {', '.join(changed)}: resume with the same "
                 "options (only --steps may grow), or use another --checkpoint-dir")  # fmt: skip
        try:
            accelerator.load_state(path)  # model, optimizer, schedule, random states
            error = None
        except (Exception, CheckpointException) as problem:  # a file cut short, or missing
            error = why_not_loaded(problem)
        loaded = torch.tensor(0.0 if error else 1.0, device=accelerator.device)
        if accelerator.reduce(loaded, "sum").item() < accelerator.num_processes:
            skipped.append(f"{path} ({error or 'another process could not load it'})")
            continue
        accelerator.step = 0  # load_state restored the micro-batch count of the run it saved
        for reason in skipped:
            warn(accelerator, f"skipped {reason}; resuming from {path}")
        say(accelerator, f"resumed from {path} after {step} steps")
        return step
    for reason in skipped:
        warn(accelerator, f"skipped {reason}; no usable checkpoint")
    say(accelerator, f"no checkpoint in {folder}: starting from scratch")
    return 0


def export(accelerator, model, folder, output_dir):
    """The trained model and the tokenizer, saved with save_pretrained into output_dir/model,
    written under a temporary name and renamed. Under FSDP, get_state_dict gathers the shards
    into full weights on the main process: every process must call it."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        from transformers import AutoTokenizer

        print(f"weights: sha256 {weights_digest(state)}")
        final = output_dir / "model"
        temporary = output_dir / "model.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        try:
            temporary.mkdir(parents=True)
            accelerator.unwrap_model(model).save_pretrained(temporary, state_dict=state)
            AutoTokenizer.from_pretrained(folder).save_pretrained(temporary)
            publish(temporary, final)
        except OSError as error:
            shutil.rmtree(temporary, ignore_errors=True)
            fail(f"cannot write {final}: {write_problem(error, output_dir)}")
        print(f"model saved to {final}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # the process group is closed before Python exits


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
    parser.add_argument("--global-batch", type=positive_int, default=32, help="sequences a step")
    parser.add_argument("--micro-batch", type=positive_int, default=4,
                        help="sequences a forward pass, in each process")  # fmt: skip
    parser.add_argument("--lr", type=positive_float, default=2e-5)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps")
    parser.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept")
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps")
    parser.add_argument("--output-dir", type=writable_dir, default="finetune-out")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"finetune_accelerate.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def say(accelerator, message):
    """A line from the main process only (accelerator.print prints once per node)."""
    if accelerator.is_main_process:
        print(message, flush=True)


def warn(accelerator, message):
    if accelerator.is_main_process:
        print(f"finetune_accelerate.py: warning: {message}", file=sys.stderr, flush=True)


def first_line(error):
    return str(error).splitlines()[0] if str(error) else "empty"


def why_not_loaded(problem):
    """A load's error in one line; for torch.distributed.checkpoint's, a process's error."""
    lines = [line.strip() for line in str(problem).splitlines() if line.strip()] or ["empty"]
    line = lines[-1] if type(problem).__name__ == "CheckpointException" else lines[0]
    return f"{type(problem).__name__}: {line.split('. ')[0]}"


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        fail(f"{name}={text!r} is not a whole number (set by accelerate launch or torchrun)")


def launcher_env():
    """(rank, processes) from the variables that accelerate launch sets through torchrun for
    two processes or more. With one process, accelerate launch runs the script directly and
    sets none of them: one process, no process group."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if "RANK" not in os.environ and "ACCELERATE_MIXED_PRECISION" in os.environ:
        if "MASTER_ADDR" in os.environ:  # set when asked for several: --cpu starts one alone
            fail("accelerate launch --cpu starts one process, not --num_processes (it needs "
                 "mpirun for more): launch with --multi_gpu and pass --device cpu")  # fmt: skip
        return 0, 1
    missing = [name for name in names if name not in os.environ]
    if missing:
        how = "start this script with accelerate launch (or torchrun)"
        if "SLURM_PROCID" in os.environ:
            how = ("srun's SLURM_PROCID is not read by Accelerate: run accelerate launch in one "
                   "srun task per node (see finetune_accelerate.sbatch)")  # fmt: skip
        fail(f"{', '.join(missing)} not set: {how}")
    rank, processes = env_int("RANK"), env_int("WORLD_SIZE")
    env_int("LOCAL_RANK")
    if "LOCAL_WORLD_SIZE" in os.environ:  # read by Accelerate on CPU: checked here first
        env_int("LOCAL_WORLD_SIZE")
    if not 0 < env_int("MASTER_PORT") < 65536:
        fail(f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number (1 to 65535)")
    if not 0 <= rank < processes:
        fail(f"RANK {rank} is outside a world of {processes} processes (WORLD_SIZE)")
    return rank, processes


def accumulation_steps(global_batch, processes, micro_batch):
    """Micro-batches per process and optimizer step, so that the global batch stays the same."""
    share = processes * micro_batch
    if global_batch % share:
        fail(f"--global-batch {global_batch} is not a multiple of {processes} processes x "
             f"--micro-batch {micro_batch} = {share}: change either, so that each process "
             "runs a whole number of micro-batches")  # fmt: skip
    return global_batch // share


def check_setup(torch, accelerator, processes, use_cuda):
    """Accelerate trains as the launcher said, or the run stops (or, for FSDP on the CPU, says
    what it does instead); one line per GPU in use."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes != processes:
        fail(f"the launcher started {processes} processes but Accelerate sees "
             f"{accelerator.num_processes} (where no GPU is seen, pass --device cpu)")  # fmt: skip
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and accelerator.distributed_type != DistributedType.FSDP:
        warn(accelerator, "FSDP is not used on the CPU (Accelerate applies it on GPUs only): "
             "data parallel instead, each process holds the whole model")  # fmt: skip
    if use_cuda:
        announce_gpu(torch, accelerator.device)


def describe(model, args):
    size = sum(p.numel() for p in model.parameters())
    checkpointing = "off" if args.no_gradient_checkpointing else "on"
    return f"{model.config.model_type}, {size:,} parameters, gradient checkpointing {checkpointing}"


def report(accelerator, described, meta, accumulation, args):
    """What runs where: the main process's first lines."""
    from accelerate.utils import gather_object

    nodes = gather_object([os.environ.get("SLURMD_NODENAME") or socket.gethostname()])
    count = accelerator.num_processes
    processes = f"{count} process{'es' if count > 1 else ''}"
    micro = f"{accumulation} micro-batch{'es' if accumulation > 1 else ''}"
    say(accelerator, f"{processes} on {', '.join(sorted(set(nodes)))}: "
                     f"{accelerator.device.type}, {strategy(accelerator)}, "
                     f"mixed precision {accelerator.mixed_precision}")  # fmt: skip
    say(accelerator, described)
    say(accelerator, f"global batch {args.global_batch} sequences of {meta['seq_len']} tokens "
                     f"= {processes} x {micro} of {args.micro_batch}")  # fmt: skip


def strategy(accelerator):
    """How the processes share the work, in words."""
    from accelerate.utils import DistributedType

    backend = accelerator.state.backend
    if accelerator.is_fsdp2:
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = accelerator.state.fsdp_plugin
        offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # else OffloadPolicy(): none
        return (f"FSDP2 ({backend}), reshard after forward: {plugin.reshard_after_forward}, "
                f"CPU offload: {offload}")  # fmt: skip
    if accelerator.distributed_type == DistributedType.NO:
        return "one process"
    return f"data parallel (DDP, {backend})"


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


def check_tokens(meta, model, folder, name):
    """The tokens were made by this model's tokenizer and fit its context."""
    embeddings = model.get_input_embeddings().num_embeddings
    if meta["vocab_size"] > embeddings:
        fail(f"the tokens come from a tokenizer of {meta['vocab_size']:,} tokens, {name} has "
             f"{embeddings:,} embeddings: tokenize again with this model's tokenizer")  # fmt: skip
    if (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        vocabulary = AutoTokenizer.from_pretrained(folder).get_vocab()
        text = json.dumps(sorted(vocabulary.items()), ensure_ascii=False)
        if hashlib.sha256(text.encode()).hexdigest() != meta["tokenizer_sha256"]:
            fail(f"the tokens were made with another tokenizer than {name}'s (made for "
                 f"{meta['model']}): tokenize again with prepare_tokens.py "
                 f"--model {name}")  # fmt: skip
    limit = getattr(model.config, "max_position_embeddings", None)
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


def choose_device(torch, choice):
    """True for the GPUs, False for the CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one per process (Slurm: "
             "--gpus-per-node=N, PBS: -l select=1:ncpus=8:ngpus=N, Grid Engine: "
             "-l gpu=N)")  # fmt: skip
    return choice == "cuda" or (choice == "auto" and gpu_usable(torch))


def announce_gpu(torch, device):
    """One line per process that runs on a GPU: make site-check counts the GPUs that ran."""
    props = torch.cuda.get_device_properties(device)
    print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)


@contextlib.contextmanager
def signals_wait():
    """Ctrl-C during the block takes effect after it: no checkpoint is cut short."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)


def publish(temporary, final, progress=None):
    """Sync the files of temporary (and progress.json, last), rename it to final, sync the
    folder that holds it: final is complete or absent."""
    if progress is not None:
        (temporary / "progress.json").write_text(json.dumps(progress) + "\n", encoding="utf-8")
    for where, _, names in os.walk(temporary):
        for name in names:
            with open(os.path.join(where, name), "rb") as file:
                os.fsync(file.fileno())
    if final.exists():  # an export run twice: replace it
        shutil.rmtree(final)
    os.rename(temporary, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_problem(error, folder):
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "no space left (the file system or your quota is full)"
    if code == errno.EROFS:
        return "the file system is read-only"
    with contextlib.suppress(OSError):
        if os.statvfs(folder).f_bavail == 0:
            return "no space left (the file system is full)"
    return first_line(error)


def weights_digest(state):
    """A fingerprint of the trained weights: a resumed run ends with the same one as a run that
    never stopped."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode() + tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def checkpoint_folders(folder):
    """The checkpoint folders in folder, oldest first (temporary ones are not among them)."""
    found = [path for path in folder.iterdir() if NAME.fullmatch(path.name) and path.is_dir()]
    return sorted(found)


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
            print(f"finetune_accelerate.py: warning: cannot lock {folder} ({error.strerror}): "
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


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the checkpoints already written are complete
        print("finetune_accelerate.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
