"""``CheckTileAlignment``: after shared-memory merging, every TMA destination and every swizzled wgmma
operand sits where the swizzle needs it; a build that finds one off raises ``MisalignedTiles``, and
``pipeline.build`` builds it again with larger barriers (``annotations.TMA_BARRIER_PADDINGS``)."""

from __future__ import annotations

import re
import tvm
import tvm.sym
import tvm_ffi
from tvm import tirx

from tvmflash.lowering.annotations import WGMMA_SWIZZLE_LAYOUTS
from tvmflash.lowering.ir import CALL, LOAD, find, inlined, is_call, is_load, let_values, loaded, prim_func_pass, substitute
from tvmflash.lowering.tma_device_functions import TMA_LOADS, TMA_REDUCTIONS


@tvm_ffi.register_error  # so that it reaches ``pipeline.build`` through TVM's pass machinery as itself
class MisalignedTiles(RuntimeError):
    """A TMA tile or a swizzled wgmma operand off the swizzle's 1024-byte boundary."""

    @property
    def shortfall(self) -> int | None:
        """How many bytes further the tile must start to sit on its boundary (from the message, which is
        all that crosses TVM's pass machinery), or None if the message does not say."""
        found = re.search(r"lands at shared-memory byte (\d+), not on a (\d+)-byte boundary", str(self))
        return None if found is None else -int(found.group(1)) % int(found.group(2))


TMA_COPIES_ATTR = "tvmflash.tma_copies"  # set by ``tma_copies.lowered_to_tma``: how many TMA copies it wrote
# a wgmma descriptor's swizzle layout type -> (the boundary its tile starts on, 8 rows of 2 c bytes for rows
# of c columns; how far past one an operand may start, up to a row: a k16 slice of a K-major tile starts 32
# bytes along a row)
_SWIZZLED_OPERANDS = {layout: (16 * c, 2 * c) for c, layout in WGMMA_SWIZZLE_LAYOUTS.items()}


def _shared_byte_offsets(pointer, what, lets, units16=0):
    """The byte offsets in dynamic shared memory that ``pointer`` (``T.address_of(buffer[index])`` or
    ``T.tvm_access_ptr(...)`` into merged "shared.dyn" memory) plus ``units16`` 16-byte units (a wgmma descriptor's offset) takes
    with the let variables of ``lets`` inlined and every other variable at 0, 1, ..., 5. Raises
    RuntimeError where the pointer is not of that form or the index does not fold to a constant:
    an unread tile is never taken for an aligned one."""
    if is_call(pointer, "tirx.tvm_access_ptr"):  # (type annotation, data, offset in elements, extent, mask)
        data, index, element = pointer.args[1], pointer.args[2], tvm.DataType(str(pointer.args[0].ty.dtype))
    elif is_call(pointer, "tirx.address_of") and is_load(pointer.args[0]) and len(pointer.args[0].indices) == 1:
        load = pointer.args[0]
        data, index, element = loaded(load).data, load.indices[0], tvm.DataType(str(loaded(load).dtype))
    else:
        data = None
    if data is None or getattr(data.ty, "storage_scope", None) != "shared.dyn":
        raise RuntimeError(f"TMA alignment check: cannot read where {what} lands in shared memory: {pointer}")
    byte = _loads_as_variables(inlined(index * (element.bits // 8) + units16 * 16, lets))
    variables = find(byte, tirx.Var, lambda n: isinstance(n.ty, tvm.ir.PrimType))
    analyzer = tvm.sym.Analyzer()
    # a divisor of these variables (a persistent walk's tile index over the batch's tiles) is never 0 where the
    # kernel takes the offset: the steps start at 1 there
    divided = find(byte, (tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod), lambda n: bool(find(n.b, tirx.Var)))
    for step in range(1, 7) if divided else range(6):
        at = analyzer.simplify(substitute(byte, [(v, tirx.const(step, v.ty.dtype)) for v in variables]))
        if not isinstance(at, tirx.IntImm):
            raise RuntimeError(f"TMA alignment check: the offset of {what} does not fold to a constant: {byte}")
        yield at.value, byte


def _loads_as_variables(expr):
    """``expr`` with each integer it loads from memory a variable of its own (a software pipeline's stage
    over a trip count read from a BlockMask's list): it is checked at each value, as the loop indices are."""
    def apply(node):
        dtype = str(node.ty.dtype)
        if "int" in dtype:
            return tirx.Var("loaded", dtype)
        return node
    return tvm_ffi.structural_map(expr, (LOAD, apply))


def check_tile_alignment(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """After MergeSharedMemoryAllocations (which places the tiles): every TMA destination starts on a
    1024-byte boundary, and every swizzled wgmma operand within the first 128 bytes after one (a k16
    slice of a K-major tile starts 32 bytes further along its rows), as the 128-byte swizzle (of the
    copy and of the wgmma descriptors) assumes. Raises MisalignedTiles where one is off
    (``pipeline.build`` then builds again with larger barriers), rather than let the kernel compute
    garbage; and RuntimeError where a TMA build has no copy or no swizzled operand to check, or one
    the check cannot read."""
    expected = int((func.attrs or {}).get(TMA_COPIES_ATTR, 0))
    calls = find(func.body, CALL, lambda n: is_call(n, "tirx.cuda.func_call"))
    # (pointer, 16-byte units past it, the boundary it needs, how far past the boundary it may start)
    aligned = {**TMA_LOADS, **TMA_REDUCTIONS}  # each takes its shared-memory pointer first
    copies = [(c.args[1], 0, aligned[c.args[0].value], 1) for c in calls if c.args[0].value in aligned]
    operands = [(c.args[1], c.args[2], *_SWIZZLED_OPERANDS[int(c.args[5])]) for c in calls
                if c.args[0].value == "tvmflash_wgmma_descriptor" and int(c.args[5]) in _SWIZZLED_OPERANDS]
    if expected and not (copies and operands):
        raise RuntimeError(f"TMA alignment check: the build wrote {expected} TMA copies, but the check finds "
                           f"{len(copies)} TMA copies and {len(operands)} swizzled wgmma operands to check")
    # let variables bound to arithmetic are inlined; one bound to a call (the warpgroup index, a shuffle)
    # stays a variable, as the loop and thread indices do
    lets = [(var, value) for var, value in let_values(func.body) if not find(value, tvm.ir.expr.Call)]
    for pointers, what in ((copies, "a TMA tile"), (operands, "a swizzled wgmma operand")):
        for pointer, units16, boundary, slack in pointers:
            for byte, expression in _shared_byte_offsets(pointer, what, lets, units16):
                if byte % boundary >= slack:
                    raise MisalignedTiles(f"TMA: {what} lands at shared-memory byte {byte}, not on a {boundary}-byte "
                                          f"boundary ({expression}); the copies would be wrong")
    return func


def CheckTileAlignment():  # noqa: N802
    """``check_tile_alignment``, as a pass."""
    return prim_func_pass(check_tile_alignment, "tvmflash.CheckTileAlignment")
