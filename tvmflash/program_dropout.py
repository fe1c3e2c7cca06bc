"""Dropout in the programs: which entries of P a (batch, head) keeps, the same bits in the forward and
the backward (``program.attention_forward``, ``program_backward``).

Entry (row, key) of head h of batch (varlen: sequence) b is kept iff the top 24 bits of
mix32(mix32(tile ^ row) ^ key), tile = mix32(seed0 ^ mix32(seed1 ^ (b · heads_q + h))), reach
ceil(dropout_p · 2^24) (mix32: ``lowering.hashing``, a bijection of uint32 with full avalanche, so the
keys of a row and the rows of a tile draw independent bits). The indices enter by xor, never by a
product that the simplifier could fold into an out-of-range uint32 constant. The backward recomputes
the same bits; ``tvmflash.ops.dropout_kept`` is the same rule on torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.lowering.hashing import mix32_call

DROPOUT_BITS = 24  # the bits compared with the rate (a float32 holds p · 2^24 exactly)


@dataclass(frozen=True)
class Dropout:
    """dropout's parameters of the PrimFunc being parsed: the rate ``p`` (float32, 0 <= p < 1) and
    the ``seed`` (2,) int32, a tensor on the kernel's device so that a new draw needs no new module
    and a captured CUDA graph reads the current one."""

    p: object
    seed: object

    def tile(self, b, h, heads: int) -> "TileDropout":
        """The dropout of head h of batch (varlen: sequence) b, of ``heads`` query heads."""
        bh = T.cast(b * heads + h, "uint32")
        key = mix32_call(T.bitwise_xor(T.cast(self.seed[0], "uint32"),
                                       mix32_call(T.bitwise_xor(T.cast(self.seed[1], "uint32"), bh))))
        return TileDropout(self, key)

    @property
    def scale(self):
        """1 / (1 - p): what the kept entries are scaled by."""
        return T.float32(1) / (T.float32(1) - self.p)


@dataclass(frozen=True)
class TileDropout:
    """One (batch, head)'s dropout: ``kept(row, key)``, and its ``scale``."""

    dropout: Dropout
    key: object  # the (batch, head)'s hash of the seed

    def kept(self, row, col):
        """Is entry (query ``row``, key ``col``) kept? Positions in the sequence (int32)."""
        bits = mix32_call(T.bitwise_xor(mix32_call(T.bitwise_xor(self.key, T.cast(row, "uint32"))),
                                        T.cast(col, "uint32")))
        threshold = T.cast(T.ceil(self.dropout.p * T.float32(2.0**DROPOUT_BITS)), "uint32")
        return T.shift_right(bits, T.uint32(32 - DROPOUT_BITS)) >= threshold

    @property
    def scale(self):
        return self.dropout.scale


def dropout_arguments(spec):
    """With dropout, two more parameters of the PrimFunc being parsed, after the others: ``dropout_p``
    (float32) and ``dropout_seed`` (2,) int32; None without."""
    if not spec.dropout:
        return None
    p = T.float32()
    IRBuilder.name("dropout_p", p)
    T.arg("dropout_p", p)
    handle = T.arg("dropout_seed_handle", T.handle())
    seed = T.match_buffer(handle, (2,), "int32")
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
