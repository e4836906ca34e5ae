"""examples/llm/finetune_accelerate.py on the tiny Llama (tests/tiny_llm.py), on the CPU with
gloo: accelerate launch with two processes, the same global batch in one process, resume,
the export, bad input. Accelerate applies FSDP on GPUs only: on the CPU, accelerate launch
with accelerate_fsdp.yaml trains with DDP (the job scripts' runs under Slurm and PBS, in
test_slurm.py and test_pbs.py). The script's FSDP2 path runs here with a stand-in that makes
Accelerate take it on the CPU (FSDP_ON_CPU), and on GPUs in the GPU suite."""

import importlib.util
import json
import re
import shutil
import sys

import pytest
import torch

from conftest import EXAMPLES, example_env, free_port, run, tiny_tokens_folder

# Found, not imported: the tests' workers never import the Hugging Face libraries.
MISSING = [name for name in ("accelerate", "transformers") if not importlib.util.find_spec(name)]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"{', '.join(MISSING)} missing: in requirements.txt, run make venv"
)
LLM = EXAMPLES / "llm"
SCRIPT = LLM / "finetune_accelerate.py"
CONFIG = LLM / "accelerate_fsdp.yaml"
# accelerate launch: its module, without the accelerate command's other subcommands (their
# imports, transformers' models among them, cost seconds before the launch).
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
STEPS = 4
# Four optimizer steps of 8 sequences, micro-batches of 2, a checkpoint every 2 steps.
SHORT = ["--device", "cpu", "--global-batch", "8", "--micro-batch", "2", "--lr", "1e-3",
         "--warmup-steps", "0", "--log-every", "1", "--checkpoint-every", "2", "--seed", "1",
         "--steps", str(STEPS)]  # fmt: skip


def one_process(**extra):
    """The variables torchrun gives the only process of a world of one."""
    return example_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), OMP_NUM_THREADS=1,
                       **extra)  # fmt: skip


@pytest.fixture(scope="module")
def tokens():
    """tests/llm/corpus.txt in blocks of 32 tokens, made by prepare_tokens.py (conftest)."""
    return tiny_tokens_folder()


@pytest.fixture(scope="module")
def two(tiny_llm, tokens, tmp_path_factory):
    """(folder, output) of accelerate launch with two processes on the CPU."""
    where = tmp_path_factory.mktemp("two")
    command = [*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--main_process_port", free_port(), "--mixed_precision", "no",
               "--dynamo_backend", "no", SCRIPT, *SHORT, "--model", tiny_llm,
               "--tokens", tokens]  # fmt: skip
    proc = run(command, cwd=where, env=example_env(OMP_NUM_THREADS=1), timeout=240)
    return where, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def one(tiny_llm, tokens, tmp_path_factory):
    """(folder, output) of the same run in one process, never interrupted."""
    where = tmp_path_factory.mktemp("one")
    args = [*SHORT, "--model", tiny_llm, "--tokens", tokens]
    proc = run([sys.executable, SCRIPT, *args], cwd=where, env=one_process(), timeout=180)
    return where, proc.stdout + proc.stderr


# A stand-in for accelerate launch with accelerate_fsdp.yaml, for one process on the CPU: the
# variables that Accelerate's launcher derives from the file (float32: no mixed precision
# here), then Accelerate made to treat the process as a GPU one on the CPU device, over gloo,
# which it refuses to do itself. prepare() then shards with fully_shard, save_state and
# load_state read and write shards (torch.distributed.checkpoint), get_state_dict gathers them.
FSDP_ON_CPU = """
import os, runpy, sys
import accelerate, accelerate.state, torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_multi_gpu_env

config, script, *args = sys.argv[1:]
launch = launch_command_parser().parse_args(
    ["--config_file", config, "--num_processes", "1", "--mixed_precision", "no",
     "--main_process_port", os.environ["MASTER_PORT"], script])
launched = prepare_multi_gpu_env(_validate_launch_command(launch)[0])
os.environ.update({k: v for k, v in launched.items() if k.startswith(("ACCELERATE_", "FSDP_"))})
state = accelerate.state.PartialState
state._prepare_backend = lambda self, *a, **k: ("gloo", DistributedType.MULTI_GPU)
state.set_device = lambda self: setattr(self, "device", torch.device("cpu"))
init = accelerate.Accelerator.__init__
accelerate.Accelerator.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "cpu": False})
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def sharded_run(folder, args):
    """finetune_accelerate.py in one process of FSDP_ON_CPU: in a folder named llm, so that it
    runs in the zygote that imported transformers already (conftest.PRELOAD)."""
    (folder / "llm").mkdir(exist_ok=True)
    (folder / "llm" / "fsdp_on_cpu.py").write_text(FSDP_ON_CPU)
    command = [sys.executable, "llm/fsdp_on_cpu.py", CONFIG, SCRIPT, *args]
    return run(command, cwd=folder, env=one_process(), timeout=180)


@pytest.fixture(scope="module")
def sharded(tiny_llm, tokens, tmp_path_factory):
    """(folder, output) of the one-process run through Accelerate's FSDP2 path."""
    where = tmp_path_factory.mktemp("sharded")
    proc = sharded_run(where, [*SHORT, "--model", tiny_llm, "--tokens", tokens])
    return where, proc.stdout + proc.stderr


