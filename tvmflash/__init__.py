"""tvmflash: exact FlashAttention as one TVM TensorIR program, scheduled per architecture."""

import os as _os

from tvmflash.version import __version__

# Installed, the top-level schedules/ folder is the subpackage tvmflash.schedules (package-dir in
# pyproject.toml). Run from a source checkout, find it beside this package.
if not _os.path.isdir(_os.path.join(__path__[0], "schedules")):
    _checkout = _os.path.dirname(_os.path.abspath(__path__[0]))
    if _os.path.isfile(_os.path.join(_checkout, "schedules", "__init__.py")):
        __path__.append(_checkout)

# Where each name of the API lives: loaded at first use (``__getattr__``).
_API = {"Kernel": "kernels", "compile": "kernels", "BackwardKernel": "kernels", "compile_backward": "kernels",
        "attention": "ops", "flash_attn_func": "flash_attn", "flash_attn_kvpacked_func": "flash_attn",
        "flash_attn_qkvpacked_func": "flash_attn", "flash_attn_varlen_func": "flash_attn",
        "flash_attn_varlen_kvpacked_func": "flash_attn", "flash_attn_varlen_qkvpacked_func": "flash_attn",
        "varlen_attention": "ops", "VarlenKernel": "kernels", "VarlenBackwardKernel": "kernels",
        "flash_attn_with_kvcache": "flash_attn", "compile_decode": "kernels", "DecodeKernel": "kernels",
        "flex_attention": "flex"}
__all__ = [*sorted(_API), "__version__"]
# Subpackages loaded at first use too: ``tvmflash.distributed`` (context parallelism, torch.distributed).
_SUBPACKAGES = ("distributed",)


def __getattr__(name):
    """The API loads TVM and torch at first use, so that ``import tvmflash`` (and ``tvmflash --help``,
    ``tvmflash cache ls``) starts in a fraction of a second."""
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"tvmflash.{name}")  # importing sets it on the package: found from now on
    if name not in _API:
        raise AttributeError(f"module 'tvmflash' has no attribute {name!r}")
    import importlib

    importlib.import_module("tvmflash.ops")  # first: it gives the kernels their torch.compile routes (kernels.registry)
    value = globals()[name] = getattr(importlib.import_module(f"tvmflash.{_API[name]}"), name)  # found here from now on
    return value
