"""The FP8 (e4m3) kernels' numerical checks, shared by their tests (tests/test_fp8.py, tests/test_decode_fp8.py)
and the tuner's check of each candidate (``tune.measured``): one rule each, written once.

The FP8 forward (issue 44's rule): the output against float64 attention of the same dequantised inputs, its
error at most twice that of a torch emulation that quantises the same places (q, k, v and P to e4m3, the
output to bf16, float32 math): ``forward_error``. Its LSE: within twice the error of the scores that the GPU's own
FP8 matrix product gives (``lse_allowance``).

Decode over an FP8 cache: each sequence's output against float64 attention of its dequantised keys and values
(k_cache · k_descale, v_cache · v_descale), flash-attn's rule (the error at most twice PyTorch's in q's dtype on
the same dequantised cache, + 1e-5): ``decode_error``.
"""

from __future__ import annotations

import math

import torch

F8 = torch.float8_e4m3fn
EPS = 1e-5  # flash-attn's rule's own slack


# ----------------------------------------------------------------------------------------------------
# the FP8 forward
# ----------------------------------------------------------------------------------------------------
def scores(q, k, q_descale, k_descale, softmax_scale, causal, dtype):
    """The descaled, scaled scores (batch, heads_q, seqlen_q, seqlen_k) in ``dtype``, -inf where masked
    (causal: bottom-right), and the mask of rows that see no key."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qd = q_descale.to(dtype).repeat_interleave(group, 1)[:, None, :, None]
    kd = k_descale.to(dtype)[:, None, :, None]
    qf = q.to(dtype) * qd
    kf = (k.to(dtype) * kd).repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if causal:
        visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        s = s.masked_fill(~visible, -math.inf)
    empty = torch.isinf(s).all(-1)  # (batch, heads_q, seqlen_q): rows that see no key
    return s, empty


def values(v, v_descale, heads_q, dtype):
    """The dequantised values in ``dtype``, repeated for each query head of a K/V head's group."""
    group = heads_q // v.shape[2]
    return (v.to(dtype) * v_descale.to(dtype)[:, None, :, None]).repeat_interleave(group, 2)


def reference(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal):
    """float64 attention of the dequantised inputs; (out, lse), rows that see no key 0 and -inf."""
    s, _ = scores(q, k, q_descale, k_descale, softmax_scale, causal, torch.float64)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, values(v, v_descale, q.shape[2], torch.float64))
    return out, s.logsumexp(-1)


def emulation(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal):
    """The same quantisation in torch: the scores in float32 from the e4m3 inputs, P = exp(s - row max)
    quantised to e4m3 for P V (its row sum unquantised, as the kernel's), the output to bf16."""
    s, _ = scores(q, k, q_descale, k_descale, softmax_scale, causal, torch.float32)
    row_max = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = torch.exp(s - row_max)
    total = p.sum(-1, keepdim=True)
    pv = torch.einsum("bhqk,bkhd->bqhd", p.to(F8).float(), values(v, v_descale, q.shape[2], torch.float32))
    out = pv / total.permute(0, 2, 1, 3).clamp_min(1e-30)
    return out.to(torch.bfloat16)


def forward_error(out, q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal) -> tuple[float, float]:
    """(the output's error against ``reference``, what the rule allows: twice ``emulation``'s error). The
    caller may pass a slice of the problem (a batch, a few K/V heads and their query heads, the last query
    rows: causal is bottom-right, so they keep their mask)."""
    ref, _ = reference(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal)
    emulated = emulation(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal)
    error = (out.double() - ref).abs().max().item()
    return error, 2 * (emulated.double() - ref).abs().max().item()


LSE_FLOOR = 1e-3  # an LSE's error allowed where the scores are made in float32 (the CPU's emulation of e4m3)


