"""The gradient of a captured float tensor that requires grad (a learnable bias table) in ``flex_attention``.

The kernels compute dq, dk and dv; a captured tensor's gradient is Σ_{b,h,i,j} dS_bhij ∂score_mod_bhij/∂table,
dS = P ∘ (dP - delta) the gradient of the score_mod's output (the logit), P = exp(logit - lse), dP = dO Vᵀ and
delta = rowsum(dO ∘ O) - dlse. Here it is torch operations after the kernels' backward: the scores recomputed
in chunks of query rows, the traced score_mod (``program_flex.Node``, the tree the kernels run, never the Python
function) evaluated on them with torch, and its gradient by torch's autograd. Exact and correct for any
score_mod the tracer takes, but slow: O(seqlen_q · seqlen_k) work and (batch, heads, rows, seqlen_k) tensors a
chunk outside the kernels, several times the backward's own time: the GPUs' default is dkdv's atomic additions
(``program_flex_gradient``); this is the CPU's (whose dkdv has no atomics) and deterministic mode's
(``choice.capture_gradients_in_kernel``). A load's gradient goes into its table by ``index_add_`` (``_Gather``).
"""

from __future__ import annotations

import math

import torch

from tvmflash.program_flex import BOOL, FLOAT, INT32, INT64, Node

# Score elements a chunk of query rows holds (each of several float32 tensors of this many elements).
CHUNK_ELEMENTS = 2**24
TORCH = {FLOAT: torch.float32, INT32: torch.int32, INT64: torch.int64, BOOL: torch.bool}

_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"), "mod": torch.remainder,
    "minimum": torch.minimum, "maximum": torch.maximum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
}
_UNARY = {"neg": torch.neg, "abs": torch.abs, "not": torch.bitwise_not, "tanh": torch.tanh, "exp": torch.exp,
          "log": torch.log, "sqrt": torch.sqrt, "sigmoid": torch.sigmoid}


def evaluate(node: Node, leaves: dict, captures) -> torch.Tensor:
    """The value of a traced tree on torch tensors: ``leaves`` maps "score", "b", "h", "q_idx" and "kv_idx"
    to broadcastable tensors, ``captures`` the captured tensors by number (float ones read as float32, as
    the programs read them). Differentiable in the score and the float captures."""
    op, args = node.op, node.args
    if op in leaves:
        return leaves[op]
    device = leaves["score"].device
    if op == "const":
        return torch.tensor(node.value, dtype=TORCH[node.dtype], device=device)
    values = [evaluate(a, leaves, captures) for a in args]
    if op == "load":
        tensor = captures[node.value]
        indices = tuple(i.long() for i in values)
        if tensor.requires_grad and len(indices) == tensor.dim() and not torch.are_deterministic_algorithms_enabled():
            return _Gather.apply(tensor, *indices).to(TORCH[node.dtype])
        return tensor[indices].to(TORCH[node.dtype])
    if op == "cast":
        return values[0].to(TORCH[node.dtype])
    if op == "where":
        return torch.where(*values)
    if op in _BINARY:
        return _BINARY[op](*values).to(TORCH[node.dtype])
    if op in _UNARY:
        return _UNARY[op](*values)
    raise NotImplementedError(f"flex_gradient: no torch evaluation of {op!r}")  # pragma: no cover


class _Gather(torch.autograd.Function):
    """``tensor[indices]`` (broadcast index tensors, one a dim), whose backward adds the gradient into the
    tensor by ``index_add_`` (atomic adds on a GPU). Advanced indexing's own backward,
    ``index_put_(accumulate=True)``, sorts its (heads, rows, seqlen_k) indices on CUDA first; it stays where
    deterministic algorithms are asked for."""

    @staticmethod
    def forward(ctx, tensor, *indices):
        ctx.save_for_backward(*indices)
        ctx.shape, ctx.dtype = tensor.shape, tensor.dtype
        return tensor[indices]

    @staticmethod
    def backward(ctx, grad):
        indices = ctx.saved_tensors
        # the row-major flat index, of the indices' broadcast shape: grad's (every dim of the tensor is indexed,
        # and autograd has summed grad over the dims the load's result was broadcast along)
        strides = [math.prod(ctx.shape[d + 1:]) for d in range(len(ctx.shape))]
        flat = sum(index * stride for index, stride in zip(indices, strides))
        total = torch.zeros(math.prod(ctx.shape), dtype=torch.float32, device=grad.device)
        total.index_add_(0, flat.reshape(-1), grad.float().reshape(-1))
        return (total.view(ctx.shape).to(ctx.dtype), *(None for _ in indices))


