"""Fine-tune a language model with LoRA on one GPU: the model stays frozen, small adapters train.

LoRA (low-rank adaptation, with the PEFT library) adds two small matrices beside each chosen
linear layer (--target-modules) and trains only those: a few million parameters instead of
billions, so the weights can stay in bfloat16 and the optimizer state is tiny. The script reads
the token blocks made by prepare_tokens.py (no tokenizer in the loop), takes --global-batch
sequences per optimizer step as --global-batch / --micro-batch forward passes (gradient
accumulation), and recomputes activations in the backward pass (gradient checkpointing) unless
told not to. Every --checkpoint-every steps it saves the adapter (safetensors) and the
optimizer state into a folder written under a temporary name and renamed, and it resumes from
the newest that loads. SIGUSR1 or SIGTERM (a time limit, preemption) saves a checkpoint and
exits with code 75, which the job script turns into a requeue. At the end, it writes the
adapter and the model with the adapter merged into it: a plain model folder that
from_pretrained loads, with no PEFT needed.

    python finetune_lora.py --model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024 --steps 200
    sbatch finetune_lora.sbatch --model Qwen/Qwen2.5-0.5B --tokens tokens/qwen-1024
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
import sys
import time
from pathlib import Path

CHECKPOINTED = 75  # os.EX_TEMPFAIL: a checkpoint was saved, run me again to go on
NAME = re.compile(r"checkpoint-(\d{8})")  # checkpoint-<optimizer steps done>


def main(argv=None):
    args = parse_args(argv)
    accumulation = accumulation_steps(args.global_batch, args.micro_batch)
    hold(args.checkpoint_dir)  # a second run on this folder stops here
    import torch

    device = choose_device(torch, args.device)  # a job given a GPU uses it, or stops here
    folder = model_folder(args.model)
    blocks, meta = open_tokens(args.tokens)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    check_tokens(meta, model, folder, args.model)
    torch.manual_seed(args.seed)  # the adapters' first values
    model = add_adapters(model, args)
    if not args.no_gradient_checkpointing:  # keep each layer's input, recompute the rest
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1))
    )
    total = sum(p.numel() for p in model.parameters())
    print(f"{model.config.model_type}, {total:,} parameters, {sum(p.numel() for p in trainable):,} "
          f"trainable (LoRA rank {args.rank} on {', '.join(args.target_modules)}), {device.type}, "
          f"{str(dtype).removeprefix('torch.')}")  # fmt: skip
    print(f"global batch {args.global_batch} sequences of {meta['seq_len']} tokens = "
          f"{accumulation} micro-batches of {args.micro_batch}")  # fmt: skip

    config = {"model": str(args.model), "tokens": meta["tokenizer_sha256"],
              "seq_len": meta["seq_len"], "global_batch": args.global_batch,
              "rank": args.rank, "alpha": args.alpha, "lr": args.lr,
              "target_modules": args.target_modules, "seed": args.seed}  # fmt: skip
    step = resume(torch, model, optimizer, scheduler, args.checkpoint_dir, config)
    stop = StopSignal()
    model.train()
    while step < args.steps and stop.name is None:
        start, loss_sum = time.perf_counter(), 0.0
        for micro in range(accumulation):  # gradients add up over the micro-batches
            batch = batch_of(torch, blocks, step, micro, args).to(device)
            loss = model(input_ids=batch, labels=batch).loss  # next-token prediction
            (loss / accumulation).backward()
            loss_sum += loss.item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = loss_sum / accumulation
        if not math.isfinite(loss_value):
            fail(f"loss is {loss_value} at step {step}: start again in a new --checkpoint-dir "
                 "with a lower --lr")  # fmt: skip
        tokens = args.global_batch * meta["seq_len"] / (time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step}/{args.steps}: loss {loss_value:.4f}, {tokens:,.0f} tokens/s")
        if step % args.checkpoint_every == 0 or step == args.steps or stop.name:
            save_checkpoint(torch, model, optimizer, scheduler, step, config, args)
    if stop.name:
        print(f"{stop.name} received: stopped after step {step} of {args.steps}, checkpoint "
              f"saved; run again to resume")  # fmt: skip
        sys.exit(CHECKPOINTED)
    print(f"adapter weights: sha256 {adapter_digest(model)}")
    export(model, folder, args.output_dir)


def add_adapters(model, args):
    """LoRA adapters on the chosen linear layers; the rest of the model is frozen."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if type(module).__name__ == "Linear"}  # fmt: skip
    if missing := sorted(set(args.target_modules) - names):
        fail(f"--target-modules {' '.join(missing)}: no such linear layer in this model; it "
             f"has {' '.join(sorted(names))}")  # fmt: skip
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                      target_modules=args.target_modules, task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, lora)


