"""Every example that starts DataLoader workers works with the forkserver start method.

Python 3.14 starts worker processes with forkserver by default on Linux (3.13 and older
fork): the dataset is pickled for each worker, so a dataset that holds a module, a lambda or
an open file fails there and nowhere else. tests/shim/sitecustomize.py sets the start method
from TESTS_START_METHOD before the example runs.
"""

import sys

import pytest

from conftest import EXAMPLES, activated, example_env, launch, make_fake_shards, run

# Examples whose DataLoader can have workers (they take --num-workers): tiny options, and how
# many processes they need (pipelines: one per stage).
TINY = "--fake-data --fake-size 32 --epochs 1 --batch-size 16 --num-workers 2"
WORKERS = {
    "checkpointing/lightning_checkpoint.py": (1, "--device cpu --checkpoint-dir ckpt"),
    "checkpointing/train_checkpoint.py": (1, "--device cpu --checkpoint-dir ckpt"),
    "cpu-threads/cnn_cpu.py": (1, "--threads 1"),
    "ddp/ddp.py": (1, "--device cpu"),
    "data/train_shards.py": (2, "--device cpu --data-dir shards"),
    "dist-checkpoint/ddp_checkpoint.py": (1, "--device cpu --output-dir ckpt"),
    "dist-checkpoint/fsdp_dcp.py": (1, "--device cpu --output-dir ckpt --width 32 --blocks 1"),
    "fsdp/fsdp_train.py": (1, "--device cpu --width 32 --blocks 1"),
    "horovod/horovod_train.py": (1, "--device cpu"),
    "lightning/lightning_train.py": (1, "--device cpu --devices 1 --output-dir out"),
    "one-gpu/cnn_gpu.py": (1, "--device cpu"),
    "pipeline/pipeline.py": (2, "--device cpu"),
    "pipeline-ddp/pipeline_ddp.py": (4, "--device cpu"),
    "preemption/preemptible.py": (1, "--device cpu --checkpoint-dir ckpt"),
    "profiling/profile_steps.py": (1, "--device cpu --output-dir out"),
    "tensorboard/train_tensorboard.py": (1, "--device cpu --output-dir out"),
}
# Examples with options of their own instead of TINY: one reads shards (made first with
# make_fake_shards), the others have no --fake-data (they only generate data).
OWN_DATA = {
    "data/train_shards.py": "--epochs 1 --batch-size 16 --num-workers 2",
    "profiling/profile_steps.py": "--steps 5 --batch-size 8 --image-size 32 --num-workers 2",
    "tensorboard/train_tensorboard.py": "--fake-size 64 --epochs 1 --batch-size 16 --num-workers 2",
}
# Started as srun tasks (SLURM_PROCID, MASTER_ADDR, ...); the others as plain programs.
DISTRIBUTED = {
    "data/train_shards.py",
    "ddp/ddp.py",
    "dist-checkpoint/ddp_checkpoint.py",
    "dist-checkpoint/fsdp_dcp.py",
    "fsdp/fsdp_train.py",
    "pipeline/pipeline.py",
    "pipeline-ddp/pipeline_ddp.py",
}


def with_workers():
    return sorted(
        str(p.relative_to(EXAMPLES))
        for p in EXAMPLES.rglob("*.py")
        if "DataLoader(" in (text := p.read_text()) and '"--num-workers"' in text
    )


def test_every_example_with_dataloader_workers_is_tried():
    assert with_workers() == sorted(WORKERS), "add the example to WORKERS"


@pytest.mark.parametrize("script", sorted(WORKERS))
def test_dataloader_workers_start_with_forkserver(script, tmp_path, request):
    world, options = WORKERS[script]
    if "--data-dir shards" in WORKERS[script][1]:
        make_fake_shards(tmp_path)
    tiny = OWN_DATA.get(script, TINY)
    cmd = [sys.executable, EXAMPLES / script, *tiny.split(), *options.split()]
    if script in DISTRIBUTED:
        ranks = launch(cmd, cwd=tmp_path, world=world, TESTS_START_METHOD="forkserver",
                       timeout=180)  # fmt: skip
        assert [rc for rc, _, _ in ranks] == [0] * world, ranks
        out = "".join(stdout for _, stdout, _ in ranks)
    else:
        env = example_env(TESTS_START_METHOD="forkserver")
        if script.startswith("horovod/"):
            env = activated(
                request.getfixturevalue("horovod_venv")[0], TESTS_START_METHOD="forkserver"
            )
            cmd = ["horovodrun", "-np", "1", "-H", "localhost:1", "--gloo", "python", *cmd[1:]]
        out = run(cmd, cwd=tmp_path, env=env, timeout=180).stdout
    assert "epoch 1" in out or "Epoch 1" in out or "loss" in out, out
