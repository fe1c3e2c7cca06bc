"""Tensors of more than 2**31 elements (issue 24, item 4): their offsets pass int32, so a call on
them takes a module of its own that indexes its global buffers in int64
(``lowering.wide_indices.WidenGlobalIndices``, chosen by ``checks.needs_int64``); smaller problems keep
their int32 modules, whose CUDA is unchanged (``test_generated_cuda.py``).

On the CPU the large tensors are views into (or caches in) storage that is allocated but mostly
never touched, so the kernels read elements past 2**31 without the memory or time of a full
tensor. The GPU tests run a decode over caches of 2**31 elements and more, and a forward, a
backward and a varlen forward over q, k and v of more than 2**31 elements, each checked against a
float64 reference on a few sequences."""

import fcntl
import os
import re
import tempfile

import pytest
import torch
from reference import (
    check_attention,
    check_gradients,
    max_error,
    reference,
    torch_same_dtype,
)

import tvmflash
from tvmflash.kernels import checks

INT32_MAX = 2**31 - 1
D = 64


def lazy(numel, dtype=torch.float16, device="cpu"):
    """A tensor of ``numel`` elements whose pages are only allocated where written (on the CPU)."""
    return torch.empty(numel, dtype=dtype, device=device)


def test_needs_int64_only_past_2_31():
    small = torch.empty(4, 16, 2, D)
    assert not checks.needs_int64(small, None)
    storage = lazy(2**31 + 2**16)
    exact = storage[: 2**31].view(2**15, 2**10, 1, D)  # offsets up to 2**31 - 1: int32 still holds them
    assert not checks.needs_int64(exact)
    assert checks.needs_int64(storage.view(-1, 1, 1, D))  # 2**31 + 2**16 elements
    assert checks.needs_int64(storage.as_strided((3, 4, 1, D), (2**30, D, D, 1)))  # a view reaching past 2**31
    with pytest.raises(ValueError, match="strides of 2..31 elements or more are not supported"):
        checks.check_strides(k=storage.as_strided((2, 4, 1, D), (2**31, D, D, 1)))


def test_int64_module_is_a_module_of_its_own():
    """A small call uses (and builds) only the int32 module; the int64 one has a key of its own, and
    the int32 key is what it was before int64 modules existed (no ``index_bits`` in it)."""
    built = tvmflash.compile(head_dim=D, dtype="float16", target="cpu")
    q = torch.randn(2, 5, 4, D).half()
    built(q, q[:, :, :2], q[:, :, :2])
    assert (4, 2) in built.build.modules and (4, 2, "int64") not in built.build.modules
    spec = built.spec(4, 2)
    assert built.build.key(spec) == built.build.key(spec, wide=False) != built.build.key(spec, wide=True)


