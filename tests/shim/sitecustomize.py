"""Test-only shim: lets the CUDA build of torchvision import on a CPU-only torch.

torchvision 0.28.0, the release for torch 2.13.0, exists only as a CUDA build. On a CPU torch
its C++ operators do not load, and `import torchvision` fails with "operator torchvision::nms
does not exist". Defining the two operator schemas first is enough for models, datasets and
transforms (not for torchvision.ops). The tests put this folder on PYTHONPATH; the example
scripts never need it, because on a GPU cluster torchvision loads normally.

With TESTS_START_METHOD set, it also sets multiprocessing's start method (see the end).
"""

import importlib.abc
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
