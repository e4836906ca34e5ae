"""Check that the installed PyTorch has kernels for a GPU, the cause of "no kernel image".

"CUDA error: no kernel image is available for execution on the device" means that the wheel
was not compiled for the compute capability of the GPU. The script compares the two: the
architectures the wheel was built for (torch.cuda.get_arch_list(), or --arch-list) and the
capability of each visible GPU (or --capability, to check a GPU you do not have at hand, for
example on a login node before you submit). sm_XY is machine code that runs on capabilities
X.Y up to X.9; compute_XY is PTX that the driver compiles, at the first start, for any
capability from X.Y up. It exits with 1 when a GPU is not covered.

    python check_arch.py                              # on a GPU node: the GPUs it sees
    python check_arch.py --capability 9.0             # anywhere: would an H100 work?
    python check_arch.py --capability 9.0 --arch-list sm_80 sm_86
"""

import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--capability", help="MAJOR.MINOR, e.g. 8.0 (A100), 9.0 (H100)")
    parser.add_argument(
        "--arch-list", nargs="+", help="e.g. sm_80 sm_90 compute_90 (default: this torch's)"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"check_arch.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_capability(text):
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        fail(f"--capability {text}: expected MAJOR.MINOR, e.g. 9.0")
    return int(major), int(minor)


def runs_on(arch, capability):
    """How code compiled for `arch` (sm_80, sm_90a, compute_90) runs on `capability` (9, 0):
    "binary", "PTX" (compiled by the driver at the first start) or None (it does not)."""
    kind, _, version = arch.partition("_")
    if kind not in ("sm", "compute") or not version.rstrip("af").isdigit():
        fail(f"unknown architecture {arch!r}: expected sm_XY or compute_XY")
    major, minor = divmod(int(version.rstrip("af")), 10)
    if version.endswith("a"):  # sm_90a: features of exactly that GPU
        return "binary" if (major, minor) == capability else None
    if kind == "sm":  # machine code: the same major version, an equal or newer minor
        return "binary" if major == capability[0] and minor <= capability[1] else None
    return "PTX" if (major, minor) <= capability else None


def check(name, capability, arch_list):
    """Print whether the architectures cover one GPU; True when they do."""
    what = f"{name}compute capability {capability[0]}.{capability[1]}"
    matches = {arch: runs_on(arch, capability) for arch in arch_list}
    binaries = [arch for arch, how in matches.items() if how == "binary"]
    ptx = [arch for arch, how in matches.items() if how == "PTX"]
    if binaries:
        print(f"{what}: supported by {', '.join(binaries)}")
    elif ptx:
        print(f"{what}: runs once the driver has compiled {ptx[-1]} (a slow first start)")
    else:
        print(
            f"{what}: NOT supported, expect 'no kernel image is available'; install a torch "
            f"built for sm_{capability[0]}{capability[1]} (your site's wheel, or a CUDA build "
            "from download.pytorch.org whose list has it)"
        )
    return bool(binaries or ptx)


def from_torch(arch_list, gpus):
    """What the options did not give: the architectures of this torch, the visible GPUs."""
    import torch

    if not arch_list:
        arch_list = torch.cuda.get_arch_list()
        if not arch_list:
            fail(
                f"torch {torch.__version__} has no CUDA kernels at all (a CPU-only build): "
                "install a CUDA build, or pass --arch-list to check another wheel's list"
            )
        print(f"torch {torch.__version__} was built for: {' '.join(arch_list)}")
    if not gpus:
        if not torch.cuda.is_available():
            fail(
                "no GPU visible: run this on a GPU node (srun --gpus-per-node=1 python "
                "check_arch.py) or give the GPU's --capability"
            )
        gpus = [
            (f"GPU {i} ({torch.cuda.get_device_name(i)}), ", torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        ]
    return arch_list, gpus


def main(argv=None):
    args = parse_args(argv)
    gpus = [("", parse_capability(args.capability))] if args.capability else None
    if args.arch_list:
        print(f"--arch-list: {' '.join(args.arch_list)}")
    arch_list = args.arch_list
    if not (arch_list and gpus):
        arch_list, gpus = from_torch(arch_list, gpus)
    results = [check(name, capability, arch_list) for name, capability in gpus]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("check_arch.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
