"""Make a tiny language model with random weights, to try the fine-tuning jobs in minutes.

Before a long run on a model of billions of parameters, check that the job scripts, the venv,
the cache and the GPUs work with a model that loads in a second: this script trains a small
byte-level BPE tokenizer on the text files you give, creates a Llama-style model of two layers
(hidden size 128, two attention heads of 64) with random weights, and saves both with
save_pretrained, as hf download would leave a real model. Every script of these pages loads it
with from_pretrained(folder). Its loss falls when fine-tuned on the same text, which is all a
check needs; it knows nothing else. Nothing is downloaded: it runs on a login node or a laptop.

    python make_tiny_model.py --text notes.txt --output-dir tiny-model
    python prepare_tokens.py --model tiny-model --input notes.txt --seq-len 64
"""

import argparse
import sys
from pathlib import Path


def main(argv=None):
    args = parse_args(argv)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    # A byte-level BPE tokenizer: any text can be encoded, whatever its characters.
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in args.text], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>", model_max_length=args.max_positions,
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256,
        num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=args.max_positions, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    try:
        model.save_pretrained(args.output_dir)  # config.json, model.safetensors
        fast.save_pretrained(args.output_dir)  # tokenizer.json, tokenizer_config.json
    except OSError as error:
        fail(f"cannot write {args.output_dir}: {error.strerror or error}")
    count = sum(p.numel() for p in model.parameters())
    print(f"tiny Llama: {count:,} parameters (decoder layers: {args.layers}), a vocabulary of "
          f"{len(fast)}, {args.max_positions} positions; saved to {args.output_dir}")  # fmt: skip


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


def text_file(text):
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file")
    return path


def new_folder(text):
    """A folder that holds no model yet: never overwrite one."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    if (path / "config.json").exists():
        raise argparse.ArgumentTypeError(f"{path} holds a model already: choose another folder")
    return path


def vocabulary(text):
    value = positive_int(text)
    if value < 260:  # the 256 bytes, the special tokens, a merge
        raise argparse.ArgumentTypeError(f"must be 260 or more (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--text", type=text_file, nargs="+", required=True,
                        help="text files to train the tokenizer on")  # fmt: skip
    parser.add_argument("--output-dir", type=new_folder, default="tiny-model")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--vocab-size", type=vocabulary, default=300)
    parser.add_argument("--max-positions", type=positive_int, default=256, help="context length")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"make_tiny_model.py: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("make_tiny_model.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
