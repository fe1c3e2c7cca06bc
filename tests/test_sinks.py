"""Learnable attention sinks (gpt-oss's): a logit per query head in each row's softmax denominator, with no
value. Forward and gradients (q, k, v and the sinks) against float64 autograd under flash-attn's rule: dense
(causal or not, GQA, a window, a softcap), rows that see no key, varlen, decode with split keys and
flex_attention; the errors; and the CUDA schedules' builds (cross-compiled; their numerics `gpu`-marked)."""

import math

import pytest
import torch
from conftest import devices, random_qkv
from reference import max_error, scores

import tvmflash
from tvmflash.kernels import forget_kernels

HEAD_DIM = 64


def sink_reference(q, k, v, sinks, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, score_mod=None, mask_mod=None, dtype=torch.float64):
    """(out, lse) of attention with sinks in ``dtype``, flash-attn's layout in and out: p_ij = exp(s_ij - lse_i),
    lse_i = log(exp(sink_h) + Σ_j exp(s_ij)); s the scaled scores (softcap, then ALiBi's -slope_h · |i + seqlen_k
    - seqlen_q - j|, or ``score_mod(s, b, h, i, j)``),
    the keys that causal, the window or ``mask_mod(b, h, i, j)`` hide left out. The sink is not scaled.
    A row that sees no key gets out 0 and lse = sink_h. Differentiable in every input (float64 autograd)."""
    s, hidden, vh = scores(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                           dtype=dtype)
    batch, heads, seqlen_q, _ = s.shape
    hidden = hidden.expand(s.shape)
    s = s.masked_fill(hidden, -math.inf)
    sink = sinks.to(dtype)[None, :, None, None].expand(batch, heads, seqlen_q, 1)
    lse = torch.logsumexp(torch.cat([s, sink], -1), dim=-1)
    p = torch.exp(s - lse[..., None])
    return (p @ vh).transpose(1, 2), lse


def reference_gradients(q, k, v, sinks, dout, dlse, dtype=torch.float64, **variant):
    """(out, lse, dq, dk, dv, dsinks) of ``sink_reference`` in ``dtype`` (sinks in float32 where dtype is
    lower, as the kernels take them) for the loss sum(out·dout) + sum(lse·dlse)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.detach().to(dtype if dtype == torch.float64 else torch.float32).requires_grad_()
    out, lse = sink_reference(*leaves, sink_leaf, dtype=dtype, **variant)
    loss = (out * dout.to(dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
    return (out, lse, *torch.autograd.grad(loss, [*leaves, sink_leaf]))


def check_all(out, lse, grads, q, k, v, sinks, dout, dlse, eps=1e-5, **variant):
    """flash-attn's rule for out and each of dq, dk, dv, dsinks: our error against float64 at most 2x that of
    the same computation in q's dtype, plus eps (times 1 + the largest element for the gradients); lse within
    float32 rounding."""
    ref = reference_gradients(q, k, v, sinks, dout, dlse, **variant)
    same = reference_gradients(q, k, v, sinks, dout, dlse, dtype=q.dtype, **variant) if q.dtype != torch.float32 \
        else reference_gradients(q, k, v, sinks, dout, dlse, dtype=torch.float32, **variant)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, ours, r, theirs in zip(names, (out, lse, *grads), ref, same):
        assert ours is not None, f"{name}: no gradient"
        assert ours.shape == r.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(r.shape)}"
        assert torch.isfinite(ours).all(), f"{name} has NaN/inf"
        err = max_error(ours, r)
        if name == "lse":
            assert err <= 1e-4 * (1 + r.abs().max().item()), f"lse error {err:.3e}"
            continue
        floor = eps * (1 + (r.abs().max().item() if name != "out" and r.numel() else 0.0))
        their_err = max_error(theirs, r)
        assert err <= 2 * their_err + floor, f"{name} error {err:.3e} > 2 x torch's {their_err:.3e} + {floor:.1e}"
    assert grads[3].dtype == torch.float32 and grads[3].shape == sinks.shape


def random_sinks(heads, device, seed=0):
    """Sink logits around the scores' scale (so the sink's share of a row is neither ~0 nor ~1)."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1).to(device)


