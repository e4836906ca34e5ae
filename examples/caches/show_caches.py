"""Show where PyTorch and the tools around it keep their caches, and how big each one is.

Each tool picks its folder from an environment variable and falls back to a default, most
often in your home directory, whose quota (space and number of files) is small on clusters.
This script resolves every location the way the tool does, then prints its size and number of
files, where its location comes from (the variable, or the folder its default is in), and
marks those in your home. Set the variables in your ~/.bashrc or job scripts (see cache_env.sh)
to move the caches out of your home.

    python show_caches.py
"""

import argparse
import getpass
import os
import re
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


def temp_source():
    """Where Python's temporary folder comes from: the first of TMPDIR, TEMP and TMP that
    names it, else the system's (tempfile tries /tmp, /var/tmp, /usr/tmp, then the working
    folder). Inductor's default cache is in it, so it moves with a job's own TMPDIR."""
    folder = tempfile.gettempdir()
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.abspath(value) == folder:
            return Path(folder), f"default in ${name}"
    return Path(folder), f"default in {folder}"


def caches():
    """(what, path, where the path comes from) for every cache, resolved as each tool does:
    the tool's variable when it is set, else its default, in the folder that decides it."""
    home = Path.home()
    xdg = os.environ.get("XDG_CACHE_HOME")
    xdg = (
        (Path(xdg), "default in $XDG_CACHE_HOME") if xdg else (home / ".cache", "default in $HOME")
    )
    in_home = (home, "default in $HOME")

    def resolve(name, base, *parts):
        value = os.environ.get(name)
        if value:
            return Path(value).expanduser(), name
        return base[0].joinpath(*parts).expanduser(), base[1]

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)  # as Inductor names its folder
    # Inductor: TORCHINDUCTOR_CACHE_DIR, else torchinductor_<user> in the temporary folder.
    inductor = resolve("TORCHINDUCTOR_CACHE_DIR", temp_source(), f"torchinductor_{user}")
    # Triton: the kernels torch.compile makes go to TRITON_CACHE_DIR, else into Inductor's
    # folder (triton/<device>); kernels that code launches itself (@triton.jit, in libraries)
    # to TRITON_CACHE_DIR, else .triton/cache in TRITON_HOME, else in the home directory.
    triton_home = os.environ.get("TRITON_HOME")
    triton_home = (Path(triton_home), "default in $TRITON_HOME") if triton_home else in_home
    return [
        ("pip downloads and wheels", *resolve("PIP_CACHE_DIR", xdg, "pip")),
        ("uv packages", *resolve("UV_CACHE_DIR", xdg, "uv")),
        ("conda packages", *resolve("CONDA_PKGS_DIRS", in_home, ".conda", "pkgs")),
        ("torch.hub weights", *resolve("TORCH_HOME", xdg, "torch")),
        ("Hugging Face models, datasets", *resolve("HF_HOME", xdg, "huggingface")),
        ("torch.compile (Inductor)", *inductor),
        ("Triton kernels (torch.compile)",
         *resolve("TRITON_CACHE_DIR", (inductor[0], "in Inductor's folder"), "triton")),
        ("Triton kernels (@triton.jit)",
         *resolve("TRITON_CACHE_DIR", triton_home, ".triton", "cache")),
        ("C++/CUDA extensions (JIT)", *resolve("TORCH_EXTENSIONS_DIR", xdg, "torch_extensions")),
        ("CUDA driver's compiled PTX", *resolve("CUDA_CACHE_PATH", in_home, ".nv", "ComputeCache")),
        ("Apptainer images, layers",
         *resolve("APPTAINER_CACHEDIR", in_home, ".apptainer", "cache")),
    ]  # fmt: skip


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


def inside(path, folder):
    return path == folder or folder in path.parents


def main(argv=None):
    args = parse_args(argv)
    home = Path.home().resolve()
    rows = [(what, path, path.resolve(), source) for what, path, source in caches()]
    in_home = total = 0
    print(f"{'cache':31} {'location from':26} {'size':>9} {'files':>7}  path")
    for i, (what, path, real, source) in enumerate(rows):
        size, figures = 0, f"{'-':>9} {'-':>7}"  # no such folder yet
        if path.exists():
            figures = f"{'':>9} {'':>7}"  # --no-sizes
        if path.exists() and not args.no_sizes:
            size, files = measure(path)
            figures = f"{human(size):>9} {files:>7}"
        # The totals count a folder once: not again when it lies in (or is) one listed before
        # or in one listed after (Triton's folder in Inductor's, for instance).
        if any(inside(real, other) and (real != other or j < i)
               for j, (_, _, other, _) in enumerate(rows) if j != i):  # fmt: skip
            size = 0
        mark = ""
        if inside(real, home):
            in_home += size
            mark = "  <- in your home"
        total += size
        print(f"{what:31} {source:26} {figures}  {path}{mark}")
    print(f"Total {human(total)}, of which {human(in_home)} in your home ({home})")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("show_caches.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
