"""How tvmflash lowers a scheduled TensorIR module to CUDA or LLVM: one pipeline (``pipeline.py``),
TVM's pass list with tvmflash's passes in their places.

- ``pipeline.py``: the pass list, in order, and ``build``;
- ``passes.py``: tvmflash's own passes (reversed loops, pragmas, hoisting, one barrier a step,
  uniform wgmma descriptors);
- ``tma.py``: the K/V pipeline's copies on TMA and mbarriers (sm_90a), and the tile-alignment check;
- ``tvm_fixes.py``: workarounds for TVM 0.27, each naming what it works around;
- ``annotations.py``: what schedules write into their TensorIR for these passes to act on;
- ``ir.py``: small TIR helpers the passes share.

Imports run one way: the kernel and the tuner import ``build``, schedules import ``annotations``,
and nothing here imports a schedule or the program.
"""

from tvmflash.lowering import annotations, ir, passes, pipeline, tma, tvm_fixes
from tvmflash.lowering.pipeline import build  # noqa: F401

MODULES = (annotations, ir, passes, pipeline, tma, tvm_fixes)  # their source is in the build cache's key