def dense_case(device, dtype, seqlen_q, seqlen_k, heads_q, heads_kv, seed=0, head_dim=HEAD_DIM, **variant):
    """flash_attn_func with sinks (that require grad) and its gradients, through out and lse, against float64."""
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, seed=seed)
    sinks = random_sinks(heads_q, device, seed)
    variant = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in variant.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse, _ = tvmflash.flash_attn_func(*leaves[:3], return_attn_probs=True, sinks=leaves[3], **variant)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    check_all(out.detach(), lse.detach(), [t.grad for t in leaves], q, k, v, sinks, dout, dlse, **variant)
    return out, lse, sinks


# (dtype, seqlen_q, seqlen_k, heads_q, heads_kv, variant): tails, Lq != Lk, MHA, GQA and MQA, causal, a window, a
# softcap. Each (dtype, heads, variant) is a forward and a backward build: 1 x 1 takes 77 x 200's, and bf16 causal
# the MHA heads of test_varlen_forward_and_gradients_match_float64's qkvpacked call.
DENSE_CASES = [
    (torch.float32, 17, 17, 2, 2, {}),
    (torch.float32, 77, 200, 4, 2, {"causal": True}),
    (torch.bfloat16, 129, 129, 4, 4, {"causal": True}),
    (torch.bfloat16, 200, 77, 4, 1, {}),
    (torch.float16, 100, 130, 4, 2, {"window_size": (20, 5), "softcap": 5.0}),
    (torch.float32, 1, 1, 4, 2, {"causal": True}),
    (torch.bfloat16, 1, 300, 4, 1, {"alibi_slopes": torch.tensor([0.1, 0.2, 0.3, 0.4])}),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype,seqlen_q,seqlen_k,heads_q,heads_kv,variant", DENSE_CASES,
                         ids=lambda p: "+".join(p) or "plain" if isinstance(p, dict) else str(p).removeprefix("torch."))
def test_forward_and_gradients_match_float64(device, dtype, seqlen_q, seqlen_k, heads_q, heads_kv, variant):
    dense_case(device, dtype, seqlen_q, seqlen_k, heads_q, heads_kv, **variant)


@pytest.mark.parametrize("device", devices())
def test_rows_that_see_no_key_get_zero_and_the_sink(device):
    """A window whose right edge passes no key for the first rows (seqlen_q > seqlen_k): out 0 and lse the
    sink, never NaN, in the forward and the gradients (which match float64)."""
    out, lse, sinks = dense_case(device, torch.bfloat16, 50, 20, 4, 2, window_size=(3, 0))
    assert torch.equal(out[:, :30].detach(), torch.zeros_like(out[:, :30]))
    assert torch.equal(lse[:, :, :30].detach(), sinks[None, :, None].expand(2, 4, 30))


