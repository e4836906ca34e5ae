"""Test-only shim: lets the CUDA build of torchvision import on a CPU-only torch.

torchvision 0.28.0, the release for torch 2.13.0, exists only as a CUDA build. On a CPU torch
its C++ operators do not load, and `import torchvision` fails with "operator torchvision::nms
does not exist". Defining the two operator schemas first is enough for models, datasets and
transforms (not for torchvision.ops). The tests put this folder on PYTHONPATH; the example
scripts never need it, because on a GPU cluster torchvision loads normally.

With TESTS_START_METHOD set, it also sets multiprocessing's start method (see the end).
It also lets DeepSpeed's compiled ops be reused from the machine's cache in a fresh clone
(_ReuseCompiledOps).
"""

import importlib.abc
import importlib.util
import multiprocessing
import os
import sys


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    """Runs once, when torchvision is first imported, so other programs pay nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch  # noqa: PLC0415 (only when torchvision is imported)

        if torch.version.cuda is None:  # CPU build: torchvision's own operators cannot load
            library = torch.library.Library("torchvision", "FRAGMENT")
            library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
            _KEEP.append(library)
        return None  # the normal import goes on


_KEEP = []
sys.meta_path.insert(0, _DefineTorchvisionOps())

# tests/test_start_method.py runs the examples with another start method for DataLoader
# workers: forkserver, the default from Python 3.14 on, pickles the dataset for each worker.
if os.environ.get("TESTS_START_METHOD"):
    multiprocessing.set_start_method(os.environ["TESTS_START_METHOD"])


class _ReuseCompiledOps(importlib.abc.MetaPathFinder):
    """DeepSpeed compiles its CPU ops on first use (torch.utils.cpp_extension.load) into
    TORCH_EXTENSIONS_DIR, which the tests keep in the machine's cache. torch's loader asks
    ninja every time, and ninja rebuilds whenever the sources' path or age changed: in every
    fresh clone, whose venv holds the same DeepSpeed sources at a new path (minutes per op).
    Here an op is loaded from its build folder when that folder holds a library built from
    sources with the same content and the same flags (a key written beside it after each
    build); anything else goes through torch's loader as before. Runs once, on the first
    import of deepspeed, so other programs pay nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)
        import torch.utils.cpp_extension as cpp_extension  # noqa: PLC0415

        original = cpp_extension.load

        def load(name, sources, extra_include_paths=None, build_directory=None, **options):
            folder = build_directory or cpp_extension._get_build_directory(name, False)
            library = os.path.join(folder, f"{name}{cpp_extension.LIB_EXT}")
            stamp = os.path.join(folder, "tests-source-key")
            key = _source_key(sources, extra_include_paths or [], options)
            if options.get("is_python_module", True) and os.path.exists(library):
                try:
                    with open(stamp, encoding="utf-8") as file:
                        same = file.read() == key
                except OSError:
                    same = False
                if same:
                    spec = importlib.util.spec_from_file_location(name, library)
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    return module
            module = original(name, sources, extra_include_paths=extra_include_paths,
                              build_directory=build_directory, **options)  # fmt: skip
            with open(f"{stamp}.tmp{os.getpid()}", "w", encoding="utf-8") as file:
                file.write(key)
            os.replace(f"{stamp}.tmp{os.getpid()}", stamp)
            return module

        cpp_extension.load = load
        return None


def _source_key(sources, include_paths, options):
    """A digest of what an op is built from: the sources' and headers' content (not their
    path or age), and the flags."""
    import hashlib  # noqa: PLC0415

    digest = hashlib.sha256()
    files = list(sources)
    for folder in include_paths:
        for root, dirs, names in os.walk(folder):
            dirs.sort()
            files.extend(os.path.join(root, n) for n in sorted(names))
    for path in files:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as file:
            digest.update(file.read())
    flags = {k: v for k, v in options.items() if k not in ("verbose",)}
    digest.update(repr(sorted(flags.items())).encode())
    return digest.hexdigest()


sys.meta_path.insert(0, _ReuseCompiledOps())


def _log_this_process(path):
    """With TESTS_PROCESS_LOG=file: at exit, one JSON line per Python process the tests start
    (test workers, examples, job steps): its command line, CPU seconds and whether it imported
    torch. tests/tools/process_costs.py sums the file: where the suite's CPU goes."""
    import atexit  # noqa: PLC0415
    import time  # noqa: PLC0415

    start = time.monotonic()

    def write():
        import json  # noqa: PLC0415

        times = os.times()
        line = json.dumps({
            "argv": sys.argv[:6], "cwd": os.getcwd()[-80:], "cpu": times.user + times.system,
            "children": times.children_user + times.children_system,
            "wall": time.monotonic() - start, "torch": "torch" in sys.modules,
        })  # fmt: skip
        with open(path, "a", encoding="utf-8") as file:
            file.write(line + "\n")

    atexit.register(write)


if os.environ.get("TESTS_PROCESS_LOG"):
    _log_this_process(os.environ["TESTS_PROCESS_LOG"])
