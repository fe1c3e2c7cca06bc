"""Ulysses (DeepSpeed-Ulysses): an all_to_all turns sequence shards into head shards, each rank runs
tvmflash's attention over the whole sequence for its heads, and an all_to_all turns the output back.
The backward is autograd's: the all_to_alls' gradients are the reverse all_to_alls (``comm.AllToAll``)."""

from __future__ import annotations

import torch

from tvmflash.distributed.comm import AllToAll


def kv_replication(heads_q: int, heads_kv: int, world: int) -> int:
    """How many times to repeat each K/V head so that the K/V heads split over ``world`` ranks with the
    query heads they serve: the least r dividing heads_q / heads_kv with heads_kv · r a multiple of
    world (heads_q a multiple of world, so r = heads_q / heads_kv always does)."""
    group = heads_q // heads_kv
    return next(r for r in range(1, group + 1) if group % r == 0 and heads_kv * r % world == 0)


def zigzag_index(world: int, shard_len: int, device) -> torch.Tensor:
    """``layout.zigzag_order`` as an int64 tensor on ``device``, made by torch ops (a million positions
    as a Python list would cost the host more than the all_to_all): row i of the ranks' shards joined
    in rank order is position index[i]."""
    chunk = shard_len // 2
    ranks = torch.arange(world, device=device)
    chunks = torch.stack((ranks, 2 * world - 1 - ranks), 1).flatten()  # chunk r, then 2W-1-r, for each rank
    return (chunks[:, None] * chunk + torch.arange(chunk, device=device)).flatten()


def sequence_to_heads(x, group, world: int, shard_len: int, layout: str):
    """(batch, shard_len, heads, d) sequence shards -> (batch, world · shard_len, heads / world, d), the
    whole sequence in order for this rank's heads."""
    x = AllToAll.apply(x, 2, 1, group)
    if layout == "zigzag" and world > 1:
        x = x.index_select(1, torch.argsort(zigzag_index(world, shard_len, x.device)))  # row p: position p
    return x


def heads_to_sequence(x, group, world: int, shard_len: int, layout: str, seq_dim: int = 1, head_dim: int = 2):
    """The inverse of :func:`sequence_to_heads` (``seq_dim``, ``head_dim``: lse's are 2 and 1)."""
    if layout == "zigzag" and world > 1:
        x = x.index_select(seq_dim, zigzag_index(world, shard_len, x.device))
    return AllToAll.apply(x.contiguous(), seq_dim, head_dim, group)
