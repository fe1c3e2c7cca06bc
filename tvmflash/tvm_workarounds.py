"""Workarounds for TVM 0.27 bugs that tvmflash's builds hit. Each says what it works around."""

from __future__ import annotations

import contextlib

import tvm
import tvm_ffi


@contextlib.contextmanager
def lower_every_warp_buffer():
    """Run LowerWarpMemory until it changes nothing.

    In TVM 0.27 one run of ``tirx.transform.LowerWarpMemory`` lowers only the first "warp"-scope
    allocation it meets; the others stay one full copy of the warp's tile per thread, and
    intrinsics that assume the lowered layout (mma fill) then write the wrong elements. The
    build pipeline looks the pass up when it runs, so swapping it for the duration of a build
    is enough.
    """
    original = tvm.tirx.transform.LowerWarpMemory

    def to_fixpoint():
        one = original()

        @tvm.transform.module_pass(opt_level=0, name="tvmflash.LowerWarpMemoryToFixpoint")
        def run(mod, _ctx):
            for _ in range(64):
                lowered = one(mod)
                if tvm_ffi.structural_equal(lowered, mod):
                    break
                mod = lowered
            return mod

        return run

    tvm.tirx.transform.LowerWarpMemory = to_fixpoint
    try:
        yield
    finally:
        tvm.tirx.transform.LowerWarpMemory = original
