"""The AMX forward's knobs: tiles in whole 32 x 32 blocks of tile products. block_m 128 by default:
each task packs every K/V tile it reads (``packing``), so more query rows a task share that cost;
measured fastest of block_m 64 and 128 by block_n 64 and 128 at d64 and d128. block_m 256 shares it
further, and was faster without a mask but slower with causal's (BENCHMARKS.md, CPU with AMX)."""

from __future__ import annotations

from .. import cpu
from ..contract import TILE, Knob, KnobSet
from .intrinsics import BLOCK, STEP

DTYPES = ("bfloat16",)  # AMX's float16 products (amx-fp16) are Granite Rapids' alone
# head_dim is QKᵀ's reduction (steps of 32) and PV's columns (blocks of 32).
HEAD_DIMS = tuple(range(STEP, 257, STEP))
FORWARD = KnobSet("amx", "forward", (
    Knob("block_m", 128, choices=(32, 64, 128, 256), space=(32, 64, 128, 256), role=TILE),
    Knob("block_n", 64, choices=(32, 64, 128, 256), space=(32, 64, 128), role=TILE),
    Knob("vector", 16, choices=cpu.VECTORS, space=cpu.SAMPLED_VECTORS),
))
assert all(value % BLOCK == 0 for knob in FORWARD.knobs[:2] for value in knob.choices)
# The backward's: dkdv's tiles are (block_n keys, block_m queries), dq's (block_m, block_n), and each
# of those sizes is a product's rows, columns or reduction: whole 32 x 32 blocks as the forward's.
# 128 x 128 by default: each step packs its right operands again (q and dout in dkdv, K and V in dq), so
# larger tiles share that cost; measured fastest of 64 and 128 each way at d64 and d128, full and causal.
BACKWARD = KnobSet("amx", "backward", (
    Knob("block_m", 128, choices=(32, 64, 128), space=(32, 64, 128), role=TILE),
    Knob("block_n", 128, choices=(32, 64, 128), space=(32, 64, 128), role=TILE),
    Knob("vector", 16, choices=cpu.VECTORS, space=cpu.SAMPLED_VECTORS),
    Knob("dq_atomic", True, space=(True, False)),  # as the CPU schedule's (``cpu.BACKWARD``)
))
assert all(value % BLOCK == 0 for knob in BACKWARD.knobs[:2] for value in knob.choices)
