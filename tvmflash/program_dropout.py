"""Dropout in the programs: which entries of P a (batch, head) keeps, the same bits in the forward and
the backward (``program_forward``, ``program_backward``), from Philox4x32-10 seeded as
flash-attn seeds it.

The random bits. ``dropout_seed`` is flash-attn's rng_state, int64 (seed, offset) drawn from torch's
generator (``tvmflash.dropout.philox_state``). Head h of batch (varlen: sequence) b of ``heads_q`` query heads is
the Philox stream offset + b · heads_q + h: a call uses batch · heads_q streams from ``offset``, which
torch's generator then advances by as many. Entry (row, key) of the head is 16-bit half k & 1 (low
half first) of word w of Philox4x32-10(counter, key=(seed lo, seed hi)), with

    counter = (row without bit 3, key without bits 0 and 3, stream lo, stream hi),
    row without bit 3 = (row >> 4) << 3 | (row & 7),  key without bits 0 and 3 = (key >> 4) << 2 | (key & 7) >> 1,
    w = (row >> 3 & 1) | (key >> 3 & 1) << 1,

kept iff that half is at least ceil(dropout_p · 2^16). Sixteen bits against the rate: the kept
fraction is 1 - p within 2^-16 (p rounded up to a multiple of 2^-16; flash-attn rounds it to 8 bits),
while the kept entries are scaled by 1 / (1 - p) of p itself, a bias of at most 1.5e-5 relative.

The counter layout: one Philox call (ten rounds, four 32-bit words, eight halves) serves the eight
entries whose row differs in bit 3 and whose key differs in bits 0 and 3. An mma.sync (m16n8) or wgmma
accumulator gives a thread rows g and g + 8 and keys 2t and 2t + 1 of each block of 8 keys: rows r and
r + 8, keys c and c + 1, and over neighbouring blocks c + 8, so in the forward (and sm80's dq, also
rows = queries) all eight of a call's entries sit in one thread. The backward's dk/dv tile is P
transposed (rows the keys, columns the queries): there a thread holds keys c and c + 8 but not c + 1,
so four of a call's entries; no layout serves eight in both orientations, since the forward's thread
holds one row parity and the backward's one key parity. (Grouping by key // 4 or // 8 would serve two
entries a call in the forward and one in the backward.) nvcc shares the call among the entries, since
its arguments are equal; the CPU computes the call once an entry. ``tvmflash.dropout.dropout_kept`` is the
same rule on torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.lowering.philox import philox_call

DROPOUT_BITS = 16  # the bits of a Philox word compared with the rate: half a word an entry
GROUP_BIT = 3  # the bit of the row and of the key, with bit 0 of the key, whose combinations share a call


def _words(x):
    """(low, high) uint32 words of the uint64 expression ``x``."""
    return T.cast(x, "uint32"), T.cast(T.shift_right(x, T.uint64(32)), "uint32")


# Positions are written as floordiv and floormod of the int32 position, so that the simplifier, which
# knows the thread indices' bounds, reduces the counter to the same expression for the entries that
# share it (and the word and half to constants): nvcc then sees calls with equal arguments, where from
# uint32 shifts it had to prove that the bits were clear, and did not always.
def _row_counter(x):
    """Row ``x`` (int32, >= 0) without bit 3, as uint32."""
    group = 1 << GROUP_BIT
    return T.cast(T.floordiv(x, 2 * group) * group + T.floormod(x, group), "uint32")


def _key_counter(x):
    """Key ``x`` (int32, >= 0) without bits 0 and 3, as uint32."""
    group = 1 << GROUP_BIT
    return T.cast(T.floordiv(x, 2 * group) * (group // 2) + T.floordiv(T.floormod(x, group), 2), "uint32")


def _bit(x, bit: int):
    """Bit ``bit`` of position ``x`` (int32, >= 0), 0 or 1, as uint32."""
    return T.cast(T.floormod(T.floordiv(x, 1 << bit), 2), "uint32")


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
        word = _bit(row, GROUP_BIT) + _bit(col, GROUP_BIT) * T.uint32(2)
        bits = philox_call((_row_counter(row), _key_counter(col), *self.stream), self.key, word)
        half = T.bitwise_and(T.shift_right(bits, _bit(col, 0) * T.uint32(DROPOUT_BITS)),
                             T.uint32((1 << DROPOUT_BITS) - 1))
        return half >= T.cast(T.ceil(self.dropout.p * T.float32(2.0**DROPOUT_BITS)), "uint32")

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
