"""Show how the venv's torch wheel was built: versions, compiler, C++ ABI, libraries.

A C++ program built against the LibTorch of a torch wheel, and every library it links with,
must agree with the wheel: same C++ ABI, a CUDA toolkit of the same version when the wheel
uses CUDA. This script prints what to match: the torch, CUDA, cuDNN and NCCL versions, the
NVIDIA pip packages the wheel depends on, the compiler and C++ ABI of the wheel, the folder
to give CMake, which library files a built program loads (ldd on --binary) and from where,
and the build settings torch.__config__.show() reports (BLAS, oneDNN, OpenMP, CUDA flags).
It exits with 1 when ldd finds a library missing.

    python show_build_info.py
    python show_build_info.py --binary build/example
"""

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path


def existing_file(text):
    """A file that must exist: the program built by build.sh, or a library."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a program or library")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} does not exist: build it first (bash build.sh)")
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--binary",
        type=existing_file,
        help="a program or library to run ldd on (default: libtorch_cuda or libtorch_cpu)",
    )
    return parser.parse_args(argv)


def nvidia_packages():
    """The nvidia-* pip packages torch depends on (CUDA builds), with installed versions."""
    found = []
    for requirement in importlib.metadata.requires("torch") or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)[0]
        if name.startswith("nvidia-") and "extra ==" not in requirement:
            try:
                found.append(f"{name} {importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                found.append(f"{name} (not installed)")
    return found


def ldd_groups(binary, torch_dir):
    """Libraries ldd resolves for binary, grouped by the folder they come from."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    groups = {"torch/lib": [], "pip packages": [], "system": [], "elsewhere": [], "NOT FOUND": []}
    for name, path in re.findall(r"^\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", out, re.M):
        if path == "not found":
            groups["NOT FOUND"].append(name)
        elif Path(path).parent == torch_dir / "lib":
            groups["torch/lib"].append(name)
        elif "site-packages" in path:
            groups["pip packages"].append(path.split("site-packages/")[1])
        elif path.startswith(("/lib", "/usr/lib")):
            groups["system"].append(name)
        else:  # a site's modules, or LD_LIBRARY_PATH
            groups["elsewhere"].append(path)
    return groups


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.utils

    torch_dir = Path(torch.__file__).parent
    config = torch.__config__.show()
    print(f"torch {torch.__version__} in {torch_dir}")
    print(f"CUDA (torch.version.cuda): {torch.version.cuda or 'none, a CPU build'}")
    print(f"cuDNN (torch.backends.cudnn.version()): {torch.backends.cudnn.version() or 'none'}")
    nccl = "none"
    if torch.version.cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"NCCL (torch.cuda.nccl.version()): {nccl}")
    print(f"NVIDIA pip packages: {', '.join(nvidia_packages()) or 'none'}")

    compiler = re.search(r"^\s*- ((?:GCC|clang|MSVC)\b.*)$", config, re.M | re.I)
    standard = re.search(r"C\+\+ Version: (\d+)", config)
    print(
        f"Built with: {compiler[1] if compiler else 'unknown compiler'}, "
        f"C++ {standard[1] if standard else 'unknown'}"
    )
    if shutil.which("c++"):
        mine = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False)
        print(f"Your c++: {mine.stdout.splitlines()[0] if mine.stdout else 'does not run'}")
    else:
        print("Your c++: none on PATH (load your site's gcc module)")
    abi = torch.compiled_with_cxx11_abi()
    print(f"C++ ABI: _GLIBCXX_USE_CXX11_ABI={int(abi)} (torch.compiled_with_cxx11_abi() is {abi})")
    print(f"CMAKE_PREFIX_PATH (torch.utils.cmake_prefix_path): {torch.utils.cmake_prefix_path}")

    main_lib = torch_dir / "lib" / ("libtorch_cuda.so" if torch.version.cuda else "libtorch_cpu.so")
    binary = args.binary or main_lib
    print(f"Libraries of {binary} (ldd):")
    groups = ldd_groups(binary, torch_dir)
    for where, names in groups.items():
        if names:
            print(f"  {where}: {', '.join(names)}")
    print(f"torch.__config__.show():\n{config}", end="")
    if groups["NOT FOUND"]:
        print(
            f"show_build_info.py: error: {binary} cannot load {', '.join(groups['NOT FOUND'])}:"
            " rebuild it with a RUNPATH, or load the modules it was built with",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("show_build_info.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
