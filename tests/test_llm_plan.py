"""examples/llm/plan_memory.py: the planner's figures against the tiny model's real ones.

The parameter counts come from the model's safetensors file, the FSDP2 state from the bytes
each rank of a real two-process FSDP2 run holds (tests/llm/fsdp2_holdings.py), and every
refusal ends in one line with the exit code the page documents.
"""

import importlib.metadata
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import EXAMPLES, TESTS, example_env, launch, run

PLANNER = EXAMPLES / "llm" / "plan_memory.py"
HOLDINGS = TESTS / "llm" / "fsdp2_holdings.py"
SEQ_LEN = 64  # the tiny model has 256 positions
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the planner's default LoRA targets


def plan(model, *options, cwd, env=None, expect_rc=0):
    """(the planner's JSON, the process) for the model with these options."""
    cmd = [sys.executable, PLANNER, "--model", model, "--seq-len", SEQ_LEN, "--json", *options]
    proc = run(cmd, cwd=cwd, env=env, expect_rc=expect_rc)
    return json.loads(proc.stdout), proc


def tensor_shapes(folder):
    """{name: shape} of every tensor in the model's safetensors file, read from its header
    (8 bytes of length, then JSON): the real model, not the planner's meta-device copy."""
    with open(folder / "model.safetensors", "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def shown(count):
    """Bytes as the planner's table shows them (GiB, MiB, KiB with one decimal)."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= factor:
            return f"{count / factor:.1f} {unit}"
    return f"{count} B"


@pytest.fixture(scope="module")
def two_gpus(tiny_llm, tmp_path_factory):
    """The planner's JSON for the tiny model on two GPUs, all methods: shared by the tests."""
    figures, _ = plan(tiny_llm, "--gpus", 2, cwd=tmp_path_factory.mktemp("plan"))
    return figures


def test_table_for_the_tiny_model(tiny_llm, two_gpus, tmp_path):
    parameters = sum(math.prod(shape) for shape in tensor_shapes(tiny_llm).values())
    ddp, fsdp2 = (two_gpus["methods"][name]["total"] for name in ("ddp", "fsdp2"))
    assert fsdp2 < ddp
    memory = (ddp + fsdp2) / 2  # room for FSDP2's shards, not for DDP's full copy
    cmd = [sys.executable, PLANNER, "--model", tiny_llm, "--seq-len", SEQ_LEN, "--gpus", 2,
           "--gpu-memory", memory / 2**30]  # fmt: skip
    out = run(cmd, cwd=tmp_path).stdout
    assert f"LlamaForCausalLM, {parameters:,} parameters, 2 decoder layers" in out
    # The state rows: DDP 4, 4 and 8 bytes a parameter; FSDP2 the same over 2 GPUs.
    for label, per_parameter in (("weights", 4), ("gradients", 4), ("AdamW state", 8)):
        row = re.search(rf"^{label} +(\S+ \S+) +(\S+ \S+) ", out, re.M)
        assert row, f"no {label} row in:\n{out}"
        assert row.groups() == (shown(per_parameter * parameters),
                                shown(per_parameter * parameters // 2)), out  # fmt: skip
    assert "DDP: does not fit: needs" in out
    assert "FSDP2: fits: needs" in out
    assert "recommended: FSDP2" in out


def test_ddp_and_lora_figures_count_the_real_tensors(tiny_llm, two_gpus):
    shapes = tensor_shapes(tiny_llm)
    parameters = sum(math.prod(shape) for shape in shapes.values())
    rank = two_gpus["lora_rank"]
    # LoRA adds rank x (inputs + outputs) beside each attention projection of every layer.
    adapters = sum(rank * sum(shape) for name, shape in shapes.items()
                   if name.endswith(tuple(f"{target}.weight" for target in ATTENTION)))  # fmt: skip
    assert two_gpus["parameters"] == parameters
    assert two_gpus["adapter_parameters"] == adapters
    ddp, lora = two_gpus["methods"]["ddp"], two_gpus["methods"]["lora"]
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer"]) == (
        4 * parameters, 4 * parameters, 8 * parameters)  # fmt: skip
    # bfloat16 frozen weights; float32 adapters with their gradients and AdamW state.
    assert (lora["weights"], lora["gradients"], lora["optimizer"]) == (
        2 * parameters + 4 * adapters, 4 * adapters, 8 * adapters)  # fmt: skip
    assert two_gpus["recommended"] == "ddp"


def test_fsdp2_state_is_what_each_rank_holds(tiny_llm, two_gpus, tmp_path):
    """The planner's FSDP2 weights, gradients and AdamW state per GPU, against a real run.

    Within 2 %: AdamW keeps a float32 step counter per parameter (a few bytes per tensor) that
    the planner leaves out, and where a parameter's first dimension does not divide by the
    number of GPUs, FSDP2 pads the shards: the planner counts the largest, padded shard,
    to_local() the rows a rank really has. Both are far below 2 % of the state."""
    results = launch([sys.executable, HOLDINGS, tiny_llm], cwd=tmp_path, world=2,
                     launcher="torchrun", timeout=180)  # fmt: skip
    for code, out, err in results:
        assert code == 0, f"fsdp2_holdings.py exited {code}\n{out}\n{err}"
    held = json.loads(results[0][1])
    one, _ = plan(tiny_llm, "--gpus", 1, "--method", "fsdp2", cwd=tmp_path)
    assert two_gpus["parameters"] == held["parameters"]
    for key in ("weights", "gradients", "optimizer"):
        ranks = [rank[key] for rank in held["ranks"]]
        planned = two_gpus["methods"]["fsdp2"][key]
        assert planned == pytest.approx(max(ranks), rel=0.02), (key, planned, ranks)
        # Each rank holds half of the state: on one GPU, the planner counts all of it.
        assert sum(ranks) == pytest.approx(one["methods"]["fsdp2"][key], rel=0.02), key
        assert one["methods"]["fsdp2"][key] > 1.9 * max(ranks), key
    assert held["ranks"][0]["weights"] == 4 * held["parameters"] // 2  # float32, halved


def test_hub_name_in_the_cache(tiny_llm, two_gpus, tmp_path):
    """A Hub name resolves to its config.json in the cache that HF_HOME names (the tests' own:
    example_env()), laid out as hf download leaves it: refs/main names a snapshot. The name
    carries the tiny model's key: a changed model gets an entry of its own."""
    name = f"pytorch-on-hpc-tests/{tiny_llm.name}"
    repo = Path(example_env()["HF_HOME"], "hub", "models--" + name.replace("/", "--"))
    if not repo.is_dir():
        repo.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".plan-memory-", dir=repo.parent))
        commit = "0123456789abcdef0123456789abcdef01234567"
        (staging / "refs").mkdir()
        (staging / "refs" / "main").write_text(commit)
        (staging / "snapshots" / commit).mkdir(parents=True)
        shutil.copy(tiny_llm / "config.json", staging / "snapshots" / commit)
        try:
            os.rename(staging, repo)
        except OSError:  # another test run was first: use its copy
            shutil.rmtree(staging)
    from_hub, _ = plan(name, "--gpus", 2, cwd=tmp_path)
    assert from_hub["model"] == name
    assert from_hub["methods"] == two_gpus["methods"]


