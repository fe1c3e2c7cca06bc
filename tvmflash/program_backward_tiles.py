"""Which tiles the backward's programs visit (``program_backward``): the masks' tests of a key and of a
whole tile, the Q blocks a dkdv tile (one K/V block) walks and the K/V blocks a dq tile (one Q block) walks,
under causal masks, windows, varlen and a BlockMask's lists. The forward's rules (``program``), counted in
the backward's tiles."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from tvm.script import tirx as T

from tvmflash import program, program_block_sparse, program_flex
from tvmflash.program import AttentionSpec


class TileRanges(NamedTuple):
    visible: Callable
    tile_visible: Callable
    first_q_block: Callable
    q_blocks: Callable
    first_kv_block: Callable
    kv_blocks: Callable
    block_walk: Callable
    block_walks: Callable


def tile_ranges(spec: AttentionSpec, BM: int, BN: int) -> TileRanges:
    """The tests and counts of tiles of ``BM`` query rows by ``BN`` keys, for ``spec``'s masks."""
    left, right = spec.window_left, spec.window_right
    group = spec.heads_q // spec.heads_kv

    def visible(row, col, seqlen_q, seqlen_k, flex=None, walk=None, t=None):
        """Is key ``col`` visible to query ``row``? (Both absolute positions; the forward's rule, a
        mask_mod's test joined: ``flex``, the tile's ``program_flex.FlexTile``; ``walk``: a BlockMask's,
        whose full blocks skip it, at step t.)"""
        seen = program.key_visible(spec, row, col, seqlen_q, seqlen_k)
        return program_block_sparse.sparse_visible(walk, t, seen, program.flex_mask(spec, flex, row, col))

    def tile_visible(qb, kb, seqlen_q, seqlen_k, walk=None, t=None):
        """Does every row of Q block qb see every key of K/V block kb? Rows past seqlen_q need no
        mask (``load_q``). With a mask_mod no block is known to: each is masked; with a BlockMask, a
        full block's tiles before the end of the keys."""
        if walk is not None:
            return T.And(walk.full(t), program.block_visible(spec, qb * BM, qb * BM + BM - 1, kb * BN, kb * BN + BN - 1,
                                                             seqlen_q, seqlen_k))
        if program.has_mask_mod(spec):
            return False
        return program.block_visible(spec, qb * BM, qb * BM + BM - 1, kb * BN, kb * BN + BN - 1, seqlen_q, seqlen_k)

    def first_q_block(kb, seqlen_q, seqlen_k):
        """The first Q block with a row that sees a key of K/V block kb (causal or a right window: a
        row that sees its first key; without a left window the last row sees every key, so every
        block has one)."""
        if spec.causal:
            return T.max(0, kb * BN + seqlen_q - seqlen_k) // BM
        if right >= 0:
            return T.max(0, kb * BN + seqlen_q - seqlen_k - right) // BM
        return 0

    def q_blocks(kb, seqlen_q, seqlen_k, walks=None):
        """How many Q blocks (of one query head) K/V block kb visits: up to the last (with a left
        window: up to the last row that sees the block's last key). ``walks``: a BlockMask's lists of
        the group's query heads, the longest's count (the others' steps past their own visit a Q block
        past the end, which adds nothing)."""
        if walks is not None:
            # never negative by its form, so that dkdv's fused loop's division of its step by it lowers to the
            # plain one, not to a signed floor division in each score's mask (``uniformity.BindLoadedDivisors``)
            return functools.reduce(T.max, [walk.count for walk in walks], 0)
        if left < 0:
            count = T.ceildiv(seqlen_q, BM) - first_q_block(kb, seqlen_q, seqlen_k)
        else:
            end = T.min(T.ceildiv(seqlen_q, BM), T.ceildiv(T.max(0, kb * BN + BN + seqlen_q - seqlen_k + left), BM))
            count = T.max(0, end - first_q_block(kb, seqlen_q, seqlen_k))
        if spec.varlen:  # the grid's K/V blocks past the sequence's keys (max_seqlen_k sizes it) see no query
            count = T.if_then_else(kb * BN < seqlen_k, count, 0)
        return count

    def first_kv_block(qb, seqlen_q, seqlen_k):
        """The first K/V block Q block qb visits (0 without a left window)."""
        return program.first_kv_block(spec, qb, BM, BN, seqlen_q, seqlen_k)

    def kv_blocks(qb, seqlen_q, seqlen_k, walk=None):
        """How many K/V blocks Q block qb visits from ``first_kv_block`` on (causal: up to its last
        row's last key, a window: its rows' keys; a block whose rows see no key visits none, and its
        dq is 0; ``walk``: a BlockMask's list's)."""
        if walk is not None:
            return walk.count
        end = program.kv_blocks_end(spec, qb, BM, BN, seqlen_q, seqlen_k)
        if spec.varlen:  # the grid's Q blocks past the sequence's end (max_seqlen_q sizes it) see no key
            end = T.if_then_else(qb * BM < seqlen_q, end, 0)
        if left < 0:
            return end
        return T.max(0, end - first_kv_block(qb, seqlen_q, seqlen_k))

    def block_walk(buffers, b, h, kb, seqlen_q):
        """dkdv's walk of query head h over a BlockMask's list of K/V block kb's Q blocks (None without)."""
        flex = program_flex.flex_tile(spec, buffers, b, h, seqlen_q, seqlen_q)
        return program_block_sparse.block_walk(spec, flex, b, h, kb * BN, BN, BM, True, T.ceildiv(seqlen_q, BM))

    def block_walks(buffers, b, hk, kb, seqlen_q):
        """The walks of K/V head hk's group of query heads (None without a BlockMask)."""
        if spec.flex is None or spec.flex.sparse is None:
            return None
        return [block_walk(buffers, b, hk * group + g, kb, seqlen_q) for g in range(group)]

    return TileRanges(visible, tile_visible, first_q_block, q_blocks, first_kv_block, kv_blocks, block_walk,
                      block_walks)
