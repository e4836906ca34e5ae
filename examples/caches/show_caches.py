"""Show where PyTorch and the tools around it keep their caches, and how big each one is.

Each tool picks its folder from an environment variable and falls back to a default, most
often in your home directory, whose quota (space and number of files) is small on clusters.
This script resolves every location the way the tool does, then prints its size and number of
files, and marks those in your home. Set the variables in your ~/.bashrc or job scripts (see
cache_env.sh) to move the caches to project or scratch space.

    python show_caches.py
"""

import argparse
import getpass
import os
import sys
import tempfile
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--no-sizes", action="store_true", help="skip walking the folders")
    return parser.parse_args(argv)


def env_path(name, default):
    value = os.environ.get(name)
    return (Path(value).expanduser(), name) if value else (Path(default).expanduser(), "default")


def caches():
    """(what, variable, path, where it came from) for every cache, resolved as each tool does."""
    home = Path.home()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    inductor, inductor_source = env_path(
        "TORCHINDUCTOR_CACHE_DIR", Path(tempfile.gettempdir()) / f"torchinductor_{user}"
    )
    rows = [
        ("pip downloads and wheels", "PIP_CACHE_DIR", *env_path("PIP_CACHE_DIR", xdg / "pip")),
        ("uv packages", "UV_CACHE_DIR", *env_path("UV_CACHE_DIR", xdg / "uv")),
        ("conda packages", "CONDA_PKGS_DIRS",
         *env_path("CONDA_PKGS_DIRS", home / ".conda" / "pkgs")),
        ("torch.hub weights", "TORCH_HOME", *env_path("TORCH_HOME", xdg / "torch")),
        ("Hugging Face models, datasets", "HF_HOME",
         *env_path("HF_HOME", xdg / "huggingface")),
        ("torch.compile (Inductor)", "TORCHINDUCTOR_CACHE_DIR", inductor, inductor_source),
        ("Triton GPU kernels", "TRITON_CACHE_DIR",  # torch.compile's: in Inductor's folder
         *env_path("TRITON_CACHE_DIR", inductor / "triton")),
        ("C++/CUDA extensions (JIT)", "TORCH_EXTENSIONS_DIR",
         *env_path("TORCH_EXTENSIONS_DIR", xdg / "torch_extensions")),
        ("CUDA driver's compiled PTX", "CUDA_CACHE_PATH",
         *env_path("CUDA_CACHE_PATH", home / ".nv" / "ComputeCache")),
        ("Apptainer images, layers", "APPTAINER_CACHEDIR",
         *env_path("APPTAINER_CACHEDIR", home / ".apptainer" / "cache")),
    ]  # fmt: skip
    return rows


def measure(path):
    """Bytes and files under path, without following symbolic links."""
    size = files = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                files += 1
                size += entry.stat(follow_symlinks=False).st_size
    return size, files


def human(size):
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def main(argv=None):
    args = parse_args(argv)
    home = Path.home().resolve()
    in_home = total = 0
    print(f"{'cache':31} {'set by':24} {'size':>9} {'files':>7}  path")
    for what, variable, path, source in caches():
        where = variable if source != "default" else "(default)"
        size, figures = 0, f"{'-':>9} {'-':>7}"  # no such folder yet
        if path.exists():
            figures = f"{'':>9} {'':>7}"  # --no-sizes
        if path.exists() and not args.no_sizes:
            size, files = measure(path)
            figures = f"{human(size):>9} {files:>7}"
        mark = ""
        if path.resolve() == home or home in path.resolve().parents:
            in_home += size
            mark = "  <- in your home"
        total += size
        print(f"{what:31} {where:24} {figures}  {path}{mark}")
    print(f"Total {human(total)}, of which {human(in_home)} in your home ({home})")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("show_caches.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