@pytest.mark.parametrize("case", ["no config.json", "unknown model type", "not in the cache",
                                  "sequence too long", "does not fit"])  # fmt: skip
def test_refusals_end_in_one_line(case, tiny_llm, tmp_path):
    env, expect_rc, options = None, 2, []
    if case == "no config.json":
        model = tmp_path / "not-a-model"
        model.mkdir()
        line = (
            f"plan_memory.py: error: {model} holds no config.json: not a Hugging Face model "
            "folder (give the folder that hf download filled, or the model's Hub name)"
        )
    elif case == "unknown model type":
        model = tmp_path / "odd-model"
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
        line = (
            f"plan_memory.py: error: {model / 'config.json'} is not a model configuration "
            f"transformers {importlib.metadata.version('transformers')} can read ("
        )  # then transformers' own first line
    elif case == "not in the cache":
        model, cache = "some-org/some-model", tmp_path / "empty-hf-home"
        env = example_env(HF_HOME=cache)
        line = (f"plan_memory.py: error: some-org/some-model is not in the Hugging Face cache "
                f"{cache / 'hub'}: on a login node, with HF_HOME pointing at the shared cache, "
                "run: hf download some-org/some-model config.json (and set the same HF_HOME "
                "here)")  # fmt: skip
    elif case == "sequence too long":
        model, options = tiny_llm, ["--seq-len", 257]
        line = (
            f"plan_memory.py: error: --seq-len 257 is above the 256 positions of {model} "
            "(max_position_embeddings in its config.json)"
        )
    else:  # 1 MiB per GPU: nothing fits; the line says by how much and what to change
        model, expect_rc, options = tiny_llm, 1, ["--method", "ddp", "--gpu-memory", 2**-10]
    if case == "does not fit":
        figures, proc = plan(model, *options, cwd=tmp_path, expect_rc=1)
        needed = figures["methods"]["ddp"]["total"]
        line = (
            f"plan_memory.py: DDP needs {shown(needed)} per GPU, {shown(needed - 2**20)} "
            "more than the 1.0 MiB of a GPU: try LoRA (--method lora), or a shorter "
            "--seq-len or a smaller --micro-batch"
        )
    else:
        cmd = [sys.executable, PLANNER, "--model", model, *options]
        proc = run(cmd, cwd=tmp_path, env=env, expect_rc=expect_rc)
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    if case == "unknown model type":
        assert proc.stderr.startswith(line), proc.stderr
        assert "no-such-architecture" in proc.stderr
    else:
        assert proc.stderr.strip() == line