@pytest.mark.parametrize("device", devices())
def test_no_keys_at_all(device):
    """seqlen_k 0 (the kernels are not run): out 0, lse the sink; the sink takes every row's whole softmax,
    so dsink_h = Σ dlse over head h's rows, and q, k, v get zeros."""
    q, k, v = random_qkv(2, 5, 0, 4, 2, HEAD_DIM, torch.bfloat16, device, seed=4)
    sinks = random_sinks(4, device, 4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse, _ = tvmflash.flash_attn_func(*leaves[:3], return_attn_probs=True, sinks=leaves[3])
    assert not out.any() and torch.equal(lse.detach(), sinks[None, :, None].expand(2, 4, 5))
    dlse = torch.randn_like(lse)
    torch.autograd.backward([out, lse], [torch.randn_like(out), dlse])
    assert torch.allclose(leaves[3].grad, dlse.sum((0, 2))) and not leaves[0].grad.any()


@pytest.mark.parametrize("device", devices())
def test_a_sink_of_minus_infinity_is_no_sink(device):
    q, k, v = random_qkv(1, 40, 40, 2, 2, HEAD_DIM, torch.float32, device, seed=3)
    none = torch.full((2,), -math.inf, device=device)
    out, lse = tvmflash.attention(q, k, v, causal=True, return_lse=True, sinks=none)
    plain, plain_lse = tvmflash.attention(q, k, v, causal=True, return_lse=True)
    assert torch.allclose(out, plain, atol=1e-6) and torch.allclose(lse, plain_lse, atol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_varlen_forward_and_gradients_match_float64(device):
    """Each packed sequence against the float64 reference of its own (causal, GQA), sinks' gradient summed
    over the sequences, under flash-attn's rule (torch's error: the same references in bf16)."""
    lengths_q, lengths_k = [5, 40, 1, 70], [9, 40, 30, 65]
    dtype, heads_q, heads_kv = torch.bfloat16, 4, 2
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lengths_q), heads_q, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(sum(lengths_k), heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    sinks = random_sinks(heads_q, device, 5)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse, _ = tvmflash.flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  causal=True, return_attn_probs=True, sinks=leaves[3])
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    refs = []  # the float64 reference and the same computation in bf16, each sequence alone, packed back
    for ref_dtype in (torch.float64, dtype):
        ref = [torch.zeros_like(t, dtype=torch.float64) for t in (out, lse, q, k, v)]
        ref.append(torch.zeros(heads_q, dtype=torch.float64, device=device))
        for b in range(len(lengths_q)):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, l, dq, dk, dv, ds = reference_gradients(q[None, rq], k[None, rk], v[None, rk], sinks, dout[None, rq],
                                                       dlse[None, :, rq], dtype=ref_dtype, causal=True)
            ref[0][rq], ref[1][:, rq], ref[2][rq], ref[3][rk], ref[4][rk] = o[0], l[0], dq[0], dk[0], dv[0]
            ref[5] += ds
        refs.append(ref)
    assert max_error(lse, refs[0][1]) < 1e-4 * (1 + refs[0][1].abs().max().item())
    for name, ours, r, same in zip(("out", "dq", "dk", "dv", "dsinks"), [out.detach()] + [t.grad for t in leaves],
                                   refs[0][:1] + refs[0][2:], refs[1][:1] + refs[1][2:]):
        assert torch.isfinite(ours).all(), name
        err, their_err = max_error(ours, r), max_error(same, r)
        floor = 1e-5 * (1 + (r.abs().max().item() if name != "out" else 0.0))
        assert err <= 2 * their_err + floor, f"{name} error {err:.3e} > 2 x torch's {their_err:.3e} + {floor:.1e}"
    # the packed forms pass sinks on: the same kernel's results
    kv = torch.stack([k, v], 1)
    packed = tvmflash.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                                      sinks=sinks)
    assert torch.equal(packed, out.detach())
    dense_q, dense_k, dense_v = (t[None, :40] for t in (q, k, v))
    qkv = torch.stack([dense_q, dense_k.repeat_interleave(2, 2), dense_v.repeat_interleave(2, 2)], 2)
    assert torch.equal(tvmflash.flash_attn_qkvpacked_func(qkv, causal=True, sinks=sinks),
                       tvmflash.flash_attn_func(*qkv.unbind(2), causal=True, sinks=sinks))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_with_split_keys_matches_float64(device, num_splits):
    """flash_attn_with_kvcache: the sink joins the merge of the splits once (one split merges too); ragged
    lengths, a length 0 (out 0, lse the sink), GQA, two query tokens causal."""
    dtype, heads_q, heads_kv, capacity = torch.bfloat16, 4, 2, 300
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(3, capacity, heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(3, capacity, heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    q = torch.randn(3, 2, heads_q, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    lengths = torch.tensor([300, 0, 123], dtype=torch.int32, device=device)
    sinks = random_sinks(heads_q, device, 7)
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                num_splits=num_splits, return_softmax_lse=True, sinks=sinks)
    for b, n in enumerate(lengths.tolist()):
        o, l = sink_reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], sinks, causal=True)
        same = sink_reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], sinks, causal=True, dtype=dtype)
        assert torch.isfinite(out[b]).all() and torch.isfinite(lse[b]).all()
        assert max_error(out[b:b + 1], o) <= 2 * max_error(same[0], o) + 1e-5, (b, max_error(out[b:b + 1], o))
        assert max_error(lse[b:b + 1], l) <= 1e-4 * (1 + l.abs().max().item())
    assert torch.equal(lse[1], sinks[:, None].expand(heads_q, 2)) and not out[1].any()


