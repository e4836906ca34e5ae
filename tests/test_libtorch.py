"""examples/libtorch/: a C++ program built with CMake against the LibTorch of the venv's torch.

The program is configured and built once for this module (about 30 s on 2 cores); the tests
then run it, look at its RUNPATH, and run the job scripts' commands. libtorch.sbatch itself is
submitted to the Slurm cluster by test_slurm.py.
"""

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from recorded import ADDRESSES, check_recorded, transcript

from conftest import (
    COMPILER_CACHE,
    EXAMPLES,
    HAS_CUDA,
    copy_example,
    epoch_losses,
    example_env,
    on_a_gpu_node,
    path_without,
    require_command,
    run,
    without_cuda_module,
)

SHOW = EXAMPLES / "libtorch" / "show_build_info.py"
HERE = EXAMPLES / "libtorch"
TORCH_LIB = Path(torch.__file__).parent / "lib"
TOOLKIT_LIB = "/usr/local/cuda-12.8/lib64"  # a site's CUDA toolkit module would point here
# The lib folders of the wheel's nvidia-* pip packages (none for a CPU wheel).
NVIDIA_LIBS = sorted(str(p) for p in TORCH_LIB.parent.parent.glob("nvidia/*/lib") if p.is_dir())
CUDA_ERROR = (
    "example: error: --device cuda but no GPU is visible: run on a GPU node (Slurm "
    "--gpus-per-node=1, PBS -l select=1:ngpus=1, Grid Engine -l gpu=1) or pass --device cpu\n"
)


def losses(out):
    return epoch_losses(out, unit="samples/s")


