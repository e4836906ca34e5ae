"""examples/llm/finetune_fsdp2.py: full fine-tuning with FSDP2 on the tiny Llama (tests/tiny_llm.py)
and its tokens, on CPUs with gloo, as torchrun starts it: training, a global batch that stays
the same whatever the processes, checkpoints and requeue signals, the exported model, bad input.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (
    EXAMPLES,
    TORCHRUN,
    example_env,
    free_port,
    launch,
    private_mount_namespace,
    run,
    tiny_tokens_folder,
)
from tiny_llm import signal_after

SCRIPT = EXAMPLES / "llm" / "finetune_fsdp2.py"
# Four optimizer steps of 8 sequences of 32 tokens; with two processes, two micro-batches of 2
# each, whose gradients are reduce-scattered once per step. A checkpoint every second step.
SHORT = ["--device", "cpu", "--steps", "4", "--global-batch", "8", "--micro-batch", "2",
         "--lr", "0.002", "--warmup-steps", "1", "--log-every", "1", "--checkpoint-every", "2",
         "--seed", "1", "--defer-gradient-sync"]  # fmt: skip
STEP = re.compile(r"^step (\d+)/(\d+): loss (\S+), [\d,]+ tokens/s$", re.M)


@pytest.fixture(scope="module")
def model_and_tokens(tiny_llm):
    return tiny_llm, tiny_tokens_folder()


def torchrun(folder, args, world=2, script=SCRIPT, **variables):
    """Start world processes as torchrun does (RANK, WORLD_SIZE, ...): [(rc, stdout, stderr)]."""
    return launch([sys.executable, script, *map(str, args)], cwd=folder, world=world,
                  launcher="torchrun", timeout=180, **variables)  # fmt: skip


def finished(results):
    """Rank 0's output of a run in which every process exited 0."""
    assert all(rc == 0 for rc, _, _ in results), results
    return results[0][1]


def digest(out):
    return re.search(r"weights sha256 (\w+)$", out, re.M)[1]


@pytest.fixture(scope="module")
def trained(model_and_tokens, tmp_path_factory):
    """(folder, rank 0's output) of a two-process run that was never interrupted."""
    model, tokens = model_and_tokens
    folder = tmp_path_factory.mktemp("fsdp2")
    out = finished(torchrun(folder, [*SHORT, "--model", model, "--tokens", tokens]))
    return folder, out


