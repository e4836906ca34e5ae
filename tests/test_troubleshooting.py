"""examples/troubleshooting/: each script reproduces the message the page quotes, and its fix.

The messages are checked as PyTorch 2.13 and Lightning 2.6 print them; what only a GPU can
show is in the tests marked gpu.
"""

import re
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from recorded import ADDRESSES, check_recorded, transcript

from conftest import EXAMPLES, example_env, free_port, launch, load_example, run, slurm_task_env

HERE = EXAMPLES / "troubleshooting"
C10_ERROR = HERE / "c10_error.py"
CHECK_ARCH = HERE / "check_arch.py"
PORT_IN_USE = HERE / "port_in_use.py"
DUPLICATE_GPU = HERE / "duplicate_gpu.py"
COLLECTIVE_TIMEOUT = HERE / "collective_timeout.py"
WEIGHTS_ONLY = HERE / "weights_only.py"
DOWNLOAD_RACE = HERE / "download_race.py"
LIGHTNING_SLURM = HERE / "lightning_slurm.py"
OUT_OF_MEMORY = HERE / "out_of_memory.py"
MEMORY_GROWTH = HERE / "memory_growth.py"

# The lines the page shows of each message, recorded from these tests' runs (tests/recorded.py).
RECORDINGS = {
    name: HERE / name
    for name in (
        "c10_error-escape.out", "c10_error-faulthandler.out", "c10_error-cpp-stacktraces.out",
        "check_arch.out", "port_in_use-fixed.out", "port_in_use-fix.out",
        "collective_timeout-gloo.out", "collective_timeout-detail.out",
        "collective_timeout-3s.out", "lightning_slurm-devices.out",
        "lightning_slurm-store-timeout.out", "weights_only-error.out", "weights_only-fix.out",
        "download_race-eof.out", "memory_growth.out", "memory_growth-leak.out",
    )
}  # fmt: skip
TORCH_DIR = str(Path(torch.__file__).parent)


def lines_from(text, start, count=None):
    """The lines of text from the first that starts with start: count of them, or all."""
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    return "".join(lines[first : None if count is None else first + count])


def last_line(text):
    return text.rstrip().splitlines()[-1] + "\n"


CONV_MESSAGE = (
    "Given groups=1, weight of size [256, 1, 3, 3], expected input[16, 10, 16, 16] to have 1 "
    "channels, but got 10 channels instead"
)


def run_ranks(script, args, cwd, ranks=2, timeout=120, **extra):
    """`ranks` processes of script as torchrun starts them: [(exit code, stdout, stderr)]."""
    return launch([sys.executable, script, *args], cwd=cwd, world=ranks, launcher="torchrun",
                  timeout=timeout, **extra)  # fmt: skip


