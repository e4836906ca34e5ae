"""examples/llm/: prepare_tokens.py and finetune_lora.py on a tiny Llama (tests/tiny_llm.py), on
the CPU, with the hub offline: tokens, LoRA training, resume, requeue signal, merge, bad input."""

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import EXAMPLES, example_env, private_mount_namespace, run
from tiny_llm import CORPUS, SIZES, signal_after

LLM = EXAMPLES / "llm"
PREPARE = LLM / "prepare_tokens.py"
LORA = LLM / "finetune_lora.py"
SEQ_LEN = 32
# Two optimizer steps of 8 sequences, two micro-batches of 4 each, a checkpoint every step.
SHORT = ["--device", "cpu", "--global-batch", "8", "--micro-batch", "4", "--rank", "8",
         "--lr", "0.01", "--log-every", "1", "--checkpoint-every", "1", "--seed", "1"]  # fmt: skip
STEPS = 4
# Rank 8 on q, k, v and o of each layer: A is 8 x 128 and B is 128 x 8.
TRAINABLE = SIZES["num_hidden_layers"] * 4 * 8 * (SIZES["hidden_size"] * 2)


@pytest.fixture(scope="module")
def tokens(tiny_llm, tmp_path_factory):
    """(folder, what prepare_tokens.py printed): the corpus in blocks of SEQ_LEN."""
    where = tmp_path_factory.mktemp("tokens")
    out = run([sys.executable, PREPARE, "--model", tiny_llm, "--input", CORPUS,
               "--seq-len", SEQ_LEN, "--output-dir", "tokens"], cwd=where).stdout  # fmt: skip
    return where / "tokens", out


@pytest.fixture(scope="module")
def trained(tiny_llm, tokens, tmp_path_factory):
    """(folder, output) of a run that was never interrupted."""
    where = tmp_path_factory.mktemp("lora")
    args = [*SHORT, "--model", tiny_llm, "--tokens", tokens[0], "--steps", STEPS]
    out = run([sys.executable, LORA, *args], cwd=where, timeout=180).stdout
    return where, out


def digest(out):
    return out.split("adapter weights: sha256 ")[1].split()[0]


def test_tokens_are_the_corpus_in_blocks_with_end_of_text(tiny_llm, tokens):
    folder, out = tokens
    meta = json.loads((folder / "meta.json").read_text())
    ids = Tokenizer.from_file(str(tiny_llm / "tokenizer.json")).encode(CORPUS.read_text()).ids
    count = len(ids) + 1  # the end-of-text token after the document
    assert meta["blocks"] == count // SEQ_LEN and meta["dtype"] == "uint16", meta
    assert out.startswith(f"1 documents, {count:,} tokens: {meta['blocks']} blocks of {SEQ_LEN} "
                          f"({count % SEQ_LEN} tokens of the last block dropped)")  # fmt: skip
    blocks = np.fromfile(folder / "tokens.bin", dtype=np.uint16).reshape(-1, SEQ_LEN)
    assert blocks.shape == (meta["blocks"], SEQ_LEN)
    assert blocks.ravel().tolist() == ids[: blocks.size]  # in order, nothing added or lost
    assert not list(folder.glob("*.tmp"))


def test_make_tiny_model_says_what_it_made(tmp_path):
    out = run([sys.executable, LLM / "make_tiny_model.py", "--text", CORPUS, "--layers", "1"],
              cwd=tmp_path).stdout  # fmt: skip
    # One layer less than the tests' model: 4 projections of 128 x 128, 3 of 128 x 256, 2 norms.
    layer = 4 * 128 * 128 + 3 * 128 * 256 + 2 * 128
    assert out == (f"tiny Llama: {405_120 - layer:,} parameters (decoder layers: 1), a "
                   "vocabulary of 300, 256 positions; saved to tiny-model\n")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "tiny-model").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]  # fmt: skip
    again = run([sys.executable, LLM / "make_tiny_model.py", "--text", CORPUS], cwd=tmp_path,
                expect_rc=2)  # fmt: skip
    assert again.stderr.endswith("argument --output-dir: tiny-model holds a model already: choose "
                                 "another folder\n")  # fmt: skip


