"""Will this model fit? Memory per GPU for fine-tuning a language model with DDP, FSDP2 or LoRA.

The planner reads the model's config.json (from a model folder, or for a Hugging Face Hub name
from the local cache: it downloads nothing) and builds the model on the meta device, which
gives every parameter's shape and allocates nothing. For each method it prints the bytes one
GPU holds: weights, gradients, AdamW state and the working copies the method makes, plus an
estimate of the activations for --seq-len and --micro-batch. Then it says which methods fit
in --gpu-memory and recommends the simplest one that does. The accounting, for P parameters
on N GPUs, computing in bfloat16 (--param-dtype):

- DDP: float32 weights, gradients and AdamW's two averages, 16 bytes per parameter on every
  GPU; DDP's gradient buckets (4 B/P) and autocast's bfloat16 copies of the weights (2 B/P).
- FSDP2 (fully_shard on each decoder layer, then on the root): the same 16 B/P divided by N;
  two decoder layers (the one computing and the next, prefetched) and the root's parameters
  (embeddings, output layer) gathered in bfloat16; the unsharded gradients of one layer and
  of the root, in bfloat16, until they are reduce-scattered.
- LoRA: the frozen weights in bfloat16 (2 B/P); adapters of rank r beside --target-modules,
  r * (inputs + outputs) parameters each, with float32 weights, gradients and AdamW state.

    hf download Qwen/Qwen2.5-7B config.json     # once, on a login node: the config only
    python plan_memory.py --model Qwen/Qwen2.5-7B --gpus 4 --seq-len 4096
    python plan_memory.py --model path/to/model --method fsdp2 --gpus 8 --json
"""

import argparse
import json
import math
import sys
from pathlib import Path

GiB = 2**30


def main(argv=None):
    args = parse_args(argv)
    config = read_config(config_file(args.model), args.model)
    shape = decoder_shape(config, args.model)
    if shape["positions"] and args.seq_len > shape["positions"]:
        fail(f"--seq-len {args.seq_len} is above the {shape['positions']} positions of "
             f"{args.model} (max_position_embeddings in its config.json)")  # fmt: skip
    model = build_on_meta(config, args.model)
    counts = count_parameters(model, args.gpus)
    if args.method in ("lora", "all"):
        counts["adapter_parameters"] = adapter_parameters(
            model, args.target_modules, args.lora_rank
        )
        if not counts["adapter_parameters"]:
            fail(f"--target-modules {' '.join(args.target_modules)}: no such layer in "
                 f"{args.model}; its layers with a 2-D weight are "
                 f"{' '.join(linear_names(model))}")  # fmt: skip
    width = 2 if args.param_dtype == "bfloat16" else 4  # bytes of a number in compute
    checkpointing = not args.no_gradient_checkpointing
    activations = activation_bytes(shape, args.seq_len * args.micro_batch, width, checkpointing)
    memory = int(args.gpu_memory * GiB)
    methods = {}
    for method in ("ddp", "fsdp2", "lora"):
        if args.method in (method, "all"):
            methods[method] = plan(method, counts, width, activations, memory)
    best = next((name for name, each in methods.items() if each["fits"]), None)
    if args.json:
        print(json.dumps({"model": args.model, "architecture": type(model).__name__,
                          **counts, "gpus": args.gpus, "gpu_memory": memory,
                          "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                          "param_dtype": args.param_dtype, "lora_rank": args.lora_rank,
                          "gradient_checkpointing": checkpointing, "methods": methods,
                          "recommended": best}, indent=2))  # fmt: skip
    else:
        print_table(args, model, counts, methods, memory)
    if best is None:
        does_not_fit(args, methods, counts, width, activations, memory)


def ddp_bytes(params, width):
    """DDP: every GPU holds the whole training state, whatever the number of GPUs."""
    buckets = 4 * params  # DDP's flat copy of the gradients, summed across the GPUs
    casts = 2 * params if width == 2 else 0  # autocast's bfloat16 copies of the weights
    return {
        "weights": 4 * params,  # float32: the master copy that AdamW updates
        "gradients": 4 * params,  # float32, like the weights
        "optimizer": 8 * params,  # AdamW: two float32 running averages per weight
        "copies": buckets + casts,
    }


