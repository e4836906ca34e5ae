"""Faults a cluster produces, met by the checkpointing, data and distributed scripts: a full file
system during a save, a second run on one checkpoint folder, a damaged CIFAR-10 folder, a shard
cut short, Ctrl-C pressed twice while a sharded checkpoint is saved. Each must end in one line
on stderr with a non-zero exit, leave no temporary file, and keep the last good checkpoint.

The full disk is real: the checkpoint folder is a small tmpfs, mounted in a private mount
namespace (root, or an unprivileged user namespace), sized so that the first save fits and a
later one does not. The second run is a second process of the script while the first runs.
"""

import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import torch
from recorded import check_recorded

from conftest import (
    EXAMPLES,
    example_env,
    free_port,
    load_example,
    make_fake_shards,
    private_mount_namespace,
    run,
)

TRAIN_CHECKPOINT = EXAMPLES / "checkpointing" / "train_checkpoint.py"
PREEMPTIBLE = EXAMPLES / "preemption" / "preemptible.py"
DDP = EXAMPLES / "dist-checkpoint" / "ddp_checkpoint.py"
FSDP = EXAMPLES / "dist-checkpoint" / "fsdp_dcp.py"
SHARDS = EXAMPLES / "data" / "train_shards.py"
CPU = ["--device", "cpu", "--fake-data", "--fake-size", "128"]
DISTRIBUTED = ["--num-workers", "0"]
FSDP_SMALL = ["--width", "64", "--blocks", "2"]
NO_SPACE = "no space left (the file system"

# script, its options, processes, its folder option, tmpfs size: one checkpoint fits, not the
# one after it (sizes with torch 2.13: 218 kB, 209 kB, 487 kB and 3.4 MB a checkpoint).
FULL_DISK = {
    "train_checkpoint": (TRAIN_CHECKPOINT, ["--batch-size", "32", "--epochs", "2",
                         "--checkpoint-every", "2", "--keep", "3"], 1, "--checkpoint-dir", "600k"),
    "preemptible": (PREEMPTIBLE, ["--epochs", "2"], 1, "--checkpoint-dir", "300k"),
    "ddp_checkpoint": (DDP, [*DISTRIBUTED, "--epochs", "2"], 2, "--output-dir", "700k"),
    "fsdp_dcp": (FSDP, [*DISTRIBUTED, *FSDP_SMALL, "--epochs", "2"], 2, "--output-dir", "5m"),
}  # fmt: skip

# In the namespace: mount the tmpfs, run the processes (rank N's output in outN, errN), then
# copy what the folder holds out of it, where the test can look.
ON_A_SMALL_DISK = """set -e
folder=$1 size=$2 kept=$3 world=$4
shift 4
mount -t tmpfs -o "size=$size" tmpfs "$folder"
pids=
for rank in $(seq 0 $((world - 1))); do
    SLURM_PROCID=$rank SLURM_LOCALID=$rank SLURM_NTASKS=$world "$@" >"out$rank" 2>"err$rank" &
    pids="$pids $!"
done
status=0
for pid in $pids; do wait "$pid" || status=$?; done
cp -a "$folder/." "$kept/"
exit "$status"
"""