def losses(out):
    return [float(x) for x in re.findall(r"^step \d+/\d+: loss (\S+), [\d,]+ tokens/s$", out, re.M)]


def digest(out):
    return re.search(r"^weights: sha256 ([0-9a-f]{64})$", out, re.M)[1]


def test_two_processes_train_and_the_loss_falls(two):
    folder, out = two
    assert re.search(r"^2 processes on \S+: cpu, data parallel \(DDP, gloo\), mixed precision no$",
                     out, re.M), out  # fmt: skip
    assert "llama, 405,120 parameters, gradient checkpointing on" in out
    assert "global batch 8 sequences of 32 tokens = 2 processes x 2 micro-batches of 2" in out
    assert out.count("global batch") == 1, out  # from the main process only
    assert len(losses(out)) == STEPS and losses(out)[-1] < losses(out)[0], out
    assert "no checkpoint in checkpoints: starting from scratch" in out
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        ".lock", "checkpoint-00000002", "checkpoint-00000004"]  # fmt: skip
    saved = folder / "checkpoints" / "checkpoint-00000004"
    assert {p.name for p in saved.iterdir()} >= {
        "model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
        "random_states_1.pkl", "progress.json"}  # accelerator.save_state's, and ours  # fmt: skip
    assert "model saved to finetune-out/model" in out


def test_one_process_keeps_the_global_batch_and_learns_the_same(two, one):
    """One process accumulates 4 micro-batches where two accumulate 2 each: the same sequences
    in every step, so the same losses (to rounding: the sums are made in another order)."""
    _, out = one
    assert "global batch 8 sequences of 32 tokens = 1 process x 4 micro-batches of 2" in out
    assert losses(out) == pytest.approx(losses(two[1]), rel=1e-4)


def test_a_resumed_run_ends_with_the_weights_of_one_never_stopped(tiny_llm, tokens, one,
                                                                  tmp_path):  # fmt: skip
    """A run stopped after step 2 left checkpoint-00000002 (the uninterrupted run's own, the
    same bytes); a newer checkpoint whose model file was cut short is skipped with a warning."""
    folder, out = one
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(folder / "checkpoints" / "checkpoint-00000002",
                    checkpoints / "checkpoint-00000002")  # fmt: skip
    damaged = checkpoints / "checkpoint-00000003"
    shutil.copytree(checkpoints / "checkpoint-00000002", damaged)
    progress = json.loads((damaged / "progress.json").read_text())
    (damaged / "progress.json").write_text(json.dumps({**progress, "step": 3}))
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    args = [*SHORT, "--model", tiny_llm, "--tokens", tokens]
    proc = run([sys.executable, SCRIPT, *args], cwd=tmp_path, env=one_process(), timeout=180)
    warnings = [line for line in proc.stderr.splitlines() if "finetune_accelerate.py" in line]
    skipped = "finetune_accelerate.py: warning: skipped checkpoints/checkpoint-00000003 ("
    assert len(warnings) == 1 and warnings[0].startswith(skipped), proc.stderr
    assert warnings[0].endswith("; resuming from checkpoints/checkpoint-00000002"), warnings
    assert "resumed from checkpoints/checkpoint-00000002 after 2 steps" in proc.stdout
    assert re.findall(r"^step (\d)/4", proc.stdout, re.M) == ["3", "4"], proc.stdout
    assert digest(proc.stdout) == digest(out)


