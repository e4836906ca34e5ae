"""The tests' tiny language model and its tokens, made once per machine by the examples' own
scripts and shared by every test and worker (in the tests' cache).

examples/llm/make_tiny_model.py makes the model (two decoder layers, hidden size 128, two
attention heads of 64: vLLM's CPU attention refuses a head size of 16) with a byte-level BPE
vocabulary of 300 trained on tests/llm/corpus.txt, saved with save_pretrained, so that the
examples load it with their own from_pretrained(path) code, as a model downloaded with
`hf download`. examples/llm/prepare_tokens.py cuts the corpus into blocks of 32 of its tokens.
No download, no network.
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
LLM = HERE.parent / "examples" / "llm"
# What make_tiny_model.py makes by default.
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 256}  # fmt: skip
VOCABULARY = 300


def made(folder, prefix, key, command, env):
    """folder/<prefix>-<key>, made by command (given the folder to fill) on first use, under a
    temporary name then renamed: workers race, the first wins."""
    final = Path(folder) / f"{prefix}-{key}"
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{prefix}-", dir=final.parent))
        subprocess.run([*command, partial / "out"], env=env, check=True, timeout=300,
                       capture_output=True)  # fmt: skip
        try:
            os.rename(partial / "out", final)
        except OSError:  # another worker was first: use its copy
            pass
        shutil.rmtree(partial)
    return final


def digest(*paths, packages=()):
    hashed = hashlib.sha256(b"".join(Path(path).read_bytes() for path in paths))
    for package in packages:
        hashed.update(importlib.metadata.version(package).encode())
    return hashed.hexdigest()[:12]


def tiny_llm(cache, env):
    """The model's folder in cache."""
    script = LLM / "make_tiny_model.py"
    key = digest(script, CORPUS, packages=("torch", "tokenizers", "transformers"))
    command = [sys.executable, script, "--text", CORPUS, "--output-dir"]
    return made(cache, "tiny-llm", key, command, env)


def tokens(model, env):
    """The corpus in blocks of 32 tokens of model, beside the model."""
    script = LLM / "prepare_tokens.py"
    command = [sys.executable, script, "--model", model, "--input", CORPUS, "--seq-len", "32",
               "--output-dir"]  # fmt: skip
    return made(Path(model).parent, f"tokens-{Path(model).name}", digest(script), command, env)


# `signal_after.py N SCRIPT ARGS...` runs SCRIPT, after registering an optimizer hook that sends
# SIGUSR1 to rank 0 (the only process of a run without RANK) once its optimizer has made N
# steps: a requeue signal that only one process receives. (No variable of its own: the run
# stays in the zygote, which has transformers.)
_SIGNAL_AFTER = """
import os, runpy, signal, sys
from torch.optim.optimizer import register_optimizer_step_post_hook

steps = 0


def count(optimizer, args, kwargs):
    global steps
    steps += 1
    if steps == stop_after and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGUSR1)


register_optimizer_step_post_hook(count)
stop_after = int(sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def signal_after(folder):
    """folder/llm/signal_after.py, written; in llm/, so that it runs in the zygote that has
    the Hugging Face libraries (conftest.PRELOAD)."""
    (folder / "llm").mkdir(exist_ok=True)
    (folder / "llm" / "signal_after.py").write_text(_SIGNAL_AFTER)
    return folder / "llm" / "signal_after.py"
