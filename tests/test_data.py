"""examples/data/: packing images into shards, training from shards, the read benchmark.

The job script that stages the shards to each node runs under the tests' Slurm cluster
(test_slurm.py), which also checks that a damaged copy stops the job.
"""

import csv
import re
import subprocess
import sys
import tarfile

import pytest
from recorded import check_recorded

from conftest import EXAMPLES, TORCHRUN, example_env, make_fake_shards, run

DATA = EXAMPLES / "data"
SHARDS = DATA / "make_shards.py"
TRAIN = DATA / "train_shards.py"
BENCHMARK = DATA / "read_benchmark.py"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """200 generated images in 10 classes, packed into shards of 32 (the last one of 8)."""
    folder = tmp_path_factory.mktemp("data")
    return folder, make_fake_shards(folder, images=200, shard_size=32)


def test_make_shards_packs_every_image_once_with_checksums(shards):
    folder, out = shards
    check_recorded(DATA / "make_shards.out", out)  # shown on the data page
    tars = sorted((folder / "shards").glob("*.tar"))
    assert [t.name for t in tars] == [f"shard-{i:06d}.tar" for i in range(7)]
    names = []
    for path in tars:
        with tarfile.open(path) as tar:
            members = tar.getnames()
        # WebDataset's layout: the files of one sample side by side, <key>.<extension>.
        assert [m.split(".")[1] for m in members] == ["png", "cls"] * (len(members) // 2)
        assert [m.split(".")[0] for m in members[::2]] == [m.split(".")[0] for m in members[1::2]]
        names += members[::2]
    assert len(names) == len(set(names)) == 200
    assert (folder / "shards" / "classes.txt").read_text().split() == [
        f"class{i}" for i in range(10)
    ]
    check = subprocess.run(
        ["sha256sum", "--check", "SHA256SUMS"],
        cwd=folder / "shards",
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0 and check.stdout.count(": OK") == 7, check.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-dir", "nowhere"], "nowhere is not a folder"),
        (["--shard-size", "0"], "argument --shard-size: must be a positive integer (got 0)"),
    ],
)
def test_make_shards_rejects_bad_input_in_one_line(tmp_path, args, message):
    proc = run([sys.executable, SHARDS, *args], cwd=tmp_path, expect_rc=2)
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr


def epochs(out):
    return [
        (float(loss), int(images))
        for loss, images in re.findall(r"^epoch \d+: loss ([\d.]+), (\d+) images, ", out, re.M)
    ]


def test_train_from_shards_reads_every_image_once_per_epoch(shards, tmp_path):
    folder, _ = shards
    args = ["--data-dir", folder / "shards", "--epochs", "3", "--num-workers", "2"]
    out = run([sys.executable, TRAIN, *args, "--batch-size", "16"], cwd=tmp_path).stdout
    assert "rank 0/1 on " in out and "reading 7 of 7 shards from " in out
    losses = epochs(out)
    assert [images for _, images in losses] == [200, 200, 200], out
    assert losses[-1][0] < losses[0][0], out  # it learns


def test_two_processes_with_uneven_shards_finish_together(shards, tmp_path):
    """7 shards for 2 processes x 2 workers, the last shard short: the processes run out of
    batches at different steps, and DDP's join() lets them end without a hang."""
    folder, _ = shards
    args = ["--data-dir", folder / "shards", "--epochs", "2", "--num-workers", "2"]
    cmd = [*TORCHRUN, "--nproc-per-node=2", TRAIN, *args, "--batch-size", "8", "--device", "cpu"]
    out = run(cmd, cwd=tmp_path, timeout=120).stdout
    assert "rank 1/2 on " in out and "reading 3 of 7 shards" in out
    assert [images for _, images in epochs(out)] == [200, 200], out
    assert "(2 processes)" in out


def test_too_few_shards_for_the_readers_is_a_warning(shards, tmp_path):
    folder, _ = shards
    args = ["--data-dir", folder / "shards", "--epochs", "1", "--num-workers", "8"]
    out = run([sys.executable, TRAIN, *args], cwd=tmp_path, timeout=120).stdout
    assert "warning: 7 shards for 1 x 8 readers: some read nothing" in out
    assert [images for _, images in epochs(out)] == [200], out


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--data-dir", "missing"], {}, "no shards in missing: pack the dataset once, on a login "
         "node, with python make_shards.py"),
        (["--batch-size", "0"], {}, "argument --batch-size: must be a positive integer (got 0)"),
        (["--lr", "nan"], {}, "argument --lr: must be a positive number (got nan)"),
        (["--num-workers", "-1"], {}, "argument --num-workers: must be 0 or more (got -1)"),
        ([], {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
         "MASTER_PORT not set: start this script with torchrun or srun"),
        ([], {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a whole number"),
    ],
)  # fmt: skip
def test_train_from_shards_rejects_bad_input_in_one_line(tmp_path, args, env, message):
    proc = run([sys.executable, TRAIN, *args], cwd=tmp_path, env=example_env(**env), expect_rc=2)
    # One line that says what to do (after argparse's usage, for a bad option).
    assert message in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, proc.stderr


def test_read_benchmark_writes_the_csv_the_page_shows(tmp_path):
    output = tmp_path / "read.csv"
    args = ["--images", "300", "--shard-size", "100", "--repeats", "1", "--output", output]
    out = run([sys.executable, BENCHMARK, *args], cwd=tmp_path, timeout=120).stdout
    assert "300 images of 64x64 pixels" in out
    assert not (tmp_path / "read-benchmark").exists(), "the work folder must be removed"
    committed = (DATA / "read_benchmark.csv").read_text().splitlines()
    written = output.read_text().splitlines()
    for lines in (committed, written):  # the same layout: command, machine, then the columns
        assert lines[0].startswith("# read_benchmark.py") and lines[1].startswith("# ")
        assert lines[2] == "layout,files,cache,images_per_s,mb_per_s"
    rows = list(csv.DictReader(written[2:]))
    assert [(r["layout"], r["files"], r["cache"]) for r in rows] == [
        ("files", "300", "cold"), ("files", "300", "warm"),
        ("shards", "3", "cold"), ("shards", "3", "warm"),
    ]  # fmt: skip
    assert all(float(r["images_per_s"]) > 0 for r in rows)


def test_read_benchmark_never_reuses_a_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    proc = run([sys.executable, BENCHMARK, "--work-dir", "taken"], cwd=tmp_path, expect_rc=2)
    assert "taken exists: give --work-dir a new folder" in proc.stderr