def batch_of(torch, blocks, step, micro, args):
    """The micro-batch of an optimizer step: the order of the blocks depends on --seed and the
    pass over them only, so a resumed run reads exactly what it had not read."""
    first = step * args.global_batch + micro * args.micro_batch
    rows = []
    for index in range(first, first + args.micro_batch):
        epoch, position = divmod(index, len(blocks))
        block = order_of(torch, len(blocks), args.seed, epoch)[position]
        rows.append(torch.from_numpy(blocks[block].astype("int64")))
    return torch.stack(rows)


@functools.cache
def order_of(torch, count, seed, epoch):
    """A shuffle of the blocks for one pass over them."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 10_000 + epoch))


def save_checkpoint(torch, model, optimizer, scheduler, step, config, args):
    """The adapter (safetensors) and the training state, in a folder written under a temporary
    name and renamed: a folder with a checkpoint's name is complete."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    final = args.checkpoint_dir / f"checkpoint-{step:08d}"
    temporary = final.with_name(f"{final.name}.tmp")
    with signals_wait(), written(temporary, final):
        adapter = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
        save_file(adapter, temporary / "adapter_model.safetensors")
        model.peft_config["default"].save_pretrained(temporary)  # adapter_config.json
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "step": step, "config": json.dumps(config),
                 "rng": torch.get_rng_state()}  # fmt: skip
        torch.save(state, temporary / "state.pt")
    for old in checkpoint_folders(args.checkpoint_dir)[: -args.keep]:
        shutil.rmtree(old)
    print(f"saved {final}")


