"""The transport: torch.distributed's point-to-point operations round a ring of a process group, its
all_to_all, and the checks that every rank of the group calls with the same shapes."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ring:
    """The ranks of ``group`` (None: the default group) as a ring: this rank sends to the next and
    receives from the previous one. ``exchange`` posts one step's sends and receives together
    (``batch_isend_irecv``) and returns at once; ``Transfer.wait`` waits for them (on a GPU: makes the
    current stream wait for the communication's stream, the host runs on)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed: expected an initialized process group "
                               "(torch.distributed.init_process_group), found none")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def exchange(self, send: torch.Tensor) -> "Transfer":
        """Send ``send`` (contiguous) to the next rank and receive a tensor of its shape from the
        previous one."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return Transfer(dist.batch_isend_irecv(ops), recv)


class Transfer:
    """A posted exchange; ``wait()`` returns the received tensor."""

    def __init__(self, works, recv):
        self.works, self.recv = works, recv

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


def world_of(group) -> tuple[int, int]:
    """(rank, world size) in ``group``, after checking that torch.distributed is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed: expected an initialized process group "
                           "(torch.distributed.init_process_group), found none")
    return dist.get_rank(group), dist.get_world_size(group)


def check_same_on_every_rank(group, device, function: str, **values) -> None:
    """A ValueError on every rank unless each rank of ``group`` passes the same ints (``values``: name ->
    an int, or a tuple of ints of one length on every rank): one small all_gather."""
    names = list(values)
    flat = []
    for name in names:
        v = values[name]
        flat.extend(v if isinstance(v, tuple) else (v,))
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.tolist() for g in gathered]
    if all(r == rows[0] for r in rows):
        return
    at = 0
    for name in names:
        v = values[name]
        n = len(v) if isinstance(v, tuple) else 1
        seen = [tuple(r[at:at + n]) if n > 1 else r[at] for r in rows]
        if len(set(seen)) > 1:
            raise ValueError(f"{function}: expected the same {name} on every rank of the group, got "
                             + ", ".join(f"rank {i}: {s}" for i, s in enumerate(seen)))
        at += n


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """x cut into ``world`` equal parts along ``scatter_dim``, part w sent to rank w, and the parts
    received (rank 0's first) joined along ``gather_dim``: one ``all_to_all_single``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    parts = torch.stack(x.chunk(world, scatter_dim))  # (world, ...) contiguous: part w to rank w
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    return torch.cat(received.unbind(0), gather_dim)


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` under autograd: its gradient is the all_to_all with the dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None
