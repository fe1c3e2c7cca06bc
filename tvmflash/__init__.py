"""tvmflash: exact FlashAttention as one TVM TensorIR program, scheduled per architecture."""

__version__ = "0.1.0"

from tvmflash.kernel import Kernel, attention, compile  # noqa: E402

__all__ = ["Kernel", "attention", "compile", "__version__"]