def fsdp2_bytes(shard, layer, root, width):
    """FSDP2: each GPU holds a shard of the state; only a few layers are ever whole."""
    gathered = width * (2 * layer + root)  # the layer at work, the next one, the root
    unsharded = width * (layer + root)  # their gradients, until they are reduce-scattered
    return {
        "weights": 4 * shard,  # the float32 shard of every parameter
        "gradients": 4 * shard,  # reduce-scattered: the shard's gradients only
        "optimizer": 8 * shard,  # AdamW state for the shard only
        "copies": gathered + unsharded,
    }


def lora_bytes(params, adapters, width):
    """LoRA: the model is frozen; only the adapters have gradients and optimizer state."""
    return {
        "weights": width * params + 4 * adapters,  # frozen model in compute dtype, fp32 adapters
        "gradients": 4 * adapters,
        "optimizer": 8 * adapters,
        "copies": 0,
    }


def layer_activation_bytes(shape, tokens, width):
    """Bytes one Llama-style decoder layer keeps for its backward pass: its saved tensors, for
    tokens = sequence length x micro-batch, with a fused attention kernel (no seq x seq
    matrix is kept) and numbers of `width` bytes (2: bfloat16)."""
    hidden, q, kv = shape["hidden"], shape["q_width"], shape["kv_width"]
    per_token = (
        2 * (4 * hidden + width * hidden)  # two RMSNorms: float32 input, normalized input
        + 2 * width * hidden  # the inputs of the attention and MLP projections
        + width * (q + 2 * kv)  # queries, keys and values after the rotary embedding
        + 2 * width * q  # attention output, and its copy that enters o_proj
        + 4 * width * shape["intermediate"]  # SwiGLU: gate, SiLU(gate), up, their product
    )
    return tokens * per_token


def activation_bytes(shape, tokens, width, checkpointing):
    """An estimate of the activations of one forward and backward pass, per GPU."""
    layer = layer_activation_bytes(shape, tokens, width)
    if checkpointing:  # each layer keeps its input; one layer at a time is recomputed
        layers = shape["layers"] * tokens * width * shape["hidden"] + layer
    else:
        layers = shape["layers"] * layer
    # The final norm, the logits, and the float32 copy and log-softmax of the loss.
    head = tokens * ((4 + 2 * width) * shape["hidden"] + (width + 8) * shape["vocab"])
    return layers + head


def plan(method, counts, width, activations, memory):
    """The bytes per GPU of one method, their total, and whether it fits in memory."""
    if method == "ddp":
        figures = ddp_bytes(counts["parameters"], width)
    elif method == "fsdp2":
        figures = fsdp2_bytes(
            counts["shard_parameters"], counts["layer_parameters"], counts["root_parameters"], width
        )
    else:
        figures = lora_bytes(counts["parameters"], counts["adapter_parameters"], width)
    figures["activations"] = activations
    figures["total"] = sum(figures.values())
    figures["fits"] = figures["total"] <= memory
    return figures


def build_on_meta(config, name):
    """The model with every parameter's shape and no storage: nothing loaded or allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, ImportError) as error:  # not a causal language model, or needs code
        fail(f"{name}: transformers cannot build it as a causal language model "
             f"({first_line(error)})")  # fmt: skip


def count_parameters(model, gpus):
    """Parameters of the model; of the largest shard one GPU holds under FSDP2, which splits
    every parameter along its first dimension in rows of ceil(rows / gpus); of its largest
    decoder layer; and of the root (those in no decoder layer: embeddings, output layer)."""
    params = list(model.parameters())  # shared (tied) parameters once
    total = sum(p.numel() for p in params)
    shard = sum(
        math.ceil(p.shape[0] / gpus) * (p.numel() // p.shape[0]) if p.dim() else p.numel()
        for p in params
    )
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    largest = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    root = sum(p.numel() for p in params if id(p) not in in_layers)
    return {"parameters": total, "shard_parameters": shard, "layer_parameters": largest,
            "root_parameters": root, "decoder_layers": len(layers)}  # fmt: skip


def decoder_layers(model):
    """The modules fully_shard wraps one by one: those transformers never splits across
    devices (_no_split_modules, e.g. LlamaDecoderLayer), else the longest ModuleList."""
    import torch

    names = set(getattr(model, "_no_split_modules", None) or ())
    layers, outer = [], ()
    for name, module in model.named_modules():
        if type(module).__name__ in names and not name.startswith(outer):
            layers.append(module)
            outer = (*outer, f"{name}.")  # not the blocks inside this one
    if not layers:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    return layers


def adapter_parameters(model, targets, rank):
    """LoRA's trainable parameters: rank x (inputs + outputs) beside each targeted layer."""
    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in targets and weight is not None and weight.dim() == 2:
            count += rank * (weight.shape[0] + weight.shape[1])
    return count


