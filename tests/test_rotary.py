"""Rotary embedding in tvmflash.flash_attn_with_kvcache against a float64 reference of flash-attn's
formula (``flash_attn.layers.rotary.apply_rotary_emb_torch``): the new k rotated at positions
cache_seqlens, cache_seqlens + 1, ... before it is appended; q at the same positions if causal or
local, else all of its tokens at cache_seqlens; interleaved (GPT-J) or not (GPT-NeoX); a partial
rotary_dim; contiguous and paged caches, GQA, cache_batch_idx."""

import math

import pytest
import torch
from conftest import captured_in_a_cuda_graph, devices
from reference import max_error, reference, torch_same_dtype
from test_decode import make_cache, random_q, sequence_kv

import tvmflash
from tvmflash import flash_attn

HEAD_DIM = 64


def rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_reference(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb_torch in float64: x (batch, seqlen, heads, d), positions (batch, seqlen)."""
    x, cos, sin = x.double(), cos.double()[positions], sin.double()[positions]  # (batch, seqlen, rotary_dim / 2)
    rotary_dim = 2 * cos.shape[-1]
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim], interleaved) * sin
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def rotary_tables(seqlen_ro, rotary_dim, dtype, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle).to(dtype=dtype, device=device), torch.sin(angle).to(dtype=dtype, device=device)


def check_rotary_decode(device, dtype, *, interleaved, rotary_dim, seqlen_q, causal, page_size=0, new=None,
                        window_size=(-1, -1), cache_batch_idx=False, cache_leftpad=False):
    """cache_leftpad: the sequences' keys start at cache positions 0, 11 and 30 (flash-attn's test: the
    rotary positions stay cache_seqlens, ...)."""
    batch, capacity, heads_q, heads_kv = 3, 80, 4, 2
    new = seqlen_q if new is None else new
    extra_rows = 2 if cache_batch_idx else 0
    k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, HEAD_DIM, dtype, device, page_size,
                                         extra_rows=extra_rows)
    rows = torch.tensor([3, 0, 4], dtype=torch.int32, device=device) if cache_batch_idx else None
    before_k, before_v = k_cache.clone().cpu(), v_cache.clone().cpu()
    cache_seqlens = torch.tensor([0, 37, capacity - new], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 11, 30], dtype=torch.int32, device=device) if cache_leftpad else None
    q = random_q(batch, seqlen_q, heads_q, HEAD_DIM, dtype, device)
    k_new, v_new = (random_q(batch, new, heads_kv, HEAD_DIM, dtype, device, seed=s) for s in (7, 8))
    cos, sin = rotary_tables(capacity + 5, rotary_dim, dtype, device)
    q_given, k_given = q.clone(), k_new.clone()
    out = torch.full_like(q, float("nan"))
    out, lse = tvmflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=rows, cache_leftpad=leftpad, block_table=table, causal=causal, window_size=window_size,
        rotary_interleaved=interleaved, num_splits=2, return_softmax_lse=True)
    assert torch.equal(q, q_given) and torch.equal(k_new, k_given), "q and k are the caller's, unchanged"
    assert out.shape == q.shape and torch.isfinite(out).all()

    cpu = [t.cpu() if t is not None else None for t in (q, k_new, v_new, cos, sin, cache_seqlens, table, rows)]
    q, k_new, v_new, cos, sin, cache_seqlens, table, rows = cpu
    k_cache, v_cache, out, lse = k_cache.cpu(), v_cache.cpu(), out.cpu(), lse.cpu()
    starts = cache_seqlens.long()[:, None]
    k_positions = starts + torch.arange(new)
    local = window_size != (-1, -1)
    q_positions = starts + torch.arange(seqlen_q) if causal or local else starts.expand(batch, seqlen_q)
    k_ro = rotary_reference(k_new, cos, sin, k_positions, interleaved)
    q_ro = rotary_reference(q, cos, sin, q_positions, interleaved)
    eps = torch.finfo(dtype).eps
    for b, start in enumerate(cache_seqlens.tolist()):
        k_seq, v_seq = sequence_kv(k_cache, v_cache, b, capacity, table, rows)
        old_k, _ = sequence_kv(before_k, before_v, b, capacity, table, rows)
        # the cache holds the rotated k (rounded once to dtype), v as given, the rest untouched
        appended = k_seq[0, start:start + new].double()
        assert max_error(appended, k_ro[b]) <= 4 * eps * (1 + k_ro[b].abs().max().item())
        assert torch.equal(appended[..., rotary_dim:], k_new[b, ..., rotary_dim:].double())
        assert torch.equal(v_seq[0, start:start + new], v_new[b])
        assert torch.equal(k_seq[0, :start], old_k[0, :start])
        # attention of the rotated q over the cache with the rotated keys, against float64
        length, first = start + new, 0 if leftpad is None else int(leftpad[b])
        k_ref = torch.cat((old_k[0, first:start].double(), k_ro[b]))[None]
        v_ref = v_seq[:, first:length].double()
        ref_out, ref_lse = reference(q_ro[b:b + 1], k_ref, v_ref, causal=causal, window_size=window_size)
        theirs = max_error(torch_same_dtype(q_ro[b:b + 1].to(dtype), k_ref.to(dtype), v_ref.to(dtype), causal=causal,
                                            window_size=window_size), ref_out)
        ours = max_error(out[b:b + 1], ref_out)
        assert ours <= 2 * theirs + 1e-5, f"sequence {b}: out error {ours:.3e} > 2 x torch's {theirs:.3e}"
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1]), seen)
        if seen.any():
            assert max_error(lse[b:b + 1][seen], ref_lse[seen]) <= 1e-3 * (1 + ref_lse[seen].abs().max().item())


CASES = [  # (interleaved, rotary_dim, seqlen_q, causal, page_size)
    (True, HEAD_DIM, 1, False, 0),
    (False, HEAD_DIM, 1, False, 0),
    (True, 32, 3, True, 0),           # partial rotary_dim, a chunk of q: successive positions
    (False, 32, 3, True, 16),         # ... paged
    (False, 48, 3, False, 16),        # not causal: every q token at cache_seqlens
    (True, 16, 2, False, 0),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("interleaved,rotary_dim,seqlen_q,causal,page_size", CASES)
def test_rotary(device, interleaved, rotary_dim, seqlen_q, causal, page_size):
    check_rotary_decode(device, torch.float16, interleaved=interleaved, rotary_dim=rotary_dim, seqlen_q=seqlen_q,
                        causal=causal, page_size=page_size)


@pytest.mark.parametrize("device", devices())
def test_rotary_bf16_window_and_cache_batch_idx(device):
    """A window is local: q's tokens at successive positions; cache_batch_idx picks the rows, the
    positions stay each sequence's cache_seqlens."""
    check_rotary_decode(device, torch.bfloat16, interleaved=False, rotary_dim=32, seqlen_q=2, causal=False,
                        window_size=(20, 5), cache_batch_idx=True)