def test_the_fsdp2_path_shards_saves_and_learns_the_same(two, sharded):
    folder, out = sharded
    assert re.search(r"^1 process on \S+: cpu, FSDP2 \(gloo\), reshard after forward: True, "
                     r"CPU offload: False, mixed precision no$", out, re.M), out  # fmt: skip
    assert "FSDP is not used" not in out
    assert losses(out) == pytest.approx(losses(two[1]), rel=1e-4)
    saved = folder / "checkpoints" / "checkpoint-00000004"
    for shards in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint's
        assert (saved / shards / ".metadata").is_file() and list((saved / shards).glob("*.distcp"))
    assert (folder / "finetune-out" / "model" / "model.safetensors").is_file()


def test_a_resumed_fsdp2_run_ends_with_the_weights_of_one_never_stopped(tiny_llm, tokens, sharded,
                                                                        tmp_path):  # fmt: skip
    """The same as for DDP, from shards: a newer checkpoint with a shard cut short is skipped."""
    folder, out = sharded
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(folder / "checkpoints" / "checkpoint-00000002",
                    checkpoints / "checkpoint-00000002")  # fmt: skip
    damaged = checkpoints / "checkpoint-00000003"
    shutil.copytree(checkpoints / "checkpoint-00000002", damaged)
    progress = json.loads((damaged / "progress.json").read_text())
    (damaged / "progress.json").write_text(json.dumps({**progress, "step": 3}))
    for shard in (damaged / "pytorch_model_fsdp_0").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    proc = sharded_run(tmp_path, [*SHORT, "--model", tiny_llm, "--tokens", tokens])
    assert "finetune_accelerate.py: warning: skipped checkpoints/checkpoint-00000003 (" in (
        proc.stderr
    )
    assert "resumed from checkpoints/checkpoint-00000002 after 2 steps" in proc.stdout
    assert digest(proc.stdout) == digest(out)


def test_the_export_loads_with_from_pretrained(one, tmp_path):
    """model/ holds the trained weights (the digest the run printed) and the tokenizer."""
    folder, out = one
    check = tmp_path / "llm" / "check_export.py"  # in a folder named llm: run by the zygote
    check.parent.mkdir()  # that imported transformers already (conftest.PRELOAD)
    check.write_text(
        "import hashlib, sys\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "digest = hashlib.sha256()\n"
        "for name, tensor in sorted(model.state_dict().items()):\n"
        "    digest.update(name.encode() + tensor.float().contiguous().numpy().tobytes())\n"
        "print(digest.hexdigest(), len(AutoTokenizer.from_pretrained(sys.argv[1])))\n"
    )
    export = folder / "finetune-out" / "model"
    printed = run([sys.executable, check, export], cwd=tmp_path).stdout.split()
    assert printed == [digest(out), "300"]
    assert not (folder / "finetune-out" / "model.tmp").exists()