# --- checks and plumbing ---


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", type=model_folder_or_name, required=True, help="model "
                        "folder, its config.json, or a Hub name in the cache")  # fmt: skip
    parser.add_argument("--gpus", type=positive_int, default=1, help="GPUs in the job")
    parser.add_argument("--gpu-memory", type=positive_float, default=80.0,
                        help="GiB of memory of each GPU")  # fmt: skip
    parser.add_argument("--seq-len", type=positive_int, default=2048, help="tokens a sequence")
    parser.add_argument("--micro-batch", type=positive_int, default=1,
                        help="sequences a forward pass, per GPU")  # fmt: skip
    parser.add_argument("--method", choices=["ddp", "fsdp2", "lora", "all"], default="all")
    parser.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="compute dtype")  # fmt: skip
    parser.add_argument("--lora-rank", type=positive_int, default=16, help="LoRA rank")
    parser.add_argument("--target-modules", nargs="+", default=["q_proj", "k_proj", "v_proj",
                        "o_proj"], help="names of the layers that get LoRA adapters")  # fmt: skip
    parser.add_argument("--no-gradient-checkpointing", action="store_true", help="keep every "
                        "layer's activations instead of recomputing them")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures (bytes) as JSON")
    return parser.parse_args(argv)


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def model_folder_or_name(text):
    """A folder, a config.json, or a Hub name; a path under a regular file is none of them."""
    for part in Path(text).parents:
        if part.is_file():
            raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
    return text


def config_file(name):
    """The config.json of --model: in its folder, the file itself, or the Hub name's copy in
    the Hugging Face cache. Never from the network: a compute node rarely reaches it."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail(f"{path} holds no config.json: not a Hugging Face model folder (give the "
                 "folder that hf download filled, or the model's Hub name)")  # fmt: skip
        return path / "config.json"
    if path.is_file():
        return path
    if path.is_absolute() or name.startswith(".") or name.count("/") > 1:
        fail(f"{name}: no such folder (and not a Hub name, which reads organization/model)")
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(name, "config.json", local_files_only=True))
    except HFValidationError:
        fail(f"{name} is neither a folder nor a Hub name (organization/model)")
    except LocalEntryNotFoundError:
        fail(f"{name} is not in the Hugging Face cache {constants.HF_HUB_CACHE}: on a login "
             f"node, with HF_HOME pointing at the shared cache, run: hf download {name} "
             "config.json (and set the same HF_HOME here)")  # fmt: skip


def read_config(path, name):
    """The model's configuration, as transformers reads it; one line if it cannot."""
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # only the planner's lines
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as error:  # unknown model_type, not JSON, custom code
        fail(f"{path} is not a model configuration transformers {version('transformers')} "
             f"can read ({first_line(error)})")  # fmt: skip


def decoder_shape(config, name):
    """The sizes the activation estimate needs, from the (text) configuration."""
    text = config.get_text_config()
    try:
        hidden, heads = text.hidden_size, text.num_attention_heads
        shape = {"hidden": hidden, "layers": text.num_hidden_layers, "vocab": text.vocab_size}
    except AttributeError as error:
        fail(f"{name}: its configuration lacks a size the estimate needs ({error})")
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    shape.update(q_width=heads * head_dim, kv_width=kv_heads * head_dim,
                 intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
                 positions=getattr(text, "max_position_embeddings", None))  # fmt: skip
    return shape