def one_line(stderr, script):
    """The single line a script ended with: there is no other, and no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("name", FULL_DISK)
def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_last_checkpoint(tmp_path, name):
    script, args, world, option, size = FULL_DISK[name]
    folder, kept = tmp_path / "checkpoints", tmp_path / "kept"
    folder.mkdir()
    kept.mkdir()
    command = [sys.executable, script, *CPU, *args, option, folder.name]
    env = example_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), OMP_NUM_THREADS=1)
    shell = ["sh", "-c", ON_A_SMALL_DISK, "sh", *map(str, [folder, size, kept, world, *command])]
    proc = subprocess.run(
        [*private_mount_namespace(), *shell],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    out, err = (tmp_path / "out0").read_text(), (tmp_path / "err0").read_text()
    assert proc.returncode == 2, (proc.stderr, out, err)
    line = one_line(err, script.name)
    assert "cannot write checkpoints/" in line and NO_SPACE in line, line
    left = sorted(path.name for path in kept.iterdir() if path.name != ".lock")
    assert left and not [name for name in left if name.endswith(".tmp")], left
    assert f"checkpoints/{left[-1]} is" in line  # it names the checkpoint that is left
    if script == TRAIN_CHECKPOINT:  # the line the checkpointing page shows
        check_recorded(EXAMPLES / "checkpointing" / "train_checkpoint-disk-full.out", err)
    for rank in range(1, world):  # the other ranks stop without a word
        assert (tmp_path / f"err{rank}").read_text() == ""
    newest = kept / left[-1]
    if newest.is_dir():  # DCP: a complete folder, its metadata written last
        assert (newest / ".metadata").is_file()
    else:
        state = torch.load(newest, map_location="cpu", weights_only=True)
        assert "model" in state and "optimizer" in state


def holding(folder, text):
    """A process that holds folder/.lock as a run of the scripts does, with text in it."""
    code = (
        "import fcntl, sys, time\n"
        "lock = open(sys.argv[1], 'a+')\n"
        "fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "lock.truncate(0); lock.write(sys.argv[2]); lock.flush()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, folder / ".lock", text], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    """Two real runs of train_checkpoint.py: the second stops at once and names the first; once
    the first has ended (here killed, as a node failure would), the folder is free again."""
    args = [sys.executable, TRAIN_CHECKPOINT, "--device", "cpu", "--fake-data", "--fake-size",
            "256", "--batch-size", "8", "--checkpoint-dir", "shared"]  # fmt: skip
    env = example_env(SLURM_JOB_ID="1001")
    first = subprocess.Popen(
        [str(part) for part in [*args, "--epochs", "1000"]], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert first.stdout.readline() == "no checkpoint in shared: starting from scratch\n"
        second = run(
            [*args, "--epochs", "1000"],
            cwd=tmp_path,
            env=example_env(SLURM_JOB_ID="1002"),
            expect_rc=2,
        )
        line = one_line(second.stderr, "train_checkpoint.py")
        check_recorded(EXAMPLES / "checkpointing" / "train_checkpoint-folder-in-use.out", line,
                       volatile=[(r"process \d+ on [^:]+:", "process … on …:")])  # fmt: skip
        assert line == (
            f"train_checkpoint.py: error: shared is in use by job 1001, process {first.pid} on "
            f"{os.uname().nodename}: wait for that run to end (or cancel it), or give this one "
            "another --checkpoint-dir; if job 1001 is no longer running (squeue -j 1001 / qstat "
            "1001), delete shared/.lock"
        )
        assert second.stdout == ""  # refused before it loaded or wrote anything
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
    again = run([*args, "--epochs", "1"], cwd=tmp_path)  # the checkpoints the first one left
    assert re.match(r"(resumed from shared/checkpoint-|no checkpoint in shared)", again.stdout)


@pytest.mark.parametrize(
    ("script", "args", "option"),
    [
        (PREEMPTIBLE, ["--epochs", "1"], "--checkpoint-dir"),
        (DDP, [*DISTRIBUTED, "--epochs", "1"], "--output-dir"),
        (FSDP, [*DISTRIBUTED, *FSDP_SMALL, "--epochs", "1"], "--output-dir"),
    ],
    ids=["preemptible", "ddp_checkpoint", "fsdp_dcp"],
)
def test_the_other_checkpointing_scripts_refuse_a_folder_another_process_holds(
    tmp_path, script, args, option
):
    folder = tmp_path / "shared"
    folder.mkdir()
    holder = holding(folder, "job 77, process 1 on n9\n")
    try:
        env = example_env(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=1, MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=free_port(), OMP_NUM_THREADS=1)  # fmt: skip
        proc = run([sys.executable, script, *CPU, *args, option, "shared"], cwd=tmp_path, env=env,
                   expect_rc=2)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    line = one_line(proc.stderr, script.name)
    assert line.endswith(f"error: shared is in use by job 77, process 1 on n9: wait for that run "
                         f"to end (or cancel it), or give this one another {option}; if job 77 "
                         "is no longer running (squeue -j 77 / qstat 77), delete "
                         "shared/.lock")  # fmt: skip
    assert sorted(path.name for path in folder.iterdir()) == [".lock"]  # nothing written


@pytest.mark.parametrize(
    ("script", "args", "option"),
    [
        (TRAIN_CHECKPOINT, ["--batch-size", "32", "--epochs", "1"], "--checkpoint-dir"),
        (PREEMPTIBLE, ["--epochs", "1"], "--checkpoint-dir"),
        (DDP, [*DISTRIBUTED, "--epochs", "1"], "--output-dir"),
        (FSDP, [*DISTRIBUTED, *FSDP_SMALL, "--epochs", "1"], "--output-dir"),
    ],
    ids=["train_checkpoint", "preemptible", "ddp_checkpoint", "fsdp_dcp"],
)
def test_a_lock_held_by_a_dead_nodes_job_is_named_with_the_lock_to_delete(
    tmp_path, script, args, option
):
    """A crashed node's lock outlives its job (NFSv3 keeps it until the node reboots, Lustre and
    GPFS for minutes): here a process that goes on holding .lock for job 4242, which no longer
    runs. The refusal names the job and the file to delete; once it is deleted (the old holder
    still holds the old file), the next run locks a new file and finishes."""
    folder = tmp_path / "shared"
    folder.mkdir()
    holder = holding(folder, "job 4242, process 1 on n9\n")
    command = [sys.executable, script, *CPU, *args, option, "shared"]
    env = example_env(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=1, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port(), OMP_NUM_THREADS=1, SLURM_JOB_ID="5151")  # fmt: skip
    try:
        proc = run(command, cwd=tmp_path, env=env, expect_rc=2)
        line = one_line(proc.stderr, script.name)
        assert line.endswith(
            f"error: shared is in use by job 4242, process 1 on n9: wait for that run to end (or "
            f"cancel it), or give this one another {option}; if job 4242 is no longer running "
            "(squeue -j 4242 / qstat 4242), delete shared/.lock"
        ), line
        (folder / ".lock").unlink()  # what the line says to do
        env["MASTER_PORT"] = str(free_port())
        run(command, cwd=tmp_path, env=env)  # it locks a new .lock, and trains
        assert holder.poll() is None  # the old holder still holds the old file
        assert (folder / ".lock").read_text().startswith("job 5151, process ")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def damaged_cifar(folder):
    """CIFAR-10's files, all there, with the wrong contents (a download cut short)."""
    files = folder / "cifar-10-batches-py"
    files.mkdir(parents=True)
    for name in [*(f"data_batch_{n}" for n in range(1, 6)), "test_batch", "batches.meta"]:
        (files / name).write_bytes(b"\x80\x04not the file it should be")


