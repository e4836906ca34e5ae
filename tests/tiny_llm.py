"""A tiny Llama-style language model and its tokenizer, made here: no download, no network.

Two decoder layers, hidden size 128, two attention heads of 64 (vLLM's CPU attention refuses a
head size of 16), a byte-level BPE vocabulary of 300 trained on tests/llm/corpus.txt. Saved with
save_pretrained, so that the examples load it with their own from_pretrained(path) code, as
they would a model downloaded with `hf download`. Built once per machine and version of this
file (in the tests' cache), then shared by every test and worker.
"""

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "llm" / "corpus.txt"
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 256}  # fmt: skip
VOCABULARY = 300


def key():
    """What the model depends on: this file, the corpus, the libraries' versions."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + CORPUS.read_bytes())
    for package in ("torch", "tokenizers", "transformers"):
        digest.update(importlib.metadata.version(package).encode())
    return digest.hexdigest()[:12]


def build(folder):
    """Train the tokenizer, create the model with fixed weights, save both into folder (run
    as a script, in a process of its own: the tests' workers never import transformers)."""
    import torch  # noqa: PLC0415
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>", model_max_length=SIZES["max_position_embeddings"],
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(fast), bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, **SIZES,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)  # config.json, generation_config.json, model.safetensors
    fast.save_pretrained(folder)  # tokenizer.json, tokenizer_config.json


def tiny_llm(cache, env):
    """The model's folder in cache, built there on first use with env (atomically: workers
    race)."""
    folder = Path(cache) / f"tiny-llm-{key()}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".tiny-llm-", dir=folder.parent))
        subprocess.run([sys.executable, __file__, partial], env=env, check=True, timeout=300,
                       capture_output=True)  # fmt: skip
        try:
            os.rename(partial, folder)
        except OSError:  # another worker was first: use its copy
            shutil.rmtree(partial)
    return folder


if __name__ == "__main__":
    build(sys.argv[1])