def linear_names(model):
    """The distinct names of the two-dimensional weights' layers (for an error message)."""
    names = set()
    for name, module in model.named_modules():
        if getattr(module, "weight", None) is not None and module.weight.dim() == 2:
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def size(count):
    """Bytes as a person reads them: GiB, MiB or KiB with one decimal."""
    for unit, factor in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= factor:
            return f"{count / factor:.1f} {unit}"
    return f"{count} B"


TITLES = {"ddp": "DDP", "fsdp2": "FSDP2", "lora": "LoRA"}
ROWS = [("weights", "weights"), ("gradients", "gradients"), ("optimizer", "AdamW state"),
        ("copies", "working copies"), ("activations", "activations (estimate)"),
        ("total", "total")]  # fmt: skip


def print_table(args, model, counts, methods, memory):
    gpus = f"{args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    print(f"{args.model}: {type(model).__name__}, {counts['parameters']:,} parameters, "
          f"{counts['decoder_layers']} decoder layers")  # fmt: skip
    print(f"per GPU, {gpus} of {size(memory)}, {args.seq_len} tokens x {args.micro_batch} "
          f"sequence{'s' if args.micro_batch > 1 else ''}, {args.param_dtype}, gradient "
          f"checkpointing {'off' if args.no_gradient_checkpointing else 'on'}")  # fmt: skip
    titles = {**TITLES, "lora": f"LoRA r={args.lora_rank}"}
    print(f"{'':24}" + "".join(f"{titles[name]:>13}" for name in methods))
    for key, label in ROWS:
        print(f"{label:24}" + "".join(f"{size(each[key]):>13}" for each in methods.values()))
    if "lora" in methods:
        adapters = counts["adapter_parameters"]
        print(f"LoRA trains {adapters:,} adapter parameters "
              f"({100 * adapters / counts['parameters']:.2f}% of the model)")  # fmt: skip
    for name, each in methods.items():
        verdict = "fits" if each["fits"] else "does not fit"
        print(f"{TITLES[name]}: {verdict}: needs {size(each['total'])} of {size(memory)}")
    best = next((name for name, each in methods.items() if each["fits"]), None)
    reasons = {"ddp": "the simplest: every GPU holds the whole model",
               "fsdp2": "the whole model trains, sharded over the GPUs",
               "lora": "full fine-tuning does not fit; LoRA trains adapters beside a frozen "
                       "model"}  # fmt: skip
    if best:
        print(f"recommended: {TITLES[best]} ({reasons[best]})")


def fsdp2_gpus_needed(counts, width, activations, memory):
    """About the fewest GPUs on which FSDP2 fits (the shard taken as parameters / GPUs), or
    None when no number does: the working copies and the activations alone are too large."""
    fixed = (
        fsdp2_bytes(0, counts["layer_parameters"], counts["root_parameters"], width)["copies"]
        + activations
    )
    if fixed >= memory:
        return None
    return max(1, math.ceil(16 * counts["parameters"] / (memory - fixed)))


def does_not_fit(args, methods, counts, width, activations, memory):
    """Exit 1 with one line: by how much the request misses, and what to change."""
    needed = min(each["total"] for each in methods.values())
    what = f"{TITLES[next(iter(methods))]} needs" if len(methods) == 1 else "every method needs"
    hints = []
    gpus = fsdp2_gpus_needed(counts, width, activations, memory)
    if gpus and "fsdp2" not in methods and gpus <= args.gpus:
        hints.append("FSDP2 (--method fsdp2)")
    elif gpus:
        gpus = max(gpus, args.gpus + 1)
        hints.append(f"FSDP2 on about {gpus} GPUs (--method fsdp2 --gpus {gpus})")
    if "lora" not in methods:
        hints.append("LoRA (--method lora)")
    if args.no_gradient_checkpointing:
        hints.append("gradient checkpointing (leave out --no-gradient-checkpointing)")
    hints.append("a shorter --seq-len or a smaller --micro-batch")
    print(
        f"plan_memory.py: {what} {size(needed)} per GPU, {size(needed - memory)} more than "
        f"the {size(memory)} of a GPU: try {', or '.join(hints)}",
        file=sys.stderr,
    )
    sys.exit(1)


def first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def version(package):
    from importlib.metadata import version as installed

    return installed(package)


def fail(message):
    print(f"plan_memory.py: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("plan_memory.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
