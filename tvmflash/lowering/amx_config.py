"""``OneTileConfigPerTask``: AMX's tile configuration loaded once a task of a parallel loop, not by
every tile product (``schedules/amx/intrinsics``, each of whose calls fills a 64-byte configuration and
loads it, ``ldtilecfg``, as a call must where it stands alone).

The configuration is the state of the thread that runs the task, and nothing else in a task's body
changes it; so where every configuration a task loads is the same, the first, at the start of the
task's body, serves all its products."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from tvmflash.lowering.ir import find, prim_func_pass, target_of

_LDTILECFG = "llvm.x86.ldtilecfg"


def _intrinsic_id(name: str) -> int:
    return int(tirx.call_llvm_intrin("void", name, tirx.const(0, "int32")).args[0].value)


def _loads_config(stmt, ldtilecfg: int) -> bool:
    return (isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.expr.Call)
            and getattr(stmt.value.op, "name", "") == "tirx.call_llvm_intrin" and int(stmt.value.args[0].value) == ldtilecfg)


def _config_buffer(load):
    """The buffer variable an ``ldtilecfg`` reads (its ``tvm_access_ptr``'s)."""
    return load.value.args[-1].args[1]


def _same(a, b) -> bool:
    return tvm_ffi.structural_equal(a, b)


def _without(stmt, drop):
    """``stmt`` with the statements for which ``drop`` holds removed (SeqStmts rebuilt)."""
    def visit(node):
        if isinstance(node, tirx.SeqStmt):
            kept = [s for s in node.seq if not drop(s)]
            return tirx.SeqStmt(kept) if len(kept) > 1 else (kept[0] if kept else tirx.Evaluate(0))
        return None
    return tvm_ffi.structural_map(stmt, (tirx.SeqStmt, lambda n: visit(n) or n))


def _one_config(loop, ldtilecfg: int):
    loads = find(loop.body, tirx.Evaluate, lambda s: _loads_config(s, ldtilecfg))
    if len(loads) < 2:
        return loop
    buffers = [_config_buffer(load) for load in loads]
    stores = find(loop.body, tirx.BufferStore, lambda s: any(_same(s.buffer.data, b) for b in buffers))
    fills = [[s for s in stores if _same(s.buffer.data, b)] for b in buffers]
    values = [sorted((str(s.indices[0]), str(s.value)) for s in fill) for fill in fills]
    if any(v != values[0] for v in values[1:]):
        return loop  # configurations that differ: each product keeps its own
    first = fills[0]

    def drop(stmt):
        return _loads_config(stmt, ldtilecfg) or (isinstance(stmt, (tirx.BufferStore, tirx.AllocBuffer))
                                                  and any(_same(stmt.buffer.data, b) for b in buffers))
    body = _without(loop.body, drop)
    # (a body of one statement: a task that walks its tiles in a loop of its own, dkdv's with dq_atomic)
    seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    # after the task's allocations
    at = next((n for n, s in enumerate(seq) if not isinstance(s, (tirx.AllocBuffer, tirx.DeclBuffer))), len(seq))
    config = tirx.decl_buffer((64,), "uint8", name="amx_config", scope="local", data_alignment=64)
    seq[at:at] = [tirx.AllocBuffer(config), *(tirx.BufferStore(config, s.value, s.indices) for s in first),
                  tirx.Evaluate(tirx.call_llvm_intrin("void", _LDTILECFG, config.access_ptr("w")))]
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.SeqStmt(seq), loop.thread_binding,
                    loop.annotations)


def OneTileConfigPerTask():  # noqa: N802
    """In the functions built for the CPU (llvm): in each parallel loop's body whose AMX tile
    configurations are all the same, the first configuration's fill and ``ldtilecfg`` at the start of
    the body and no others."""
    def rewrite(func):
        if target_of(func, "llvm") is None:
            return func
        ldtilecfg = _intrinsic_id(_LDTILECFG)
        return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, lambda loop: _one_config(loop, ldtilecfg)
                                                                 if loop.kind == tirx.ForKind.PARALLEL else loop)))
    return prim_func_pass(rewrite, "tvmflash.OneTileConfigPerTask")