def runpath(binary):
    out = run(["readelf", "-d", binary], cwd=binary.parent).stdout
    found = re.search(r"\((RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)
    return found and (found[1], found[2].split(":"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The example configured and built as the page says: (folder, seconds, cmake's output)."""
    require_command("cmake", "run `make system-packages` as root (apt-get install cmake)")
    require_command("g++", "run `make system-packages` as root (apt-get install g++)")
    if torch.version.cuda:  # find_package(Torch) of a CUDA build needs the CUDA compiler
        require_command("nvcc", f"load a CUDA {torch.version.cuda} module, as build.sh does")
    folder = copy_example(
        tmp_path_factory.mktemp("libtorch"), "libtorch/example.cpp", "libtorch/CMakeLists.txt"
    )
    prefix = run(
        [sys.executable, "-c", "import torch; print(torch.utils.cmake_prefix_path)"], cwd=folder
    ).stdout.strip()
    start = time.perf_counter()
    # With a CUDA wheel, find_package(Torch) sets CUDAToolkit_LIBRARY_DIR to the CUDA module's
    # toolkit; set it here too, so that a CPU machine shows it stays off the RUNPATH.
    configure = run(
        ["cmake", "-S", ".", "-B", "build", f"-DCMAKE_PREFIX_PATH={prefix}",
         f"-DCUDAToolkit_LIBRARY_DIR={TOOLKIT_LIB}"], cwd=folder,
    )  # fmt: skip
    build = run(["cmake", "--build", "build", "-j", "2"], cwd=folder, timeout=600)
    seconds = time.perf_counter() - start
    return folder, seconds, configure.stdout + configure.stderr + build.stdout


def env_without_library_path(**extra):
    env = example_env(**extra)
    env.pop("LD_LIBRARY_PATH", None)
    return env


@pytest.mark.cpp
def test_cmake_builds_the_example(built, record_property):
    folder, seconds, out = built
    record_property("timing", f"LibTorch example: cmake configure + build: {seconds:.1f} s")
    assert f"Found Torch: {TORCH_LIB / 'libtorch.so'}" in out
    # The page tells readers to ignore this warning of the pip wheel's TorchConfig.cmake.
    assert "TorchConfig.cmake:" in out and "  library kineto not found." in out
    assert (folder / "build" / "example").is_file()
    # The page shows the warning as a reader sees it, the venv's path shortened.
    lines = out.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("CMake Warning at "))
    warning = "".join(lines[first : first + 2]).replace(
        str(TORCH_LIB.parent.parent), ".../site-packages"
    )
    check_recorded(HERE / "cmake-kineto-warning.out", warning)


@pytest.mark.cpp
def test_it_trains_on_the_cpu_and_prints_its_versions(built):
    folder = built[0]
    out = run(
        ["build/example", "--device", "cpu", "--epochs", "4"],
        cwd=folder,
        env=env_without_library_path(OMP_NUM_THREADS=1),
    ).stdout
    # torch 2.13 is built as C++20 (torch.__config__.show(): "C++ Version: 202002").
    assert f"LibTorch {torch.__version__.split('+')[0]} (C++ 202002, compiler " in out
    assert ("CUDA available: yes" if HAS_CUDA else "CUDA available: no\n") in out
    assert "Training on cpu: 1024 samples, 577 parameters, torch::get_num_threads() = 1\n" in out
    values = losses(out)
    assert len(values) == 4 and values == sorted(values, reverse=True), out
    assert values[-1] < values[0] / 10, out


@pytest.mark.cpp
def test_the_runpath_points_at_the_venvs_torch(built):
    """readelf -d shows RUNPATH = torch/lib and the wheel's nvidia-* folders: the program runs
    without LD_LIBRARY_PATH, and loads the CUDA libraries Python loads, not the toolkit's."""
    binary = built[0] / "build" / "example"
    kind, folders = runpath(binary)
    assert kind == "RUNPATH" and folders == [str(TORCH_LIB), *NVIDIA_LIBS], folders
    assert not any("cuda" in f and "site-packages" not in f for f in folders), folders
    ldd = run(["ldd", binary], cwd=built[0], env=env_without_library_path()).stdout
    assert f"libtorch.so => {TORCH_LIB / 'libtorch.so'}" in ldd and "not found" not in ldd


@pytest.mark.cpp
def test_the_installed_program_keeps_its_runpath(built, tmp_path):
    run(["cmake", "--install", "build", "--prefix", tmp_path], cwd=built[0])
    installed = tmp_path / "bin" / "example"
    assert runpath(installed)[1][0] == str(TORCH_LIB)
    out = run([installed, "--epochs", "1", "--device", "cpu"], cwd=tmp_path,
              env=env_without_library_path()).stdout  # fmt: skip
    assert len(losses(out)) == 1


@pytest.mark.cpp
def test_without_a_runpath_the_loader_cannot_find_libtorch(built, tmp_path):
    """What the RUNPATH prevents: the same object linked without one does not start, and
    show_build_info.py names the libraries that ldd cannot find."""
    folder = built[0]
    objects = list((folder / "build").rglob("example.cpp.o"))
    bare = tmp_path / "build" / "example"
    bare.parent.mkdir()
    libraries = [TORCH_LIB / name for name in ("libtorch.so", "libtorch_cpu.so", "libc10.so")]
    run(["g++", *objects, "-o", bare, *libraries], cwd=tmp_path)
    assert runpath(bare) is None
    proc = run(["build/example"], cwd=tmp_path, env=env_without_library_path(), expect_rc=127)
    assert re.search(
        r"^build/example: error while loading shared libraries: lib(torch|torch_cpu|c10)\.so: "
        r"cannot open shared object file: No such file or directory$",
        proc.stderr,
    ), proc.stderr
    check_recorded(HERE / "example-without-runpath.out", proc.stderr)
    proc = run([sys.executable, SHOW, "--binary", bare], cwd=tmp_path,
               env=env_without_library_path(), expect_rc=1)  # fmt: skip
    missing = re.search(r"^  NOT FOUND: (.*)$", proc.stdout, re.M)[1]
    assert {"libc10.so", "libtorch_cpu.so"} <= set(missing.split(", "))
    assert proc.stderr == (
        f"show_build_info.py: error: {bare} cannot load {missing}: rebuild it with a RUNPATH, "
        "or load the modules it was built with\n"
    )


@pytest.mark.cpp
def test_an_uncaught_c10_error_aborts_with_a_backtrace(tmp_path):
    """What main() in example.cpp avoids, as the page shows it: the c10::Error of --lr -1
    (SGDOptions with a negative learning rate) that nobody catches."""
    require_command("g++", "run `make system-packages` as root (apt-get install g++)")
    source = tmp_path / "uncaught.cpp"
    source.write_text(
        "#include <torch/optim/sgd.h>\n"
        "int main() {\n"
        "  std::vector<torch::Tensor> parameters;\n"
        "  torch::optim::SGD optimizer(parameters, torch::optim::SGDOptions(-1));\n"
        "}\n"
    )
    include = TORCH_LIB.parent / "include"
    # Compiled and linked in two steps: the compile step through ccache where the tests use it.
    launcher = [COMPILER_CACHE["CMAKE_CXX_COMPILER_LAUNCHER"]] if COMPILER_CACHE else []
    run([*launcher, "g++", "-std=c++20", "-isystem", include, "-isystem",
         include / "torch" / "csrc" / "api" / "include", "-c", source, "-o", "uncaught.o"],
        cwd=tmp_path, timeout=300)  # fmt: skip
    run(["g++", "uncaught.o", "-o", "uncaught", f"-Wl,-rpath,{TORCH_LIB}",
         TORCH_LIB / "libtorch_cpu.so", TORCH_LIB / "libc10.so"], cwd=tmp_path)  # fmt: skip
    proc = run([tmp_path / "uncaught"], cwd=tmp_path, expect_rc=-6)  # SIGABRT
    assert proc.stderr.startswith(
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  Invalid learning rate: -1\n"
        "Exception raised from SGD at "
    ), proc.stderr
    # The page shows the first lines, the headers' folder shortened as a reader's venv.
    first = "".join(proc.stderr.splitlines(keepends=True)[:4])
    check_recorded(
        HERE / "uncaught-c10-error.out",
        first.replace(str(TORCH_LIB.parent), ".../torch"),
        volatile=[ADDRESSES],
    )


@pytest.mark.cpp
def test_cuda_without_a_gpu_is_a_one_line_error(built):
    if HAS_CUDA:
        pytest.skip("a GPU is visible here: test_it_trains_on_the_gpu runs the CUDA path")
    proc = run(["build/example", "--device", "cuda"], cwd=built[0], expect_rc=2)
    assert proc.stderr == CUDA_ERROR
    check_recorded(
        HERE / "example-no-gpu.out", transcript(("build/example --device cuda", proc.stderr))
    )


@pytest.mark.cpp
def test_a_job_given_gpus_that_libtorch_cannot_use_stops_in_one_line(built, tmp_path):
    """As the Python scripts (tests/test_bad_input.py): on a node with a GPU device file, in a
    job given GPUs, --device auto stops when LibTorch can use none; without the device file (the
    tests' Slurm cluster's GPUs) it trains on the CPU."""
    example = built[0] / "build" / "example"
    cmd = on_a_gpu_node([example, "--device", "auto", "--epochs", "1"], tmp_path)
    env = example_env(SLURM_JOB_GPUS="0")
    proc = run(cmd, cwd=tmp_path, env=env, expect_rc=2)
    assert re.fullmatch(
        r"example: error: this job was given GPUs \(SLURM_JOB_GPUS=0\) but LibTorch [\d.]+ can "
        r"use none: run check_pytorch.py in the job to see why, or pass --device cpu\n",
        proc.stderr,
    ), proc.stderr
    assert "epoch 1" not in proc.stdout
    assert "Training on cpu" in run([example, "--device", "auto", "--epochs", "1"], cwd=tmp_path,
                                    env=env).stdout  # fmt: skip


@pytest.mark.cpp
@pytest.mark.parametrize("given", ["SLURM_JOB_GPUS=0", "JOB_GPUS=1", "PBS_NGPUS=2"])
def test_a_container_without_its_gpus_stops_in_one_line(built, tmp_path, given):
    """A container started without GPU support (Apptainer without --nv) has no /dev/nvidia*, but
    the job's variables: --device auto stops and says how to start it, never trains on the CPU.
    Inside a Slurm step, the job's SLURM_JOB_GPUS alone does not count (a CPU step)."""
    if HAS_CUDA:
        pytest.skip("PyTorch can use a GPU here")
    example = built[0] / "build" / "example"
    name, value = given.split("=")
    env = example_env(**{name: value, "APPTAINER_CONTAINER": "/images/pytorch.sif"})
    proc = run([example, "--device", "auto", "--epochs", "1"], cwd=tmp_path, env=env, expect_rc=2)
    assert re.fullmatch(
        rf"example: error: this job was given GPUs \({given}\) but LibTorch [\d.]+ can use none: "
        r"start the container with GPU support \(apptainer --nv, podman --gpus all\), or pass "
        r"--device cpu\n",
        proc.stderr,
    ), proc.stderr
    if name == "SLURM_JOB_GPUS":
        env["SLURM_STEP_ID"] = "0"
        assert "Training on cpu" in run([example, "--device", "auto", "--epochs", "1"],
                                        cwd=tmp_path, env=env).stdout  # fmt: skip


@pytest.mark.cpp
def test_an_error_from_libtorch_is_one_line_not_a_crash(built):
    """A c10::Error (here from SGDOptions) is caught in main: one line, exit code 1."""
    proc = run(["build/example", "--device", "cpu", "--lr", "-1"], cwd=built[0], expect_rc=1)
    assert proc.stderr == "example: error: Invalid learning rate: -1\n"
    assert "terminate called" not in proc.stderr
    check_recorded(
        HERE / "example-bad-lr.out", transcript(("build/example --device cpu --lr -1", proc.stderr))
    )


@pytest.mark.cpp
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "two"], "--epochs expects a number, not 'two'"),
        (["--device", "gpu"], "--device must be auto, cpu or cuda, not 'gpu'"),
        (["--fake-data"], "--fake-data needs a value (usage: example [--device"),
        (["--steps", "3"], "unknown option --steps (usage: example [--device"),
    ],
)
def test_a_bad_option_is_a_one_line_error(built, args, message):
    proc = run(["build/example", *args], cwd=built[0], expect_rc=2)
    assert proc.stderr.startswith(f"example: error: {message}") and proc.stderr.count("\n") == 1


