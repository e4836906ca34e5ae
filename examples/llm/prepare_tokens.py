"""Tokenize text once into fixed-length blocks of token ids, for training with no tokenizer.

Run it on a login node, or in a CPU job for a large corpus, after the model is in the shared
Hugging Face cache (see the models page). Each input is a document: a .txt file as a whole, or
each line of a .jsonl file (its "text" field). Every document gets the end-of-text token, the
documents are joined, and the stream is cut into blocks of --seq-len tokens (the last, partial
block is dropped). The output folder holds tokens.bin, the blocks one after the other as raw
16-bit (or 32-bit, for vocabularies above 65,536) token ids, and meta.json, which says how to
read them and which tokenizer made them. Training maps tokens.bin into memory and reads the
blocks it needs: the file can be staged to node-local storage like any dataset.

    python prepare_tokens.py --model Qwen/Qwen2.5-0.5B --input corpus/*.jsonl --seq-len 1024 \
        --output-dir $SCRATCH/tokens/qwen-1024
"""

import argparse
import contextlib
import errno
import hashlib
import json
import os
import sys
from pathlib import Path

FORMAT = "pytorch-on-hpc tokens 1"  # meta.json's "format": what the training scripts accept


def main(argv=None):
    args = parse_args(argv)
    folder = model_folder(args.model)  # a local folder, or the model's copy in the cache
    quiet_transformers()
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    check_fits(config, tokenizer, args.seq_len, args.model)

    # One stream of ids: each document, then the end-of-text token that separates documents.
    ids, documents = [], 0
    for text in documents_of(args.input):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
        documents += 1
    blocks = len(ids) // args.seq_len
    if blocks == 0:
        fail(f"{documents} documents give {len(ids)} tokens: fewer than one block of "
             f"--seq-len {args.seq_len}; give more text or a shorter --seq-len")  # fmt: skip

    import numpy as np

    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    array = np.asarray(ids[: blocks * args.seq_len], dtype=dtype)
    meta = {
        "format": FORMAT,
        "dtype": np.dtype(dtype).name,
        "seq_len": args.seq_len,
        "blocks": blocks,
        "model": args.model,
        "vocab_size": len(tokenizer),
        "tokenizer_sha256": tokenizer_digest(tokenizer),
    }
    write_tokens(args.output_dir, array, meta)
    dropped = len(ids) - blocks * args.seq_len
    print(f"{documents} documents, {len(ids):,} tokens: {blocks:,} blocks of {args.seq_len} "
          f"({dropped} tokens of the last block dropped), {meta['dtype']} ids")  # fmt: skip
    print(f"wrote {args.output_dir / 'tokens.bin'} and {args.output_dir / 'meta.json'}")


def documents_of(paths):
    """Each document's text: a .txt file whole, or the "text" of each line of a .jsonl file."""
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            fail(f"cannot read {path}: {getattr(error, 'strerror', None) or error}")
        if path.suffix != ".jsonl":
            yield text
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                document = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                document = None
            if not isinstance(document, str):
                fail(f'{path}, line {number}: not a JSON object with a "text" string')
            yield document


def tokenizer_digest(tokenizer):
    """A fingerprint of the vocabulary: training checks that its model's tokenizer has it."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocabulary.encode()).hexdigest()


def write_tokens(folder, array, meta):
    """tokens.bin, then meta.json, each written to a temporary name, synced and renamed: a
    folder whose meta.json exists holds complete tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("tokens.bin", array.tobytes()),
                       ("meta.json", (json.dumps(meta, indent=1) + "\n").encode())):  # fmt: skip
        path = folder / name
        temporary = folder / f"{name}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            fail(f"cannot write {path}: {write_problem(error)}")


# --- checks and plumbing ---------------------------------------------------------------------


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def input_file(text):
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file")
    return path


def new_folder(text):
    """The output folder: new, or one without tokens yet (never overwrite a dataset in use)."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    if (path / "meta.json").exists() or (path / "tokens.bin").exists():
        raise argparse.ArgumentTypeError(f"{path} already holds tokens: remove them first, or "
                                         "choose another folder")  # fmt: skip
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model folder, or Hub name in the cache")
    parser.add_argument("--input", type=input_file, nargs="+", required=True,
                        help=".txt (a document a file), .jsonl (a document a line)")  # fmt: skip
    parser.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per block")
    parser.add_argument("--output-dir", type=new_folder, default="tokens")
    return parser.parse_args(argv)


def fail(message):
    print(f"prepare_tokens.py: error: {message}", file=sys.stderr)
    sys.exit(2)


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


def check_fits(config, tokenizer, seq_len, name):
    """The tokenizer belongs to the model, and a block fits the model's context."""
    embeddings = getattr(config, "vocab_size", None)
    if embeddings is not None and len(tokenizer) > embeddings:
        fail(f"the tokenizer of {name} has {len(tokenizer):,} tokens but the model only "
             f"{embeddings:,} embeddings: they do not belong together")  # fmt: skip
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {name} has no end-of-text token to separate documents")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        fail(f"--seq-len {seq_len} is longer than the {limit} positions {name} was trained for")


def write_problem(error):
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left (the file system or your quota is full)"
    if error.errno == errno.EROFS:
        return "the file system is read-only"
    return error.strerror or str(error)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("prepare_tokens.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
