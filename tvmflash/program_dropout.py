"""Dropout in the programs: which entries of P a (batch, head) keeps, the same bits in the forward and
the backward (``program.attention_forward``, ``program_backward``), from Philox4x32-10 seeded as
flash-attn seeds it.

The random bits. ``dropout_seed`` is flash-attn's rng_state, int64 (seed, offset) drawn from torch's
generator (``ops.resolve_dropout``). Head h of batch (varlen: sequence) b of ``heads_q`` query heads is
the Philox stream offset + b · heads_q + h: a call uses batch · heads_q streams from ``offset``, which
torch's generator then advances by as many. Entry (row, key) of the head is word w of
Philox4x32-10(counter, key=(seed lo, seed hi)) with

    counter = (half(row), half(key), stream lo, stream hi),  half(x) = (x >> 4) << 3 | (x & 7),
    w = (row >> 3 & 1) | (key >> 3 & 1) << 1,

kept iff that word is at least ceil(dropout_p · 2^32): all 32 bits against the rate, so the kept
fraction is 1 - p up to float32's rounding of p itself (the scale 1 / (1 - p) rounds the same p).

The counter layout: one Philox call (ten rounds, four words) serves the four entries whose row and key
differ in bit 3 alone, (r, c), (r + 8, c), (r, c + 8), (r + 8, c + 8). Those four sit in one thread in
every tensor-core layout tvmflash uses, forward and backward: an mma.sync (m16n8) or wgmma accumulator
gives a thread rows g and g + 8 and columns 2t, 2t + 1 of each block of 8 columns, so rows r and r + 8
and, over neighbouring blocks, columns c and c + 8; the backward's dk/dv tile is P transposed (rows the
keys, columns the queries), where the same holds with the roles swapped, so the grouping must be
symmetric in row and key, which bit 3 of each is. (Grouping by key // 4 would serve four entries in the
forward but one in the backward.) nvcc shares the call among the four, since its arguments are equal;
the CPU computes the call once an entry. ``tvmflash.ops.dropout_kept`` is the same rule on torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.lowering.philox import philox_call

DROPOUT_BITS = 32  # the bits of a Philox word compared with the rate: all of them (p · 2^32 < 2^32 for p < 1)
GROUP_BIT = 3  # the bit of the row and of the key whose four combinations share a Philox call


def _words(x):
    """(low, high) uint32 words of the uint64 expression ``x``."""
    return T.cast(x, "uint32"), T.cast(T.shift_right(x, T.uint64(32)), "uint32")


def _half(x):
    """Position ``x`` (int32, >= 0) with bit GROUP_BIT taken out, (x >> 4) << 3 | (x & 7), as uint32.
    Written as floordiv and floormod of the int32 position so that the simplifier, which knows the
    thread indices' bounds, reduces it to the same expression for x and x + 8 (and the bit to a
    constant): nvcc then sees one call with equal arguments, where from uint32 shifts it had to prove
    that the bit was clear, and did not always."""
    group = 1 << GROUP_BIT
    return T.cast(T.floordiv(x, 2 * group) * group + T.floormod(x, group), "uint32")


def _bit(x):
    """Bit GROUP_BIT of position ``x`` (int32, >= 0), 0 or 1, as uint32."""
    return T.cast(T.floormod(T.floordiv(x, 1 << GROUP_BIT), 2), "uint32")


@dataclass(frozen=True)
class Dropout:
    """dropout's parameters of the PrimFunc being parsed: the rate ``p`` (float32, 0 <= p < 1) and
    ``seed``, (2,) int64 (Philox's seed, the offset of the call's first stream), a tensor on the kernel's
    device so that a new draw needs no new module and a captured CUDA graph reads the current one."""

    p: object
    seed: object

    def tile(self, b, h, heads: int) -> "TileDropout":
        """The dropout of head h of batch (varlen: sequence) b, of ``heads`` query heads."""
        stream = T.cast(self.seed[1], "uint64") + T.cast(b * heads + h, "uint64")
        return TileDropout(self, _words(T.cast(self.seed[0], "uint64")), _words(stream))

    @property
    def scale(self):
        """1 / (1 - p): what the kept entries are scaled by."""
        return T.float32(1) / (T.float32(1) - self.p)


@dataclass(frozen=True)
class TileDropout:
    """One (batch, head)'s dropout: ``kept(row, key)``, and its ``scale``."""

    dropout: Dropout
    key: tuple  # Philox's key: the seed's (low, high) words
    stream: tuple  # the (batch, head)'s stream: counter words 2 and 3

    def kept(self, row, col):
        """Is entry (query ``row``, key ``col``) kept? Positions in the sequence (int32)."""
        word = _bit(row) + _bit(col) * T.uint32(2)
        bits = philox_call((_half(row), _half(col), *self.stream), self.key, word)
        threshold = T.cast(T.ceil(self.dropout.p * T.float32(2.0**DROPOUT_BITS)), "uint32")
        return bits >= threshold

    @property
    def scale(self):
        return self.dropout.scale


def dropout_arguments(spec):
    """With dropout, two more parameters of the PrimFunc being parsed, after the others: ``dropout_p``
    (float32) and ``dropout_seed`` (2,) int64, (seed, offset); None without."""
    if not spec.dropout:
        return None
    p = T.float32()
    IRBuilder.name("dropout_p", p)
    T.arg("dropout_p", p)
    handle = T.arg("dropout_seed_handle", T.handle())
    seed = T.match_buffer(handle, (2,), "int64")
    IRBuilder.name("DropoutSeed", seed)
    return Dropout(p, seed)


def dropout_tile(dropout, b, h, heads: int):
    """``Dropout.tile`` of b, h, or None without dropout."""
    return None if dropout is None else dropout.tile(b, h, heads)


def dropped(tile_dropout, value, row, col):
    """``value`` where entry (row, col) is kept (or without dropout), else 0."""
    if tile_dropout is None:
        return value
    return T.if_then_else(tile_dropout.kept(row, col), value, T.float32(0))


def dropout_scaled(dropout, value):
    """``value`` times 1 / (1 - p) (``dropout``: a Dropout or TileDropout), or ``value`` itself without
    dropout (None)."""
    return value if dropout is None else value * dropout.scale