CIFAR_SCRIPTS = sorted(
    path
    for path in EXAMPLES.glob("*/*.py")
    if "torchvision.datasets.CIFAR10(args.data_dir" in path.read_text(encoding="utf-8")
    and path.parent.name != "horovod"  # its own venv: tests/test_horovod.py
)


@pytest.mark.parametrize("script", CIFAR_SCRIPTS, ids=lambda path: path.stem)
def test_a_damaged_cifar_folder_is_named_with_what_to_do(tmp_path, script):
    damaged_cifar(tmp_path / "data")
    tasks = 2 if script.parent.name.startswith("pipeline") else 1  # one per stage: rank 0's view
    env = example_env(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=tasks, SLURM_NNODES=1,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())  # fmt: skip
    device = ["--device", "cpu"] if "--device" in script.read_text(encoding="utf-8") else []
    proc = run([sys.executable, script, *device, "--data-dir", "data"], cwd=tmp_path, env=env,
               expect_rc=2)  # fmt: skip
    line = one_line(proc.stderr, script.name)
    assert line.endswith(
        "error: CIFAR-10 in data is incomplete or damaged (a file fails its checksum, as after an "
        "interrupted download): remove data/cifar-10-batches-py and download it again on a login "
        "node, or pass --fake-data"
    ), line


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    make_fake_shards(folder, images=64, shard_size=16)
    return folder / "shards"


