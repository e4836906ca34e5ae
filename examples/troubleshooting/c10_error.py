"""Show a c10::Error with and without a Python traceback, and how to find where it came from.

PyTorch's operators are C++: when one fails, here a convolution that gets 10 input channels
instead of 1, it throws a c10::Error, and the Python binding turns it into a RuntimeError with
an ordinary Python traceback. TORCH_SHOW_CPP_STACKTRACES=1 adds the C++ side ("Exception raised
from check_shape_forward at .../aten/src/ATen/native/Convolution.cpp:..."). With --escape the
same error is thrown where no binding can catch it: the script calls, through ctypes, the C++
function behind every failed TORCH_CHECK, as a LibTorch program, a C++ extension's own thread
or a broken build would. The process then aborts with "terminate called after throwing an
instance of 'c10::Error'" and no Python traceback, unless Python's faulthandler is on.

    python c10_error.py                                  # RuntimeError, Python traceback
    TORCH_SHOW_CPP_STACKTRACES=1 python c10_error.py     # the same, with the C++ location
    python c10_error.py --escape                         # terminate called ..., no traceback
    python -X faulthandler c10_error.py --escape         # ... and the Python line that did it
"""

import argparse
import ctypes
import inspect
import sys
from pathlib import Path

# c10::detail::torchCheckFail(const char* func, const char* file, uint32_t line, const char* msg)
TORCH_CHECK_FAIL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--escape", action="store_true", help="throw the error where Python cannot catch it"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"c10_error.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def wrong_channels(torch):
    conv = torch.nn.Conv2d(1, 256, kernel_size=3)  # expects 1 input channel
    images = torch.randn(16, 10, 16, 16)  # 10 channels
    return conv(images)


def throw_from_cpp(torch, message):
    """Throw a c10::Error from C++ code that no Python binding wraps."""
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        check_fail = getattr(ctypes.CDLL(str(library)), TORCH_CHECK_FAIL)
    except (OSError, AttributeError):
        fail(f"{TORCH_CHECK_FAIL} not found in {library}: --escape needs Linux")
    check_fail.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p]
    line = inspect.currentframe().f_lineno
    check_fail(b"throw_from_cpp", b"c10_error.py", line, message.encode())


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not args.escape:
        wrong_channels(torch)  # RuntimeError: Given groups=1, weight of size ...
        return
    try:
        wrong_channels(torch)
    except RuntimeError as error:  # the same message, thrown again outside Python's reach
        throw_from_cpp(torch, str(error).splitlines()[0])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("c10_error.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
