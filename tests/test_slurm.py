"""Every Slurm job script in examples/, submitted with sbatch to a real Slurm cluster.

The cluster (tests/slurm/) has two nodes, n1 and n2, with 16 CPUs, 64 GB and two fake GPUs
each; it is started once for these tests and stopped at the end. Run only these tests with
`make test-slurm`.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import records
from recorded import check_recorded

from conftest import (
    CENTRE_SITES,
    EXAMPLES,
    TEST_SITES,
    VERSIONS,
    Job,
    build_edition,
    centre_edition,
    copy_example,
    make_job_env,
    page_text,
    run,
)
from generate import generate  # noqa: E402 (edition/, on the path from conftest)
from sitefile import load  # noqa: E402

pytestmark = pytest.mark.slurm
# How a job asks this cluster for n GPUs (tests/sites/slurm-test-cluster.toml).
GPU_REQUEST = load(TEST_SITES["slurm"]).gpu_request


# One entry per Slurm job script in examples/ (a test fails when one is missing).
JOBS = {
    "first-job/check_pytorch.sbatch": Job(
        files=("install/check_pytorch.py",),
        args=("--size", "64"),
        expect=(
            "Job {job_id} on ",
            # One GPU, the one Slurm gave (which one depends on the jobs beside it).
            re.compile(r"CUDA_VISIBLE_DEVICES=(\d)\n(?s:.*)GPUs requested:  SLURM_JOB_GPUS=\1\n"),
            "CPU threads:     4 (from SLURM_CPUS_PER_TASK)",
            "Test product:    64x64 on cpu",
            "Result: PyTorch",
        ),
    ),
    "first-job/check_distributed.sbatch": Job(
        files=("first-job/check_distributed.py",),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "rank 0/4 on n1, cpu (gloo): sum 10",
            "rank 3/4 on n2, cpu (gloo): sum 10",
            "All 4 processes on 2 node(s) (n1, n2) reached each other",
        ),
    ),
    "install/check_pytorch_conda.sbatch": Job(
        files=("install/check_pytorch.py",),
        args=("--size", "64"),
        expect=("Job {job_id} on ", "conda environment ", "Result: PyTorch"),
        venv="conda_env",  # made by make_conda_env.sh with the conda stand-in
    ),
    "precision/precision.sbatch": Job(
        files=("precision/precision.py",),
        args=("--size", "64", "--repeats", "2", "--train-steps", "5"),
        expect=("Job {job_id} on ", "float32 ", "bfloat16 ", "Mixed precision (bf16), 5 steps"),
    ),
    "cpu-threads/cnn_cpu.sbatch": Job(
        files=("cpu-threads/cnn_cpu.py",),
        args=("--fake-data", "--fake-size", "256", "--epochs", "2"),
        expect=(
            "Job {job_id} on ",
            "256 images, 4 threads (4 CPUs from SLURM_CPUS_PER_TASK), OMP_NUM_THREADS=4",
            "Throughput: ",
        ),
    ),
    "one-gpu/cnn_gpu.sbatch": Job(
        files=("one-gpu/cnn_gpu.py",),
        args=("--fake-data", "--fake-size", "32", "--epochs", "1", "--batch-size", "16"),
        expect=("Job {job_id} on ", "8 CPUs", "tuned: ", "workers=7"),
    ),
    "ddp/ddp_one_node.sbatch": Job(
        files=("ddp/ddp.py",),
        args=("--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2"),
        expect=("Job {job_id} on ", ": 2 processes", "2 processes, cpu (gloo)", "epoch 2: loss "),
    ),
    "ddp/ddp_srun.sbatch": Job(
        files=("ddp/ddp.py",),
        args=("--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2"),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "4 processes, cpu (gloo), global batch 256",
            "Nodes: n1, n2",
            "epoch 2: loss ",
        ),
    ),
    "ddp/ddp_torchrun.sbatch": Job(
        files=("ddp/ddp.py",),
        args=("--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2"),
        expect=(
            "Job {job_id}: 2 nodes x 2 processes, rendezvous at n1:",
            "4 processes, cpu (gloo), global batch 256",
            "Nodes: n1, n2",
            "epoch 2: loss ",
        ),
    ),
    "lightning/lightning.sbatch": Job(
        files=("lightning/lightning_train.py",),
        args=tuple("--device cpu --fake-data --fake-size 512 --epochs 2 --num-workers 0".split()),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "world size 4: 2 node(s) x 2 devices, cpu (gloo), SLURMEnvironment",
            "rank 3/4 on n2, cpu",
            "epoch 2: loss ",
        ),
    ),
    "fsdp/fsdp.sbatch": Job(
        files=("fsdp/fsdp_train.py",),
        args=tuple(
            "--device cpu --fake-data --fake-size 512 --epochs 2 --width 128 --blocks 2 "
            "--num-workers 0".split()
        ),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "4 processes, cpu (gloo), shards of 1/4, compute in float32",
            "rank 0 on n1 holds 164,771 of 658,826 parameters (25.0%)",
            "rank 3 on n2 holds 164,513 of 658,826 parameters (25.0%)",
            "epoch 2: loss ",
        ),
    ),
    "horovod/horovod.sbatch": Job(
        files=("horovod/horovod_train.py",),
        args=tuple("--device cpu --fake-data --fake-size 512 --epochs 2".split()),
        expect=(
            "Job {job_id}: 4 processes on n1:2,n2:2",
            "[0]<stdout>:4 processes on 2 node(s), cpu, batch 64 per process, learning rate 0.05",
            "[0]<stdout>:epoch 2: loss ",
        ),
        venv="horovod_venv",  # Horovod is built by install_horovod.sh, not pip-installed
    ),
    "pipeline/pipeline.sbatch": Job(
        files=("pipeline/pipeline.py",),
        args=tuple("--device cpu --fake-data --fake-size 256 --epochs 2 --num-workers 0".split()),
        expect=(
            "Job {job_id} on ",
            "2 stages, cpu (gloo), schedule gpipe, 4 micro-batches of 16 images",
            "epoch 2: loss ",
        ),
    ),
    "pipeline-ddp/pipeline_ddp.sbatch": Job(
        files=("pipeline-ddp/pipeline_ddp.py",),
        args=tuple("--device cpu --fake-data --fake-size 256 --epochs 2 --num-workers 0".split()),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "4 processes = 2 x 2 (replicas x stages), cpu (gloo), schedule 1f1b",
            "replica 0: stage 0 on n1 (rank 0), stage 1 on n1 (rank 1)",
            "replica 1: stage 0 on n2 (rank 2), stage 1 on n2 (rank 3)",
            "epoch 2: loss ",
        ),
    ),
    "deepspeed/deepspeed.sbatch": Job(
        files=("deepspeed/deepspeed_train.py", "deepspeed/ds_zero3.json"),
        args=tuple(
            "--device cpu --fake-size 512 --width 64 --layers 2 --epochs 2 --lr 0.01".split()
        ),
        expect=(
            "Job {job_id}: 2 processes on n1, rendezvous at n1:",
            "-ds-{job_id}",
            "2 processes, cpu (gloo), ZeRO stage 3, 8,970 parameters, optimizer AdamW",
            "offload: parameters none, optimizer states none",
            "epoch 2: loss ",
        ),
    ),
    "benchmark/resnet_benchmark.sbatch": Job(
        files=("benchmark/resnet_benchmark.py",),
        args=("--quick", "--device", "cpu", "--precisions", "float", "--output-dir", "results"),
        expect=(
            "Job {job_id} on ",
            "name, driver_version, clocks.max.sm [MHz], power.limit [W]",
            "resnet18          train     float ",
            "Wrote 2 rows to results/resnet_benchmark.csv",
        ),
    ),
    "preemption/preemptible.sbatch": Job(
        files=("preemption/preemptible.py",),
        args=("--device", "cpu", "--fake-data", "--fake-size", "512", "--epochs", "2"),
        expect=(
            "Job {job_id} on ",
            "SLURM_RESTART_COUNT=0",
            "/preemptible-{job_id}\n",
            "epoch 2: loss ",
            "finished: 2 epochs, weights sha256 ",
        ),
    ),
    "checkpointing/train_checkpoint.sbatch": Job(
        files=("checkpointing/train_checkpoint.py",),
        args=tuple(
            "--device cpu --fake-data --fake-size 256 --epochs 2 --checkpoint-every 4".split()
        ),
        expect=(
            "Job {job_id} on ",
            "run train-checkpoint, checkpoints in ",
            "checkpoints/train-checkpoint/checkpoints: starting from scratch",
            "epoch 2: loss ",
            "final weights: sha256 ",
        ),
    ),
    "dist-checkpoint/fsdp_dcp.sbatch": Job(
        files=("dist-checkpoint/fsdp_dcp.py",),
        args=tuple(
            "--device cpu --fake-data --fake-size 512 --epochs 2 --width 64 --blocks 2 "
            "--num-workers 0".split()
        ),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "/checkpoints/{job_id}",
            "No checkpoint in ",
            "4 processes, cpu (gloo), shards of 1/4, epochs 1 to 2",
            "Nodes: n1, n2",
            "epoch 2: loss ",
            "/checkpoints/{job_id}/epoch-2",
            "Weights digest: ",
            "Kept: epoch-1 epoch-2",
        ),
    ),
    "libtorch/libtorch.sbatch": Job(
        files=("libtorch/example.cpp", "libtorch/CMakeLists.txt"),
        args=("--device", "cpu", "--epochs", "3"),
        expect=(
            "Job {job_id} on ",
            "building in /tmp/libtorch-{job_id}",
            "(C++ 202002, compiler ",
            "CUDA available: no",
            "Training on cpu: 1024 samples, 577 parameters",
            "epoch 3: loss ",
        ),
    ),
    "mps/mps_ddp.sbatch": Job(
        files=("mps/mps_ddp.py",),
        args=("--fake-data", "--fake-size", "512", "--epochs", "2"),
        expect=(
            "Job {job_id} on ",
            "MPS control daemon started (stand-in), pipes in /tmp/mps-{job_id}/pipe",
            "samples/s with 4 replicas on cpu",
            "MPS control daemon stopped (stand-in)",
        ),
    ),
    "containers/apptainer.sbatch": Job(
        files=("first-job/check_distributed.py",),
        # The cluster's GPUs are a count, with no device files, inside the container too:
        # --device auto stops there (test_a_container_without_gpu_devices_stops_every_process).
        args=("--device", "cpu"),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            ", bound: /",  # the test cluster's project and scratch (site file), which exist
            "rank 0/4 on n1, cpu (gloo): sum 10",
            "rank 3/4 on n2, cpu (gloo): sum 10",
            "All 4 processes on 2 node(s) (n1, n2) reached each other",
        ),
        # The image, built on the "login node" by the apptainer stand-in (tests/standins), in
        # the project space of the cluster's site file ($PWD), where its edition looks for it.
        prepare=(
            f"mkdir -p containers && apptainer build containers/pytorch.sif "
            f"{EXAMPLES / 'containers' / 'pytorch.def'}",
        ),
    ),
    "caches/compile_cache.sbatch": Job(
        files=("caches/compile_cache.py",),
        args=("--device", "cpu"),
        expect=(
            "Job {job_id}: no shared cache yet at ",
            # in a folder of its own for this PyTorch and device model
            re.compile(r"no shared cache yet at \S+/compile-cache/torch-[^/\s]+: compiling"),
            "/compile-{job_id}/inductor: 0 files before, ",
            "(cold)",
            "Published the compile cache to ",
        ),
    ),
    "data/train_shards.sbatch": Job(
        files=("data/train_shards.py",),
        args=("--device", "cpu", "--epochs", "2", "--batch-size", "16"),
        prepare=(f"python {EXAMPLES}/data/make_shards.py --fake 384 --shard-size 16",),
        expect=(
            "n1: 24 shards checked in /tmp/shards-{job_id}/shards",
            "n2: 24 shards checked in /tmp/shards-{job_id}/shards",
            " to 2 node(s) in ",
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "rank 3/4 on n2: reading 6 of 24 shards from /tmp/shards-{job_id}",
            "epoch 2: loss ",
        ),
    ),
    "monitoring/gpu_usage.sbatch": Job(
        files=("one-gpu/cnn_gpu.py", "monitoring/summarise_gpu_log.py"),
        args=("--fake-data", "--fake-size", "32", "--epochs", "1", "--batch-size", "16"),
        expect=(
            "Job {job_id} on ",
            ": sampling the GPUs every 10 s into gpu-usage-{job_id}.csv",
            "GPU samples mean util lowest mean power most memory",
            "Every GPU at 50% or more on average.",
        ),
    ),
    "hangs/hang_demo.sbatch": Job(
        files=("hangs/hang_demo.py",),
        args=("--steps", "4", "--hang-at-step", "2", "--timeout", "120"),
    ),
    "arrays/sweep.sbatch": Job(files=("arrays/sweep_train.py",)),
    "arrays/collect.sbatch": Job(files=("arrays/collect_results.py",)),
    "node-check/node_check.sbatch": Job(
        files=("node-check/node_check.py", "node-check/allreduce_bench.py"),
        args=(
            "--device",
            "cpu",
            "--matrix-size",
            "128",
            "--mem-fraction",
            "0.001",
            "--slow-fraction",  # loopback timings vary too much for the default, 0.5
            "1e-6",
            "--",
            "--device",
            "cpu",
            "--max-bytes",
            "1M",
            "--iters",
            "5",
        ),
        expect=(
            "Job {job_id}: 4 processes on n[1-2], rendezvous at n1:",
            "Node check: 4 ranks on 2 node(s), gloo, matmul 128x128, timeout 60 s",
            "rank 0 on n1, cpu: ",
            "rank 3 on n2, cpu: ",
            "nodes n1 <-> n2, local rank 0: ",  # every local rank, each with its own peer
            "nodes n1 <-> n2, local rank 1: ",
            "All 4 ranks on 2 nodes passed",
            "# all_reduce (sum, float32, in place): 4 ranks on 2 node(s), gloo, cpu (",
            "Peak bus bandwidth: ",
            "with 4 ranks (gloo)",
        ),
    ),
    "profiling/profile.sbatch": Job(
        files=("profiling/profile_steps.py",),
        args=("--device", "cpu", "--steps", "5", "--batch-size", "8", "--image-size", "32"),
        expect=(
            "Job {job_id}: 2 processes on ",
            "rank 0/2 on ",
            "rank 1/2 on ",
            "cpu (gloo): 5 steps of 8 images, recording ProfilerStep#2 to #4",
            "Self CPU time total: ",
            "/profiles/profile-{job_id}/: 2 (rank<N>.<timestamp>.pt.trace.json, one per process)",
        ),
    ),
    "tensorboard/tensorboard.sbatch": Job(
        files=("tensorboard/train_tensorboard.py",),
        args=("--device", "cpu", "--epochs", "2", "--fake-size", "128", "--batch-size", "32"),
        expect=(
            "Job {job_id} on ",
            "4 CPUs",
            ", cpu: 2 epochs of 4 steps, logging to ",
            "/runs/{job_id}-seed0",
            "epoch 2: loss ",
            "Event file: ",
            "    tensorboard --logdir ",
        ),
    ),
    "jupyter/jupyter.sbatch": Job(
        args=("--allow-root",),  # the tests' jobs run as root, which Jupyter refuses without it
        expect=(
            "Job {job_id}: JupyterLab on n",
            "@login.cluster.example.org",
            "End the session with: scancel {job_id}",
        ),
    ),
}
SBATCH_SCRIPTS = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sbatch"))
# Job scripts that start a server and run until scancel or their time limit: the tests that
# wait for a job to end leave them out, and each has a test of its own at the end of this file.
SERVERS = {"jupyter/jupyter.sbatch"}
# Job scripts with a test of their own: a job array and the job that waits for it (submitted
# together by submit_sweep.sh), and a job that hangs on purpose (diagnosed while it hangs).
ARRAYS = {"arrays/sweep.sbatch", "arrays/collect.sbatch"}
HANGS = {"hangs/hang_demo.sbatch"}
OWN_TESTS = SERVERS | ARRAYS | HANGS
FINISHED = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL"}


def job_info(job_id, env):
    out = run(["scontrol", "show", "job", "--oneliner", job_id], cwd="/", env=env).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for(job_id, env, timeout=600):
    """Poll until the job has finished; return scontrol's fields and the job's output. The
    bound counts time in the queue, behind the other tests' jobs: a guard against a hang, not a
    verdict on speed (CI on 5369d1a: a job still PENDING, Reason=Priority, after 180 s)."""
    deadline = time.monotonic() + timeout
    while (info := job_info(job_id, env))["JobState"] not in FINISHED:
        if time.monotonic() > deadline:
            output = Path(info["StdOut"])
            so_far = output.read_text(encoding="utf-8") if output.exists() else ""
            pytest.fail(
                f"job {job_id} still {info['JobState']} after {timeout} s\n{info}\n{so_far}",
                pytrace=False,
            )
        time.sleep(0.2)
    info["output"] = Path(info["StdOut"]).read_text(encoding="utf-8")
    return info


def prepare(job, folder, env):
    """What a reader does on a login node before submitting the job (Job.prepare)."""
    for command in job.prepare:
        run(["bash", "-c", command], cwd=folder, env=env, timeout=300)


def sbatch(*args, cwd, env):
    return run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def cluster(slurm_cluster, tmp_path_factory):
    """Environment for Slurm commands; also submits, at once, a job that overruns its time
    limit (Slurm checks limits about once a minute), so that it ends while the others run."""
    conf, seconds = slurm_cluster
    env = {**os.environ, "SLURM_CONF": str(conf)}
    folder = tmp_path_factory.mktemp("overdue")
    overdue = sbatch(
        "--job-name=overdue", "--time=00:01:00", "--mem=100M", "--output=%x-%j.out",
        "--wrap", "echo started; sleep 600", cwd=folder, env=env,
    )  # fmt: skip
    return {"env": env, "start_seconds": seconds, "overdue": overdue}


def job_env_for(cluster, job_env, job=None, request=None):
    # SLURM_EXACT=1 (srun --exact): a step gets exactly tasks x srun's cores per task, so the
    # allocation that tests/slurm/task_prolog.sh logs shows what srun asked for. Without it,
    # a step without -c gets the whole job's cores, which hides a srun that asks for one core
    # per task (the default of srun in Slurm 22.05 to 23.02) and so binds each task to one core.
    env = {**job_env, "SLURM_CONF": cluster["env"]["SLURM_CONF"], "SLURM_EXACT": "1"}
    if job is not None and job.venv:  # the job activates a venv built by a fixture
        env["VENV"] = env["CONDA_ENV"] = str(request.getfixturevalue(job.venv)[0])
    return env


def test_cluster_has_two_idle_nodes_with_gpus(cluster, record_property):
    record_property("timing", f"Slurm cluster start: {cluster['start_seconds']:.1f} s")
    out = run(
        ["sinfo", "--noheader", "--Node", "--format=%N %c %m %G"], cwd="/", env=cluster["env"]
    )
    nodes = sorted(set(out.stdout.splitlines()))
    assert nodes == ["n1 16 64000 gpu:2", "n2 16 64000 gpu:2"]


def test_every_slurm_job_script_has_a_test():
    assert sorted(JOBS) == SBATCH_SCRIPTS, "add the new job script to JOBS in tests/test_slurm.py"


# The jobs of the two tests that submit every job script as it is and broken
# (test_job_script_completes_under_slurm, test_a_broken_job_script_fails_under_slurm), less
# those that activate a venv a fixture builds: submitted all at once by the first of them, so
# that the cluster runs them side by side while each test collects its own.
COMPLETES = [s for s in SBATCH_SCRIPTS if s not in OWN_TESTS]
BREAKABLE = [s for s in SBATCH_SCRIPTS if s not in SERVERS | ARRAYS]
FAULTS = ["wrong module", "missing file"]
BATCHED = [
    *((script, None) for script in COMPLETES if not JOBS[script].venv),
    *((script, fault) for script in BREAKABLE if not JOBS[script].venv for fault in FAULTS),
]


def submit(script, fault, folder, env):
    """Copy a job script and its files into folder (breaking it by fault: a module name with
    a typo, or its files left out), prepare it as a reader would, and submit it; returns the
    job id and the message its output must show when broken."""
    job = JOBS[script]
    copy_example(folder, script, *job.files)
    name = script.split("/")[-1]
    message = None
    if fault == "wrong module":
        text = (folder / name).read_text()
        module = re.search(r"^module load (\S+)", text, re.M)
        assert module, f"{script} loads no module"
        (folder / name).write_text(text.replace(module[0], module[0] + "-typo", 1))
        message = "unknown"
    elif fault == "missing file":
        for extra in job.files:
            (folder / extra.split("/")[-1]).unlink()
        message = "No such file"
    prepare(job, folder, env)
    return sbatch(name, *job.args, cwd=folder, env=env), message


@pytest.fixture(scope="module")
def batch(cluster, tmp_path_factory, request):
    """{(script, fault): (job id, environment, message, example files it ran)} of the BATCHED
    jobs whose tests this run selected (make test PYTEST_ARGS='-k ddp' submits only those)."""
    selected = {
        (item.callspec.params["script"], item.callspec.params.get("fault"))
        for item in request.session.items
        if item.originalname in ("test_job_script_completes_under_slurm",
                                 "test_a_broken_job_script_fails_under_slurm")
    }  # fmt: skip
    submitted = {}
    for script, fault in (job for job in BATCHED if job in selected):
        folder = tmp_path_factory.mktemp("job")
        env = job_env_for(cluster, make_job_env(folder))
        with records.followed() as ran:
            job_id, message = submit(script, fault, folder, env)
        submitted[script, fault] = (job_id, env, message, set(ran))
    return submitted


def collect(batch, script, fault, cluster, job_env, tmp_path, request):
    """The job of script (broken by fault) from the batch, or submitted now: (its id,
    scontrol's fields and its output, the message a broken job must show)."""
    if (script, fault) in batch:
        job_id, env, message, ran = batch[script, fault]
        records.credit(ran)  # this test judges the job the batch ran for it
        info = wait_for(job_id, env, timeout=900)  # behind every job of the batch, at worst
    else:
        env = job_env_for(cluster, job_env, JOBS[script], request)
        job_id, message = submit(script, fault, tmp_path, env)
        info = wait_for(job_id, env)
    return job_id, info, message


@pytest.mark.parametrize("script", COMPLETES)
def test_job_script_completes_under_slurm(
    cluster, batch, job_env, tmp_path, script, record_property, request
):
    job = JOBS[script]
    job_id, info, _ = collect(batch, script, None, cluster, job_env, tmp_path, request)
    record_property("timing", f"Slurm job {script}: ran {info['RunTime']}")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"]
    job.assert_printed(info["output"], job_id)
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", (EXAMPLES / script).read_text(), re.M)
    if nodes and int(nodes[1]) > 1:  # a multi-node script must really use every node
        for node in ("n1", "n2"):
            assert node in info["output"], f"no output from {node}:\n{info['output']}"
    if SRUN_LINE.search(commands(script)):
        check_step_cores(cluster, job_id, info)
    if script in RECORDED:  # the first job page shows this run's output
        check_recorded(RECORDED[script], in_rank_order(info["output"]), volatile=JOB_AND_PORT)


# Job scripts whose output a page shows: recorded from their run above (tests/recorded.py).
RECORDED = {"first-job/check_distributed.sbatch": EXAMPLES / "first-job" / "check_distributed.out"}
JOB_AND_PORT = [(r"^Job \d+: ", "Job …: "), (r"rendezvous at (\S+):\d+$", r"rendezvous at \1:…")]


def in_rank_order(output):
    """srun passes on the lines of the tasks as they come, so rank 0's summary may come before
    another rank's line: the lines before the first rank's, the ranks' in rank order, the rest."""
    lines = output.splitlines(keepends=True)
    ranks = [i for i, line in enumerate(lines) if line.startswith("rank ")]
    if not ranks:
        return output
    by_rank = sorted((lines[i] for i in ranks), key=lambda line: int(line.split()[1].split("/")[0]))
    rest = [line for i, line in enumerate(lines) if i not in ranks and i > ranks[0]]
    return "".join(lines[: ranks[0]] + by_rank + rest)


def commands(script):
    """The job script's text with each command on one line (continuation lines joined)."""
    return re.sub(r"\\\n\s*", " ", (EXAMPLES / script).read_text())


# A command of a job script that starts tasks with srun.
SRUN_LINE = re.compile(r"^[ \t]*(?:exec[ \t]+)?srun[ \t].*$", re.M)


def check_step_cores(cluster, job_id, info):
    """Every srun step of the job got, per task, the cores the job asked for, as Slurm
    allocated them (tests/slurm/task_prolog.sh logs each step's allocation)."""
    log = Path(cluster["env"]["SLURM_CONF"]).parent.parent / "log" / "steps.log"
    steps = {}
    for line in log.read_text().splitlines():
        step, _task, *fields = line.split()
        if step.split(".")[0] == job_id:
            steps[step] = dict(field.split("=", 1) for field in fields)
    assert steps, f"no srun step of job {job_id} in {log}"
    per_task = int(info["CPUs/Task"])
    for step, fields in steps.items():
        assert {"CPUs", "Tasks"} <= fields.keys(), (step, fields)  # scontrol failed in the prolog
        assert int(fields["CPUs"]) == int(fields["Tasks"]) * per_task, (step, fields, per_task)


@pytest.mark.parametrize("script", [s for s in SBATCH_SCRIPTS if SRUN_LINE.search(commands(s))])
def test_srun_passes_cores_per_task_and_kills_the_step_on_a_failed_task(script):
    """Slurm 22.05 to 23.02: srun does not inherit --cpus-per-task from the job, so each srun
    passes it; and one task that fails must end the step, not leave the others waiting."""
    for line in SRUN_LINE.findall(commands(script)):
        assert 'srun -c "$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 ' in line, line


# Job scripts whose srun starts `python <script>.py` or `torchrun ... <script>.py`: each gets a
# stand-in script whose rank 1 (the task with SLURM_PROCID 1) fails.
SRUN_STARTS = re.compile(r"^[ \t]*srun[ \t].*?\b(?:python3?|torchrun)[ \t].*?(\S+\.py)\b", re.M)
SRUN_PYTHON = {s: m[1] for s in SBATCH_SCRIPTS if (m := SRUN_STARTS.search(commands(s)))}


def test_every_srun_job_gets_a_failed_task_test():
    """Each job script that starts tasks with srun is one test_one_failed_task_ends_the_job
    knows how to break (its srun runs python or torchrun with a .py script). A step that runs
    beside the tasks (--overlap) and starts no Python, such as a GPU sampler, is not one."""
    with_srun = [
        s for s in SBATCH_SCRIPTS
        if any("--overlap" not in line or ".py" in line for line in SRUN_LINE.findall(commands(s)))
    ]  # fmt: skip
    assert with_srun and sorted(SRUN_PYTHON) == with_srun


@pytest.mark.parametrize("script", sorted(SRUN_PYTHON))
def test_one_failed_task_ends_the_job(cluster, job_env, tmp_path, script):
    """Rank 1 exits at once with an error while the others would run for minutes: with
    --kill-on-bad-exit=1 srun ends the step and the job fails within seconds."""
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    (tmp_path / SRUN_PYTHON[script]).write_text(
        "import os, sys, time\n"
        "if os.environ['SLURM_PROCID'] == '1':\n"
        "    sys.exit('rank 1: failing on purpose')\n"
        "time.sleep(300)\n"
    )
    env = job_env_for(cluster, job_env, job)
    prepare(job, tmp_path, env)
    start = time.perf_counter()
    info = wait_for(
        sbatch(script.split("/")[-1], *job.args, cwd=tmp_path, env=env), env, timeout=90
    )
    assert info["JobState"] == "FAILED", info["output"]
    assert "rank 1: failing on purpose" in info["output"], info["output"]
    assert time.perf_counter() - start < 60, info["output"]


GPU_INDEX_PROBE = """
import importlib.util, os, sys
visible = len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
local = int(os.environ["SLURM_LOCALID"])
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("probe_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    index = module.gpu_index(local, visible)
    print(os.path.basename(path), local, visible, index, os.environ["CUDA_VISIBLE_DEVICES"])
"""
GPU_SCRIPTS = sorted(p for p in EXAMPLES.rglob("*.py") if "def gpu_index(" in p.read_text())


@pytest.mark.parametrize(
    ("request_gpus", "per_task"),
    [("--gpus-per-task=1", True), ("--gpus-per-node=2", False)],
    ids=["gpus-per-task", "gpus-per-node"],
)
def test_scripts_pick_their_gpu_as_slurm_binds_it(cluster, tmp_path, request_gpus, per_task):
    """Two tasks on one node. With --gpus-per-task=1 Slurm gives each task its own GPU, which
    the task sees as device 0; with --gpus-per-node=2 both see both and take their local rank.
    Each distributed script's gpu_index() must follow what the task sees."""
    assert GPU_SCRIPTS, "no example defines gpu_index()"
    (tmp_path / "probe.py").write_text(GPU_INDEX_PROBE)
    proc = run(
        ["srun", "--nodes=1", "--ntasks=2", request_gpus, "--time=1", sys.executable,
         "probe.py", *GPU_SCRIPTS], cwd=tmp_path, env=cluster["env"],
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 * len(GPU_SCRIPTS), proc.stdout + proc.stderr
    for line in lines:
        _name, local, visible, index, _devices = line.split()
        want = f"{local} 1 0" if per_task else f"{local} 2 {local}"
        assert f"{local} {visible} {index}" == want, line
    bound = {line.split()[1]: line.split()[4] for line in lines}  # local rank: its GPUs
    assert len(set(bound.values())) == (2 if per_task else 1), bound  # per task: one GPU each


# The scripts that the job scripts' srun starts (one per task, or per torchrun worker).
def started_script(job_script, name):
    """The example file of that name: one the job copies beside it (Job.files), else its own."""
    files = [f for f in JOBS[job_script].files if Path(f).name == name]
    return EXAMPLES / (files[0] if files else Path(job_script).parent / name)


STARTED_BY_SRUN = sorted({started_script(s, name) for s, name in SRUN_PYTHON.items()})
PICKS_A_GPU = re.compile(r'set_device\(|torch\.device\("cuda", ')


@pytest.mark.parametrize(
    "path", STARTED_BY_SRUN, ids=[str(p.relative_to(EXAMPLES)) for p in STARTED_BY_SRUN]
)
def test_scripts_started_by_srun_pick_their_gpu_with_gpu_index(path):
    """A task of `srun --gpus-per-task=1` sees one GPU, device 0, whatever its local rank: a
    script started by srun that picks its CUDA device itself must do so with gpu_index()
    (checked by test_scripts_pick_their_gpu_as_slurm_binds_it), not with the local rank."""
    text = path.read_text()
    assert not PICKS_A_GPU.search(text) or path in GPU_SCRIPTS, f"{path.name}: no gpu_index()"


@pytest.mark.parametrize("script", BREAKABLE)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_job_script_fails_under_slurm(
    cluster, batch, job_env, tmp_path, script, fault, request
):
    _, info, message = collect(batch, script, fault, cluster, job_env, tmp_path, request)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info["output"]
    assert message in info["output"], info["output"]


def test_impossible_request_is_rejected_at_submission(cluster, tmp_path):
    proc = run(
        ["sbatch", "--gpus-per-node=3", "--wrap", "true"],
        cwd=tmp_path,
        env=cluster["env"],
        expect_rc=1,
    )
    assert "Requested node configuration is not available" in proc.stderr


def test_a_two_node_step_runs_on_both_nodes(cluster, tmp_path):
    proc = run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--time=1", "printenv", "SLURMD_NODENAME"],
        cwd=tmp_path, env=cluster["env"],
    )  # fmt: skip
    assert sorted(proc.stdout.split()) == ["n1", "n2"]


def test_a_job_over_its_time_limit_ends_in_timeout(cluster):
    info = wait_for(cluster["overdue"], cluster["env"], timeout=180)
    assert info["JobState"] == "TIMEOUT", info
    assert "started" in info["output"]
    assert re.search(
        rf"\*\*\* JOB {cluster['overdue']} ON n\d CANCELLED AT \S+ DUE TO TIME LIMIT \*\*\*",
        info["output"],
    )


def test_preemptible_job_on_usr1_saves_requeues_itself_and_resumes(
    cluster, job_env, tmp_path, record_property
):
    """USR1 to the batch shell, as --signal=B:USR1@120 sends it before the time limit: the job
    script passes it on, Python saves a checkpoint, the script requeues the job, and the new
    run (same job id, same checkpoint folder) resumes and ends after the requested epochs."""
    script = "preemption/preemptible.sbatch"
    copy_example(tmp_path, script, *JOBS[script].files)
    env = job_env_for(cluster, job_env)
    args = ("--device", "cpu", "--fake-data", "--fake-size", "2048", "--epochs", "8")
    start = time.perf_counter()
    job_id = sbatch("--cpus-per-task=2", "preemptible.sbatch", *args, cwd=tmp_path, env=env)
    output = tmp_path / f"preemptible-{job_id}.out"
    deadline = time.monotonic() + 120
    while not (output.exists() and "epoch 1:" in output.read_text(encoding="utf-8")):
        if job_info(job_id, env)["JobState"] in FINISHED or time.monotonic() > deadline:
            pytest.fail(f"no epoch 1 from job {job_id}:\n{wait_for(job_id, env)['output']}")
        time.sleep(0.2)
    run(["scancel", "--signal=USR1", "--batch", job_id], cwd=tmp_path, env=env)
    # Slurm holds a requeued job for AuthInfo's cred_expire, 30 s in tests/slurm/slurm.conf.in
    # (120 s by default), then starts it at its next pass over the queue.
    info = wait_for(job_id, env, timeout=300)
    record_property(
        "timing", f"Slurm requeue of preemptible.sbatch: {time.perf_counter() - start:.1f} s"
    )
    out = info["output"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert re.search(r"^SIGUSR1: checkpoint saved at epoch \d, step \d+$", out, re.M), out
    assert f"Requeuing job {job_id}: it will resume from {tmp_path}/preemptible-{job_id}" in out
    assert "SLURM_RESTART_COUNT=0" in out and "SLURM_RESTART_COUNT=1" in out
    assert f"resumed from {tmp_path}/preemptible-{job_id}/checkpoint.pt at epoch " in out
    epochs = [int(n) for n in re.findall(r"^epoch (\d+): loss ", out, re.M)]
    assert epochs == list(range(1, 9)) and "finished: 8 epochs" in out, out  # none twice
    waited = datetime.fromisoformat(info["StartTime"]) - datetime.fromisoformat(info["SubmitTime"])
    record_property("timing", f"Slurm requeue: the job waited {waited.total_seconds():.0f} s")


def test_a_damaged_shard_stops_the_job_before_training(cluster, job_env, tmp_path):
    """A shard that changed after make_shards.py wrote its checksum (a copy cut short, a
    damaged disk): the staging step's sha256sum fails on each node and no training starts."""
    script = "data/train_shards.sbatch"
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    env = job_env_for(cluster, job_env, job)
    prepare(job, tmp_path, env)
    shard = tmp_path / "shards" / "shard-000003.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])
    info = wait_for(sbatch("train_shards.sbatch", *job.args, cwd=tmp_path, env=env), env)
    assert info["JobState"] == "FAILED", info["output"]
    assert "shard-000003.tar: FAILED" in info["output"], info["output"]
    # (sha256sum's closing warning on stderr may be lost when srun ends the step at once.)
    assert "Job " not in info["output"] and "epoch" not in info["output"], info["output"]
    assert not Path(f"/tmp/shards-{info['JobId']}").exists(), "staged copies left behind"


# Scripts that start a distributed job: they must choose their port per job.
DISTRIBUTED = [
    s
    for s in SBATCH_SCRIPTS
    if s not in OWN_TESTS and "SLURM_JOB_ID % 10000" in (EXAMPLES / s).read_text()
]


@pytest.mark.parametrize("script", DISTRIBUTED)
def test_two_copies_of_a_distributed_job_share_a_node(cluster, job_env, tmp_path, script):
    """Both copies run on n1 at the same time; with a fixed port the second would fail with
    "Address already in use"."""
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    env = job_env_for(cluster, job_env)
    prepare(job, tmp_path, env)
    # One GPU each, in the form of the cluster's site file (the script asks for GPUs that way).
    one_node = ["--nodelist=n1", "--nodes=1", "--cpus-per-task=1", GPU_REQUEST(1),
                "--mem=8G"]  # fmt: skip
    tasks = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", (EXAMPLES / script).read_text(), re.M)
    if tasks and int(tasks[1]) > 1:  # one task per GPU: two tasks; one torchrun per node: one
        one_node.append("--ntasks-per-node=2")
    # One epoch: the point is two rendezvous at once, which happen before the first.
    args = list(job.args)
    if "--epochs" in args:
        args[args.index("--epochs") + 1] = "1"
    ids = [sbatch(*one_node, script.split("/")[-1], *args, cwd=tmp_path, env=env) for _ in "ab"]
    first, second = (wait_for(job_id, env) for job_id in ids)
    for info in (first, second):
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"]
    assert first["StartTime"] <= second["EndTime"] and second["StartTime"] <= first["EndTime"]
    ports = {re.search(r"rendezvous at \S+:(\d+)", info["output"])[1] for info in (first, second)}
    assert len(ports) == 2


def test_a_container_without_gpu_devices_stops_every_process(cluster, job_env, tmp_path):
    """apptainer.sbatch in a job given GPUs whose container has no GPU device files (here the
    cluster's GPUs are a count; on a GPU node, a container started without --nv, or with
    --contain): every process stops in one line saying how to start the container, and the
    job fails; none trains on the CPU."""
    script = "containers/apptainer.sbatch"
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    env = job_env_for(cluster, job_env)
    prepare(job, tmp_path, env)
    info = wait_for(sbatch("apptainer.sbatch", cwd=tmp_path, env=env), env)
    assert info["JobState"] == "FAILED", info["output"]
    stops = re.findall(r"^check_distributed\.py: error: this job was given GPUs \(SLURM_STEP_GPUS="
                       r"\S+\) but PyTorch \S+ can use none: start the container with GPU "
                       r"support \(apptainer --nv, podman --gpus all\), or pass --device cpu$",
                       info["output"], re.M)  # fmt: skip
    assert stops, info["output"]
    assert "reached each other" not in info["output"] and "sum 10" not in info["output"]


def http_get(url, host):
    """(status, body) of a GET of url with the Host header a browser at host sends (no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Host": host})
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def port_accepts(host, port):
    """Whether a TCP connection to host:port is accepted now."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_jupyter_server_starts_answers_and_stops(cluster, job_env, tmp_path):
    """jupyter.sbatch runs until scancel: it prints the tunnel and the URL, the server answers
    with the token (and refuses without it), and scancel stops it and removes its runtime dir."""
    script = "jupyter/jupyter.sbatch"
    job = JOBS[script]
    copy_example(tmp_path, script)
    env = job_env_for(cluster, job_env)
    job_id = sbatch("jupyter.sbatch", *job.args, cwd=tmp_path, env=env)
    output = tmp_path / f"jupyter-{job_id}.out"
    deadline, out = time.monotonic() + 90, ""
    try:
        # The script prints the tunnel, then Jupyter logs that it listens.
        while not re.search(r"Jupyter Server \S+ is running at:", out):
            if job_info(job_id, env)["JobState"] in FINISHED or time.monotonic() > deadline:
                pytest.fail(f"no running JupyterLab in job {job_id}:\n{out}", pytrace=False)
            time.sleep(0.5)
            out = output.read_text(encoding="utf-8") if output.exists() else ""
        tunnel = re.search(r"^    ssh -N -L (\d+):(\S+):(\d+) \S+@login\.cluster\.example\.org$",
                           out, re.M)  # fmt: skip
        assert tunnel and tunnel[1] == tunnel[3], out
        port, node = int(tunnel[1]), tunnel[2]
        assert node in ("n1", "n2") and port != 8888 and port >= 20000 + int(job_id) % 10000, out
        token = re.search(rf"^    http://localhost:{port}/lab\?token=([0-9a-f]{{48}})$", out, re.M)
        assert token, out
        job.assert_printed(out, job_id)
        assert output.stat().st_mode & 0o777 == 0o600, "the output holds the token: private"
        runtime = Path("/tmp", f"jupyter-{job_id}")
        assert runtime.stat().st_mode & 0o777 == 0o700, out
        assert (runtime / "token").read_text() == token[1]
        # Jupyter prints "is running at" before its event loop binds the port: wait for it.
        while not port_accepts(node, port):
            if job_info(job_id, env)["JobState"] in FINISHED or time.monotonic() > deadline:
                out = output.read_text(encoding="utf-8")
                pytest.fail(f"job {job_id} never listened on {node}:{port}:\n{out}", pytrace=False)
            time.sleep(0.5)
        # What the browser sends through the tunnel: Host localhost:<port>.
        api = f"http://{node}:{port}/api/status"
        status, body = http_get(f"{api}?token={token[1]}", f"localhost:{port}")
        assert status == 200 and {"started", "kernels"} <= json.loads(body).keys(), body
        assert http_get(api, f"localhost:{port}")[0] == 403  # no token: Forbidden
    finally:
        run(["scancel", job_id], cwd=tmp_path, env=env)
    info = wait_for(job_id, env, timeout=60)
    out = info["output"]
    assert info["JobState"] == "CANCELLED", out
    # Slurm's SIGTERM reached the server, which shut down; then the script's traps ran.
    assert "received signal 15, stopping" in out, out
    assert re.search(r"Shutting down \d+ extensions", out), out
    assert f"Job {job_id}: stopping JupyterLab" in out, out
    assert not runtime.exists(), out


SWEEP_FILES = tuple(
    f"arrays/{name}"
    for name in ("sweep.sbatch", "collect.sbatch", "submit_sweep.sh", "make_sweep.py",
                 "sweep_train.py", "collect_results.py")
)  # fmt: skip


def submit_sweep(cluster, job_env, tmp_path, sweep=None, **variables):
    """make_sweep.py (or the given sweep.csv), then submit_sweep.sh with these variables:
    (array id, collect id, environment, the sweep's own folder)."""
    copy_example(tmp_path, *SWEEP_FILES)
    env = {**job_env_for(cluster, job_env), "MAX_RUNNING": "2", **variables}
    if sweep is None:
        run([sys.executable, "make_sweep.py", "--lr", "0.1", "0.01", "--batch-size", "32", "128"],
            cwd=tmp_path, env=env)  # fmt: skip
    else:
        (tmp_path / "sweep.csv").write_text(sweep)
    out = run(["bash", "submit_sweep.sh", "--epochs", "1"], cwd=tmp_path, env=env).stdout
    ids = re.search(r"^Submitted array job (\d+) \(4 tasks\) and collect job (\d+) ", out, re.M)
    folder = re.search(r"^Sweep and results in (sweeps/[\w-]+); ", out, re.M)
    assert ids and folder, out
    return ids[1], ids[2], env, folder[1]


def test_a_sweep_runs_as_a_throttled_array_then_one_job_collects_it(cluster, job_env, tmp_path):
    """Submitted held (SBATCH_HOLD), and released once make_sweep.py has rewritten sweep.csv
    with other values: every task trains its row as submitted, from the sweep's own folder."""
    array, collect, env, sweep_dir = submit_sweep(cluster, job_env, tmp_path, SBATCH_HOLD="1")
    run([sys.executable, "make_sweep.py", "--lr", "0.5", "0.05", "--batch-size", "64", "256"],
        cwd=tmp_path, env=env)  # fmt: skip
    run(["scontrol", "release", f"{array},{collect}"], cwd=tmp_path, env=env)
    info = wait_for(collect, env, timeout=240)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"]
    assert info["Dependency"] == "(null)" or array in info["Dependency"]
    table = re.findall(r"^ +(\d) +0\.0?1 +(?:32|128) +0 +[\d.]+ +[\d.]+ +[\d.]+$",
                       info["output"], re.M)  # fmt: skip
    assert sorted(table) == ["0", "1", "2", "3"], info["output"]
    assert "Best: task " in info["output"]
    for task in range(4):  # one output file per task: %A_%a
        out = (tmp_path / f"sweep-{array}_{task}.out").read_text()
        assert f"Array job {array}, task {task} of 0-3 on " in out, out
        assert f"task {task}: lr=" in out, out
    throttle = run(["scontrol", "show", "job", array], cwd=tmp_path, env=env).stdout
    assert "ArrayTaskThrottle=2" in throttle, throttle
    summary = (tmp_path / sweep_dir / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("task,lr,") and len(summary) == 5, summary
    assert sorted(line.split(",")[1] for line in summary[1:]) == ["0.01", "0.01", "0.1", "0.1"]
    assert not (tmp_path / "results").exists()


def test_a_failed_task_cancels_the_collecting_job(cluster, job_env, tmp_path):
    """afterok is never satisfied when a task fails; --kill-on-invalid-dep=yes cancels the
    collecting job instead of leaving it pending for ever."""
    sweep = "lr,batch_size,seed\n0.1,32,0\n0.1,64,0\nnot-a-number,32,0\n0.01,32,0\n"
    array, collect, env, sweep_dir = submit_sweep(cluster, job_env, tmp_path, sweep)
    deadline = time.monotonic() + 120
    while (info := job_info(collect, env))["JobState"] not in FINISHED:
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    assert info["JobState"] == "CANCELLED", info
    assert not (tmp_path / f"collect-{collect}.out").exists()
    failed = (tmp_path / f"sweep-{array}_2.out").read_text()
    assert f"sweep_train.py: error: row 2 of {sweep_dir}/sweep.csv needs lr, batch_size " in failed


def test_dump_stacks_shows_where_each_rank_of_a_hung_job_waits(cluster, job_env, tmp_path):
    """The documented diagnosis: py-spy through srun --overlap on each node of the running job
    shows rank 0 (n1) waiting in all_reduce and rank 1 (n2) in the barrier."""
    script = "hangs/hang_demo.sbatch"
    job = JOBS[script]
    copy_example(tmp_path, script, "hangs/dump_stacks.sh", *job.files)
    env = job_env_for(cluster, job_env)
    job_id = sbatch("hang_demo.sbatch", *job.args, cwd=tmp_path, env=env)
    output = tmp_path / f"hang-demo-{job_id}.out"
    try:
        deadline, out = time.monotonic() + 90, ""
        while "rank 1: step 4 done" not in out:  # rank 1 is in the barrier now
            assert time.monotonic() < deadline, out
            assert job_info(job_id, env)["JobState"] not in FINISHED, out
            time.sleep(0.5)
            out = output.read_text() if output.exists() else ""
        time.sleep(1)  # rank 0 has entered its last all_reduce
        dump = run(["bash", "dump_stacks.sh", job_id], cwd=tmp_path, env=env, timeout=60).stdout
    finally:
        run(["scancel", job_id], cwd=tmp_path, env=env)
    # srun --label: "0: " on the lines of the first node's task, "1: " on the second's.
    lines = sorted(dump.splitlines(keepends=True), key=lambda line: int(line.split(":")[0]))
    by_node = "".join(lines)
    sections = dict(re.findall(r"^\d: === (n\d), process \d+: (.*?)(?=^\d: === |\Z)", by_node,
                               re.M | re.S))  # fmt: skip
    assert sorted(sections) == ["n1", "n2"], dump
    for node, waits_in in (("n1", "all_reduce"), ("n2", "barrier")):
        stack = sections[node]
        assert re.match(r"\S*python hang_demo\.py --steps 4 ", stack), dump
        assert re.search(rf"^\d: +{waits_in} \(torch/distributed/distributed_c10d\.py:\d+\)$",
                         stack, re.M), dump  # fmt: skip
        assert re.search(r"^\d: +main \(hang_demo\.py:\d+\)$", stack, re.M), dump
    # The page shows this dump, each node's lines together, with the venv where a reader has it.
    check_recorded(
        EXAMPLES / "hangs" / "dump_stacks.out",
        by_node.replace(str(Path(sys.executable).parent.parent), "/home/user/venvs/pytorch"),
        volatile=[(r"(?<=[Pp]rocess )\d+|(?<=Thread )\d+", "…"), (r"\.py:\d+\)", ".py:…)"),
                  (r"Python v.*$", "Python v…")],
    )  # fmt: skip
    assert wait_for(job_id, env, timeout=60)["JobState"] == "CANCELLED"


# make site-check against this cluster. A variant of its site file whose CPU partition does
# not exist and which asks for node-local disk (the nodes declare none), and a benchmark that
# needs a real GPU: every outcome a centre can meet, in one run of six job scripts.
SITE_CHECK = {
    "first-job/check_pytorch.sbatch": "passed",
    "ddp/ddp_srun.sbatch": "passed",
    "jupyter/jupyter.sbatch": "passed",  # a server: passes once it serves, then cancelled
    "cpu-threads/cnn_cpu.sbatch": "refused",  # CPU partition "nosuch"
    "data/train_shards.sbatch": "refused",  # --tmp=50G
    "benchmark/resnet_benchmark.sbatch": "failed",  # no CUDA here
}


def site_variant(folder, **scheduler):
    """The cluster's site file with [scheduler] keys changed or added, as folder/<same name>."""
    text = TEST_SITES["slurm"].read_text(encoding="utf-8")
    for key, value in scheduler.items():
        line = f"{key} = {json.dumps(value)}"
        text, found = re.subn(rf"^{key} = .*$", line, text, flags=re.M)
        if not found:
            text = text.replace("[scheduler]\n", f"[scheduler]\n{line}\n")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TEST_SITES["slurm"].name
    path.write_text(text, encoding="utf-8")
    return path


def test_site_check_records_each_outcome_and_the_edition_shows_it(cluster, job_env, tmp_path):
    site = site_variant(tmp_path / "site", cpu_partition="nosuch", local_disk=True)
    env = job_env_for(cluster, job_env)
    only = " ".join(SITE_CHECK)
    proc = run(["make", "--no-print-directory", "site-check", f"SITE={site}",
                f"CHECK_ARGS=--only {only} --work-dir {tmp_path / 'work'}"],
               cwd=EXAMPLES.parent, env=env, timeout=600, expect_rc=2)  # fmt: skip
    out = proc.stdout
    assert "the tests' Slurm cluster: 3 of 6 job scripts passed. Record: " in out, out
    # The report: the scheduler's message for a refused job, the end of a failed job's log.
    assert re.search(r"^refused +cpu-threads/cnn_cpu\.sbatch .*\n +sbatch: error: .*[Pp]artition",
                     out, re.M), out  # fmt: skip
    assert re.search(r"^refused +data/train_shards\.sbatch .*\n +sbatch: error: .*", out, re.M), out
    failed_report = r"^failed +benchmark/resnet_benchmark\.sbatch .*\n +FAILED \d+:0\n( +\| .*\n)+"
    assert re.search(failed_report, out, re.M), out

    record = json.loads(site.with_name("slurm-test-cluster.record.json").read_text())
    assert record["suite"] == "site" and record["site"]["name"] == "the tests' Slurm cluster"
    entries = record["examples"]
    assert {name: e["tests"]["site-check"][0] for name, e in entries.items()} == SITE_CHECK
    srun = entries["ddp/ddp_srun.sbatch"]
    # Given 4 GPUs, ran on none: the cluster's GPUs are not real and its PyTorch is a CPU build,
    # so the stamp names no GPU (tests/test_edition.py counts those a GPU job's output names).
    assert (srun["nodes"], srun["gpus_given"], srun["gpus"], srun["state"]) == (
        "n[1-2]", 4, 0, "COMPLETED 0:0"), srun  # fmt: skip
    assert srun["torch"].split("+")[0] == VERSIONS["cpu"]["torch"], srun  # from check_pytorch.py
    assert srun["scheduler"].startswith("slurm"), srun  # sinfo --version: "slurm-wlm 22.05.8"
    assert "partition" in entries["cpu-threads/cnn_cpu.sbatch"]["message"].lower()
    failed = entries["benchmark/resnet_benchmark.sbatch"]
    assert failed["log_tail"] and "resnet_benchmark.py: error:" in "\n".join(failed["log_tail"]), (
        failed
    )
    assert not srun["log_tail"]

    # The centre's edition, built with that record: its job scripts and its stamps.
    built = tmp_path / "html"
    build_edition(site, built)
    first_job = text_of(built / "getting-started" / "first-job.html")
    date = srun["date"]
    assert (
        f"Verified at the tests' Slurm cluster on {date}: 1 of 2 job scripts passed · "
        "not run there in their current version: check_distributed.sbatch"
    ) in first_job
    assert (
        "Edition of the tests' Slurm cluster: GPU jobs go to debug; CPU jobs to nosuch; GPUs "
        "are requested with --gres=gpu:N; the account is tests" in first_job
    )
    benchmark = text_of(built / "performance" / "gpu-benchmark.html")
    assert "0 of 1 job script passed · failed there: resnet_benchmark.sbatch" in benchmark
    ddp = text_of(built / "distributed" / "ddp.html")
    assert "× GPU" not in ddp and "#SBATCH --gres=gpu:2" in ddp and "##SBATCH" not in ddp
    downloads = list((built / "_downloads").rglob("ddp_srun.sbatch"))
    assert downloads and "#SBATCH --partition=debug" in downloads[0].read_text()


def text_of(path):
    """A built page's text, from its stamp on."""
    text = page_text(path)
    return (
        re.search(r"Scripts on this page: .*? \(How this guide is tested\)", text)[0]
        + text.split("(How this guide is tested)", 1)[1]
    )


def test_ctrl_c_cancels_the_jobs_of_site_check(cluster, job_env, tmp_path):
    env = job_env_for(cluster, job_env)
    proc = subprocess.Popen(
        [sys.executable, EXAMPLES.parent / "edition" / "site_check.py", TEST_SITES["slurm"],
         "--only", "ddp/ddp_torchrun.sbatch", "--work-dir", tmp_path / "work",
         "--record", tmp_path / "record.json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        if line.startswith("submitted ddp/ddp_torchrun.sbatch: job "):
            job_id = line.split()[-1]
            break
    else:
        pytest.fail(f"site-check submitted nothing:\n{proc.stderr.read()}")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert err.strip().endswith(
        f"site_check.py: interrupted (Ctrl-C): cancelled 1 job(s) ({job_id}); no record written"
    ), err
    assert "Traceback" not in err and not (tmp_path / "record.json").exists()
    deadline = time.monotonic() + 30
    while job_info(job_id, cluster["env"])["JobState"] != "CANCELLED":
        assert time.monotonic() < deadline, job_info(job_id, cluster["env"])
        time.sleep(0.2)


@pytest.mark.parametrize(
    "name", [name for name, path in CENTRE_SITES.items() if 'kind = "slurm"' in path.read_text()]
)
def test_every_directive_of_a_centres_edition_is_one_sbatch_accepts(cluster, tmp_path, name):
    """sbatch --test-only reads every #SBATCH line of the centre's scripts: an option it does
    not know or a value it cannot parse stops it before it asks the controller. The cluster
    may then refuse what it does not have (the centre's partition, QoS, GPU type): the
    controller's "allocation failure", which is about this cluster, not the script."""
    edition = centre_edition(name, tmp_path)
    scripts = sorted(edition.rglob("*.sbatch"))
    assert len(scripts) > 30
    bad = {}
    for script in scripts:
        proc = run(["sbatch", "--test-only", script], cwd=script.parent, env=cluster["env"],
                   expect_rc=None)  # fmt: skip
        if proc.returncode != 0 and "\nallocation failure: " not in f"\n{proc.stderr}":
            bad[script.relative_to(edition).as_posix()] = proc.stderr.strip()
    assert not bad, bad
    # The check can fail: a directive sbatch cannot parse stops it with its own message.
    broken = tmp_path / "broken.sbatch"
    broken.write_text(scripts[0].read_text().replace("#SBATCH --time=", "#SBATCH --time=soon", 1))
    proc = run(["sbatch", "--test-only", broken], cwd=tmp_path, env=cluster["env"],
               expect_rc=None)  # fmt: skip
    assert proc.returncode != 0 and "allocation failure" not in proc.stderr, proc.stderr
    assert "Invalid --time specification" in proc.stderr, proc.stderr


def test_a_site_that_asks_per_gpu_runs_its_jobs_with_their_cores(cluster, job_env, tmp_path):
    """scheduler.per_gpu: GPU jobs ask with --cpus-per-gpu and --mem-per-gpu, as such. The
    scripts read SLURM_CPUS_PER_TASK (srun -c, threads), which --cpus-per-gpu does not set:
    the edition derives it, and the two-node DDP job runs with each task's cores."""
    site = site_variant(tmp_path / "site", per_gpu=True, cores_per_gpu=1, memory_per_gpu="200M")
    generate(load(site), tmp_path / "edition")
    script = tmp_path / "edition" / "examples" / "ddp" / "ddp_srun.sbatch"
    text = script.read_text()
    assert re.search(r"^#SBATCH --cpus-per-gpu=1 ", text, re.M), text
    assert re.search(r"^#SBATCH --mem-per-gpu=200M ", text, re.M), text
    assert not re.search(r"^#SBATCH --(cpus-per-task|mem)=", text, re.M), text
    job = JOBS["ddp/ddp_srun.sbatch"]
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy2(script, folder)
    shutil.copy2(EXAMPLES / "ddp" / "ddp.py", folder)
    env = job_env_for(cluster, job_env)
    job_id = sbatch("ddp_srun.sbatch", *job.args, cwd=folder, env=env)
    info = wait_for(job_id, env)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info["output"]
    job.assert_printed(info["output"], job_id)
    assert info.get("CPUs/Task", "1") == "1", info
    check_step_cores(cluster, job_id, {**info, "CPUs/Task": "1"})


def test_gpu_usage_samples_every_node_and_survives_a_sampler_that_ended(cluster, job_env, tmp_path):
    """gpu_usage.sbatch on two nodes: one sampler per node, each line of the CSV led by its
    node, the summary per node; the stand-in nvidia-smi on PATH here writes one sample and
    ends (as when nvidia-smi fails), so the job's final kill finds no sampler: not a failure."""
    script = "monitoring/gpu_usage.sbatch"
    job = JOBS[script]
    copy_example(tmp_path, script, *job.files)
    once = tmp_path / "bin" / "nvidia-smi"
    once.parent.mkdir()
    standin = Path(__file__).parent / "standins" / "nvidia-smi"
    once.write_text(  # the stand-in without -l N: one sample, then it ends
        "#!/bin/bash\nargs=()\nwhile (($#)); do\n"
        '    if [[ $1 == -l ]]; then shift 2; else args+=("$1"); shift; fi\ndone\n'
        f'exec {standin} "${{args[@]}}"\n'
    )
    once.chmod(0o755)
    env = job_env_for(cluster, job_env, job)
    env["PATH"] = f"{once.parent}:{env['PATH']}"
    job_id = sbatch("--nodes=2", "--ntasks=2", "gpu_usage.sbatch", *job.args, cwd=tmp_path, env=env)
    info = wait_for(job_id, env)
    out = info["output"]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert f"Note: the GPU sampler had ended before the training: gpu-usage-{job_id}.csv" in out
    log = (tmp_path / f"gpu-usage-{job_id}.csv").read_text().splitlines()
    assert sorted(line.split(",")[0] for line in log) == ["host", "host", "n1", "n2"], (log, out)
    rows = re.findall(r"^(n\d) +0 +1 +87% ", out, re.M)
    assert rows == ["n1", "n2"], out