def test_two_processes_shard_the_model_and_the_loss_falls(trained):
    folder, out = trained
    assert "2 processes on 1 node(s) (" in out and ", cpu (gloo), compute in float32, " \
        "activation checkpointing on" in out  # fmt: skip
    # 421,504 parameters in two decoder layers, the embeddings, the output layer and the norms;
    # the last rows of a tensor that does not split evenly go to rank 1.
    held = re.search(r"^llama, ([\d,]+) parameters, all trained: 2 decoder layers sharded over "
                     r"2 processes, rank 0 holds ([\d,]+)$", out, re.M)  # fmt: skip
    total, mine = (int(group.replace(",", "")) for group in held.groups())
    assert total // 2 <= mine <= total // 2 + 256, out
    assert "global batch 8 sequences of 32 tokens = 2 processes x 2 micro-batches of 2" in out
    assert "no checkpoint in checkpoints: starting from the model" in out
    losses = [float(loss) for _, _, loss in STEP.findall(out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out
    for step in (2, 4):
        assert f"saved checkpoints/checkpoint-0000000{step}\n" in out
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        ".lock", "checkpoint-00000002", "checkpoint-00000004"]  # fmt: skip
    assert re.search(r"^wrote finetuned \([\d.]+ MiB, float32\): weights sha256 \w{16}$", out,
                     re.M), out  # fmt: skip
    assert not list(folder.glob("*.tmp")) and not list((folder / "checkpoints").glob("*.tmp"))


# Loads the exported folder and the model it started from with from_pretrained: the weights
# differ, and the loss on the training blocks is lower.
CHECK_EXPORT = """
import sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer

exported, base, tokens = sys.argv[1:]
meta_blocks = np.fromfile(tokens + "/tokens.bin", dtype=np.uint16).reshape(-1, 32)
batch = torch.from_numpy(meta_blocks[:16].astype("int64"))
losses, weights = [], []
for folder in (exported, base):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        losses.append(model(input_ids=batch, labels=batch).loss.item())
    weights.append(model.model.layers[0].mlp.up_proj.weight.clone())
print("dtype", model.dtype, "changed", not torch.equal(*weights), "losses", *losses)
print("tokenizer", len(AutoTokenizer.from_pretrained(exported)))
"""


def test_the_exported_folder_loads_with_from_pretrained_and_learned(
    trained, model_and_tokens, tmp_path
):
    folder, _ = trained
    model, tokens = model_and_tokens
    (tmp_path / "llm").mkdir()  # the language-model scripts' zygote, which has transformers
    (tmp_path / "llm" / "check.py").write_text(CHECK_EXPORT)
    out = run([sys.executable, tmp_path / "llm" / "check.py", folder / "finetuned", model, tokens],
              cwd=tmp_path).stdout  # fmt: skip
    found = re.search(r"^dtype torch.float32 changed True losses (\S+) (\S+)$", out, re.M)
    assert found and float(found[1]) < float(found[2]), out
    assert "tokenizer 300" in out
    assert sorted(p.name for p in (folder / "finetuned").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]  # fmt: skip


def test_the_global_batch_is_the_same_with_one_process_or_two(trained, model_and_tokens, tmp_path):
    """The run of two processes (two micro-batches of 2 each) again with one process, in two
    micro-batches of 4, their gradients reduce-scattered after each (without
    --defer-gradient-sync): the same 8 sequences in each step, the same first loss, and the
    same weights at the end, up to rounding."""
    from safetensors.torch import load_file  # noqa: PLC0415 (only this test reads weights)

    model, tokens = model_and_tokens
    args = [*SHORT[:-1], "--model", model, "--tokens", tokens, "--micro-batch", "4"]
    out = finished(torchrun(tmp_path, args, world=1))
    said = "global batch 8 sequences of 32 tokens = "
    assert f"{said}1 process x 2 micro-batches of 4\n" in out
    assert f"{said}2 processes x 2 micro-batches of 2\n" in trained[1]
    assert STEP.search(out)[3] == STEP.search(trained[1])[3]  # the loss of step 1, to 4 places
    one, two = (load_file(folder / "finetuned" / "model.safetensors")
                for folder in (tmp_path, trained[0]))  # fmt: skip
    assert one.keys() == two.keys()
    for name in one:
        assert (one[name] - two[name]).abs().max() < 1e-5, name


def test_a_signal_saves_exits_75_and_the_next_run_ends_as_if_never_stopped(
    trained, model_and_tokens, tmp_path
):
    """SIGUSR1 reaches rank 0 only, after step 2: every process saves after that step and
    exits 75; the run started again resumes there and ends with the weights, bit for bit, of
    the run that never stopped."""
    model, tokens = model_and_tokens
    args = [*SHORT, "--model", model, "--tokens", tokens]
    results = launch([sys.executable, signal_after(tmp_path), 2, SCRIPT, *args],
                     cwd=tmp_path, world=2, launcher="torchrun", timeout=180)  # fmt: skip
    assert [rc for rc, _, _ in results] == [75, 75], results
    out = results[0][1]
    assert "saved checkpoints/checkpoint-00000002\n" in out
    assert out.endswith("SIGUSR1: checkpoint saved after step 2 of 4; run again to resume\n"), out
    assert "step 3/4" not in out and not (tmp_path / "finetuned").exists()
    again = finished(torchrun(tmp_path, args))
    assert "resumed from checkpoints/checkpoint-00000002, saved by 2 processes after 2 steps" \
        in again  # fmt: skip
    assert [int(step) for step, _, _ in STEP.findall(again)] == [3, 4]
    assert digest(again) == digest(trained[1])


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(trained, model_and_tokens, tmp_path):
    model, tokens = model_and_tokens
    shutil.copytree(trained[0] / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / ".lock").unlink()
    # Rank 1's shards cut short (outside a rename): the metadata and the options, in rank 0's
    # file, read well; loading fails on every rank, which go back to the checkpoint before.
    shard = tmp_path / "checkpoints" / "checkpoint-00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    results = torchrun(tmp_path, [*SHORT, "--model", model, "--tokens", tokens])
    out, err = finished(results), results[0][2]
    skipped = "finetune_fsdp2.py: warning: skipped checkpoints/checkpoint-00000004 ("
    assert err.startswith(skipped), err
    assert err.rstrip().endswith("; trying checkpoints/checkpoint-00000002"), err
    assert "resumed from checkpoints/checkpoint-00000002, saved by 2 processes after 2 steps" in out
    assert digest(out) == digest(trained[1])


def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_checkpoint(
    model_and_tokens, tmp_path
):
    """The checkpoint folder is a tmpfs where one checkpoint of one process fits (about 5 MB),
    not two: the save of step 4 fails, the run stops in one line, step 2's checkpoint stays."""
    model, tokens = model_and_tokens
    (tmp_path / "checkpoints").mkdir()
    command = [sys.executable, SCRIPT, *SHORT, "--model", model, "--tokens", tokens]
    shell = ('mount -t tmpfs -o size=7m tmpfs checkpoints && "$@"; status=$?; '
             "ls -a checkpoints; exit $status")  # fmt: skip
    env = example_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port(), OMP_NUM_THREADS=1)  # fmt: skip
    proc = subprocess.run([*private_mount_namespace(), "sh", "-c", shell, "sh", *map(str, command)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                          check=False)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.fullmatch(
        r"finetune_fsdp2\.py: error: cannot write checkpoints/checkpoint-00000004: no space left "
        r"\(the file system (or your quota )?is full\); the checkpoints written before are intact: "
        r"free some space \(df -h, or your centre's quota command\) and run again",
        lines[0],
    ), lines  # (the errno is lost in a short write: the free space says it)
    assert proc.stdout.endswith("\n.\n..\n.lock\ncheckpoint-00000002\n"), proc.stdout


def test_a_run_with_other_options_is_refused(trained, model_and_tokens, tmp_path):
    model, tokens = model_and_tokens
    shutil.copytree(trained[0] / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / ".lock").unlink()
    args = [*SHORT, "--model", model, "--tokens", tokens, "--lr", "0.01"]
    [(rc, out, err)] = torchrun(tmp_path, args, world=1)
    assert rc == 2 and err == (
        "finetune_fsdp2.py: error: checkpoints/checkpoint-00000004 was written with other "
        "options: lr 0.002 (now 0.01); resume with the same options (the number of processes "
        "and --micro-batch may change), or use another --checkpoint-dir\n"
    ), err


def test_a_second_run_on_the_checkpoint_folder_is_refused(model_and_tokens, tmp_path):
    model, tokens = model_and_tokens
    (tmp_path / "checkpoints").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\nlock = open(sys.argv[1], 'a+')\n"
         "fcntl.lockf(lock, fcntl.LOCK_EX)\nlock.write('job 77, process 1 on n1')\nlock.flush()\n"
         "print('held', flush=True)\ntime.sleep(60)\n", tmp_path / "checkpoints" / ".lock"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        [(rc, _, err)] = torchrun(tmp_path, [*SHORT, "--model", model, "--tokens", tokens], 1)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    refused = "finetune_fsdp2.py: error: checkpoints is in use by job 77, process 1 on n1: wait"
    assert rc == 2 and err.startswith(refused), err


def edited_tokens(tokens, folder, **changes):
    """A copy of the tokens with meta.json changed (and tokens.bin cut to fit its size)."""
    shutil.copytree(tokens, folder)
    meta = {**json.loads((tokens / "meta.json").read_text()), **changes}
    (folder / "meta.json").write_text(json.dumps(meta))
    size = meta["blocks"] * meta["seq_len"] * 2
    (folder / "tokens.bin").write_bytes((tokens / "tokens.bin").read_bytes()[:size])
    return folder


def bad_tokens(kind, tokens, folder):
    if kind == "other-tokenizer":
        return edited_tokens(tokens, folder / "other", tokenizer_sha256="0" * 64, model="gpt2")
    if kind == "too-long":
        return edited_tokens(tokens, folder / "long", seq_len=512, blocks=2)
    if kind == "damaged":
        shutil.copytree(tokens, folder / "cut")
        (folder / "cut" / "tokens.bin").write_bytes((tokens / "tokens.bin").read_bytes()[:-2])
        return folder / "cut"
    return folder / "nothing"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "--device cuda but no GPU is visible: request GPUs (Slurm: "
         "--gpus-per-node=N, PBS: ngpus=N in -l select, Grid Engine: -l gpu=N)"),
        (["--model", "empty"], "empty holds no config.json: not a Hugging Face model folder "
         "(give the folder that hf download filled, or the model's Hub name)"),
        (["--tokens", "nothing"], "nothing holds no tokens (no meta.json): make them on a login "
         "node with prepare_tokens.py, or pass --tokens"),
        (["--tokens", "damaged"], "cut/tokens.bin is 2,878 bytes, meta.json says 2,880: it is "
         "damaged or incomplete; make the tokens again with prepare_tokens.py"),
        (["--tokens", "other-tokenizer"], "the tokens were made with another tokenizer than "
         "{model}'s (made for gpt2): tokenize again with prepare_tokens.py --model {model}"),
        (["--tokens", "too-long"], "the tokens are blocks of 512, longer than the 256 positions "
         "of {model}: make them again with a --seq-len of 256 or less"),
    ],
    ids=["no-gpu", "not-a-model", "no-tokens", "damaged-tokens", "other-tokenizer", "too-long"],
)  # fmt: skip
def test_bad_input_stops_in_one_line(model_and_tokens, tmp_path, args, message):
    model, tokens = model_and_tokens
    (tmp_path / "empty").mkdir()
    argv = ["--device", "cpu", "--model", model, "--tokens", tokens, *args]
    if args[0] == "--tokens":
        argv[-1] = bad_tokens(args[1], tokens, tmp_path).relative_to(tmp_path)
    [(rc, out, err)] = torchrun(tmp_path, argv, world=1)
    assert (rc, out) == (2, "") and err == (
        f"finetune_fsdp2.py: error: {message.format(model=model)}\n"
    ), err


