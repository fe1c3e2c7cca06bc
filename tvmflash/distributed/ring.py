"""Ring attention: each rank keeps its query shard and the K/V shards pass round the ring, one step a
shard; the partial outputs merge by their LSE in float32. The backward passes the K/V shards round again,
with their dK/dV (float32), which come home after the last step.

Each step's calls are ``plan.step_pieces``; each is a call of tvmflash's own forward or backward kernel
(``ops.kernel_for``, ``ops.backward_kernel_for``) on slices of the shards. The next step's transfer is
posted before the current step's kernels run, so the two overlap (on a GPU, NCCL's stream beside the
kernels')."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tvmflash import ops
from tvmflash.distributed.comm import Ring
from tvmflash.distributed.plan import Piece


@dataclass(frozen=True)
class RingCall:
    """One ring_attention call's constants: the ring, each step's kernel calls (step s: the K/V shard of
    rank (rank - s) mod world), the scale, softcap and ``deterministic``; with documents (varlen), each
    call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) in the same order as the calls."""

    ring: Ring | None  # None: a world of one, nothing moves
    steps: tuple[tuple[Piece, ...], ...]
    softmax_scale: float
    softcap: float
    deterministic: bool
    documents: tuple[tuple[tuple, ...], ...] | None = None

    def calls(self, step: int):
        """(piece, its documents or None) of each call of step ``step``."""
        pieces = self.steps[step]
        return zip(pieces, self.documents[step] if self.documents is not None else (None,) * len(pieces))


def step_forward(q, kv, step: int, call: RingCall, out, lse) -> None:
    """One step of the forward: each call's kernel on q's rows [q0, q1) over kv's rows [k0, k1) (kv: (2,
    batch, shard_len, heads_kv, head_dim), K then V; with documents, batch 1 and the varlen kernel),
    merged into out and lse in place."""
    for p, documents in call.calls(step):
        kernel = ops.kernel_for(q, p.causal, p.window[0], p.window[1], call.softcap, varlen=documents is not None)
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        if documents is None:
            part_out, part_lse = kernel(q[:, rows], kv[0][:, keys], kv[1][:, keys], softmax_scale=call.softmax_scale,
                                        return_lse=True)
        else:
            cu_q, cu_k, max_q, _ = documents
            part_out, part_lse = kernel(q[0, rows], kv[0][0, keys], kv[1][0, keys], cu_q, cu_k, max_q,
                                        softmax_scale=call.softmax_scale, return_lse=True)
            part_out, part_lse = part_out[None], part_lse[None]
        merge(out[:, rows], lse[:, :, rows], part_out, part_lse)


def step_backward(dout, dlse, q, kv, out, lse, step: int, call: RingCall, dq, dkv) -> None:
    """One step of the backward: each call's backward kernel, with the rows' global out and lse, its
    dq added into dq (float32, q's shape) and its dk, dv into dkv (float32, kv's shape), in place."""
    for p, documents in call.calls(step):
        kernel = ops.backward_kernel_for(q, p.causal, p.window[0], p.window[1], call.softcap,
                                         varlen=documents is not None, deterministic=call.deterministic)
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        if documents is None:
            dq_part, dk_part, dv_part = kernel(
                q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], dout[:, rows], lse[:, :, rows],
                dlse=None if dlse is None else dlse[:, :, rows], softmax_scale=call.softmax_scale)
        else:
            dq_part, dk_part, dv_part = (t[None] for t in kernel(
                q[0, rows], kv[0][0, keys], kv[1][0, keys], out[0, rows], dout[0, rows], lse[0, :, rows], *documents,
                dlse=None if dlse is None else dlse[0, :, rows], softmax_scale=call.softmax_scale))
        dq[:, rows] += dq_part
        dkv[0][:, keys] += dk_part
        dkv[1][:, keys] += dv_part


def merge(out, lse, part_out, part_lse) -> None:
    """Add a partial result into the running one, in place: out (batch, rows, heads, head_dim) float32,
    lse (batch, heads, rows) float32, each rescaled to the joint LSE. Rows that neither has seen a key
    for stay 0 with lse -inf (the joint LSE is -inf there: its exponents are taken against 0, never
    -inf - -inf)."""
    joint = torch.logaddexp(lse, part_lse)
    safe = joint.masked_fill(joint == -torch.inf, 0.0)
    old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    new = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(old).add_(part_out.float() * new)
    lse.copy_(joint)


def ring_forward(q, k, v, call: RingCall):
    """(out in q's dtype, lse float32 (batch, heads_q, rows)) of this rank's queries over every rank's keys."""
    batch, rows, heads, head_dim = q.shape
    out = torch.zeros((batch, rows, heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, rows), -torch.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # one tensor to send a step
    last = len(call.steps) - 1
    for step in range(len(call.steps)):
        transfer = call.ring.exchange(kv) if step < last else None  # posted first: it runs beside the kernels
        step_forward(q, kv, step, call, out, lse)
        if transfer is not None:
            kv = transfer.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, dlse, q, k, v, out, lse, call: RingCall):
    """(dq, dk, dv) of :func:`ring_forward`. Each piece runs the backward kernel with the rows' global
    out and lse, so its D = rowsum(dO∘O) and its softmax are the whole sequence's, and its dq, dk, dv
    are exact shares of the gradients: dq sums here, dk and dv in a float32 buffer that travels with
    the K/V shard and, one step after the last, reaches its owner."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    last = len(call.steps) - 1
    gradient_transfer = None
    for step in range(len(call.steps)):
        transfer = call.ring.exchange(kv) if step < last else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        step_backward(dout, dlse, q, kv, out, lse, step, call, dq, dkv)
        if gradient_transfer is not None:  # the shares of the ranks this shard visited before
            dkv += gradient_transfer.wait()
        if call.ring is not None:
            gradient_transfer = call.ring.exchange(dkv)  # to the next rank; after the last step, home
        if transfer is not None:
            kv = transfer.wait()
    if gradient_transfer is not None:
        dkv = gradient_transfer.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """:func:`ring_forward` and :func:`ring_backward` for autograd: (out, lse) of (q, k, v)."""

    @staticmethod
    def forward(ctx, q, k, v, call: RingCall):
        out, lse = ring_forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only lse reached the loss
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout.contiguous(), dlse, q, k, v, out, lse, ctx.call)
        return dq, dk, dv, None
