"""tvmflash: exact FlashAttention as one TVM TensorIR program, scheduled per architecture."""

import os as _os

__version__ = "0.1.0"

# Installed, the top-level schedules/ folder is the subpackage tvmflash.schedules (package-dir in
# pyproject.toml). Run from a source checkout, find it beside this package.
if not _os.path.isdir(_os.path.join(__path__[0], "schedules")):
    _checkout = _os.path.dirname(_os.path.abspath(__path__[0]))
    if _os.path.isfile(_os.path.join(_checkout, "schedules", "__init__.py")):
        __path__.append(_checkout)

# TVM's CPU thread pool starts with one thread per two cores; use every core torch uses, unless
# the user chose (TVM reads this when its pool starts, at the first CPU kernel call).
if "TVM_NUM_THREADS" not in _os.environ:
    import torch as _torch

    _os.environ["TVM_NUM_THREADS"] = str(_torch.get_num_threads())

from tvmflash.flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func  # noqa: E402
from tvmflash.kernel import BackwardKernel, Kernel, compile, compile_backward  # noqa: E402
from tvmflash.ops import attention  # noqa: E402

__all__ = ["BackwardKernel", "Kernel", "attention", "compile", "compile_backward", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "__version__"]