@pytest.mark.parametrize("cut", ["in a member", "at a member's end"])
def test_a_shard_cut_short_is_named_before_training(tmp_path, shard_folder, cut):
    shards = tmp_path / "shards"
    shards.mkdir()
    for path in shard_folder.iterdir():
        (shards / path.name).write_bytes(path.read_bytes())
    victim = shards / "shard-000002.tar"
    data = victim.read_bytes()
    with tarfile.open(victim) as tar:
        members = tar.getmembers()
    end = members[len(members) // 2].offset  # a header's first byte: the member before is whole
    victim.write_bytes(data[: end - 300] if cut == "in a member" else data[:end])
    proc = run([sys.executable, SHARDS, "--data-dir", "shards", "--device", "cpu"], cwd=tmp_path,
               expect_rc=2)  # fmt: skip
    assert one_line(proc.stderr, "train_shards.py") == (
        "train_shards.py: error: shard shards/shard-000002.tar is damaged (it does not end as a "
        "tar file does): copy it again, or pack the dataset again with make_shards.py"
    )
    assert proc.stdout == ""  # not one image trained


def test_a_shard_with_a_zero_filled_hole_is_named_not_trained_on_in_part(tmp_path, shard_folder):
    """A shard still being written by a parallel transfer (Globus, rsync --preallocate) has
    zero-filled, 512-byte-aligned regions, its tail written already: it passes the check at
    start, and a tar stream stops quietly at the first zero block. The run must stop in one line
    that names it, not train an epoch on the part before the hole."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for path in shard_folder.iterdir():
        (shards / path.name).write_bytes(path.read_bytes())
    victim = shards / "shard-000002.tar"
    data = bytearray(victim.read_bytes())
    with tarfile.open(victim) as tar:
        members = tar.getmembers()
    start, end = members[len(members) // 2].offset, members[len(members) // 2 + 2].offset
    data[start:end] = bytes(end - start)  # headers' first bytes: 512-byte aligned
    victim.write_bytes(data)
    proc = run([sys.executable, SHARDS, "--data-dir", "shards", "--device", "cpu"], cwd=tmp_path,
               expect_rc=2)  # fmt: skip
    assert one_line(proc.stderr, "train_shards.py") == (
        "train_shards.py: error: shard shards/shard-000002.tar is damaged (zero bytes from byte "
        f"{start} on, then data again: a file still being written?): copy it again, or pack the "
        "dataset again with make_shards.py"
    )
    assert "epoch 1" not in proc.stdout  # not an epoch on part of the data


def test_a_shard_cut_short_while_it_is_read_is_named(shard_folder, tmp_path):
    """The reader also checks as it streams: a shard that passed the check at start and is cut
    short afterwards (a copy still running) is named, in a member or between two."""
    example = load_example(SHARDS)
    victim = tmp_path / "shard-000000.tar"
    data = (shard_folder / victim.name).read_bytes()
    dataset = example.ShardDataset([victim], rank=0, world=1, seed=0, buffer_size=4)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member, last = tar.getmembers()[4], tar.getmembers()[-1]  # an image, a class
    cuts = {  # where the file ends: what the reader must say
        member.offset_data + member.size // 2: "unexpected end of data",  # tarfile's words
        last.offset_data + 512: "it ends before the end of the archive",  # whole members only
    }
    for size, why in cuts.items():
        victim.write_bytes(data[:size])
        with pytest.raises(example.DamagedShard, match=re.escape(why)):
            list(dataset.samples([victim]))
    victim.write_bytes(data)
    assert len(list(dataset.samples([victim]))) == 16


# Every fsync announces itself on stderr and takes half a second: the test knows a save is
# under way, and has time to press Ctrl-C twice inside it.
SLOW_FSYNC = """import os, runpy, sys, time
real = os.fsync
def fsync(descriptor):
    print("test: fsync", file=sys.stderr, flush=True)
    time.sleep(0.5)
    real(descriptor)
os.fsync = fsync
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_twice_during_a_sharded_save_ends_in_one_line_and_completes_it(tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = example_env(SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=2,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=1)  # fmt: skip
        command = [sys.executable, "-c", SLOW_FSYNC, FSDP, *CPU, *DISTRIBUTED, *FSDP_SMALL,
                   "--epochs", "3"]  # fmt: skip
        procs.append(subprocess.Popen(
            [str(part) for part in command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    try:
        assert procs[0].stderr.readline() == "test: fsync\n"  # the first save has begun
        for _ in range(2):  # as a terminal does: every process of the job, twice
            for proc in procs:
                proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [130, 130], outputs
    for _, err in outputs:
        lines = [line for line in err.splitlines() if line != "test: fsync"]
        assert lines == ["fsdp_dcp.py: interrupted (Ctrl-C)"], err
    assert "Saved checkpoints/epoch-1" in outputs[0][0]  # the save it was in completed
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == [
        ".lock",
        "epoch-1",
    ]
    assert (tmp_path / "checkpoints" / "epoch-1" / ".metadata").is_file()