def test_jsonl_documents_are_separated_by_end_of_text(tiny_llm, tmp_path):
    lines = CORPUS.read_text().splitlines()
    documents = [" ".join(lines[:12]), " ".join(lines[12:])]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    out = run([sys.executable, PREPARE, "--model", tiny_llm, "--input", "docs.jsonl",
               "--seq-len", "16"], cwd=tmp_path).stdout  # fmt: skip
    assert out.startswith("2 documents, ")
    tokenizer = Tokenizer.from_file(str(tiny_llm / "tokenizer.json"))
    first = tokenizer.encode(documents[0]).ids
    ids = np.fromfile(tmp_path / "tokens" / "tokens.bin", dtype=np.uint16).tolist()
    assert ids[len(first)] == tokenizer.token_to_id("</s>") and ids[: len(first)] == first


def test_lora_trains_only_the_adapters_and_the_loss_falls(trained):
    _, out = trained
    assert f"llama, 421,504 parameters, {TRAINABLE:,} trainable (LoRA rank 8 on q_proj, k_proj, " \
        "v_proj, o_proj), cpu, float32" in out  # fmt: skip
    assert f"global batch 8 sequences of {SEQ_LEN} tokens = 2 micro-batches of 4" in out
    losses = [float(x) for x in re.findall(r"^step \d+/4: loss (\S+), [\d,]+ tokens/s$", out, re.M)]
    assert len(losses) == STEPS and losses[-1] < losses[0], out
    assert "no checkpoint in checkpoints: starting from scratch" in out


def test_the_merged_model_is_the_model_with_its_adapter(tiny_llm, trained):
    """from_pretrained(merged) gives the logits of the base model with the adapter applied by
    PEFT, and they differ from the base model's: the merge kept what training learned."""
    folder, _ = trained
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        ".lock", "checkpoint-00000003", "checkpoint-00000004"]  # --keep 2  # fmt: skip
    check = (
        "import sys, torch\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n"
        "base, out = sys.argv[1], sys.argv[2]\n"
        "ids = torch.arange(3, 35).reshape(2, 16)\n"
        "merged = AutoModelForCausalLM.from_pretrained(out + '/merged')(ids).logits\n"
        "model = AutoModelForCausalLM.from_pretrained(base)\n"
        "plain = model(ids).logits\n"
        "adapted = PeftModel.from_pretrained(model, out + '/adapter')(ids).logits\n"
        "print(torch.allclose(merged, adapted, atol=1e-5), torch.allclose(merged, plain))\n"
    )
    out = run([sys.executable, "-c", check, tiny_llm, folder / "lora-out"], cwd=folder).stdout
    assert out.split()[-2:] == ["True", "False"], out
    assert (folder / "lora-out" / "merged" / "tokenizer.json").is_file()


def test_sigusr1_saves_exits_75_and_the_next_run_ends_as_if_never_stopped(
    tiny_llm, tokens, trained, tmp_path
):
    """A requeue signal (after step 2, from an optimizer hook) saves a checkpoint after the
    step under way and exits 75; the run that follows resumes there and ends with the adapter,
    bit for bit, of the uninterrupted run."""
    args = [*SHORT, "--model", tiny_llm, "--tokens", tokens[0], "--steps", STEPS]
    out = run([sys.executable, signal_after(tmp_path), 2, LORA, *args], cwd=tmp_path,
              timeout=180, expect_rc=75).stdout  # fmt: skip
    assert out.endswith("SIGUSR1 received: stopped after step 2 of 4, checkpoint saved; run "
                        "again to resume\n"), out  # fmt: skip
    assert "saved checkpoints/checkpoint-00000002" in out and "step 3/4" not in out, out
    again = run([sys.executable, LORA, *args], cwd=tmp_path, timeout=180).stdout
    assert "resumed from checkpoints/checkpoint-00000002 after 2 steps" in again, again
    assert digest(again) == digest(trained[1])


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tiny_llm, tokens, trained, tmp_path):
    shutil.copytree(trained[0] / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / ".lock").unlink()
    state = tmp_path / "checkpoints" / "checkpoint-00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # cut short, as by a crash outside the rename
    args = [*SHORT, "--model", tiny_llm, "--tokens", tokens[0], "--steps", STEPS]
    proc = run([sys.executable, LORA, *args], cwd=tmp_path, timeout=180)
    assert proc.stderr.startswith("finetune_lora.py: warning: skipped checkpoints/checkpoint-"
                                  "00000004 (")  # fmt: skip
    assert "resuming from checkpoints/checkpoint-00000003" in proc.stderr
    assert "resumed from checkpoints/checkpoint-00000003 after 3 steps" in proc.stdout
    assert digest(proc.stdout) == digest(trained[1])


