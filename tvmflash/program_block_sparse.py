"""A BlockMask's block sparsity in the programs: the lists they take (``SPARSE_ARGUMENTS``), the walk of a
tile's list (``BlockWalk``), the tiles the lists' blocks must divide, and a tile's mask with full blocks
skipping mask_mod. ``tvmflash.flex_block_mask`` makes the lists from torch's ``BlockMask``."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

# A BlockMask's lists as the programs take them (``tvmflash.flex_block_mask.block_sparse_arguments`` makes them),
# int32, batch and head dims of 1 (shared) or the call's batch and query heads:
#   KvCounts  (B, H, q_blocks, 2):  a Q block's partial K/V blocks, then partial + full
#   KvIndices (B, H, q_blocks, w):  its partial K/V blocks, then its full ones (w: at least the count)
#   QCounts, QIndices (B, H, kv_blocks, ...): the same of a K/V block's Q blocks (the backward's dkdv)
SPARSE_ARGUMENTS = ("KvCounts", "KvIndices", "QCounts", "QIndices")


@dataclass(frozen=True)
class BlockWalk:
    """The tiles that one tile of a program visits, from the BlockMask's list of the block it lies in:
    step t (0 <= t < ``count``) visits tile ``tile(t)``, of ``per`` kernel tiles a listed block (the
    BlockMask's block size over the kernel's tile along the walk). A step past the list (a schedule's
    ``min_kv_tiles``, the largest count of a GQA group) visits ``end``, a tile past the sequence's end:
    zeros on load, every key (query) masked, so it changes nothing. ``full(t)``: the listed block is
    full, so its tile skips mask_mod (the sequence's end still applies)."""

    counts: object
    indices: object
    b: object
    h: object
    row: object
    per: int
    end: object

    def _at(self, buffer, last):
        b = T.min(self.b, buffer.shape[0] - 1)  # a dim of 1 is shared (torch's BlockMask broadcasts it)
        h = T.min(self.h, buffer.shape[1] - 1)
        return buffer[b, h, self.row, last]

    @property
    def count(self):
        return self._at(self.counts, 1) * self.per

    def tile(self, t):
        entry = T.min(t // self.per, self.indices.shape[3] - 1)  # in the tensor whatever its counts say
        listed = T.max(self._at(self.indices, entry), 0) * self.per + t % self.per
        return T.if_then_else(t < self.count, listed, self.end)

    def full(self, t):
        return t >= self._at(self.counts, 0) * self.per


def block_walk(spec, flex, b, h, first_row, rows: int, steps: int, keys: bool, end):
    """The ``BlockWalk`` of the tile of batch b, query head h whose ``rows`` rows (the forward's and dq's
    queries; ``keys``: dkdv's keys) start at ``first_row``, in steps of ``steps`` keys (queries), or None
    without block sparsity. The BlockMask's blocks must be whole multiples of both (``check_sparse_tiles``)."""
    sparse = getattr(getattr(spec, "flex", None), "sparse", None)
    if sparse is None:
        return None
    check_sparse_tiles(sparse, rows, steps, keys)
    row_block, step_block = sparse[::-1] if keys else sparse
    counts, indices = flex.buffers[-2:] if keys else flex.buffers[-4:-2]
    return BlockWalk(counts, indices, b, h, first_row // row_block, step_block // steps, end)


# A kernel's tile knobs and the BlockMask block size each must divide: 0 its Q block, 1 its KV block.
SPARSE_TILE_KNOBS = {"block_m": 0, "block_n": 1, "dq_block_m": 0, "dq_block_n": 1}


def check_sparse_tiles(sparse: tuple, rows: int, steps: int, keys: bool = False) -> None:
    """A ValueError unless the kernel's tiles (``rows`` queries by ``steps`` keys; ``keys``: rows keys)
    divide the BlockMask's (Q, KV) block size: a kernel tile then lies in one block, whose list it walks."""
    block_q, block_kv = sparse
    tile_q, tile_kv = (steps, rows) if keys else (rows, steps)
    if block_q % tile_q or block_kv % tile_kv:
        raise ValueError(f"block_mask: its BLOCK_SIZE {block_q}x{block_kv} (Q x KV) is not a multiple of the kernel's "
                         f"tile {tile_q}x{tile_kv}: make the BlockMask with a BLOCK_SIZE that is (128 fits every "
                         f"schedule's default tiles), or pass a mask_mod alone")


def sparse_visible(walk, t, visible, mask):
    """The mask of a tile's element: ``visible`` (the built-in mask: the sequence's end) and ``mask``
    (mask_mod's test, None without one), both evaluated as ``program.key_visible``'s tests are; with
    block sparsity a full block's tile (``walk.full(t)``) skips mask_mod. (``visible`` once: the
    simplifiers do not merge a second copy of its tests inside the or.)"""
    if mask is None:
        return visible
    if walk is None:
        return T.bitwise_and(visible, mask)
    return T.bitwise_and(visible, T.bitwise_or(walk.full(t), mask))