@pytest.mark.cpp
def test_build_sh_configures_builds_and_runs(built, job_env):
    """build.sh's modules, venv and cmake commands, in the folder the fixture built: the
    configure step reruns, the build finds nothing to do, the program runs."""
    folder = built[0]
    copy_example(folder, "libtorch/build.sh")
    env = {**job_env, "SLURM_CPUS_PER_TASK": "2"}
    env.pop("LD_LIBRARY_PATH", None)
    args = ["--device", "cpu", "--epochs", "2"]
    out = run(["bash", folder / "build.sh", *args], cwd="/", env=env,
              timeout=300).stdout  # fmt: skip
    assert "Build files have been written to" in out and len(losses(out)) == 2, out


def fake_cuda_venv(tmp_path, cuda):
    """A venv whose python imports a stand-in torch with torch.version.cuda = cuda."""
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        f"from . import utils, version\n__version__ = '2.13.0+cu{cuda.replace('.', '')}'\n"
    )
    (stub / "version.py").write_text(f"cuda = {cuda!r}\n")
    (stub / "utils.py").write_text(f"cmake_prefix_path = {torch.utils.cmake_prefix_path!r}\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={stub.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return venv


def test_build_sh_loads_the_cuda_module_of_the_wheel(built, job_env, tmp_path):
    """torch.version.cuda = 12.8: build.sh loads cuda/12.8, then builds as usual."""
    folder = built[0]
    copy_example(folder, "libtorch/build.sh")
    env = {**job_env, "VENV": str(fake_cuda_venv(tmp_path, "12.8"))}
    env.pop("LD_LIBRARY_PATH", None)
    proc = run(["bash", folder / "build.sh", "--device", "cpu", "--epochs", "1"], cwd="/",
               env=env, timeout=300)  # fmt: skip
    assert proc.stdout.startswith("Loaded cuda/12.8, the CUDA of torch 2.13.0+cu128\n"), proc.stdout
    assert len(losses(proc.stdout)) == 1, proc.stdout


def test_build_sh_without_a_matching_cuda_module_is_a_one_line_error(tmp_path, job_env):
    """torch.version.cuda = 13.0 and the site has only cuda/12.8: one line, nothing built."""
    copy_example(tmp_path, "libtorch/build.sh")
    env = {**job_env, "VENV": str(fake_cuda_venv(tmp_path, "13.0"))}
    proc = run(["bash", "build.sh"], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr == (
        "build.sh: error: torch was built with CUDA 13.0 but there is no module cuda/13.0: "
        "ask your site, or install a torch for a CUDA it has\n"
    )
    assert not (tmp_path / "build").exists()


def test_build_sh_at_a_site_without_a_cuda_module_needs_nvcc_on_path(tmp_path, job_env):
    """CUDA_MODULE="" (a site without a CUDA module): no module load; without an nvcc on
    PATH, one line, nothing built."""
    script = without_cuda_module(tmp_path, EXAMPLES / "libtorch" / "build.sh")
    env = {**job_env, "VENV": str(fake_cuda_venv(tmp_path, "13.0"))}
    env["PATH"] = path_without("nvcc", env["PATH"])
    proc = run(["bash", script], cwd=tmp_path, env=env, expect_rc=1)
    assert proc.stderr == (
        "build.sh: error: torch was built with CUDA 13.0 and there is no nvcc on PATH: install "
        "the CUDA 13.0 toolkit, or set CUDA_MODULE to your site's module\n"
    )
    assert not (tmp_path / "build").exists()


def test_build_sh_stops_at_a_wrong_module(tmp_path, job_env):
    copy_example(tmp_path, "libtorch/build.sh")
    text = (tmp_path / "build.sh").read_text()
    assert "module load gcc/12" in text
    (tmp_path / "build.sh").write_text(text.replace("module load gcc/12", "module load gcc/99"))
    proc = run(["bash", "build.sh"], cwd=tmp_path, env=job_env, expect_rc=None)
    assert proc.returncode != 0 and "unknown" in proc.stderr, proc.stderr
    assert not (tmp_path / "build").exists()


def test_show_build_info_prints_what_to_match():
    out = run([sys.executable, SHOW], cwd=SHOW.parent).stdout
    abi = torch.compiled_with_cxx11_abi()
    assert abi == torch._C._GLIBCXX_USE_CXX11_ABI
    for line in [
        f"torch {torch.__version__} in {TORCH_LIB.parent}",
        f"CUDA (torch.version.cuda): {torch.version.cuda or 'none, a CPU build'}",
        f"cuDNN (torch.backends.cudnn.version()): {torch.backends.cudnn.version() or 'none'}",
        f"C++ ABI: _GLIBCXX_USE_CXX11_ABI={int(abi)} (torch.compiled_with_cxx11_abi() is {abi})",
        f"CMAKE_PREFIX_PATH (torch.utils.cmake_prefix_path): {TORCH_LIB.parent}/share/cmake",
        f"Libraries of {TORCH_LIB}/libtorch_{'cuda' if torch.version.cuda else 'cpu'}.so (ldd):",
    ]:
        assert f"\n{line}\n" in f"\n{out}", out
    assert re.search(r"^Built with: GCC \d+\.\d+, C\+\+ \d{6}$", out, re.M), out
    assert re.search(r"^  torch/lib: .*libc10\.so", out, re.M) and "NOT FOUND" not in out
    assert out.endswith(torch.__config__.show()) and "PyTorch built with:" in out


@pytest.mark.cpp
def test_show_build_info_lists_the_programs_libraries(built):
    binary = built[0] / "build" / "example"
    out = run([sys.executable, SHOW, "--binary", binary], cwd=built[0],
              env=env_without_library_path()).stdout  # fmt: skip
    assert f"Libraries of {binary} (ldd):\n" in out
    torch_line = re.search(r"^  torch/lib: (.*)$", out, re.M)[1].split(", ")
    assert {"libc10.so", "libtorch.so", "libtorch_cpu.so"} <= set(torch_line), out


def test_show_build_info_without_the_binary_says_to_build_it(tmp_path):
    proc = run([sys.executable, SHOW, "--binary", "build/example"], cwd=tmp_path,
               expect_rc=2)  # fmt: skip
    assert proc.stderr.splitlines()[-1] == (  # after argparse's usage line
        "show_build_info.py: error: argument --binary: build/example does not exist: build it "
        "first (bash build.sh)"
    )


def test_the_job_script_builds_in_a_per_job_folder():
    """libtorch.sbatch: scratch per job, cleaned up; the thread count from the allocation."""
    text = (EXAMPLES / "libtorch" / "libtorch.sbatch").read_text()
    assert "LOCAL=${SLURM_TMPDIR:-${TMPDIR:-/tmp}}" in text  # in the site-specific block
    assert "WORK=$LOCAL/libtorch-$SLURM_JOB_ID" in text
    assert "trap 'rm -rf \"$WORK\"' EXIT" in text
    assert "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK" in text
    assert '"$WORK/build/example" "$@"' in text


@pytest.mark.gpu
@pytest.mark.cpp
def test_it_trains_on_the_gpu(built):
    out = run(["build/example", "--device", "cuda", "--epochs", "4"], cwd=built[0],
              env=env_without_library_path()).stdout  # fmt: skip
    assert "CUDA available: yes, " in out and "Training on cuda: " in out
    values = losses(out)
    assert len(values) == 4 and values[-1] < values[0], out
