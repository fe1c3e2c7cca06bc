"""The PyTorch binding: ``tvmflash.attention`` as a torch custom op (``torch.ops.tvmflash.forward``).

Registering a custom op lets torch.compile trace through attention without a graph break (the
fake implementation gives output shapes), and gives autograd one place to hook the backward pass.
"""

from __future__ import annotations

import torch

from tvmflash import target as targets
from tvmflash.kernel import check_flag, compile, resolve_softmax_scale


def kernel_for(q: torch.Tensor, causal: bool):
    """The kernel for q's device, dtype and head_dim (compiled on first use, then cached)."""
    if q.device.type == "cuda":
        target = targets.cuda_device_target(q.device.index)
    elif q.device.type == "cpu":
        target = "cpu"
    else:
        raise ValueError(f"q: expected a CPU or CUDA tensor, got one on {q.device}")
    return compile(head_dim=q.shape[-1], dtype=q.dtype, causal=causal, target=target)


@torch.library.custom_op("tvmflash::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) = attention forward; see :func:`attention`."""
    return kernel_for(q, causal)(q, k, v, softmax_scale=softmax_scale, return_lse=True)


@forward.register_fake
def _forward_shapes(q, k, v, causal, softmax_scale):
    batch, seqlen_q, heads_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_out, grad_lse):
    raise NotImplementedError("tvmflash: the attention backward pass is not implemented yet; "
                              "call tvmflash.attention on tensors that do not require grad")


forward.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, *, causal: bool = False, softmax_scale=None, return_lse: bool = False):
    """Exact attention softmax(q kᵀ · scale) v in flash-attn's layout.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (GQA/MQA). Returns out with q's shape and dtype, or (out, lse)
    with lse float32 of shape (batch, heads_q, seqlen_q). softmax_scale (positive, at most 1e8) defaults to
    1/sqrt(head_dim). With causal and seqlen_q != seqlen_k the mask is aligned bottom-right; a
    query that sees no key gets 0 (and lse -inf). The kernel for the tensors' device, dtype and
    head_dim is compiled on first use and cached.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(q.shape)}")
    check_flag("causal", causal)
    check_flag("return_lse", return_lse)
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = forward(q, k, v, causal, softmax_scale)
    return (out, lse) if return_lse else out