def sequence_reference_check(out, q, k_seq, v_seq, b):
    """Sequence b's output against float64 over its keys k_seq, v_seq (1, n, heads_kv, d): flash-attn's rule."""
    q, k_seq, v_seq = q[b:b + 1].cpu(), k_seq.cpu(), v_seq.cpu()
    ref, _ = reference(q, k_seq, v_seq)
    theirs = max_error(torch_same_dtype(q, k_seq, v_seq), ref)
    ours = max_error(out[b:b + 1].cpu(), ref)
    assert torch.isfinite(out[b:b + 1]).all()
    assert ours <= 2 * theirs + 1e-5, f"sequence {b}: error {ours:.3e} > 2 x torch's {theirs:.3e}"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_past_2_31_elements_on_cpu(paged):
    """A cache of more than 2**31 elements: sequences whose keys sit past 2**31 (a high cache row, or
    high pages), new keys appended there, against float64."""
    heads_kv, length, new = 2, 300, 2
    gen = torch.Generator().manual_seed(0)
    if paged:
        page = 16
        pages = 2**31 // (page * heads_kv * D) + 64
        k_cache = lazy(pages * page * heads_kv * D).view(pages, page, heads_kv, D)
        v_cache = lazy(pages * page * heads_kv * D).view(pages, page, heads_kv, D)
        per_seq = -(-(length + new) // page)
        table = torch.stack([torch.arange(pages - per_seq, pages).flip(0), torch.arange(per_seq)]).to(torch.int32)
        rows = None
        for used in table.unique().tolist():
            k_cache[used] = torch.randn(page, heads_kv, D, generator=gen).half()
            v_cache[used] = torch.randn(page, heads_kv, D, generator=gen).half()
    else:
        capacity = 2**16
        cache_rows = 2**31 // (capacity * heads_kv * D) + 1
        k_cache = lazy(cache_rows * capacity * heads_kv * D).view(cache_rows, capacity, heads_kv, D)
        v_cache = lazy(cache_rows * capacity * heads_kv * D).view(cache_rows, capacity, heads_kv, D)
        rows = torch.tensor([cache_rows - 1, 0], dtype=torch.int32)
        table = None
        for row in rows.tolist():
            k_cache[row, :length] = torch.randn(length, heads_kv, D, generator=gen).half()
            v_cache[row, :length] = torch.randn(length, heads_kv, D, generator=gen).half()
    assert k_cache.numel() > 2**31
    q = torch.randn(2, new, 4, D, generator=gen).half()
    k_new, v_new = (torch.randn(2, new, heads_kv, D, generator=gen).half() for _ in range(2))
    out = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=length,
                                           cache_batch_idx=rows, block_table=table, num_splits=2)
    for b in range(2):
        if paged:
            k_seq, v_seq = (c[table[b].long()].flatten(0, 1)[None, :length + new] for c in (k_cache, v_cache))
        else:
            k_seq, v_seq = (c[rows[b].item()][None, :length + new] for c in (k_cache, v_cache))
        assert torch.equal(k_seq[0, length:], k_new[b]) and torch.equal(v_seq[0, length:], v_new[b])
        sequence_reference_check(out, q, k_seq, v_seq, b)


def test_forward_and_varlen_past_2_31_elements_on_cpu():
    """k and v as views whose last rows sit past 2**31 elements from their first: the forward and
    varlen forward against float64 on compact copies."""
    gen = torch.Generator().manual_seed(1)
    storage_k, storage_v = lazy(2**31 + 2**27), lazy(2**31 + 2**27)
    k = storage_k.as_strided((3, 40, 2, D), (2**30, 2 * D, D, 1))  # batch b at b * 2**30
    v = storage_v.as_strided((3, 40, 2, D), (2**30, 2 * D, D, 1))
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    q = torch.randn(3, 17, 4, D, generator=gen).half()
    assert checks.needs_int64(k) and not checks.needs_int64(q)
    out, lse = tvmflash.attention(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k.contiguous(), v.contiguous(), causal=True)

    # varlen: 34 rows of keys 2**26 elements apart (the last at 2**31 + 2**26), in two sequences
    k_rows = storage_k.as_strided((34, 2, D), (2**26, D, 1))
    v_rows = storage_v.as_strided((34, 2, D), (2**26, D, 1))
    k_rows.copy_(torch.randn(k_rows.shape, generator=gen))
    v_rows.copy_(torch.randn(v_rows.shape, generator=gen))
    q_rows = torch.randn(20, 4, D, generator=gen).half()
    cu_q, cu_k = torch.tensor([0, 8, 20], dtype=torch.int32), torch.tensor([0, 15, 34], dtype=torch.int32)
    out, lse = tvmflash.varlen_attention(q_rows, k_rows, v_rows, cu_q, cu_k, 12, 19, return_lse=True)
    for b in range(2):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        check_attention(out[None, qs], lse[None, :, qs], q_rows[None, qs], k_rows[None, ks].contiguous(),
                        v_rows[None, ks].contiguous())