def capture_gradients(query, key, value, out, lse, dout, dlse, mods, captures, wanted, scale: float) -> list:
    """The gradients of the captured tensors ``wanted`` (bools, one a capture) for the loss whose gradients of
    out and lse are dout and dlse (None: 0); None for the others. flex_attention's layout: query, out, dout
    (batch, heads_q, seqlen_q, head_dim), key and value (batch, heads_kv, seqlen_k, head_dim), lse and dlse
    (batch, heads_q, seqlen_q) (lse: the forward's, sinks included)."""
    batch, heads, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    group = heads // key.shape[1]
    k = key.detach().float().repeat_interleave(group, 1)
    v = value.detach().float().repeat_interleave(group, 1)
    dout = torch.zeros_like(out) if dout is None else dout
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    device = query.device
    leaves_of = {"b": torch.arange(batch, device=device, dtype=torch.int32)[:, None, None, None],
                 "h": torch.arange(heads, device=device, dtype=torch.int32)[None, :, None, None],
                 "kv_idx": torch.arange(seqlen_k, device=device, dtype=torch.int32)[None, :]}
    tables = [t.detach().requires_grad_() if want else t.detach() for t, want in zip(captures, wanted)]
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) if want else None
             for t, want in zip(captures, wanted)]
    differentiable = [t for t, want in zip(tables, wanted) if want]
    rows = max(1, CHUNK_ELEMENTS // max(1, batch * heads * seqlen_k))
    for first in range(0, seqlen_q, rows):
        end = min(seqlen_q, first + rows)
        s = (query[:, :, first:end].detach().float() @ k.transpose(-1, -2)) * scale
        leaves = {**leaves_of, "score": s,
                  "q_idx": torch.arange(first, end, device=device, dtype=torch.int32)[:, None]}
        with torch.enable_grad():
            logit = evaluate(mods.score, leaves, tables)
            row_lse = lse[:, :, first:end, None]
            p = torch.exp(logit.detach() - row_lse)
            hidden = ~torch.isfinite(row_lse)  # a row that sees no key (and no sink): p 0
            if mods.mask is not None:
                hidden = hidden | ~evaluate(mods.mask, leaves, tables)
            p = torch.where(hidden | (logit.detach() == -math.inf), 0.0, p)
            dp = dout[:, :, first:end].float() @ v.transpose(-1, -2)
            ds = p * (dp - delta[:, :, first:end, None])
            found = torch.autograd.grad((logit * ds).sum(), differentiable, allow_unused=True)
        found = iter(found)
        for n, want in enumerate(wanted):
            if want:
                g = next(found)
                if g is not None:
                    grads[n] += g.float()
    return [None if g is None else g.to(t.dtype) for g, t in zip(grads, captures)]


class CapturedGradients(torch.autograd.Function):
    """out and lse of flex_attention as they are (copies), whose backward passes their gradients on and adds
    the gradients of the captured tensors that require grad (``capture_gradients``)."""

    @staticmethod
    def forward(ctx, out, lse, query, key, value, mods, scale, *captures):
        ctx.save_for_backward(out, lse, query, key, value, *captures)
        ctx.mods, ctx.scale = mods, scale
        return out.clone(), lse.clone()

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, query, key, value, *captures = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[7 + n] and t.is_floating_point() for n, t in enumerate(captures)]
        grads = capture_gradients(query, key, value, out, lse, dout, dlse, ctx.mods, captures, wanted, ctx.scale)
        return (dout, dlse, None, None, None, None, None, *grads)
