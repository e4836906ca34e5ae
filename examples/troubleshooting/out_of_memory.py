"""CUDA out of memory: reproduce it under a memory cap, then see what each fix saves.

A training step keeps the activations of every layer for the backward pass: their size grows
with the batch, and past the GPU's memory the step fails with "torch.OutOfMemoryError: CUDA out
of memory. Tried to allocate ...". The script caps the memory PyTorch may use (--memory-gb),
so the error comes at the same batch size on any GPU, and prints torch.cuda.memory_summary().
With --fix it runs the same step in four ways and prints the peak memory of each: the full
batch, gradient accumulation over --micro-batches, bfloat16 autocast, and activation
checkpointing with accumulation; and it checks that accumulation and checkpointing compute the
same gradients as the full batch. On CPU, --fix checks the gradients only, at a small size.

    python out_of_memory.py --device cuda                # torch.OutOfMemoryError
    python out_of_memory.py --device cuda --fix          # the peak memory of each fix
    python out_of_memory.py --device cpu --fix --batch-size 256 --width 64
"""

import argparse
import math
import sys

FIXES = {  # name: (micro-batches used, autocast, checkpointing)
    "full batch": (False, False, False),
    "gradient accumulation": (True, False, False),
    "bfloat16 autocast": (False, True, False),
    "checkpointing + accumulation": (True, False, True),
}


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--fix", action="store_true", help="compare the ways to need less memory")
    parser.add_argument("--batch-size", type=positive_int, default=16384)
    parser.add_argument(
        "--micro-batches", type=positive_int, default=8, help="for gradient accumulation"
    )
    parser.add_argument("--width", type=positive_int, default=2048, help="features per layer")
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument(
        "--memory-gb", type=positive_float, default=1.0, help="cap on the GPU memory used"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"out_of_memory.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def make_model(torch, width, layers):
    nn = torch.nn
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def forward(torch, model, inputs, checkpoint):
    for block in model[:-1]:
        if checkpoint:  # keep only the block's input; recompute the rest during backward
            inputs = torch.utils.checkpoint.checkpoint(block, inputs, use_reentrant=False)
        else:
            inputs = block(inputs)
    return model[-1](inputs)


def train_step(torch, model, inputs, targets, micro_batches, autocast, checkpoint):
    """One step's gradients, from the whole batch at once or --micro-batches at a time."""
    model.zero_grad(set_to_none=True)
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True):
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
            outputs = forward(torch, model, x, checkpoint)
        loss = torch.nn.functional.mse_loss(outputs.float(), y) / micro_batches
        loss.backward()  # adds to the gradients of the previous micro-batches
    return [parameter.grad.clone() for parameter in model.parameters()]


def main(argv=None):
    args = parse_args(argv)
    if args.batch_size % args.micro_batches:
        fail(f"--batch-size {args.batch_size} is not a multiple of --micro-batches")
    cuda = args.device == "cuda"
    if not cuda and not args.fix:
        fail("only a GPU runs out of memory this way: use --device cuda, or --fix on CPU")
    import torch

    if cuda and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one with #SBATCH --gpus-per-node=1")
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 2**30 / total))
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = make_model(torch, args.width, args.layers).to(device)
    inputs = torch.randn(args.batch_size, args.width, device=device)
    targets = torch.randn(args.batch_size, 1, device=device)

    if not args.fix:
        try:
            train_step(torch, model, inputs, targets, 1, False, False)
        except torch.OutOfMemoryError:
            print(torch.cuda.memory_summary(abbreviated=True))
            raise
        print(f"batch {args.batch_size} fits in {args.memory_gb} GiB: raise --batch-size")
        return

    reference = None
    for name, (accumulate, autocast, checkpoint) in FIXES.items():
        micro_batches = args.micro_batches if accumulate else 1
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            grads = train_step(torch, model, inputs, targets, micro_batches, autocast, checkpoint)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory")
            continue
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""
        if name == "full batch":
            reference = grads
        elif reference is not None and not autocast:  # bfloat16 rounds: not the same numbers
            pairs = zip(grads, reference, strict=True)
            difference = max((grad - ref).abs().max().item() for grad, ref in pairs)
            peak += f", gradients differ from the full batch's by {difference:.1e}"
        print(f"{name}: fits{peak}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("out_of_memory.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