def run_together(*calls):
    """run() for several (command, keywords) at once: this file starts PyTorch about 30 times,
    and two cores start it twice as fast as one."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, command, **keywords) for command, keywords in calls]
        return [future.result() for future in futures]


# --- c10::Error ------------------------------------------------------------------------------


def test_c10_error_in_python_has_a_traceback_and_cpp_stacktraces_add_the_aten_location(
    tmp_path,
):
    env = example_env(TORCH_SHOW_CPP_STACKTRACES=1)
    proc = run([sys.executable, C10_ERROR], cwd=tmp_path, env=env, expect_rc=1)
    assert "Traceback (most recent call last):" in proc.stderr
    assert "in wrong_channels\n" in proc.stderr
    assert f"RuntimeError: {CONV_MESSAGE}\nException raised from check_shape_forward at " in (
        proc.stderr
    )
    assert "/aten/src/ATen/native/Convolution.cpp:" in proc.stderr
    assert "C++ CapturedTraceback:" in proc.stderr
    check_recorded(
        RECORDINGS["c10_error-cpp-stacktraces.out"], lines_from(proc.stderr, "RuntimeError", 3)
    )


def test_escaped_c10_error_aborts_and_faulthandler_shows_the_python_line(tmp_path):
    aborted = dict(cwd=tmp_path, expect_rc=-signal.SIGABRT)
    plain, faulthandler = run_together(
        ([sys.executable, C10_ERROR, "--escape"], aborted),
        ([sys.executable, "-X", "faulthandler", C10_ERROR, "--escape"], aborted),
    )
    assert plain.stderr.startswith(
        "terminate called after throwing an instance of 'c10::Error'\n"
        f"  what():  {CONV_MESSAGE}\n"
        "Exception raised from throw_from_cpp at c10_error.py:"
    ), plain.stderr
    assert "frame #0: c10::Error::Error(" in plain.stderr
    assert "Traceback" not in plain.stderr and 'File "' not in plain.stderr
    # With the fault handler, the same abort, then the Python stack.
    err = faulthandler.stderr
    assert "terminate called after throwing an instance of 'c10::Error'" in err
    assert "Fatal Python error: Aborted\n" in err
    assert f'File "{C10_ERROR}", line ' in err and " in throw_from_cpp\n" in err
    assert " in main\n" in err
    # Recorded as a reader sees them, who runs the script from its folder: paths shortened.
    check_recorded(
        RECORDINGS["c10_error-escape.out"],
        lines_from(plain.stderr, "terminate called", 4).replace(TORCH_DIR, ".../torch"),
        volatile=[ADDRESSES],
    )
    check_recorded(
        RECORDINGS["c10_error-faulthandler.out"],
        lines_from(err, "Fatal Python error", 5).replace(f"{HERE}/", ".../"),
        volatile=[ADDRESSES],
    )


# --- no kernel image -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "arch_list", "rc", "verdict"),
    [
        ("9.0", ["sm_80", "sm_86"], 1, "compute capability 9.0: NOT supported, expect 'no "
         "kernel image is available'; install a torch built for sm_90 (your site's wheel, or a "
         "CUDA build from download.pytorch.org whose list has it)\n"),
        ("8.6", ["sm_80", "sm_90"], 0, "compute capability 8.6: supported by sm_80\n"),
        ("9.0", ["sm_80", "compute_80"], 0, "compute capability 9.0: runs once the driver has "
         "compiled compute_80 (a slow first start)\n"),
        ("9.0", ["sm_90a"], 0, "compute capability 9.0: supported by sm_90a\n"),
        ("10.0", ["sm_90a"], 1, "compute capability 10.0: NOT supported"),
    ],
    ids=["newer-gpu", "same-major", "ptx", "arch-specific", "arch-specific-other"],
)  # fmt: skip
def test_check_arch_compares_the_arch_list_with_the_gpu(tmp_path, capability, arch_list, rc,
                                                        verdict):  # fmt: skip
    args = ["--capability", capability, "--arch-list", *arch_list]
    proc = run([sys.executable, CHECK_ARCH, *args], cwd=tmp_path, expect_rc=rc)
    assert proc.stdout.startswith(f"--arch-list: {' '.join(arch_list)}\n{verdict}"), proc.stdout
    assert proc.stdout.count("\n") == 2


def test_check_arch_session_the_page_shows(tmp_path):
    steps = []
    for args, rc in ((["sm_80", "sm_86"], 1), (["sm_80", "compute_80"], 0)):
        command = ["python", "check_arch.py", "--capability", "9.0", "--arch-list", *args]
        proc = run([sys.executable, CHECK_ARCH, *command[2:]], cwd=tmp_path, expect_rc=rc)
        steps.append((" ".join(command), proc.stdout))
    check_recorded(RECORDINGS["check_arch.out"], transcript(*steps))


def test_check_arch_refuses_a_malformed_capability(tmp_path):
    args = ["--capability", "9", "--arch-list", "sm_90"]
    proc = run([sys.executable, CHECK_ARCH, *args], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == "check_arch.py: error: --capability 9: expected MAJOR.MINOR, e.g. 9.0\n"


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only wheel's message")
def test_check_arch_says_a_cpu_wheel_has_no_cuda_kernels(tmp_path):
    proc = run([sys.executable, CHECK_ARCH, "--capability", "9.0"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        f"check_arch.py: error: torch {torch.__version__} has no CUDA kernels at all (a CPU-only "
        "build): install a CUDA build, or pass --arch-list to check another wheel's list\n"
    )


@pytest.mark.gpu
def test_check_arch_finds_the_gpus_of_this_machine_supported(tmp_path):
    proc = run([sys.executable, CHECK_ARCH], cwd=tmp_path)
    assert proc.stdout.startswith(f"torch {torch.__version__} was built for: sm_")
    assert proc.stdout.count(": supported by sm_") == torch.cuda.device_count(), proc.stdout


# --- Address already in use ------------------------------------------------------------------


def free_job_ids(count=2):
    """Job ids whose ports (15000 + id % 10000, as the job scripts derive them) are free."""
    ids = []
    for job_id in range(4242001, 4252000):
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 15000 + job_id % 10000))
        except OSError:
            continue
        ids.append(job_id)
        if len(ids) == count:
            return ids
    pytest.fail("no free ports in 15000-24999")


def test_a_fixed_port_fails_with_eaddrinuse_and_ports_from_job_ids_do_not(
    tmp_path, record_property
):
    port = free_port()
    first, second = free_job_ids()
    (tmp_path / "fixed").mkdir()
    (tmp_path / "fix").mkdir()
    start = time.perf_counter()
    fixed, fix = run_together(
        ([sys.executable, PORT_IN_USE, "--port", port], dict(cwd=tmp_path / "fixed", expect_rc=1)),
        ([sys.executable, PORT_IN_USE, "--fix", "--job-ids", first, second],
         dict(cwd=tmp_path / "fix")),
    )  # fmt: skip
    record_property("timing", f"port_in_use.py, twice 2 jobs: {time.perf_counter() - start:.1f} s")
    assert fixed.stdout.splitlines() == [
        f"job 4242001: rank 0 listens on port {port}",
        "job 4242001: done",
        "job 4242002 failed: its port was taken by job 4242001",
    ]
    assert fixed.stderr.endswith(
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
        f"network address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: "
        "address already in use\n"
    ), fixed.stderr
    # Volatile: the free port the test found, and the job ids whose ports were free.
    check_recorded(RECORDINGS["port_in_use-fixed.out"], last_line(fixed.stderr),
                   volatile=[(r"port: \d+", "port: N")])  # fmt: skip
    assert fix.stdout.splitlines() == [
        f"job {first}: rank 0 listens on port {15000 + first % 10000}",
        f"job {second}: rank 0 listens on port {15000 + second % 10000}",
        f"job {second}: done",
        f"job {first}: done",
    ]
    check_recorded(RECORDINGS["port_in_use-fix.out"], fix.stdout,
                   volatile=[(r"job \d+", "job N"), (r"port \d+", "port N")])  # fmt: skip


# --- Duplicate GPU detected ------------------------------------------------------------------


def test_gpu_choice_follows_the_local_rank_or_the_only_gpu(capsys):
    duplicate_gpu = load_example(DUPLICATE_GPU)
    assert duplicate_gpu.gpu_index(1, 4) == 1  # all the node's GPUs visible
    assert duplicate_gpu.gpu_index(1, 1) == 0  # --gpus-per-task=1: each task sees its own
    with pytest.raises(SystemExit) as stopped:
        duplicate_gpu.gpu_index(2, 2)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "duplicate_gpu.py: error: local rank 2 but 2 GPUs visible: request one GPU per process\n"
    )


def test_shared_gpus_are_found_per_host():
    duplicate_gpu = load_example(DUPLICATE_GPU)
    placements = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-c"), ("n1", "GPU-a")]
    assert duplicate_gpu.shared_gpus(placements) == [(0, 3, "n1")]
    assert duplicate_gpu.shared_gpus(placements[:3]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPU")
def test_duplicate_gpu_without_a_gpu_says_what_to_request(tmp_path):
    env = example_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=free_port())  # fmt: skip
    proc = run([sys.executable, DUPLICATE_GPU, "--fix"], cwd=tmp_path, env=env, expect_rc=2)
    assert proc.stderr == (
        "duplicate_gpu.py: error: no GPU visible: request one per process, e.g. "
        "#SBATCH --gpus-per-node=2 with --ntasks-per-node=2\n"
    )


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_make_nccl_detect_a_duplicate(tmp_path):
    results = run_ranks(DUPLICATE_GPU, [], tmp_path, CUDA_VISIBLE_DEVICES=0)
    assert all(rc != 0 for rc, _, _ in results), results
    errors = "".join(err for _, _, err in results)
    assert "Duplicate GPU detected : rank " in errors and "ncclInvalidUsage" in errors, errors


@pytest.mark.gpu
def test_the_check_names_the_ranks_that_share_a_gpu(tmp_path):
    results = run_ranks(DUPLICATE_GPU, ["--fix"], tmp_path, CUDA_VISIBLE_DEVICES=0)
    assert [rc for rc, _, _ in results] == [2, 2], results
    assert "duplicate_gpu.py: error: ranks 0 and 1 share one GPU on " in results[0][2]
    assert "Duplicate GPU detected" not in results[0][2]


@pytest.mark.gpu
def test_one_gpu_per_rank_runs(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(DUPLICATE_GPU, ["--fix"], tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert "rank 1 on cuda:1: all_reduce gives 2" in results[1][1]


# --- collective timeouts ---------------------------------------------------------------------


def test_a_skipped_collective_times_out_within_seconds(tmp_path, record_property):
    start = time.monotonic()
    results = run_ranks(COLLECTIVE_TIMEOUT, ["--init-timeout", 1], tmp_path, timeout=60)
    seconds = time.monotonic() - start
    record_property("timing", f"collective_timeout.py, 2 ranks, 1 s timeout: {seconds:.1f} s")
    assert seconds < 30
    assert [(rc, out) for rc, out, _ in results] == [(1, ""), (1, "")], results
    timed_out = (
        "/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv operation "
        "to complete"
    )
    last_lines = [err.rstrip().splitlines()[-1] for _, _, err in results]
    assert "in all_reduce" in results[0][2] and "in barrier" in results[1][2]
    # Both ranks wait 1 s: whichever times out first says so and exits, and the other one times
    # out too or sees its connection closed (CI saw rank 1 first). The recording is rank 0's line.
    first = [line for line in last_lines if timed_out in line]
    assert first and first[0].startswith(("[rank0]: RuntimeError: [", "[rank1]: RuntimeError: ["))
    for line in last_lines:
        assert timed_out in line or "Connection closed by peer" in line, results
    check_recorded(
        RECORDINGS["collective_timeout-gloo.out"], re.sub(r"^\[rank\d+\]", "[rank0]", first[0])
    )


def test_a_group_timeout_of_3_seconds_stops_the_waiting_rank(tmp_path):
    """The distributed checkpointing page quotes gloo's message for a 3 s group timeout."""
    results = run_ranks(COLLECTIVE_TIMEOUT, ["--init-timeout", 3], tmp_path, timeout=60)
    assert [rc for rc, _, _ in results] == [1, 1], results
    # Both ranks wait 3 s; whichever times out first reports it, and the other one may see the
    # connection close instead: the recording is rank 0's line.
    lines = [err.rstrip().splitlines()[-1] for _, _, err in results]
    timed_out = [line for line in lines if "Timed out waiting 3000ms for recv operation" in line]
    assert timed_out, results
    check_recorded(
        RECORDINGS["collective_timeout-3s.out"], re.sub(r"^\[rank\d+\]", "[rank0]", timed_out[0])
    )