def test_the_job_scripts_launch_fsdp2_from_the_config_file():
    """The FSDP2 settings the page explains, and one accelerate launch per node that names the
    file; the runs themselves are in test_slurm.py and test_pbs.py."""
    config = CONFIG.read_text()
    for line in ("distributed_type: FSDP", "mixed_precision: bf16", "fsdp_version: 2",
                 "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                 "fsdp_state_dict_type: SHARDED_STATE_DICT"):  # fmt: skip
        assert re.search(rf"^\s*{line}\b", config, re.M), line
    for name in ("finetune_accelerate.sbatch", "finetune_accelerate.pbs"):
        text = (LLM / name).read_text()
        assert "accelerate launch" in text and "--config_file accelerate_fsdp.yaml" in text, name
        for flag in ("--num_machines", "--machine_rank", "--main_process_ip",
                     "--main_process_port", "--num_processes"):  # fmt: skip
            assert flag in text, (name, flag)
        assert "export HF_HUB_OFFLINE=1" in text, name
    slurm = (LLM / "finetune_accelerate.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1 " in slurm and '--machine_rank "$SLURM_NODEID"' in slurm


@pytest.mark.gpu
def test_fsdp2_from_the_config_file_on_the_gpus(tiny_llm, tokens, tmp_path):
    """The path the CPU cannot take: accelerate_fsdp.yaml on every GPU of the machine, FSDP2 in
    bfloat16, a checkpoint with save_state (a shard per process) and the export."""
    gpus = torch.cuda.device_count()
    command = [*ACCELERATE_LAUNCH, "--config_file", CONFIG, "--num_processes", gpus,
               "--num_machines", "1", "--main_process_port", free_port(), SCRIPT,
               "--device", "cuda", "--model", tiny_llm, "--tokens", tokens, "--steps", "4",
               "--global-batch", 4 * gpus, "--micro-batch", "2", "--lr", "1e-3",
               "--warmup-steps", "0", "--log-every", "1", "--checkpoint-every", "2"]  # fmt: skip
    proc = run(command, cwd=tmp_path, timeout=300)
    out = proc.stdout
    assert out.count("GPU in use: ") == gpus, out
    processes = f"{gpus} process{'es' if gpus > 1 else ''}"
    assert re.search(rf"^{processes} on \S+: cuda, FSDP2 \(nccl\), reshard after forward: True, "
                     r"CPU offload: False, mixed precision bf16$", out, re.M), out  # fmt: skip
    assert f"= {processes} x 2 micro-batches of 2" in out
    assert len(losses(out)) == 4 and losses(out)[-1] < losses(out)[0], out
    assert "FSDP is not used" not in proc.stderr, proc.stderr
    assert (tmp_path / "finetune-out" / "model" / "model.safetensors").is_file()


def edited_tokens(tokens, folder, **changes):
    folder.mkdir()
    meta = {**json.loads((tokens / "meta.json").read_text()), **changes}
    (folder / "meta.json").write_text(json.dumps(meta))
    shutil.copy(tokens / "tokens.bin", folder / "tokens.bin")
    return folder


def test_tokens_of_another_tokenizer_are_refused(tiny_llm, tokens, tmp_path):
    other = edited_tokens(tokens, tmp_path / "other", tokenizer_sha256="0" * 64, model="gpt2")
    proc = run([sys.executable, SCRIPT, "--device", "cpu", "--model", tiny_llm, "--tokens", other],
               cwd=tmp_path, env=one_process(), expect_rc=2)  # fmt: skip
    assert proc.stderr.splitlines()[-1] == (
        f"finetune_accelerate.py: error: the tokens were made with another tokenizer than "
        f"{tiny_llm}'s (made for gpt2): tokenize again with prepare_tokens.py --model {tiny_llm}"
    )


LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"WORLD_SIZE": 2, "RANK": 1},
         "--global-batch 6 is not a multiple of 2 processes x --micro-batch 2 = 4: change "
         "either, so that each process runs a whole number of micro-batches"),
        (["--model", "empty"], {},
         "empty holds no config.json: not a Hugging Face model folder (give the folder that hf "
         "download filled, or the model's Hub name)"),
        (["--tokens", "cut"], {},
         "cut/tokens.bin is 2,878 bytes, meta.json says 2,880: it is damaged or incomplete; make "
         "the tokens again with prepare_tokens.py"),
        ([], {name: None for name in LAUNCHER},
         "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start this script "
         "with accelerate launch (or torchrun)"),
        ([], {**{name: None for name in LAUNCHER}, "SLURM_PROCID": 0},
         "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: srun's SLURM_PROCID "
         "is not read by Accelerate: run accelerate launch in one srun task per node (see "
         "finetune_accelerate.sbatch)"),
        ([], {**{name: None for name in LAUNCHER}, "ACCELERATE_MIXED_PRECISION": "no",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500},
         "accelerate launch --cpu starts one process, not --num_processes (it needs mpirun for "
         "more): launch with --multi_gpu and pass --device cpu"),
        (["--device", "cuda"], {},
         "--device cuda but no GPU is visible: request one per process (Slurm: "
         "--gpus-per-node=N, PBS: -l select=1:ncpus=8:ngpus=N, Grid Engine: -l gpu=N)"),
    ],
    ids=["global-batch", "not-a-model", "damaged-tokens", "no-launcher", "srun-only", "cpu-flag",
         "no-gpu"],
)  # fmt: skip
def test_bad_input_stops_in_one_line(tiny_llm, tokens, tmp_path, args, env, message):
    if "--device" in args and torch.cuda.is_available():
        pytest.skip("checks the message given without a GPU")
    (tmp_path / "empty").mkdir()
    shutil.copytree(tokens, tmp_path / "cut")
    data = tmp_path / "cut" / "tokens.bin"
    data.write_bytes(data.read_bytes()[:-2])
    environment = one_process()
    for name, value in env.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = str(value)
    command = [sys.executable, SCRIPT, "--device", "cpu", "--model", tiny_llm, "--tokens", tokens,
               "--global-batch", "6", "--micro-batch", "2", *args]  # fmt: skip
    if "global-batch" not in message:
        command[command.index("6")] = "8"
    proc = run(command, cwd=tmp_path, env=environment, expect_rc=2)
    assert proc.stderr == f"finetune_accelerate.py: error: {message}\n"
