"""The gradient of a captured float tensor that requires grad (a learnable bias table) inside dkdv.

A score_mod that loads from such a tensor (``bias[h, q_idx - kv_idx + n]``) makes the logit of query i and
key j depend on the loaded value x; the loss's gradient in the tensor is Σ over (b, h, i, j) of
dS_bhij · ∂score_mod_bhij/∂x at the load's index, dS = P ∘ (dP - delta) the gradient of the logit. dkdv has
dS of each element of its tiles in registers (``program_backward``'s ``ds`` block, before the score's
derivative), so the block ``capture_gradient``, right after it, adds dS · ∂score_mod/∂x into a float32
buffer of the tensor's shape at the load's index, for each float load of a learned capture
(``FlexMods.learned``), the derivative taken by ``program_flex.derivative``'s rules (the score's own).

Every dkdv tile adds into the same buffers: the block's stores are declared writes alone, as dq_atomic's
``accumulate_dq``, and a schedule that runs tiles at once makes them atomic (``annotations.MERGED_ATOMIC_ADD_PRAGMA``:
each thread adds a run of its elements with one index once). Elements that P hides (masked, past the ends)
add nothing: the store runs only where P is not 0. With dkdv's slices of the columns (``dkdv_slices``) each
element is in several tiles or rows; only the first slice's add.

The buffers are parameters of dkdv only, after every other (``gradient_arguments``): a module whose mods
learn nothing has none, and its program is the one without this module.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.program_flex import FLOAT, Node, derivative

BLOCK = "capture_gradient"


def learned_loads(flex) -> list[Node]:
    """The distinct float loads of ``flex``'s score_mod from its learned captures, in the tree's order (equal
    loads are one: their derivatives sum)."""
    if flex is None or not flex.learned:
        return []
    found: list[Node] = []

    def walk(node: Node) -> None:
        if node.op == "load" and node.dtype == FLOAT and node.value in flex.learned and node not in found:
            found.append(node)
        for a in node.args:
            walk(a)
    walk(flex.score)
    return found


def learnable(score: Node | None, captures) -> tuple:
    """The numbers of ``captures`` (torch tensors) that a score_mod's tree ``score`` loads as floats and that
    require grad: what ``FlexMods.learned`` names for dkdv to make their gradients."""
    loaded: set = set()

    def walk(node: Node) -> None:
        if node.op == "load" and node.dtype == FLOAT:
            loaded.add(node.value)
        for a in node.args:
            walk(a)
    if score is not None:
        walk(score)
    return tuple(n for n in sorted(loaded) if captures[n].requires_grad)


def gradient_arguments(spec, flex_buffers):
    """With learned captures (``FlexMods.learned``), one more parameter of the dkdv being parsed a learned
    capture: its gradient, float32 of the capture's shape (``flex_buffers``: ``program_flex.flex_arguments``'),
    compact; {capture number: buffer}, or None."""
    flex = getattr(spec, "flex", None)
    if flex is None or not flex.learned:
        return None
    grads = {}
    for n in flex.learned:
        handle = T.arg(f"captured{n}_grad_handle", T.handle())
        grads[n] = T.match_buffer(handle, flex_buffers[n].shape, "float32")
        IRBuilder.name(f"Captured{n}Grad", grads[n])
    return grads


def _whole(buffer):
    return tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, extent) for extent in buffer.shape])


def add_capture_gradients(grads, flex, flex_buffers, P, dP, delta_t, S, softmax_scale, first_query, first_key,
                          rows: int, cols: int, block_n: int, first_tile):
    """The ``capture_gradient`` block of a dkdv step (nothing without ``grads``): over its key-first tiles
    (``rows`` x ``cols``: sᵀ's, pᵀ's, dpᵀ's; ``rows`` more than ``block_n``: dkdv's slices of rows, key r %
    block_n), element (r, c) of query ``first_query`` + c and key ``first_key`` + r adds pᵀ (dpᵀ - delta) ·
    ∂score_mod/∂x into each learned load x's gradient at x's index, where P is not 0, in the first slice of
    rows and where ``first_tile`` (the first of a K/V block's tiles with dkdv's slices of tiles). ``flex``: the
    tile's ``program_flex.FlexTile``; S, q·k unscaled, for a derivative that reads the score."""
    if grads is None:
        return
    # a load whose value reaches the logit only through an index or a comparison adds nothing
    pairs = [(load, derivative(flex.mods.score, load)) for load in learned_loads(flex.mods)]
    pairs = [(load, d) for load, d in pairs if not (d.op == "const" and d.value == 0)]
    if not pairs:
        return
    loads, derivatives = zip(*pairs)
    reads_score = any(_reads_score(d) for d in derivatives)
    sliced = rows > block_n
    with T.grid(rows, cols) as (r, c):
        with T.sblock(BLOCK):
            vr = T.axis.spatial(rows, r)
            vc = T.axis.spatial(cols, c)
            # S only where a derivative reads the score: a schedule's layout of a buffer rewrites the region of
            # it that each block declares, which must be one the block reads
            T.reads([P[vr, vc], dP[vr, vc], delta_t[vc], *([S[vr, vc]] if reads_score else []),
                     *(_whole(b) for b in flex_buffers)])
            # declared writes alone (no read): the tiles' additions commute, so no tile waits on another's
            T.writes([_whole(grads[n]) for n in sorted({load.value for load in loads})])
            ds = P[vr, vc] * (dP[vr, vc] - delta_t[vc])  # the logit's gradient
            row, col = first_query + vc, first_key + (vr % block_n if sliced else vr)
            adds = T.And(P[vr, vc] != T.float32(0), first_tile)
            with T.If(T.And(adds, vr < block_n) if sliced else adds):
                with T.Then():
                    for load, gradient in zip(loads, derivatives):
                        grad = grads[load.value]
                        index = [flex.tir(i, None, None, row, col, within=load) for i in load.args]
                        value = ds * flex.tir(gradient, S[vr, vc], softmax_scale, row, col)
                        T.buffer_store(grad, grad[tuple(index)] + value, index)


def _reads_score(node: Node) -> bool:
    return node.op == "score" or any(_reads_score(a) for a in node.args)