@pytest.mark.parametrize("which", ["decode", "varlen-sm80", "backward-sm80"])
def test_int64_modules_index_in_64_bits(which):
    """Cross-compiled CUDA: an int32 module has no 64-bit index arithmetic; the int64 module of the
    same kernel computes every offset into K (and the cp.async copies' source offsets) in int64."""
    if which == "decode":
        built = tvmflash.compile_decode(head_dim=128, dtype="bfloat16", target="sm90")
        sources = [built.source(32, 8, wide=wide) for wide in (False, True)]
    elif which == "varlen-sm80":
        built = tvmflash.compile(head_dim=64, dtype="bfloat16", target="sm90", varlen=True)  # sm80 on sm_90a
        sources = [built.source(4, 2, wide=wide) for wide in (False, True)]
    else:
        built = tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm80")
        sources = [built.source(4, 2, wide=wide) for wide in (False, True)]
    narrow, wide = sources
    assert "(int64_t)" not in narrow
    uses = [s for s in wide.split(";") if re.search(r"K_ptr(\[|, \()", s)]  # K_ptr[index], or a copy's (K_ptr, offset)
    assert uses and all("(int64_t)" in s for s in uses), [s for s in uses if "(int64_t)" not in s][:1]
    copies = [s for s in wide.split(";") if "tvmflash_cp_async_zfill" in s and "K_ptr" in s]
    assert all("_i64(" in s for s in copies)  # the zero-filling copy takes a 64-bit source offset


# ------------------------------------------------------------------------------------------- GPU
def gpu_randn(shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_memory_alone")
@pytest.mark.parametrize("cache_rows", [32, 33], ids=["2**31", "past-2**31"])
def test_decode_64k_cache_on_the_gpu(cache_rows):
    """The issue's decode: 64k keys x batch 32 x 8 heads x d128 is 2**31 elements (it was refused;
    its offsets fit int32), and one row more (2**31 + 2**26: the int64 module), GQA 32/8, bf16, new
    keys appended; the sequences at the cache's first and last rows against float64."""
    capacity, heads_kv, heads_q, d = 2**16, 8, 32, 128
    k_cache = torch.empty((cache_rows, capacity, heads_kv, d), dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    for row in range(cache_rows):  # row by row: no float32 copy of the whole cache
        k_cache[row] = gpu_randn((capacity, heads_kv, d), seed=2 * row)
        v_cache[row] = gpu_randn((capacity, heads_kv, d), seed=2 * row + 1)
    batch = cache_rows
    lengths = torch.randint(1, capacity - 1, (batch,), device="cuda", dtype=torch.int32)
    lengths[-1] = capacity - 1  # the last sequence: the cache's last keys
    q = gpu_randn((batch, 1, heads_q, d), seed=1000)
    k_new, v_new = gpu_randn((batch, 1, heads_kv, d), seed=1001), gpu_randn((batch, 1, heads_kv, d), seed=1002)
    out = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)
    torch.cuda.synchronize()
    for b in (0, batch - 1):
        n = int(lengths[b]) + 1
        assert torch.equal(k_cache[b, n - 1], k_new[b, 0])
        sequence_reference_check(out, q, k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], b)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_memory_alone")
