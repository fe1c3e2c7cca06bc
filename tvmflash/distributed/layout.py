"""Which positions of the whole sequence each rank holds: the contiguous and zigzag layouts, the helpers
that shard and unshard a batch, and each rank's segments (runs of consecutive positions).

A sequence of S tokens over W ranks: ``contiguous`` gives rank r the positions r·S/W ... (r+1)·S/W - 1;
``zigzag`` cuts it into 2W chunks of S/(2W) and gives rank r chunks r and 2W-1-r, so that under a causal
mask every rank has the same work (a rank with an early chunk also has a late one)."""

from __future__ import annotations

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    """``layout``, one of ``LAYOUTS``; a ValueError naming them otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def segments(rank: int, world: int, shard_len: int, layout: str) -> tuple[tuple[int, int, int], ...]:
    """Rank ``rank``'s positions, as (first global position, one past the last, first local row) for
    each run of consecutive positions: one for ``contiguous``, two chunks of shard_len / 2 for
    ``zigzag`` (shard_len even, checked by the callers)."""
    if layout == "contiguous":
        return ((rank * shard_len, (rank + 1) * shard_len, 0),)
    chunk = shard_len // 2
    late = 2 * world - 1 - rank
    return ((rank * chunk, (rank + 1) * chunk, 0), (late * chunk, (late + 1) * chunk, chunk))


def _check_split(x, world: int, dim: int, parts: int, what: str):
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    n = x.shape[dim]
    if n % parts:
        raise ValueError(f"x: {what} needs the length of dim {dim} to be a multiple of {parts}, got {n}")


def zigzag_shard(x, rank: int, world: int, dim: int = 1):
    """Rank ``rank``'s zigzag shard of ``x`` (the whole sequence along ``dim``; flash-attn's layout
    (batch, seqlen, heads, head_dim): dim 1): chunks rank and 2·world-1-rank of 2·world equal chunks,
    concatenated (a new tensor, contiguous). The length along ``dim`` must be a multiple of 2·world."""
    _check_split(x, world, dim, 2 * world, f"zigzag over {world} ranks")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world}, got {rank!r}")
    import torch

    chunks = x.chunk(2 * world, dim)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim)


def zigzag_unshard(shards, dim: int = 1):
    """The whole sequence from every rank's zigzag shard (``shards``: a list, rank 0 first, as
    ``torch.distributed.all_gather`` fills it): the inverse of :func:`zigzag_shard`."""
    import torch

    shards = list(shards)
    world = len(shards)
    if not world:
        raise ValueError("shards: expected one tensor a rank, got none")
    for s in shards:
        _check_split(s, world, dim, 2, "zigzag")
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def shard(x, rank: int, world: int, dim: int = 1, layout: str = "contiguous"):
    """Rank ``rank``'s shard of the whole sequence ``x`` along ``dim`` in ``layout`` (a new tensor,
    contiguous): :func:`zigzag_shard`, or the rank-th of ``world`` equal slices."""
    if check_layout(layout) == "zigzag":
        return zigzag_shard(x, rank, world, dim)
    _check_split(x, world, dim, world, f"sharding over {world} ranks")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world}, got {rank!r}")
    return x.chunk(world, dim)[rank].contiguous()


def unshard(shards, dim: int = 1, layout: str = "contiguous"):
    """The whole sequence from every rank's shard in ``layout`` (rank 0 first): the inverse of
    :func:`shard`."""
    if check_layout(layout) == "zigzag":
        return zigzag_unshard(shards, dim)
    import torch

    return torch.cat(list(shards), dim)


def zigzag_order(world: int, shard_len: int):
    """The positions, in order, that the concatenation of every rank's zigzag shard holds: row i of
    the concatenation is position ``zigzag_order(...)[i]`` (a list of ints)."""
    order = []
    for rank in range(world):
        for start, end, _ in segments(rank, world, shard_len, "zigzag"):
            order.extend(range(start, end))
    return order
