"""How tvmflash lowers a scheduled TensorIR module to CUDA or LLVM: one pipeline (``pipeline.py``),
TVM's pass list with tvmflash's passes in their places.

- ``pipeline.py``: the pass list, in order, and ``build``;
- tvmflash's own passes, a module a role: ``loops_and_blocks.py`` (reversed loops, blocks run under a
  condition, a pipelined loop's trip count read from memory), ``pragmas.py`` (the pragmas' statements,
  atomic additions among them), ``uniformity.py`` (block-uniform loads and their divisors, a BlockMask's values once a
  step, conditions and guards, warp-uniform wgmma descriptors), ``cp_async_barriers.py`` (one barrier a cp.async pipeline's step),
  ``double_buffers.py`` (a tile written and read each step in two buffers, one barrier a step),
  ``wide_indices.py`` (int64 indices into large tensors), ``cpu_exp2.py`` (exp2 as a polynomial on
  the CPU), ``cpu_padding.py`` (the padded tiles' loads without a test where a whole tile is inside),
  ``amx_config.py`` (AMX's tile configuration loaded once a task), ``philox.py`` (Philox4x32-10, dropout's random bits);
- the K/V pipeline's copies on TMA and mbarriers (sm_90a): ``tma_copies.py`` (the pass, and how its
  waits and releases follow the pipeline), ``tma_plan.py`` (what it works from, each copy block read as
  one TMA copy), ``tma_producer_warpgroup.py`` (FA3's producer warpgroup and its consumers' named
  barriers), ``tma_tensor_maps.py`` (the host's tensor maps), ``tma_device_functions.py`` (the PTX they
  call); and ``tile_alignment.py``, the check that the swizzled tiles sit on their boundaries;
- ``tvm_fixes.py``: workarounds for TVM 0.27, each naming what it works around;
- ``annotations.py``: what schedules write into their TensorIR for these passes to act on;
- ``ir.py``: small TIR helpers the passes share.

Imports run one way: the kernel and the tuner import ``build``, schedules import ``annotations``,
and nothing here imports a schedule or the program.
"""

from tvmflash.lowering import (amx_config, annotations, cp_async_barriers, cpu_exp2, cpu_padding, double_buffers, ir, loops_and_blocks, philox,
                               pipeline, pragmas, tile_alignment, tma_copies, tma_device_functions, tma_plan,
                               tma_producer_warpgroup, tma_reductions, tma_tensor_maps, tvm_fixes, uniformity,
                               wide_indices)
from tvmflash.lowering.pipeline import build  # noqa: F401

# their source is in the build cache's key
MODULES = (amx_config, annotations, cp_async_barriers, cpu_exp2, cpu_padding, double_buffers, ir, loops_and_blocks, philox, pipeline, pragmas,
           tile_alignment, tma_copies, tma_device_functions, tma_plan, tma_producer_warpgroup, tma_reductions,
           tma_tensor_maps, tvm_fixes, uniformity, wide_indices)