def test_apply_rotary_matches_reference():
    """The torch-ops rotation itself: float32 arithmetic, one rounding, either pairing, the rest copied."""
    x = random_q(2, 5, 3, HEAD_DIM, torch.float32, "cpu")
    cos, sin = rotary_tables(16, 32, torch.float32, "cpu")
    offsets = torch.tensor([2, 7], dtype=torch.int32)
    for interleaved in (True, False):
        for successive in (True, False):
            positions = offsets.long()[:, None] + (torch.arange(5) if successive else torch.zeros(5, dtype=torch.long))
            got = flash_attn.apply_rotary(x, cos, sin, offsets, interleaved, successive)
            want = rotary_reference(x, cos, sin, positions, interleaved)
            assert max_error(got, want) < 1e-5
            assert torch.equal(got[..., 32:], x[..., 32:])
    assert max_error(flash_attn.apply_rotary(x, cos, sin, offsets, True),
                     flash_attn.apply_rotary(x, cos, sin, offsets, False)) > 0.1  # the pairing matters


@pytest.mark.parametrize("kwargs,error,message", [
    ({"rotary_sin": None}, ValueError, "rotary_sin: expected rotary_cos and rotary_sin both"),
    ({"k": None, "v": None}, ValueError, "needs the new k"),
    ({"rotary_cos": torch.zeros(100, 40, dtype=torch.float16), "rotary_sin": torch.zeros(100, 40, dtype=torch.float16)},
     ValueError, "multiple of 16 up to head_dim"),
    ({"rotary_cos": torch.zeros(100, 12, dtype=torch.float16), "rotary_sin": torch.zeros(100, 12, dtype=torch.float16)},
     ValueError, "multiple of 16"),
    ({"rotary_cos": torch.zeros(10, 16, dtype=torch.float16), "rotary_sin": torch.zeros(10, 16, dtype=torch.float16)},
     ValueError, "at least the cache's 16 positions"),
    ({"rotary_cos": torch.zeros(100, 16), "rotary_sin": torch.zeros(100, 16)}, ValueError, "q's dtype"),
])
def test_rotary_bad_input(kwargs, error, message):
    k_cache, v_cache, _ = make_cache(2, 16, 1, HEAD_DIM, torch.float16, "cpu")
    before = k_cache.clone()
    q = random_q(2, 1, 2, HEAD_DIM, torch.float16, "cpu")
    k_new = random_q(2, 1, 1, HEAD_DIM, torch.float16, "cpu")
    args = {"k": k_new, "v": k_new, "rotary_cos": torch.zeros(100, 16, dtype=torch.float16),
            "rotary_sin": torch.zeros(100, 16, dtype=torch.float16), **kwargs}
    with pytest.raises(error, match=message):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **args)
    assert torch.equal(k_cache, before), "nothing is written on bad input"


@pytest.mark.gpu
def test_rotary_decode_step_in_a_cuda_graph():
    """A decode step with rotary (two new tokens, causal, paged) captured in a CUDA graph replays as
    cache_seqlens changes: the same output and cache as the eager call (the rotation gathers its
    positions on the device)."""
    dtype, batch, capacity, heads_kv = torch.bfloat16, 3, 512, 2
    k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, 128, dtype, "cuda", page_size=64)
    cos, sin = rotary_tables(capacity, 64, dtype, "cuda")
    cache_seqlens = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    q = random_q(batch, 2, 8, 128, dtype, "cuda")
    k_new, v_new = (random_q(batch, 2, heads_kv, 128, dtype, "cuda", seed=s) for s in (3, 4))

    def step():
        return tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                cache_seqlens=cache_seqlens, block_table=table, causal=True,
                                                rotary_interleaved=False)

    graph, out = captured_in_a_cuda_graph(step)
    for lengths in ([1, 2, 3], [5, 300, 510], [509, 0, 64]):
        cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        k_new.copy_(random_q(batch, 2, heads_kv, 128, dtype, "cuda", seed=sum(lengths)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        rotated = flash_attn.apply_rotary(k_new, cos, sin, cache_seqlens, False)
        for b, length in enumerate(lengths):
            assert torch.equal(sequence_kv(k_cache, v_cache, b, capacity, table)[0][0, length:length + 2], rotated[b])
        assert torch.equal(replayed, step()), f"lengths {lengths}: the replay differs from the eager call"