@pytest.mark.parametrize("device", devices())
def test_paged_decode_with_sinks(device):
    """A paged cache (its pages shuffled): the merge is the contiguous cache's."""
    dtype, heads_q, heads_kv, page_size = torch.float32, 4, 1, 16
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(2, 64, heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(2, 64, heads_kv, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    q = torch.randn(2, 1, heads_q, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
    order = torch.randperm(8, generator=gen)
    pages = torch.empty(8, page_size, heads_kv, HEAD_DIM, dtype=dtype, device=device)
    pages_v = torch.empty_like(pages)
    pages[order] = k.reshape(8, page_size, heads_kv, HEAD_DIM)
    pages_v[order] = v.reshape(8, page_size, heads_kv, HEAD_DIM)
    table = order.reshape(2, 4).to(dtype=torch.int32, device=device)
    lengths = torch.tensor([64, 37], dtype=torch.int32, device=device)
    sinks = random_sinks(heads_q, device, 8)
    out, lse = tvmflash.flash_attn_with_kvcache(q, pages, pages_v, cache_seqlens=lengths, block_table=table,
                                                num_splits=2, return_softmax_lse=True, sinks=sinks)
    for b, n in enumerate(lengths.tolist()):
        o, l = sink_reference(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], sinks)
        assert max_error(out[b:b + 1], o) < 1e-5 and max_error(lse[b:b + 1], l) < 1e-5


@pytest.mark.gpu
def test_a_decode_shaped_call_runs_the_decode_kernel_with_sinks():
    """tvmflash.attention of a generation step (few queries, many contiguous keys, no autograd) on the GPU
    runs on the split-KV decode kernel (``ops.decode_shaped``): the sink joins its merge."""
    q, k, v = random_qkv(2, 1, 3000, 8, 2, 128, torch.bfloat16, "cuda", seed=12)
    sinks = random_sinks(8, "cuda", 12)
    out, lse = tvmflash.attention(q, k, v, return_lse=True, sinks=sinks)
    ref, ref_lse = sink_reference(q, k, v, sinks)
    same = sink_reference(q, k, v, sinks, dtype=torch.bfloat16)[0]
    assert max_error(out, ref) <= 2 * max_error(same, ref) + 1e-5
    assert max_error(lse, ref_lse) <= 1e-4 * (1 + ref_lse.abs().max().item())


def relative_bias(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-8, 8) + 8]
    return score_mod


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mods", ["score_and_mask", "none"])
def test_flex_attention_with_sinks_matches_float64(device, mods):
    """flex_attention(sinks=): after a score_mod (a captured bias table) and a causal mask_mod, and without
    mods (the built-in kernels); gradients of query, key, value and the sinks."""
    dtype, heads = torch.bfloat16, 4
    q, k, v = random_qkv(2, 70, 70, heads, 2, HEAD_DIM, dtype, device, seed=9)
    table = torch.randn(heads, 17, generator=torch.Generator().manual_seed(9)).to(device)
    score_mod, mask_mod = (relative_bias(table), causal_mask) if mods != "none" else (None, None)
    sinks = random_sinks(heads, device, 9)
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = tvmflash.flex_attention(*leaves[:3], score_mod=score_mod, block_mask=mask_mod, enable_gqa=True,
                                       return_lse=True, sinks=leaves[3])
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    grads = [t.grad.transpose(1, 2) for t in leaves[:3]] + [leaves[3].grad]
    ref_mods = {} if mods == "none" else {"score_mod": lambda s, b, h, i, j: s + table.double()[h, (i - j).clamp(-8, 8)
                                                                                               + 8],
                                          "mask_mod": causal_mask}
    check_all(out.detach().transpose(1, 2), lse.detach(), grads, q, k, v, sinks, dout.transpose(1, 2), dlse,
              **ref_mods)


def test_flex_attention_with_sinks_and_a_learnable_bias_table():
    """The table's gradient (flex_gradient: P from the lse, which holds the sink) beside the sinks'."""
    dtype, heads = torch.float32, 4
    q, k, v = random_qkv(1, 50, 60, heads, 2, HEAD_DIM, dtype, "cpu", seed=10)
    table = torch.randn(heads, 17, generator=torch.Generator().manual_seed(10)).requires_grad_()
    sinks = random_sinks(heads, "cpu", 10).requires_grad_()
    out = tvmflash.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=relative_bias(table),
                                  block_mask=causal_mask, enable_gqa=True, sinks=sinks)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (table, sinks)]
    ref, _ = sink_reference(q, k, v, leaves[1], score_mod=lambda s, b, h, i, j: s + leaves[0][h, (i - j).clamp(-8, 8)
                                                                                               + 8],
                            mask_mod=causal_mask)
    (ref * dout.transpose(1, 2).double()).sum().backward()
    for ours, theirs in ((table.grad, leaves[0].grad), (sinks.grad, leaves[1].grad)):
        assert max_error(ours, theirs) <= 1e-4 * (1 + theirs.abs().max().item())