def test_paged_decode_past_2_31_on_the_gpu():
    """A paged cache of more than 2**31 elements (pages of 256): a sequence on the last pages."""
    page, heads_kv, d = 256, 8, 128
    pages = 2**31 // (page * heads_kv * d) + 16
    k_cache = torch.empty((pages, page, heads_kv, d), dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    per_seq = 64
    table = torch.stack([torch.arange(pages - per_seq, pages, device="cuda").flip(0),
                         torch.arange(per_seq, device="cuda")]).to(torch.int32)
    for used in table.unique().tolist():
        k_cache[used] = gpu_randn((page, heads_kv, d), seed=used)
        v_cache[used] = gpu_randn((page, heads_kv, d), seed=used + pages)
    q = gpu_randn((2, 1, 32, d), seed=7)
    lengths = torch.tensor([per_seq * page, 5000], dtype=torch.int32, device="cuda")
    out = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    for b in range(2):
        n = int(lengths[b])
        k_seq, v_seq = (c[table[b].long()].flatten(0, 1)[None, :n] for c in (k_cache, v_cache))
        sequence_reference_check(out, q, k_seq, v_seq, b)


@pytest.fixture
def gpu_memory_alone():
    """The GPU tests of this file hold tens of GB each: where the GPU suite runs tests in parallel processes
    (``benchmarks/gpu_tests.py``), they take turns (a lock file), and each gives its memory back after."""
    with open(os.path.join(tempfile.gettempdir(), "tvmflash-large-gpu-tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()


def big_qkv(batch, seqlen, heads, d, seed=0):
    return [gpu_randn((batch, seqlen, heads, d), seed=seed + i) for i in range(3)]


BIG_BATCH, BIG_SEQLEN, BIG_HEADS = 2**31 // (128 * 8 * 128) + 16, 128, 8  # 2**31 + 2**21 elements each


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_memory_alone")
def test_forward_past_2_31_on_the_gpu():
    """q, k, v of 2**31 + 2**21 elements each (bf16, d128, 128 tokens a sequence, causal): the
    forward (its default schedule, int64 module), the first and last sequences against float64."""
    q, k, v = big_qkv(BIG_BATCH, BIG_SEQLEN, BIG_HEADS, 128)
    assert q.numel() > 2**31
    out, lse = tvmflash.attention(q, k, v, causal=True, return_lse=True)
    for b in (0, BIG_BATCH - 1):
        check_attention(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), *(t[b:b + 1].cpu() for t in (q, k, v)), causal=True)


def torch_forward(q, k, v, chunk=512):
    """(out, lse) of causal attention in float32 torch ops, ``chunk`` sequences at a time: the
    backward test's forward, so that its process builds the backward only."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    seqlen = q.shape[1]
    mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        qc, kc, vc = (t[part].float().transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
        scores = (qc @ kc.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
        lse[part] = torch.logsumexp(scores, dim=-1)
        out[part] = (torch.softmax(scores, dim=-1) @ vc).transpose(1, 2).to(q.dtype)
    return out, lse


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_memory_alone")
def test_backward_past_2_31_on_the_gpu():
    """The backward over q, k, v, out and dout of 2**31 + 2**21 elements each (the int64 module),
    from a float32 torch forward; the first and last sequences' gradients against float64."""
    q, k, v = big_qkv(BIG_BATCH, BIG_SEQLEN, BIG_HEADS, 128, seed=10)
    out, lse = torch_forward(q, k, v)
    dout = gpu_randn(q.shape, seed=9)
    backward = tvmflash.compile_backward(head_dim=128, dtype=torch.bfloat16, causal=True, target="cuda")
    grads = backward(q, k, v, out, dout, lse)
    torch.cuda.synchronize()
    for b in (0, BIG_BATCH - 1):
        check_gradients([g[b:b + 1].cpu() for g in grads], *(t[b:b + 1].cpu() for t in (q, k, v)),
                        dout[b:b + 1].cpu(), causal=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_memory_alone")
def test_varlen_past_2_31_on_the_gpu():
    """varlen over packed q, k, v of 2**31 + 2**21 elements: the first and last sequences against float64."""
    q, k, v = (t.flatten(0, 1) for t in big_qkv(BIG_BATCH, BIG_SEQLEN, BIG_HEADS, 128, seed=20))
    cu = torch.arange(0, BIG_BATCH + 1, device="cuda", dtype=torch.int32) * BIG_SEQLEN
    out, lse = tvmflash.varlen_attention(q, k, v, cu, cu, BIG_SEQLEN, BIG_SEQLEN, causal=True, return_lse=True)
    for b in (0, BIG_BATCH - 1):
        rows = slice(b * BIG_SEQLEN, (b + 1) * BIG_SEQLEN)
        check_attention(out[None, rows].cpu(), lse[None, :, rows].cpu(), *(t[None, rows].cpu() for t in (q, k, v)),
                        causal=True)