def lse_allowance(q, k, q_descale, k_descale, softmax_scale) -> float:
    """The error allowed in the FP8 forward's LSE against ``reference``'s. On a CUDA GPU: twice the largest error
    of the same scores by torch's own FP8 matrix product (``torch._scaled_mm``, fast accumulation: in the tensor
    cores' accumulator, as wgmma's), plus LSE_FLOOR. Hopper's e4m3 products keep fewer bits than float32 in their
    accumulator, so the scores, and with them the LSE (which moves by at most the scores' largest error), are off by
    about 2^-10 of their size in any FP8 kernel there; the output's rule (``forward_error``) is unaffected. On the
    CPU (float32 products) LSE_FLOOR."""
    if q.device.type != "cuda":
        return LSE_FLOOR
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    exact, _ = scores(q, k, q_descale, k_descale, softmax_scale, False, torch.float64)
    one = torch.ones((), device=q.device)
    padded = lambda n: -(-n // 16) * 16  # noqa: E731  (_scaled_mm's shapes: multiples of 16)
    worst = 0.0
    for b in range(batch):
        for h in range(heads_q):
            hk = h // (heads_q // heads_kv)
            a = torch.zeros(padded(seqlen_q), q.shape[3], dtype=q.dtype, device=q.device)
            a[:seqlen_q] = q[b, :, h]
            bt = torch.zeros(padded(seqlen_k), k.shape[3], dtype=k.dtype, device=k.device)
            bt[:seqlen_k] = k[b, :, hk]
            s = torch._scaled_mm(a, bt.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
            s = s[:seqlen_q, :seqlen_k].double() * float(q_descale[b, hk] * k_descale[b, hk]) * softmax_scale
            worst = max(worst, (s - exact[b, h]).abs().max().item())
    return 2 * worst + LSE_FLOOR


# ----------------------------------------------------------------------------------------------------
# decode over an FP8 cache
# ----------------------------------------------------------------------------------------------------
def dequantised(cache, descale, block_table, b, length, start=0):
    """Sequence b's rows ``start`` .. ``length`` - 1 of an e4m3 cache times its descales, float64 (1, length -
    start, heads_kv, head_dim)."""
    rows = cache[block_table[b].long()].flatten(0, 1) if block_table is not None else cache[b]
    return (rows[start:length].double() * descale[b].double()[None, :, None])[None]


def plain_attention(q, k, v, causal, dtype):
    """Attention computed in ``dtype`` (scores, softmax and products), bottom-right causal, as the tests'
    reference (tests/reference.py) computes it without variants: float64 for the reference, q's dtype for
    PyTorch's own error. q, k, v (batch, seqlen, heads, head_dim), as many K/V heads as query heads."""
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    s = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        seqlen_q, seqlen_k = s.shape[-2:]
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + seqlen_k - seqlen_q, -math.inf)
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vh).transpose(1, 2)


def decode_error(out, q, k_cache, v_cache, lengths, k_descale, v_descale, *, causal=False,
                 block_table=None) -> tuple[float, float]:
    """(a sequence's error against float64 attention of its dequantised cache, what flash-attn's rule allows
    it: twice PyTorch's error in q's dtype on the same dequantised cache, + 1e-5), of the sequence whose error
    exceeds its allowance by the most (or comes nearest to it). Plain attention (no window, softcap, ALiBi or
    sinks); q (batch, seqlen_q, heads_q, head_dim), heads_q a multiple of the caches' heads."""
    worst = (0.0, EPS)
    for b, length in enumerate(lengths.tolist()):
        k, v = (dequantised(c, d, block_table, b, length) for c, d in ((k_cache, k_descale), (v_cache, v_descale)))
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        qb = q[b:b + 1]
        ref = plain_attention(qb, k, v, causal, torch.float64)
        theirs = (plain_attention(qb, k.to(q.dtype), v.to(q.dtype), causal, q.dtype).double() - ref).abs().max().item()
        found = ((out[b:b + 1].double() - ref).abs().max().item(), 2 * theirs + EPS)
        if b == 0 or found[0] - found[1] > worst[0] - worst[1]:
            worst = found
    return worst
