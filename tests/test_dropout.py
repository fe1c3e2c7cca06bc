"""Dropout (flash-attn's dropout_p): the kernels drop the entries that ``tvmflash.ops.dropout_kept`` names,
forward and backward, dense and varlen, against float64 attention with that mask; the mask's statistics;
seeds; S_dmask; the refusals."""

import math

import pytest
import torch

import tvmflash
from tvmflash import ops
from tests.conftest import poisoned_out, random_qkv
from tests.reference import check_attention, check_gradients

HEADS = (4, 2)  # GQA


def dense_mask(seed, p, q, k):
    return ops.dropout_mask(seed, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def check_autograd(q, k, v, p, seed, **variant):
    """attention's out, lse and gradients (of both) with dropout against float64 attention with the same
    entries dropped (flash-attn's rule: at most twice the error of torch's same-dtype attention)."""
    mask = dense_mask(seed, p, q, k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tvmflash.attention(*leaves, return_lse=True, dropout_p=p, dropout_seed=seed, **variant)
    check_attention(out.detach(), lse.detach(), q, k, v, dropout_p=p, dropout_mask=mask, **variant)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    check_gradients([t.grad for t in leaves], q, k, v, dout, dlse, dropout_p=p, dropout_mask=mask, **variant)


def test_the_mask_drops_a_fraction_p_independently():
    """The rule's statistics (no build): over 2 x 4 x 256 x 256 entries the kept fraction is 1 - p within
    4 standard deviations, for every p; neighbouring keys, rows and heads are uncorrelated; a new seed
    draws a new pattern; p = 0 keeps everything."""
    seed = torch.tensor([12345, 678], dtype=torch.int32)
    for p in (0.0, 0.1, 0.5, 0.9):
        kept = ops.dropout_mask(seed, p, 2, 4, 256, 256).double()
        n = kept.numel()
        assert abs(kept.mean().item() - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, p
    kept = ops.dropout_mask(seed, 0.5, 2, 4, 256, 256).double() - 0.5
    for shifted in (kept[..., 1:] * kept[..., :-1], kept[:, :, 1:] * kept[:, :, :-1], kept[:, 1:] * kept[:, :-1],
                    kept[1:] * kept[:-1]):
        assert abs(shifted.mean().item()) < 4 * 0.25 / math.sqrt(shifted.numel()), "correlated neighbours"
    other = ops.dropout_mask(torch.tensor([12345, 679], dtype=torch.int32), 0.5, 2, 4, 256, 256).double() - 0.5
    assert abs((kept * other).mean().item()) < 4 * 0.25 / math.sqrt(kept.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_with_dropout_on_cpu(dtype):
    """Dense, GQA 4/2, causal with seqlen_q != seqlen_k (bottom-right) and a row that sees no key: the
    kernels' out, lse and gradients against float64 with the same entries dropped."""
    seed = torch.tensor([7, 99], dtype=torch.int32)
    for n, (seqlen_q, seqlen_k) in enumerate([(70, 79), (130, 77)]):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, 32, dtype, "cpu", seed=n)
        check_autograd(q, k, v, 0.25, seed, causal=True)


def test_dropout_with_every_variant_and_the_kernel_api():
    """A window, softcap and ALiBi with dropout (float32), through ``compile`` and ``compile_backward``
    (outputs poisoned): the same entries dropped forward and backward, and the p of the call used."""
    seed = torch.tensor([3, 5], dtype=torch.int32)
    variant = {"window_size": (40, 8), "softcap": 20.0}
    forward = tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu", alibi=True, dropout=True, **variant)
    backward = tvmflash.compile_backward(head_dim=32, dtype=torch.float32, target="cpu", alibi=True, dropout=True,
                                         **variant)
    q, k, v = random_qkv(2, 90, 100, *HEADS, 32, torch.float32, "cpu")
    slopes = torch.rand(HEADS[0]) * 0.3
    for p in (0.1, 0.6):
        mask = dense_mask(seed, p, q, k)
        out, lse = forward(q, k, v, out=poisoned_out(q), return_lse=True, alibi_slopes=slopes, dropout_p=p,
                           dropout_seed=seed)
        check_attention(out, lse, q, k, v, alibi_slopes=slopes, dropout_p=p, dropout_mask=mask, **variant)
        dout = torch.randn_like(out)
        grads = backward(q, k, v, out, dout, lse, dq=poisoned_out(q), dk=poisoned_out(k), dv=poisoned_out(v),
                         alibi_slopes=slopes, dropout_p=p, dropout_seed=seed)
        check_gradients(grads, q, k, v, dout, alibi_slopes=slopes, dropout_p=p, dropout_mask=mask, **variant)


def test_varlen_dropout_uses_each_sequences_own_positions():
    """flash_attn_varlen_func with dropout: each sequence drops the entries of its own (sequence, head,
    query, key) positions, forward and backward; S_dmask holds them padded to max_seqlen."""
    lengths_q, lengths_k = [37, 0, 90], [50, 20, 64]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = random_qkv(1, sum(lengths_q), sum(lengths_k), *HEADS, 32, torch.float32, "cpu")
    q, k, v = (t[0].requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    p = 0.3
    out, lse, s_dmask = tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                        dropout_p=p, causal=True, return_attn_probs=True)
    torch.manual_seed(11)  # the seed flash_attn_varlen_func drew
    seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32)
    assert s_dmask.shape == (3, HEADS[0], max(lengths_q), max(lengths_k))
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(3):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t.detach()[None, r] for t, r in ((q, rows), (k, cols), (v, cols)))
        mask = ops.dropout_kept(seed, p, HEADS[0], b, torch.arange(HEADS[0])[:, None, None],
                                torch.arange(lengths_q[b])[:, None], torch.arange(lengths_k[b]))[None]
        entries = s_dmask[b, :, :lengths_q[b], :lengths_k[b]]
        assert torch.equal((entries > 0)[entries != 0], mask[0][entries != 0])
        check_attention(out.detach()[None, rows], lse.detach()[None, :, rows], qb, kb, vb, causal=True, dropout_p=p,
                        dropout_mask=mask)
        check_gradients([q.grad[None, rows], k.grad[None, cols], v.grad[None, cols]], qb, kb, vb, dout[None, rows],
                        causal=True, dropout_p=p, dropout_mask=mask)


def test_seeds_repeat_and_differ_and_s_dmask_is_flash_attns():
    """flash_attn_func draws its seed from torch's generator: torch.manual_seed repeats a call bitwise, a
    new draw drops other entries. S_dmask is the softmax with the dropped entries negated (flash-attn's
    convention), None at dropout_p 0."""
    q, k, v = random_qkv(2, 64, 64, *HEADS, 32, torch.float32, "cpu")
    torch.manual_seed(0)
    first, lse, s_dmask = tvmflash.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)
    torch.manual_seed(0)
    again = tvmflash.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    other = tvmflash.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(0)
    mask = dense_mask(torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32), 0.2, q, k)
    probabilities = torch.softmax((torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / math.sqrt(32))
                                  .masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf), -1)
    assert torch.allclose(s_dmask.abs(), probabilities, atol=1e-6)
    visible = probabilities > 0
    assert torch.equal(s_dmask[visible] > 0, mask[visible])
    assert tvmflash.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_dropout_refusals():
    q, k, v = random_qkv(1, 8, 8, 2, 2, 32, torch.float32, "cpu")
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dropout_p: expected 0 <= dropout_p < 1"):
            tvmflash.flash_attn_func(q, k, v, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p: expected a float"):
        tvmflash.attention(q, k, v, dropout_p="0.1")
    with pytest.raises(ValueError, match=r"dropout_seed: expected an int32 tensor of shape \(2,\)"):
        tvmflash.attention(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        pages = torch.zeros(1, 16, 2, 32)
        tvmflash.flash_attn_varlen_func(q[0], pages, pages, cu, cu, 8, 8, dropout_p=0.1,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32))
    plain = tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu")
    with pytest.raises(ValueError, match="compiled without dropout"):
        plain(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="compiled with dropout"):
        tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu", dropout=True)(q, k, v)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)],
                         ids=str)
def test_attention_with_dropout_on_the_gpu(head_dim, dtype):
    """The default CUDA schedules (sm90's wgmma forward and backward on an H100) with dropout, causal and
    not, GQA: out, lse and gradients against float64 with the same entries dropped."""
    seed = torch.tensor([7, 99], dtype=torch.int32, device="cuda")
    for n, (seqlen_q, seqlen_k, causal) in enumerate([(300, 300, True), (130, 577, False), (1, 129, True)]):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, dtype, "cuda", seed=n)
        check_autograd(q, k, v, 0.17, seed, causal=causal)


@pytest.mark.gpu
def test_dropout_under_torch_compile_draws_a_new_pattern_each_step():
    """flash_attn_func with dropout under torch.compile(fullgraph=True): no graph break, each call a new
    seed (two calls differ), and gradients flow."""
    q, k, v = random_qkv(2, 128, 128, *HEADS, 64, torch.bfloat16, "cuda")
    q.requires_grad_()
    step = torch.compile(lambda q, k, v: tvmflash.flash_attn_func(q, k, v, dropout_p=0.1, causal=True), fullgraph=True)
    first, second = step(q, k, v), step(q, k, v)
    assert not torch.equal(first, second)
    first.float().sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