def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_checkpoint(
    tiny_llm, tokens, tmp_path
):
    """The checkpoint folder is a tmpfs where one checkpoint fits (about 200 kB), not two."""
    (tmp_path / "checkpoints").mkdir()
    command = [sys.executable, LORA, *SHORT, "--model", tiny_llm, "--tokens", tokens[0],
               "--steps", STEPS, "--keep", "3"]  # fmt: skip
    shell = ('mount -t tmpfs -o size=300k tmpfs checkpoints && "$@"; status=$?; '
             "ls checkpoints; exit $status")  # fmt: skip
    proc = subprocess.run([*private_mount_namespace(), "sh", "-c", shell, "sh", *map(str, command)],
                          cwd=tmp_path, env=example_env(), capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("finetune_lora.py: error: cannot write checkpoints/checkpoint-0000")
    assert "no space left" in lines[0] and "written before are intact" in lines[0]
    assert "checkpoint-00000001\n" in proc.stdout and ".tmp" not in proc.stdout, proc.stdout


def test_a_second_run_on_the_folder_is_refused_at_once(tiny_llm, tokens, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\nlock = open(sys.argv[1], 'a+')\n"
         "fcntl.lockf(lock, fcntl.LOCK_EX)\nlock.write('job 77, process 1 on n1')\nlock.flush()\n"
         "print('held', flush=True)\ntime.sleep(60)\n", tmp_path / "checkpoints" / ".lock"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        proc = run([sys.executable, LORA, "--model", tiny_llm, "--tokens", tokens[0]],
                   cwd=tmp_path, expect_rc=2)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert proc.stderr.startswith("finetune_lora.py: error: checkpoints is in use by job 77, "
                                  "process 1 on n1: wait for that run to end")  # fmt: skip


def edited_tokens(tokens, folder, **changes):
    """A copy of the tokens with meta.json changed (and tokens.bin cut to fit its size)."""
    shutil.copytree(tokens, folder)
    meta = {**json.loads((tokens / "meta.json").read_text()), **changes}
    (folder / "meta.json").write_text(json.dumps(meta))
    size = meta["blocks"] * meta["seq_len"] * 2
    (folder / "tokens.bin").write_bytes((tokens / "tokens.bin").read_bytes()[:size])
    return folder


def test_tokens_of_another_tokenizer_are_refused(tiny_llm, tokens, tmp_path):
    other = edited_tokens(tokens[0], tmp_path / "other", tokenizer_sha256="0" * 64, model="gpt2")
    proc = run([sys.executable, LORA, "--device", "cpu", "--model", tiny_llm, "--tokens", other],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        f"finetune_lora.py: error: the tokens were made with another tokenizer than {tiny_llm}'s "
        f"(made for gpt2): tokenize again with prepare_tokens.py --model {tiny_llm}\n"
    )


def test_blocks_longer_than_the_model_s_context_are_refused(tiny_llm, tokens, tmp_path):
    long = edited_tokens(tokens[0], tmp_path / "long", seq_len=512, blocks=2)
    proc = run([sys.executable, LORA, "--device", "cpu", "--model", tiny_llm, "--tokens", long],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    limit = SIZES["max_position_embeddings"]
    assert proc.stderr == (
        f"finetune_lora.py: error: the tokens are blocks of 512, longer than the {limit} "
        f"positions of {tiny_llm}: make them again with a --seq-len of {limit} or less\n"
    )


def test_a_target_module_the_model_lacks_is_named(tiny_llm, tokens, tmp_path):
    args = ["--device", "cpu", "--model", tiny_llm, "--tokens", tokens[0],
            "--target-modules", "q_proj", "query_key_value"]  # fmt: skip
    proc = run([sys.executable, LORA, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "finetune_lora.py: error: --target-modules query_key_value: no such linear layer in this "
        "model; it has down_proj gate_proj k_proj lm_head o_proj q_proj up_proj v_proj\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--global-batch", "6", "--micro-batch", "4"],
         "--global-batch 6 is not a multiple of --micro-batch 4"),
        (["--tokens", "nothing"],
         "nothing holds no tokens (no meta.json): make them on a login node with "
         "prepare_tokens.py, or pass --tokens"),
    ],
    ids=["global-batch", "no-tokens"],
)  # fmt: skip
def test_bad_input_stops_in_one_line(tiny_llm, tmp_path, args, message):
    proc = run([sys.executable, LORA, "--device", "cpu", "--model", tiny_llm, *args],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr == f"finetune_lora.py: error: {message}\n"


def test_damaged_tokens_are_refused(tiny_llm, tokens, tmp_path):
    shutil.copytree(tokens[0], tmp_path / "cut")
    data = tmp_path / "cut" / "tokens.bin"
    data.write_bytes(data.read_bytes()[:-2])
    proc = run([sys.executable, LORA, "--device", "cpu", "--model", tiny_llm, "--tokens", "cut"],
               cwd=tmp_path, expect_rc=2)  # fmt: skip
    assert proc.stderr.startswith("finetune_lora.py: error: cut/tokens.bin is ")
    assert (
        "it is damaged or incomplete; make the tokens again with prepare_tokens.py" in proc.stderr
    )


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    for script in (PREPARE, LORA):
        args = (
            ["--model", "empty", "--input", CORPUS] if script == PREPARE else ["--model", "empty"]
        )
        proc = run([sys.executable, script, *args], cwd=tmp_path, expect_rc=2)
        assert proc.stderr == (
            f"{script.name}: error: empty holds no config.json: not a Hugging Face model folder "
            "(give the folder that hf download filled, or the model's Hub name)\n"
        )


def test_a_model_missing_from_the_cache_names_the_download_at_once(tmp_path):
    """Offline, with an empty cache: one line with the command, within seconds, no retries."""
    env = example_env(HF_HOME=tmp_path / "hf")
    start = time.monotonic()
    proc = run([sys.executable, LORA, "--device", "cpu", "--model", "Qwen/Qwen2.5-0.5B"],
               cwd=tmp_path, env=env, expect_rc=2)  # fmt: skip
    assert time.monotonic() - start < 30
    assert proc.stderr == (
        f"finetune_lora.py: error: Qwen/Qwen2.5-0.5B is not in the Hugging Face cache "
        f"{tmp_path / 'hf' / 'hub'}: download it on a login node with: hf download "
        "Qwen/Qwen2.5-0.5B (HF_HOME set as in your jobs)\n"
    )


def test_prepare_refuses_a_block_longer_than_the_model_s_context(tiny_llm, tmp_path):
    args = ["--model", tiny_llm, "--input", CORPUS, "--seq-len", "4096"]
    proc = run([sys.executable, PREPARE, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        f"prepare_tokens.py: error: --seq-len 4096 is longer than the "
        f"{SIZES['max_position_embeddings']} positions {tiny_llm} was trained for\n"
    )
    assert not (tmp_path / "tokens").exists()


def test_prepare_refuses_a_model_whose_tokenizer_is_larger(tiny_llm, tmp_path):
    shutil.copytree(tiny_llm, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    args = ["--model", "model", "--input", CORPUS, "--seq-len", "32"]
    proc = run([sys.executable, PREPARE, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "prepare_tokens.py: error: the tokenizer of model has 300 tokens but the model only 200 "
        "embeddings: they do not belong together\n"
    )


def test_prepare_never_overwrites_tokens(tokens):
    folder = tokens[0]
    proc = run([sys.executable, PREPARE, "--model", "m", "--input", CORPUS, "--output-dir", folder],
               cwd=folder.parent, expect_rc=2)  # fmt: skip
    assert proc.stderr.endswith(f"argument --output-dir: {folder} already holds tokens: remove "
                                "them first, or choose another folder\n")  # fmt: skip


def test_requirements_pin_the_versions_the_tests_ran():
    """examples/llm/requirements.txt, which the models page has readers install, names the
    versions of the Hugging Face libraries that these tests import."""
    pins = re.findall(r"^([\w-]+)==(\S+)$", (LLM / "requirements.txt").read_text(), re.M)
    assert len(pins) == 6
    for name, version in pins:
        assert importlib.metadata.version(name) == version, name


@pytest.mark.gpu
def test_lora_on_the_gpu_in_bfloat16(tiny_llm, tokens, tmp_path):
    """--device cuda: the model in bfloat16 on the GPU, which the script names; the loss falls."""
    args = [*SHORT[2:], "--device", "cuda", "--model", tiny_llm, "--tokens", tokens[0],
            "--steps", STEPS]  # fmt: skip
    out = run([sys.executable, LORA, *args], cwd=tmp_path, timeout=300).stdout
    assert re.search(r"^GPU in use: \S+ \(.+\) on \S+$", out, re.M), out
    assert f"{TRAINABLE:,} trainable (LoRA rank 8 on q_proj, k_proj, v_proj, o_proj), cuda, " \
        "bfloat16" in out  # fmt: skip
    losses = [float(x) for x in re.findall(r"^step \d+/4: loss (\S+), [\d,]+ tokens/s$", out, re.M)]
    assert len(losses) == STEPS and losses[-1] < losses[0], out
    assert (tmp_path / "lora-out" / "merged" / "model.safetensors").is_file()