def test_a_global_batch_that_does_not_split_names_all_three_numbers(tmp_path):
    results = torchrun(tmp_path, ["--global-batch", "6", "--micro-batch", "2"], world=2)
    assert [rc for rc, _, _ in results] == [2, 2]
    for _, _, err in results:
        assert err == (
            "finetune_fsdp2.py: error: --global-batch 6 does not split into 2 processes x "
            "--micro-batch 2: make it a multiple of 4, or change --micro-batch\n"
        )


def test_without_torchrun_the_missing_variables_are_named(tmp_path):
    proc = run([sys.executable, SCRIPT, "--device", "cpu"], cwd=tmp_path, env=example_env(),
               expect_rc=2)  # fmt: skip
    assert proc.stderr == (
        "finetune_fsdp2.py: error: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not "
        "set: start this script with torchrun (see finetune_fsdp2.sbatch)\n"
    )


@pytest.mark.gpu
def test_fsdp2_on_the_gpus_in_bfloat16(model_and_tokens, tmp_path):
    """torchrun with one process per GPU of the machine: nccl, the layers in bfloat16, every
    process names its GPU, and the loss falls."""
    gpus = torch.cuda.device_count()
    model, tokens = model_and_tokens
    args = ["--device", "cuda", "--model", model, "--tokens", tokens, "--steps", "4",
            "--global-batch", str(8 * gpus), "--micro-batch", "2", "--log-every", "1"]  # fmt: skip
    out = run([*TORCHRUN, f"--nproc-per-node={gpus}", SCRIPT, *args], cwd=tmp_path,
              timeout=600).stdout  # fmt: skip
    assert len(re.findall(r"^GPU in use: ", out, re.M)) == gpus, out
    assert f"{gpus} process" in out and ", cuda (nccl), compute in bfloat16, " in out, out
    losses = [float(loss) for _, _, loss in STEP.findall(out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out