def test_distributed_debug_detail_reports_the_mismatch_at_once(tmp_path):
    results = run_ranks(COLLECTIVE_TIMEOUT, ["--init-timeout", 30], tmp_path, timeout=60,
                        TORCH_DISTRIBUTED_DEBUG="DETAIL")  # fmt: skip
    assert [rc for rc, _, _ in results] == [1, 1], results
    assert (
        "[rank0]: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
        "collective: CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[1], "
    ) in results[0][2]
    assert "Timed out" not in results[0][2] + results[1][2]
    check_recorded(
        RECORDINGS["collective_timeout-detail.out"],
        lines_from(results[0][2], "[rank0]: RuntimeError: Detected mismatch", 1),
    )


def test_every_rank_calling_the_collective_completes(tmp_path):
    results = run_ranks(COLLECTIVE_TIMEOUT, ["--fix", "--init-timeout", 30], tmp_path)
    outputs = [(rc, out) for rc, out, _ in results]
    assert outputs == [(0, "rank 0: total 3\n"), (0, "rank 1: total 3\n")], results


@pytest.mark.gpu
def test_nccl_watchdog_reports_the_timeout(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    start = time.monotonic()
    results = run_ranks(COLLECTIVE_TIMEOUT, ["--device", "cuda", "--init-timeout", 5], tmp_path,
                        timeout=120)  # fmt: skip
    assert time.monotonic() - start < 90
    assert any(rc != 0 for rc, _, _ in results), results
    errors = "".join(err for _, _, err in results)
    assert "Watchdog caught collective operation timeout: WorkNCCL(" in errors, errors


# --- Weights only load failed ----------------------------------------------------------------


def test_a_pickled_namespace_fails_the_weights_only_load_and_the_ways_out_work(tmp_path):
    failed, fix = run_together(
        ([sys.executable, WEIGHTS_ONLY, "--output-dir", "failed"], dict(cwd=tmp_path, expect_rc=1)),
        ([sys.executable, WEIGHTS_ONLY, "--output-dir", "fix", "--fix"], dict(cwd=tmp_path)),
    )
    assert (
        "_pickle.UnpicklingError: Weights only load failed. This file can still be loaded, to do "
        "so you have two options"
    ) in failed.stderr
    assert (
        "\t(1) In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
        "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to "
        "`False` will likely succeed, but it can result in arbitrary code execution. Do it only if "
        "you got the file from a trusted source.\n\t(2) Alternatively, to load with "
        "`weights_only=True` please check the recommended steps in the following error message.\n"
    ) in failed.stderr
    assert (
        "WeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace was not an allowed "
        "global by default. Please use `torch.serialization.add_safe_globals([argparse."
        "Namespace])` or the `torch.serialization.safe_globals([argparse.Namespace])` context "
        "manager to allowlist this global if you trust this class/function."
    ) in failed.stderr
    assert fix.stdout.splitlines() == [
        "with_namespace.pt needs: argparse.Namespace, pathlib.PosixPath",
        "with_namespace.pt loads with safe_globals: lr 0.1",
        "plain.pt loads with the default weights_only=True: lr 0.1",
    ]
    # Recorded without the terminal's bold (ANSI escapes) that torch puts in the first line.
    plain = re.sub(r"\x1b\[\d*m", "", failed.stderr)
    check_recorded(
        RECORDINGS["weights_only-error.out"], lines_from(plain, "_pickle.UnpicklingError", 4)
    )
    check_recorded(RECORDINGS["weights_only-fix.out"], fix.stdout)


# --- dataset download races ------------------------------------------------------------------


def test_ranks_downloading_at_once_read_a_truncated_archive(tmp_path, record_property):
    start = time.perf_counter()
    results = run_ranks(DOWNLOAD_RACE, ["--data-dir", "data"], tmp_path, timeout=60)
    record_property("timing", f"download_race.py, 2 ranks: {time.perf_counter() - start:.1f} s")
    rc, out, err = results[1]  # rank 1 found rank 0's archive half-written
    assert rc == 1 and out == "", err
    assert err.rstrip().endswith(
        "EOFError: Compressed file ended before the end-of-stream marker was reached"
    ), err
    check_recorded(RECORDINGS["download_race-eof.out"], last_line(err))
    rc, out, err = results[0]  # rank 0 read its own download, then lost rank 1
    assert rc == 1 and out == "rank 0: 2000 samples\n", err
    assert "Connection closed by peer" in err
    assert "This is typically caused by a remote worker crashing" in err


@pytest.mark.parametrize("fix", ["rank0", "lock"])
def test_one_download_at_a_time_gives_every_rank_the_data(tmp_path, fix):
    results = run_ranks(DOWNLOAD_RACE, ["--data-dir", "data", "--fix", fix], tmp_path)
    outputs = [(rc, out) for rc, out, _ in results]
    assert outputs == [(0, "rank 0: 2000 samples\n"), (0, "rank 1: 2000 samples\n")], results
    assert not list((tmp_path / "data").glob("*.part")), "a temporary file was left behind"


# --- Lightning under Slurm -------------------------------------------------------------------


def test_lightning_devices_that_differ_from_srun_stop_fit(tmp_path):
    env = slurm_task_env(SLURM_STEP_NUM_TASKS=2, MASTER_PORT=free_port())
    proc = run([sys.executable, LIGHTNING_SLURM, "--devices", "1"], cwd=tmp_path, env=env,
               expect_rc=1)  # fmt: skip
    assert proc.stderr.endswith(
        "ValueError: You set `devices=1` in Lightning, but the number of tasks per node "
        "configured in SLURM `--ntasks-per-node=2` does not match. HINT: Set `devices=2`.\n"
    ), proc.stderr
    check_recorded(RECORDINGS["lightning_slurm-devices.out"], last_line(proc.stderr))


def test_leaked_slurm_variables_make_lightning_wait_and_an_interactive_name_avoids_it(
    tmp_path,
):
    start = time.monotonic()
    leaked, interactive = run_together(
        (
            [sys.executable, LIGHTNING_SLURM, "--devices", "2", "--init-timeout", 1],
            dict(
                cwd=tmp_path, env=slurm_task_env(MASTER_PORT=free_port()), expect_rc=1, timeout=60
            ),  # no srun step
        ),
        (
            [sys.executable, LIGHTNING_SLURM],
            dict(
                cwd=tmp_path,
                env=slurm_task_env(SLURM_JOB_NAME="interactive", MASTER_PORT=free_port()),
                timeout=60,
            ),
        ),
    )
    assert time.monotonic() - start < 40
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in leaked.stdout + leaked.stderr
    assert leaked.stderr.rstrip().endswith(
        "torch.distributed.DistStoreError: Timed out after 2 seconds waiting for clients. "
        "1/2 clients joined."
    ), leaked.stderr
    check_recorded(RECORDINGS["lightning_slurm-store-timeout.out"], last_line(leaked.stderr))
    assert "Slurm: SLURM_JOB_NAME=interactive, SLURM_NTASKS=2" in interactive.stdout
    assert interactive.stdout.endswith("rank 0 of 1 (LightningEnvironment): trained\n")


# --- CUDA out of memory ----------------------------------------------------------------------


def test_the_memory_fixes_compute_the_same_gradients(tmp_path):
    args = ["--device", "cpu", "--fix", "--batch-size", 256, "--width", 64, "--layers", 4]
    proc = run([sys.executable, OUT_OF_MEMORY, *args], cwd=tmp_path,
               env=example_env(OMP_NUM_THREADS=1))  # fmt: skip
    lines = proc.stdout.splitlines()
    assert lines[0] == "full batch: fits" and lines[2] == "bfloat16 autocast: fits", lines
    for line, name in ((lines[1], "gradient accumulation"),
                       (lines[3], "checkpointing + accumulation")):  # fmt: skip
        prefix = f"{name}: fits, gradients differ from the full batch's by "
        assert line.startswith(prefix) and float(line.removeprefix(prefix)) < 1e-5, line


def test_out_of_memory_on_cpu_says_it_needs_a_gpu(tmp_path):
    proc = run([sys.executable, OUT_OF_MEMORY, "--device", "cpu"], cwd=tmp_path, expect_rc=2)
    assert proc.stderr == (
        "out_of_memory.py: error: only a GPU runs out of memory this way: use --device cuda, or "
        "--fix on CPU\n"
    )


@pytest.mark.gpu
def test_a_batch_too_large_runs_out_of_cuda_memory(tmp_path):
    proc = run([sys.executable, OUT_OF_MEMORY], cwd=tmp_path, expect_rc=1)
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " in proc.stderr
    assert "PyTorch CUDA memory summary" in proc.stdout


@pytest.mark.gpu
def test_accumulation_and_checkpointing_fit_under_the_cap(tmp_path):
    out = run([sys.executable, OUT_OF_MEMORY, "--fix"], cwd=tmp_path).stdout
    assert "full batch: out of memory" in out, out
    assert "gradient accumulation: fits, peak " in out
    assert "checkpointing + accumulation: fits, peak " in out


# --- memory growth ---------------------------------------------------------------------------


def test_memory_stays_flat_a_leak_is_caught_and_aten_cpu_capability_changes_the_kernels(
    tmp_path,
):
    forced = example_env(OMP_NUM_THREADS=1, ATEN_CPU_CAPABILITY="default")
    flat, leak = run_together(
        ([sys.executable, MEMORY_GROWTH], dict(cwd=tmp_path, env=example_env(OMP_NUM_THREADS=1))),
        ([sys.executable, MEMORY_GROWTH, "--leak"], dict(cwd=tmp_path, env=forced, expect_rc=1)),
    )
    lines = flat.stdout.splitlines()
    capability = torch.backends.cpu.get_cpu_capability()
    assert lines[0] == f"torch {torch.__version__}, CPU capability {capability}"
    assert lines[1].startswith("resident memory: ") and lines[2] == "no growth", lines
    # Volatile: the machine's CPU capability and the memory sizes.
    sizes = [(r"CPU capability \w+", "CPU capability X"), (r"[+-]?[\d.]+ [KM]iB", "N MiB")]
    check_recorded(RECORDINGS["memory_growth.out"], flat.stdout, volatile=sizes)
    lines = leak.stdout.splitlines()
    assert lines[0] == f"torch {torch.__version__}, CPU capability DEFAULT", lines
    assert lines[-1].startswith("memory grows: ") and lines[-1].endswith(" KiB per step"), lines
    check_recorded(RECORDINGS["memory_growth-leak.out"], lines[-1], volatile=sizes)