def test_sinks_errors_name_the_argument():
    q, k, v = random_qkv(1, 8, 8, 4, 2, HEAD_DIM, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        tvmflash.flash_attn_func(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks: expected dtype torch.float32"):
        tvmflash.flash_attn_func(q, k, v, sinks=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sinks: expected device cpu"):
        tvmflash.flash_attn_func(q, k, v, sinks=torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match="sinks: expected a float32 tensor"):
        tvmflash.attention(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        tvmflash.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True, sinks=torch.zeros(4, 1))
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        tvmflash.flash_attn_with_kvcache(q, k, v, sinks=torch.zeros(3))
    kernel = tvmflash.compile(head_dim=HEAD_DIM, dtype="float32", target="cpu", sinks=True)
    with pytest.raises(ValueError, match="compiled with sinks"):
        kernel(q, k, v)
    plain = tvmflash.compile(head_dim=HEAD_DIM, dtype="float32", target="cpu")
    with pytest.raises(ValueError, match="compiled without sinks"):
        plain(q, k, v, sinks=torch.zeros(4))


def test_torch_compile_traces_sinks_and_their_gradient():
    """One graph (fullgraph), the sinks' gradient as eager's."""
    q, k, v = random_qkv(2, 30, 30, 4, 2, HEAD_DIM, torch.float32, "cpu", seed=2)
    sinks = random_sinks(4, "cpu", 2)

    def step(q, k, v, sinks):
        return tvmflash.flash_attn_func(q, k, v, causal=True, sinks=sinks).square().sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        assert torch.allclose(eager, compiled, atol=1e-5)


def test_a_kept_kernel_with_sinks_under_torch_compile():
    """tvmflash.compile(..., sinks=True) called inside a compiled function (its custom op, fullgraph), out given
    or not: eager's results."""
    q, k, v = random_qkv(1, 20, 33, 4, 2, HEAD_DIM, torch.float32, "cpu", seed=13)
    sinks = random_sinks(4, "cpu", 13)
    kernel = tvmflash.compile(head_dim=HEAD_DIM, dtype="float32", target="cpu", causal=True, sinks=True)

    def call(q, k, v, sinks):
        out, lse = kernel(q, k, v, sinks=sinks, return_lse=True)
        given = torch.empty_like(q)
        kernel(q, k, v, sinks=sinks, out=given)
        return out, lse, given

    eager = call(q, k, v, sinks)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert torch.equal(eager[0], eager[2])


# ----------------------------------------------------------------------------- the CUDA schedules, cross-compiled
@pytest.mark.parametrize("target,schedule,dtype", [("sm90", "sm90", "bfloat16"), ("sm80", "sm80", "bfloat16"),
                                                   ("sm90", "simt", "float32")])
def test_cuda_schedules_build_the_forward_with_sinks(monkeypatch, target, schedule, dtype):
    """Each CUDA schedule maps the program with sinks (the sink read into the row state's start); without
    sinks the generated CUDA is unchanged (tests/test_generated_cuda.py, whose modules the plain ones are:
    heads 4/2, bf16 on the tensor cores)."""
    forget_kernels()
    for causal in (False, True):
        kernel = tvmflash.compile(head_dim=128 if schedule != "simt" else 64, dtype=dtype, causal=causal,
                                  target=target, schedule=schedule, sinks=True)
        src = kernel.source(heads_q=4, heads_kv=2)
        assert "sinks" in src.lower() and "__global__" in src
        plain = tvmflash.compile(head_dim=128 if schedule != "simt" else 64, dtype=dtype, causal=causal,
                                 target=target, schedule=schedule).source(heads_q=4, heads_kv=2)
        assert "sinks" not in plain.lower()


@pytest.mark.parametrize("schedule,dtype", [("sm80", "bfloat16"), ("simt", "float32")])
def test_cuda_decode_merge_with_sinks_builds(schedule, dtype):
    forget_kernels()
    kernel = tvmflash.compile_decode(head_dim=HEAD_DIM, dtype=dtype, target="sm80", schedule=schedule, sinks=True)
    src = kernel.source(heads_q=8, heads_kv=2)
    assert "sinks" in src.lower()


# ----------------------------------------------------------------------------- the GPU (the lead runs these)
GPU_DENSE_CASES = [
    (torch.bfloat16, 129, 129, 4, 2, {"causal": True}),
    (torch.bfloat16, 1000, 1000, 2, 2, {}),
    (torch.float16, 200, 77, 4, 1, {"window_size": (20, 5), "softcap": 5.0}),
    (torch.float32, 77, 200, 4, 2, {"causal": True}),  # SIMT
    (torch.bfloat16, 300, 300, 4, 1, {"causal": True, "alibi_slopes": torch.tensor([0.1, 0.2, 0.3, 0.4])}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,seqlen_q,seqlen_k,heads_q,heads_kv,variant", GPU_DENSE_CASES,
                         ids=lambda p: "+".join(p) or "plain" if isinstance(p, dict) else str(p).removeprefix("torch."))
def test_forward_and_gradients_match_float64_on_the_gpu(head_dim, dtype, seqlen_q, seqlen_k, heads_q, heads_kv,
                                                        variant):
    """The default schedules (sm90 wgmma on sm_90a, sm80 mma.sync, SIMT for float32) at head_dim 64 and 128."""
    dense_case("cuda", dtype, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim=head_dim, **variant)


@pytest.mark.gpu
def test_the_sm80_schedule_with_sinks_on_an_sm90_gpu(monkeypatch):
    """sm80's forward and backward on sm_90a too (the forward's default there is sm90's)."""
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm80")
    forget_kernels()
    try:
        dense_case("cuda", torch.bfloat16, 129, 200, 4, 2, causal=True)
    finally:
        forget_kernels()