def resume(torch, model, optimizer, scheduler, folder, config):
    """The steps done by the newest checkpoint in folder that loads, or 0. A damaged one is
    skipped with a warning; one written with other options stops the run."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for leftover in folder.glob("checkpoint-*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)  # a save that was cut short
    skipped = []
    for path in reversed(checkpoint_folders(folder)):
        try:
            adapter = load_file(path / "adapter_model.safetensors")
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
            saved = json.loads(state["config"])
        except Exception as error:  # truncated, damaged, or another script's
            skipped.append(f"{path} ({type(error).__name__}: {first_line(error)})")
            continue
        if changed := [key for key in config if saved.get(key) != config[key]]:
            fail(f"{path} was written with other {', '.join(changed)}: resume with the same "
                 "options (only --steps may grow), or use another --checkpoint-dir")  # fmt: skip
        set_peft_model_state_dict(model, adapter)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        for reason in skipped:
            warn(f"skipped {reason}; resuming from {path}")
        print(f"resumed from {path} after {state['step']} steps")
        return state["step"]
    for reason in skipped:
        warn(f"skipped {reason}; no usable checkpoint")
    print(f"no checkpoint in {folder}: starting from scratch")
    return 0


def export(model, folder, output_dir):
    """The adapter alone (output_dir/adapter) and the model with the adapter merged into its
    weights (output_dir/merged), with the tokenizer: each written whole or not at all."""
    from transformers import AutoTokenizer

    with written(output_dir / "adapter.tmp", output_dir / "adapter") as temporary:
        model.save_pretrained(temporary)  # adapter_model.safetensors, adapter_config.json
    merged = model.merge_and_unload()  # W + (alpha / rank) * B @ A, the adapters removed
    with written(output_dir / "merged.tmp", output_dir / "merged") as temporary:
        merged.save_pretrained(temporary)  # model.safetensors, config.json
        if any(folder.glob("tokenizer*")):
            AutoTokenizer.from_pretrained(folder).save_pretrained(temporary)
    print(f"adapter saved to {output_dir / 'adapter'}, merged model to {output_dir / 'merged'}")


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
    parser.add_argument("--model", required=True, help="model folder, or Hub name in the cache")
    parser.add_argument("--tokens", type=folder_path, default="tokens", help="prepare_tokens.py's")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps")
    parser.add_argument("--global-batch", type=positive_int, default=32, help="sequences a step")
    parser.add_argument("--micro-batch", type=positive_int, default=4, help="sequences a pass")
    parser.add_argument("--lr", type=positive_float, default=2e-4)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--rank", type=positive_int, default=16, help="LoRA rank")
    parser.add_argument("--alpha", type=positive_float, default=32, help="LoRA scale numerator")
    parser.add_argument("--target-modules", nargs="+", default=["q_proj", "k_proj", "v_proj",
                        "o_proj"], help="names of the linear layers that get adapters")  # fmt: skip
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--checkpoint-dir", type=writable_dir, default="checkpoints")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps")
    parser.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept")
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps")
    parser.add_argument("--output-dir", type=writable_dir, default="lora-out")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"finetune_lora.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def warn(message):
    print(f"finetune_lora.py: warning: {message}", file=sys.stderr)


def first_line(error):
    return str(error).splitlines()[0] if str(error) else "empty"


def accumulation_steps(global_batch, micro_batch):
    if global_batch % micro_batch:
        fail(f"--global-batch {global_batch} is not a multiple of --micro-batch {micro_batch}")
    return global_batch // micro_batch


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
    if choice == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=8:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    if choice == "cuda" or (choice == "auto" and gpu_usable(torch)):
        device = torch.device("cuda", 0)
        props = torch.cuda.get_device_properties(device)  # make site-check counts this line
        print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)
        return device
    return torch.device("cpu")


class StopSignal:
    """Records that SIGUSR1 or SIGTERM came; the training loop saves and stops after its step."""

    def __init__(self):
        self.name = None
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self.record)

    def record(self, signum, frame):
        self.name = signal.Signals(signum).name  # nothing else: a step may be half done


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


@contextlib.contextmanager
def written(temporary, final):
    """A folder filled under a temporary name, synced, then renamed to final (which must not
    exist as a file); a failed write (a full disk, a quota) removes it and stops in one line."""
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        temporary.mkdir(parents=True)
        yield temporary
        for path in temporary.iterdir():
            with open(path, "rb") as file:
                os.fsync(file.fileno())
        if final.exists():  # a folder written before (an export run twice): replace it
            shutil.rmtree(final)
        os.rename(temporary, final)
        fsync_folder(final.parent)
    except (OSError, RuntimeError) as error:
        reason = write_problem(error, final.parent)  # before the space is freed
        shutil.rmtree(temporary, ignore_errors=True)
        fail(f"cannot write {final}: {reason}; the checkpoints "
             "written before are intact: free some space (df -h, or your centre's quota "
             "command) and run again")  # fmt: skip


def fsync_folder(path):
    directory = os.open(path, os.O_RDONLY)
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


def adapter_digest(model):
    """A fingerprint of the trained adapter: a resumed run ends with the same one as a run that
    never stopped."""
    from peft import get_peft_model_state_dict

    digest = hashlib.sha256()
    for name, tensor in sorted(get_peft_model_state_dict(model).items()):
        digest.update(name.encode() + tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def checkpoint_folders(folder):
    """The checkpoint folders in folder, oldest first (temporary ones are not among them)."""
    found = [path for path in folder.iterdir() if NAME.fullmatch(path.name) and path.is_dir()]
    return sorted(found)


def hold(folder):
    """Refuse a second run on folder (a resubmission while this one runs): a lock on
    folder/.lock, which the system releases when this process ends, however it ends."""
    lock = open(folder / ".lock", "a+")  # noqa: SIM115  held open until the process ends
    atexit.register(lock.close)
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            warn(f"cannot lock {folder} ({error.strerror}): make sure no other run uses it")
            return
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        fail(f"{folder} is in use by {holder}: wait for that run to end (or cancel it), or give "
             f"this one another --checkpoint-dir; if it is no longer running, delete "
             f"{folder}/.lock")  # fmt: skip
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("JOB_ID") or os.environ.get("PBS_JOBID")
    lock.truncate(0)
    lock.write(f"{f'job {job}, ' if job else ''}process {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the checkpoints already written are complete
        print("finetune_lora.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
