"""The varlen forward kernel: sequences packed without padding (flash-attn's varlen)."""

from __future__ import annotations


import torch

from tvmflash.kernels import registry
from tvmflash.kernels.checks import check_flag, resolve_softmax_scale
from tvmflash.kernels.forward import Kernel, no_keys_lse


def one_batch(t: torch.Tensor) -> torch.Tensor:
    """Packed rows (rows, ...) as the programs' batch of one, (1, rows, ...), with no copy. Its batch
    stride is the row stride, not torch's rows x row stride: the modules take each stride as an int32,
    and past 2**31 elements that product would wrap (negative, which a TMA tensor map rejects). The one
    batch's index is 0, so the stride is never used."""
    return t.as_strided((1, *t.shape), (t.stride(0), *t.stride()), t.storage_offset())


class VarlenKernel(Kernel):
    """FlashAttention forward over sequences packed without padding (flash-attn's varlen)::

        out, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, return_lse=True)

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); cu_seqlens_q and
    cu_seqlens_k: int32 (batch + 1,) on q's device, non-decreasing from 0 to total_q (total_k):
    sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] - 1 of k and v. max_seqlen_q: an int, at least every sequence's query
    count (it sizes the grid; rows past it are not computed). out has q's shape; lse is float32
    (heads_q, total_q), flash-attn 2's varlen layout. The kernel reads the offsets on the device:
    no padding, no loop over sequences, and new lengths need no rebuild. Causal masks, windows and
    ALiBi distances are per sequence (bottom-right aligned); ALiBi slopes are (heads_q,) or
    (batch, heads_q). The values of cu_seqlens are checked only on the CPU (on CUDA that would wait
    for the device). With sinks each call takes ``sinks``, float32 (heads_q,) (see ``Kernel``).

    It is the forward Kernel (its spec's ``varlen`` field set: the same construction, schedule and
    build) with the packed call.
    """

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, softmax_scale=None, out=None,
                 return_lse=False, alibi_slopes=None, dropout_p=None, dropout_seed=None, sinks=None):
        """Attention of each packed sequence of q over its keys. See the class docstring."""
        return_lse = check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        if torch.compiler.is_compiling():
            return registry.route("varlen")(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                                            out, return_lse, alibi_slopes, dropout_p, dropout_seed, sinks)
        arguments = self.arguments
        arguments.check_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
        total_q, heads_q, _ = q.shape
        heads_kv = k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        variant_arguments = arguments.variant_arguments(q, alibi_slopes, batch, dropout_p, dropout_seed, sinks=sinks)
        # The module takes the packed rows as one batch: (1, total, heads, head_dim) views, each made
        # once (a view costs a few microseconds of the host time a call takes).
        q4, k4, v4 = (arguments.usable(one_batch(t), name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
        out4 = None if out is None else one_batch(out)
        in_place = out4 is not None and arguments.fits(out4)
        if not in_place:
            if out4 is not None:
                arguments.usable(out4, "out", copy=False)
            out4 = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((1, heads_q, total_q), dtype=torch.float32, device=q.device)
        module = self.build.module_for(heads_q, heads_kv, q=q4, k=k4, v=v4, out=out4)
        if out4.numel() and not k4.shape[1]:  # no key at all (as Kernel.__call__)
            out4.zero_()
            no_keys_lse(lse, sinks, heads_dim=1)
        elif out4.numel() and batch:
            module.function(q4, k4, v4, out4, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            *variant_arguments)
        if not in_place:  # out4 is a tensor of its own: the result, or copied into the given out
            out = out4[0] if out is None else out.copy_(out4[0])
        return (out, lse[0]) if return_lse else out
