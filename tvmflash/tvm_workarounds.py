"""Workarounds for TVM 0.27 bugs that tvmflash's builds hit. Each says what it works around."""

from __future__ import annotations

import contextlib

import tvm
import tvm_ffi


@contextlib.contextmanager
def _replaced(namespace, name: str, replacement):
    """``namespace.name = replacement`` for the duration: TVM's build pipeline looks its passes up
    by attribute when it runs, so swapping a pass factory is enough to change one build."""
    original = getattr(namespace, name)
    setattr(namespace, name, replacement)
    try:
        yield
    finally:
        setattr(namespace, name, original)


@contextlib.contextmanager
def lower_every_warp_buffer():
    """Run LowerWarpMemory until it changes nothing.

    In TVM 0.27 one run of ``tirx.transform.LowerWarpMemory`` lowers only the first "warp"-scope
    allocation it meets; the others stay one full copy of the warp's tile per thread, and
    intrinsics that assume the lowered layout (mma fill) then write the wrong elements.
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

    with _replaced(tvm.tirx.transform, "LowerWarpMemory", to_fixpoint):
        yield


@contextlib.contextmanager
def no_warp_thread_sync():
    """Leave out ``s_tir.transform.ThreadSync("warp")``.

    The barriers it plans for "warp"-scope buffers are never emitted for CUDA (the generated source
    has no ``__syncwarp``: the "warp" buffers become registers), so it changes nothing in the
    output, but it aborts a build whose mma accumulator rescale sits under a block-uniform guard:
    "Check failed: condition_counter() == 0 (1 vs. 0) : Cannot insert syncs inside condition".
    InjectSoftwarePipeline writes such guards (``if 1 <= seqlen_k``) around the epilogue of a
    pipeline over the symbolic number of K/V tiles. The "shared" and "shared.dyn" syncs are kept.
    """
    original = tvm.s_tir.transform.ThreadSync

    def thread_sync(storage_scope):
        if storage_scope == "warp":
            return tvm.transform.Sequential([], name="tvmflash.NoWarpThreadSync")
        return original(storage_scope)

    with _replaced(tvm.s_tir.transform, "ThreadSync", thread_sync):
        yield


@contextlib.contextmanager
def compact_again_after_match_buffers():
    """Run ``s_tir.transform.CompactBufferAllocation`` a second time, right after
    ``LowerMatchBuffer`` (on the ``StmtSimplify`` that follows it).

    The pipeline compacts buffers once, before ``LowerMatchBuffer``: a tensorized block's
    ``match_buffer`` region then counts as accessed by every thread, so a "local" buffer that each
    lane touches at a lane-dependent index (the sm80 row_state "registers" per-row values: row
    8 k + lane // 4 of each warp, matched as the warp's whole (4, 8) tile by the quad intrinsics)
    keeps the whole warp's shape, indexed with ``threadIdx.x >> 2``, and nvcc puts it in local
    memory. Once the match buffers are lowered, the accesses are plain loads and stores at
    ``[k, threadIdx.x // 4]``, and the same pass (threadIdx is not relaxed for "local" scope)
    shrinks them to the 4 values each thread owns. On the other buffers it is a no-op (the sm80
    "shared" row state's CUDA is byte-identical with and without it).
    """
    original = tvm.s_tir.transform.StmtSimplify
    compact = tvm.s_tir.transform.CompactBufferAllocation

    def simplify_then_compact(*args, **kwargs):
        return tvm.transform.Sequential(
            [original(*args, **kwargs), compact(), original(*args, **kwargs)],
            name="tvmflash.StmtSimplifyThenCompactAgain")

    with _replaced(tvm.s_tir.transform, "StmtSimplify", simplify_then_compact):
        yield
