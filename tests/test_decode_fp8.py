"""Decode over an FP8 (e4m3) KV cache (issue 44): ``flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=,
v_descale=)`` with k_cache and v_cache torch.float8_e4m3fn and FA3's descales, float32 (batch, heads_kv).

Numerics: each sequence's output against a float64 reference on the dequantised cache (k_cache · k_descale,
v_cache · v_descale), flash-attn's rule (our error at most twice PyTorch's in q's dtype on the same
dequantised cache, + 1e-5), outputs poisoned with NaN first. The CPU's kernel converts e4m3 by its bits
(``program_decode.e4m3_bits_to_float32``), so its inputs may hold every non-NaN byte, zero and the
subnormals included (TVM's own LLVM conversion is wrong there: tests/test_fp8.py)."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
from conftest import devices
from reference import max_error, reference, torch_same_dtype

import tvmflash
from tvmflash import kernels, schedules
from tvmflash.fp8_reference import decode_error, dequantised
from tvmflash.kernels import compile_decode

F8 = torch.float8_e4m3fn
NAN_BYTES = (0x7F, 0xFF)  # e4m3fn's NaNs (it has no infinity)


@pytest.fixture(autouse=True)
def served_before_its_gpu_check(monkeypatch):
    """The GPU's FP8-cache decode is served where TVMFLASH_GPU_UNCHECKED=1 asks until its GPU tests pass
    (``DecodeTasks.fp8_unchecked_head_dims``): these tests, a GPU run's included, ask."""
    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")


def e4m3_cache(shape, gen, every_byte=False):
    """An e4m3 tensor of randn * 2 values; every_byte: its first elements are every non-NaN byte in turn
    (zero, the subnormals, the largest), so that the conversion is checked on all of them."""
    x = (torch.randn(shape, generator=gen) * 2).to(F8)
    if every_byte:
        values = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
        flat = x.view(torch.uint8).view(-1)
        count = min(flat.numel(), 4 * values.numel())
        flat[:count] = values.repeat(4)[:count]  # (make_fp8_cache gives such keys a small k_descale)
    return x


def make_fp8_cache(batch, capacity, heads_kv, head_dim, device, page_size=0, seed=0, every_byte=False):
    """(k_cache, v_cache, block_table or None, k_descale, v_descale): contiguous, or paged with the
    sequences' pages shuffled over a pool with a few pages no sequence uses."""
    gen = torch.Generator().manual_seed(seed)
    if page_size:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 3
        shape = (num_pages, page_size, heads_kv, head_dim)
        table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
        table = table.to(dtype=torch.int32, device=device)
    else:
        shape, table = (batch, capacity, heads_kv, head_dim), None
    k = e4m3_cache(shape, gen, every_byte)
    v = e4m3_cache(shape, gen, every_byte)
    k_descale = (torch.rand(batch, heads_kv, generator=gen) * 0.2 + (0.02 if every_byte else 0.5)).to(device)
    v_descale = (torch.rand(batch, heads_kv, generator=gen) + 0.5).to(device)
    return k.to(device), v.to(device), table, k_descale, v_descale


def poison_past_the_keys(caches, block_table, lengths):
    """e4m3's NaN byte in every cache row past each sequence's keys (and in the pages no sequence uses): a
    kernel that let them into a product (0 · NaN) would write NaN."""
    for cache in caches:
        nan_rows = torch.ones(cache.shape[:2], dtype=torch.bool)
        for b, length in enumerate(lengths.tolist()):
            if block_table is None:
                nan_rows[b, :length] = False
            else:
                rows = torch.arange(length)
                pages = block_table[b].cpu().long()[rows // cache.shape[1]]
                nan_rows[pages, rows % cache.shape[1]] = False
        cache.view(torch.uint8)[nan_rows.to(cache.device)] = NAN_BYTES[0]


def check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, k_descale, v_descale, *, causal, block_table=None,
                     cache_leftpad=None, sinks=None, **variant):
    """Each sequence against float64 attention of its dequantised keys and values (flash-attn's rule);
    cache_leftpad: sequence b's keys from that row on; sinks: each head's logit in the denominator."""
    q, k_cache, v_cache, out, lse = (t.cpu() for t in (q, k_cache, v_cache, out, lse))
    k_descale, v_descale = k_descale.cpu(), v_descale.cpu()
    block_table = None if block_table is None else block_table.cpu()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert not out.isnan().any(), "unwritten or NaN outputs"
    worst = 0.0
    for b, length in enumerate(lengths.tolist()):
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        k = dequantised(k_cache, k_descale, block_table, b, length, start)
        v = dequantised(v_cache, v_descale, block_table, b, length, start)
        ref_out, ref_lse = reference(q[b:b + 1], k, v, causal=causal, **variant)
        same_dtype = torch_same_dtype(q[b:b + 1], k.to(q.dtype), v.to(q.dtype), causal=causal, **variant)
        if sinks is not None:  # out · Σ / (Σ + exp(sink)), lse = log(Σ + exp(sink)), per (query, head)
            sink = sinks.cpu().double()[None, :, None]  # (1, heads_q, 1) as the LSE (1, heads_q, seqlen_q)
            weight = torch.exp(ref_lse - torch.logaddexp(ref_lse, sink)).nan_to_num(0.0).transpose(1, 2)[..., None]
            ref_out, ref_lse = ref_out * weight, torch.logaddexp(ref_lse, sink)
            same_dtype = (same_dtype.double() * weight).to(q.dtype)
        theirs = max_error(same_dtype, ref_out)
        ours = max_error(out[b:b + 1], ref_out)
        assert ours <= 2 * theirs + 1e-5, f"sequence {b} ({length} keys): error {ours:.3e} > 2 x torch's {theirs:.3e}"
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1]), seen)
        if seen.any():
            assert (lse[b:b + 1][seen].double() - ref_lse[seen]).abs().max().item() < 1e-3
        worst = max(worst, ours)
    return worst


def run_both(q, k_cache, v_cache, lengths, table, kd, vd, *, causal=False, num_splits=0, page_size=0, **options):
    """flash_attn_with_kvcache's (out, lse), and the kernel's own call into an output poisoned with NaN
    (the same numbers)."""
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                causal=causal, num_splits=num_splits, k_descale=kd, v_descale=vd,
                                                return_softmax_lse=True, **options)
    kernel = compile_decode(head_dim=q.shape[-1], dtype=q.dtype, page_size=page_size, target=_target(q.device),
                            cache_dtype=F8, window_size=options.get("window_size", (-1, -1)),
                            softcap=options.get("softcap", 0.0), alibi=options.get("alibi_slopes") is not None,
                            leftpad=options.get("cache_leftpad") is not None, sinks=options.get("sinks") is not None)
    poisoned = torch.full_like(q, math.nan)
    index = table if table is not None else torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    out2, lse2 = kernel(q, k_cache, v_cache, lengths, index, num_splits=num_splits, causal=causal, out=poisoned,
                        alibi_slopes=options.get("alibi_slopes"), cache_leftpad=options.get("cache_leftpad"),
                        sinks=options.get("sinks"), k_descale=kd, v_descale=vd)
    assert out2 is poisoned and torch.equal(out2, out) and torch.equal(lse2, lse)
    return out, lse


def _target(device):
    return "cpu" if device.type == "cpu" else None


# ----------------------------------------------------------------------------------------------------
# numerics (CPU; the same cases on a GPU)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlen_q,causal,num_splits", [(1, False, 1), (1, False, 3), (3, True, 0)],
                         ids=["one-split", "three-splits", "chunk-causal"])
def test_fp8_cache_against_the_dequantised_reference(device, page_size, dtype, seqlen_q, causal, num_splits):
    """GQA 8/2, ragged lengths (one shorter than a tile, one not a multiple of it), each byte value of e4m3."""
    batch, heads_q, heads_kv, head_dim, capacity = 3, 8, 2, 64, 150
    k_cache, v_cache, table, kd, vd = make_fp8_cache(batch, capacity, heads_kv, head_dim, device, page_size,
                                                     seed=seqlen_q + page_size, every_byte=device == "cpu")
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
    lengths = torch.tensor([150, 9, 77], dtype=torch.int32, device=device)
    poison_past_the_keys((k_cache, v_cache), table, lengths)
    out, lse = run_both(q, k_cache, v_cache, lengths, table, kd, vd, causal=causal, num_splits=num_splits,
                        page_size=page_size)
    check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=causal, block_table=table)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("variant", [{"window_size": (40, -1)}, {"softcap": 5.0}, {"alibi": True}, {"leftpad": True},
                                     {"sinks": True}], ids=["window", "softcap", "alibi", "leftpad", "sinks"])
def test_fp8_cache_variants(device, variant):
    """A sliding window, a softcap, ALiBi, cache_leftpad and sinks over an FP8 cache, as over a bf16 one."""
    batch, heads_q, heads_kv, head_dim = 2, 4, 2, 64
    k_cache, v_cache, table, kd, vd = make_fp8_cache(batch, 130, heads_kv, head_dim, device, seed=3)
    q = torch.randn(batch, 2, heads_q, head_dim, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    lengths = torch.tensor([130, 61], dtype=torch.int32, device=device)
    options = {k: v for k, v in variant.items() if k not in ("alibi", "leftpad", "sinks")}
    gen = torch.Generator().manual_seed(1)
    if variant.get("alibi"):
        options["alibi_slopes"] = torch.rand(heads_q, generator=gen).to(device)
    if variant.get("leftpad"):
        options["cache_leftpad"] = torch.tensor([17, 60], dtype=torch.int32, device=device)
    if variant.get("sinks"):
        options["sinks"] = (torch.randn(heads_q, generator=gen) * 3).to(device)
    out, lse = run_both(q, k_cache, v_cache, lengths, table, kd, vd, causal=True, num_splits=2, **options)
    check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=True, **options)


# the sm80 schedule's staged form of an FP8 cache's tiles (knob fp8_tiles "fragments": FP8_FRAGMENTS, the
# default where the target converts e4m3 itself; "registers" elsewhere)
STAGED_TILES = ("fragments",)


@pytest.mark.parametrize("device,fp8_tiles", [("cpu", None), pytest.param("cuda", None, marks=pytest.mark.gpu),
                                              *(pytest.param("cuda", tiles, marks=pytest.mark.gpu)
                                                for tiles in STAGED_TILES)],
                         ids=["cpu", "cuda", *(f"cuda-{tiles}" for tiles in STAGED_TILES)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_e4m3_byte_is_read_exactly(device, fp8_tiles, dtype):
    """Sequence b has one key, whose every element is byte b (each non-NaN e4m3 value: zero, the subnormals
    and the largest): its output is that value exactly, and its LSE q·k · scale with q all ones. A sharper
    check of the conversion than the tests above, whose outputs average it away. fp8_tiles: the sm80
    schedule's staged form (FP8_FRAGMENTS converts bf16 through fp16 by its own bit moves)."""
    values = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    head_dim = 32
    cache = values[:, None, None, None].expand(-1, 1, 1, head_dim).contiguous().view(F8).to(device)
    q = torch.ones(len(values), 1, 2, head_dim, dtype=dtype, device=device)
    lengths = torch.ones(len(values), dtype=torch.int32, device=device)
    poisoned = torch.full_like(q, math.nan)
    kernel = compile_decode(head_dim=head_dim, dtype=dtype, target=_target(q.device), cache_dtype=F8,
                            knobs={"fp8_tiles": fp8_tiles} if fp8_tiles else None)
    rows = torch.arange(len(values), dtype=torch.int32, device=device)
    out, lse = kernel(q, cache, cache, lengths, rows, num_splits=1, out=poisoned, softmax_scale=0.125)
    exact = cache.float()[:, :, :, :].expand(-1, 1, 2, head_dim).cpu()  # (every e4m3 value is a bf16, fp16 value)
    assert torch.equal(out.float().cpu(), exact), (out.float().cpu() - exact).abs().amax((1, 2, 3))
    expected_lse = cache.float().cpu()[:, 0, 0, 0].double() * head_dim * 0.125
    assert (lse.cpu()[:, :, 0].double() - expected_lse[:, None]).abs().max().item() <= 1e-6 * 448 * 4


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_the_byte_tiles_form_on_the_cpu(monkeypatch, tmp_path, paged):
    """The program's byte_tiles form (the cache's bytes in tiles of their own, converted by dequant_k and
    dequant_v: what the sm80 schedule prefetches at head_dim <= 128) on the CPU's schedule, every byte, GQA,
    chunked causal queries, three splits: the algorithm the GPU runs, checked here."""
    from dataclasses import replace

    from tvmflash.kernels.decode import DecodeKernel
    from tvmflash.target import resolve

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))  # (the form is not in the cache's key)
    kernel = DecodeKernel(64, "bfloat16", 16 if paged else 0, resolve("cpu"), None, {"cache_dtype": "float8_e4m3fn"})
    kernel.tasks = replace(kernel.tasks, fp8_byte_tiles=lambda head_dim, knobs, converts: "prefetched")
    assert "dequant_k" in kernel.build.scheduled_tir(8, 2)
    k_cache, v_cache, table, kd, vd = make_fp8_cache(3, 150, 2, 64, "cpu", 16 if paged else 0, seed=11,
                                                     every_byte=True)
    q = torch.randn(3, 3, 8, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    lengths = torch.tensor([150, 9, 77], dtype=torch.int32)
    poison_past_the_keys((k_cache, v_cache), table, lengths)
    index = table if paged else torch.arange(3, dtype=torch.int32)
    out, lse = kernel(q, k_cache, v_cache, lengths, index, num_splits=3, causal=True, out=torch.full_like(q, math.nan),
                      k_descale=kd, v_descale=vd)
    check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=True, block_table=table)


def test_fp8_descales_scale_the_keys_and_values():
    """Descales of None are ones; a v_descale of 2 doubles the output, a k_descale of 2 doubles the logits
    (the same as a softmax_scale twice as large)."""
    k_cache, v_cache, _, _, _ = make_fp8_cache(2, 40, 1, 32, "cpu", seed=9)
    q = torch.randn(2, 1, 2, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    ones, twos = torch.ones(2, 1), torch.full((2, 1), 2.0)
    plain = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1)
    assert torch.equal(plain, tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=ones, v_descale=ones,
                                                               num_splits=1))
    doubled = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, v_descale=twos, num_splits=1)
    assert torch.equal(doubled, (plain.float() * 2).bfloat16())  # (a power of two: exact)
    sharper = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=twos, num_splits=1)
    assert torch.equal(sharper, tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, softmax_scale=2 / math.sqrt(32),
                                                                 num_splits=1))
    assert not torch.equal(sharper, plain)


# ----------------------------------------------------------------------------------------------------
# what it refuses
# ----------------------------------------------------------------------------------------------------
def test_fp8_cache_refusals(monkeypatch):
    k_cache, v_cache, _, kd, vd = make_fp8_cache(1, 32, 1, 64, "cpu")
    q = torch.randn(1, 1, 2, 64).bfloat16()
    new = torch.randn(1, 1, 1, 64).to(F8)
    with pytest.raises(NotImplementedError, match="appending to an FP8 cache"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=3)
    cos = torch.ones(64, 16).bfloat16()
    with pytest.raises(NotImplementedError, match="rotary"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=cos)
    with pytest.raises(NotImplementedError, match="q_descale"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, q_descale=kd)
    with pytest.raises(NotImplementedError, match="float16 or bfloat16"):
        tvmflash.flash_attn_with_kvcache(q.float(), k_cache, v_cache)
    with pytest.raises(NotImplementedError, match="float16 or bfloat16"):
        tvmflash.flash_attn_with_kvcache(q.to(F8), k_cache, v_cache)
    with pytest.raises(TypeError, match="both torch.float8_e4m3fn"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache.bfloat16())
    with pytest.raises(TypeError, match="both torch.float8_e4m3fn"):  # descales with a bf16 cache
        tvmflash.flash_attn_with_kvcache(q, k_cache.bfloat16(), v_cache.bfloat16(), k_descale=kd)
    with pytest.raises(NotImplementedError, match="q_descale"):  # an FP8 q over a bf16 cache
        tvmflash.flash_attn_with_kvcache(q, k_cache.bfloat16(), v_cache.bfloat16(), q_descale=kd)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(batch, heads_kv\)"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=torch.ones(1, 2))
    with pytest.raises(TypeError, match="v_descale: expected a float32"):
        tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, v_descale=vd.double())
    for target in ("sm80", "sm90"):  # the SIMT decode reads no FP8 cache
        with pytest.raises(NotImplementedError, match="the simt decode schedule does not read one"):
            compile_decode(head_dim=64, dtype="bfloat16", target=target, schedule="simt", cache_dtype=F8)
    with pytest.raises(ValueError, match="q's dtype must be float16 or bfloat16"):
        compile_decode(head_dim=64, dtype="float32", target="cpu", cache_dtype=F8)
    monkeypatch.delenv("TVMFLASH_GPU_UNCHECKED")
    compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8)  # every head_dim has passed on a GPU
    # a head_dim yet to pass its GPU tests is served only where asked
    sm80 = schedules.SCHEDULES["sm80"]
    tasks = dataclasses.replace(sm80.decode.tasks, fp8_unchecked_head_dims=(128,))
    monkeypatch.setitem(schedules.SCHEDULES, "sm80", dataclasses.replace(
        sm80, decode=dataclasses.replace(sm80.decode, tasks=tasks)))
    monkeypatch.setattr(kernels, "_DECODE_KERNELS", {})  # (not the kernel built above)
    with pytest.raises(NotImplementedError, match=r"the sm80 decode over an FP8 cache at head_dim 128 has not passed "
                                                  r"the GPU tests yet \(TVMFLASH_GPU_UNCHECKED=1 serves it"):
        compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8)
    compile_decode(head_dim=64, dtype="bfloat16", target="cpu", cache_dtype=F8)  # the CPU's is checked here


# ----------------------------------------------------------------------------------------------------
# the GPU build (cross-compiled on the CPU)
# ----------------------------------------------------------------------------------------------------
def test_targets_without_an_fp8_conversion_convert_by_the_bits(monkeypatch, tmp_path):
    """Where the target has no FP8 conversion of its own (the CPU, sm_80, sm_86), TVM legalizes a cast of e4m3 into
    a bit expression with no zero or subnormals (byte 0 reads as 2^-7); the kernel converts by the bits there
    (``e4m3_bits_to_float32``, whose subnormal scale 2^-9 the source shows), and casts on sm_89 and sm_90."""
    from tvmflash import target as targets
    from tvmflash.kernels.decode import DecodeKernel

    assert [targets.converts_fp8(targets.resolve(t)) for t in ("cpu", "sm80", "sm86", "sm89", "sm90")] == [
        False, False, False, True, True]
    for target, bits in (("sm80", True), ("sm86", True), ("sm90", False)):
        src = compile_decode(head_dim=64, dtype="float16", target=target, cache_dtype=F8).source(4, 2)
        assert ("0x1p-9f" in src) == bits, target
    # TVM's legalized cast, which the bits avoid: the CPU's kernel made to cast reads an all-zero cache as 2^-7
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(targets, "converts_fp8", lambda target: True)
    kernel = DecodeKernel(32, "bfloat16", 0, targets.resolve("cpu"), None, {"cache_dtype": "float8_e4m3fn"})
    zeros = torch.zeros(1, 4, 1, 32, dtype=torch.uint8).view(F8)
    out, _ = kernel(torch.ones(1, 1, 1, 32, dtype=torch.bfloat16), zeros, zeros, torch.tensor([4], dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), num_splits=1)
    assert torch.equal(out.float(), torch.full_like(out.float(), 2.0 ** -7))


@pytest.mark.parametrize("head_dim,prefetched", [(128, True), (256, False)])
def test_fp8_cache_sm90_source_converts_the_cache_bytes_in_registers(head_dim, prefetched):
    """fp8_tiles "registers" (the default before FP8_FRAGMENTS): the split kernel reads the caches as e4m3 (one byte an element), 4 at a time, and converts them in
    registers into the bf16 tiles the mma.sync products read; the output stays bf16. Where the next tiles'
    bytes fit FP8_PREFETCH_BYTES a thread (d128) a step converts the bytes it holds, then loads the next
    tile's into the same registers (one copy, indexed by constants), then computes; else (d256) each element
    is converted as it is read."""
    import re

    from tvmflash.schedules.sm80.decode import FP8_PREFETCH_BYTES, fp8_byte_tiles

    kernel = compile_decode(head_dim=head_dim, dtype="bfloat16", target="sm90", cache_dtype=F8,
                            knobs={"fp8_tiles": "registers"})
    assert (fp8_byte_tiles(head_dim, kernel.knobs) == "prefetched") == prefetched == \
        (2 * 32 * head_dim <= FP8_PREFETCH_BYTES * 32)
    src = kernel.source(32, 8)
    assert "__nv_fp8_e4m3* __restrict__ K_ptr" in src and "__nv_fp8_e4m3* __restrict__ V_ptr" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src
    loop = src[src.index("for (int kb = 0;"):]
    if prefetched:
        assert f"__nv_fp8x4_e4m3 Kt8_local_ptr[{head_dim // 4}];" in src  # (block_n 32, one warp: 32 * d / 32 / 4)
        converted = loop.index("(nv_bfloat164)(Kt8_local_ptr[")
        loaded = re.search(r"Kt8_local_ptr\[\w+\] = \*\(__nv_fp8x4_e4m3\*\)\(K_ptr[^;]*\+ 32\)", loop)
        assert loaded and loaded.start() > converted  # the next tile's rows, after this tile's conversion
    else:
        assert "Kt8_local" not in src
        assert "(nv_bfloat164)(*(__nv_fp8x4_e4m3*)(K_ptr" in loop and "(nv_bfloat164)(*(__nv_fp8x4_e4m3*)(V_ptr" in loop
    assert "float* __restrict__ k_descale_ptr" in src and "float* __restrict__ v_descale_ptr" in src


def test_fp8_cache_split_count_counts_single_buffered_tiles(monkeypatch):
    """num_splits=0 fills the SMs with the tasks an SM holds: an FP8 cache's tiles take fewer shared bytes
    (FP8_FRAGMENTS: DECODE_FP8_CACHE_DEFAULTS' stages of byte tiles and no converted tiles; the registers form:
    single-buffered converted tiles), so more of its tasks fit than the bf16 kernel's three-stage ones, and it
    splits more."""
    from tvmflash.kernels import decode
    from tvmflash.schedules.sm80.knobs import DECODE_FP8_CACHE_DEFAULTS

    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    device = torch.device("cuda")
    plain = compile_decode(head_dim=128, dtype="bfloat16", target="sm90")
    fp8 = compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8)
    assert plain.knobs["num_stages"] > 1 and fp8.knobs == {**plain.knobs, **DECODE_FP8_CACHE_DEFAULTS}
    assert fp8.auto_num_splits(32, 8, 1, 16384, device, 4) > plain.auto_num_splits(32, 8, 1, 16384, device, 4)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [0, 256], ids=["contiguous", "paged256"])
def test_fp8_cache_sm90_builds_without_spills(head_dim, page_size):
    from conftest import ptxas_report

    kernel = compile_decode(head_dim=head_dim, dtype="bfloat16", target="sm90", page_size=page_size, cache_dtype=F8)
    for name, lines in ptxas_report(kernel.source(32, 8), "sm_90a").items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


@pytest.mark.parametrize("fp8_tiles", STAGED_TILES)
def test_fp8_cache_staged_sources(fp8_tiles):
    """The staged form on sm_90a: the K and V tiles' bytes by zero-filling 16-byte cp.async copies (one byte an
    element on both sides: ``tvm_fixes.ZeroFillingCpAsync``) in a three-stage pipeline; each lane converts its
    B fragments' byte pairs (``intrinsics.ld_b_e4m3``; bf16 by its own bit moves), and ldmatrix loads only Q
    (no static shared memory). On sm_80 (no e4m3 conversion of its own, where TVM computes a copy of e4m3
    values in float32) the registers form serves it: no cp.async."""
    import re

    kernel = compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8,
                            knobs={"fp8_tiles": fp8_tiles, "num_stages": 3})
    src = kernel.source(32, 8)
    split = src[re.search(r"split_kernel\([^;{]*\)\s*\{", src).start():]  # its definition, then the others
    split = split[:split.index("single_kernel(")] if "single_kernel(" in split else split
    assert split.count("tvmflash_cp_async_zfill_16_1_1(") >= 4  # K's and V's, in the prologue and the step
    assert "cp_async_wait_group_async_wait_group_2" in split or "cp_async_wait_group_async_wait_group_1" in split
    assert "tvmflash_e4m3_pair_bf16(" in split and ".trans" not in split
    assert "__shared__ alignas" not in split
    from tvmflash.schedules.sm80.decode import fp8_byte_tiles
    assert fp8_byte_tiles(128, kernel.knobs) == "staged" and fp8_byte_tiles(128, kernel.knobs, False) == "prefetched"
    sm80 = compile_decode(head_dim=64, dtype="float16", target="sm80", cache_dtype=F8, knobs={"fp8_tiles": fp8_tiles})
    assert "cp_async" not in sm80.source(4, 2) and "0x1p-9f" in sm80.source(4, 2)


@pytest.mark.parametrize("transposed", [True, False], ids=["K-ld_b_trans", "V-ld_b"])
def test_e4m3_fragments_hold_what_ldmatrix_loads(transposed):
    """FP8_FRAGMENTS's conversion must leave in each register what the ldmatrix it replaces leaves there (the
    mma reads registers, not the intrinsics' description of them): ldmatrix.x4 simulated by PTX's rule (lane
    t gives the address of row t % 8 of matrix t // 8, and receives of matrix m, in register m, row t // 4,
    columns 2 (t % 4) + e; with .trans, row 2 (t % 4) + e, column t // 4) from the schedule's row addresses
    (``ldmatrix_row_offset``), against ``b_fragment_element``; both against mma.sync's B fragment (lane
    4 n8 + q holds k = 2 q + e (+ 8) of column n8 (+ 8), registers 0-3 the first 8 columns)."""
    from tvmflash.schedules.sm80.intrinsics import b_fragment_element, ldmatrix_row_offset

    stride = 24  # (any row stride of at least 16)
    trans = not transposed  # (_ldmatrix_intrin's, operand B)
    for lane in range(32):
        for reg in range(8):
            m, e = divmod(reg, 2)
            r, c = (2 * (lane % 4) + e, lane // 4) if trans else (lane // 4, 2 * (lane % 4) + e)
            row0, col0 = divmod(ldmatrix_row_offset(8 * m + r, stride, transposed), stride)
            assert b_fragment_element(lane, reg, transposed) == (row0, col0 + c), (lane, reg)
            k, n = 2 * (lane % 4) + e % 2 + 8 * (m % 2), lane // 4 + 8 * (m // 2)
            assert b_fragment_element(lane, reg, transposed) == ((n, k) if transposed else (k, n))


def test_fp8_cache_staged_shared_memory():
    """The split count's model of a task's shared memory (``knobs.decode_shared_memory_bytes``) per form, d128,
    32-key tiles, three stages, 16 rows: "registers" one pair of converted tiles (rows padded by 8 elements);
    "fragments" three pairs of byte tiles alone (rows padded by 16 bytes). The knob has no other form."""
    from tvmflash.schedules.sm80.knobs import decode_shared_memory_bytes

    knobs = {"block_n": 32, "num_stages": 3, "fp8_cache": True}
    query = 16 * 136 * 2 + 8 * 16
    assert decode_shared_memory_bytes(128, "bfloat16", {**knobs, "fp8_tiles": "registers"}, 4) == query + 64 * 136 * 2
    assert decode_shared_memory_bytes(128, "bfloat16", {**knobs, "fp8_tiles": "fragments"}, 4) == query + 3 * 64 * 144
    with pytest.raises(ValueError, match=r"fp8_tiles: the sm80 schedule takes one of \['registers', 'fragments'\]"):
        compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8, knobs={"fp8_tiles": "shared"})


def test_fp8_cache_knobs_are_checked_against_their_own_shared_memory():
    """choice.decode checks an FP8 cache's knobs by its tiles' own sizes: 128-key tiles in four stages at d128 need
    276 KiB as a bf16 cache's tiles (over the H100's 227) and 148 KiB as byte tiles (the tuner's space has them)."""
    knobs = {"block_n": 128, "num_stages": 4}
    kernel = compile_decode(head_dim=128, dtype="bfloat16", target="sm90", cache_dtype=F8, knobs=knobs)
    assert kernel.knobs["fp8_tiles"] == "fragments"
    with pytest.raises(ValueError, match="KiB of shared memory"):
        compile_decode(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("fp8_tiles", STAGED_TILES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [0, 256], ids=["contiguous", "paged256"])
def test_fp8_cache_staged_sm90_builds_without_spills(head_dim, page_size, fp8_tiles):
    """The staged form through nvcc for sm_90a: no spills, the cache's bytes by cp.async."""
    from conftest import ptxas_report

    kernel = compile_decode(head_dim=head_dim, dtype="bfloat16", target="sm90", page_size=page_size, cache_dtype=F8,
                            knobs={"fp8_tiles": fp8_tiles})
    src = kernel.source(32, 8)
    assert "tvmflash_cp_async_zfill_16_1_1(" in src
    for name, lines in ptxas_report(src, "sm_90a").items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 256])  # (64: the byte tiles prefetched; 256: converted as read)
def test_fp8_cache_sm80_bit_conversion_compiles(head_dim):
    """sm_80's kernel converts by the bits (no FP8 conversion of its own): nvcc compiles it for sm_80."""
    from conftest import ptxas_report

    kernel = compile_decode(head_dim=head_dim, dtype="float16", target="sm80", cache_dtype=F8)
    assert any("split" in name for name in ptxas_report(kernel.source(32, 8), "sm_80"))


# ----------------------------------------------------------------------------------------------------
# on the GPU
# ----------------------------------------------------------------------------------------------------
def run_knobs(q, k_cache, v_cache, lengths, table, kd, vd, knobs, *, causal=False, num_splits=0, page_size=0):
    """The kernel of these knobs' (out, lse), into an output poisoned with NaN."""
    kernel = compile_decode(head_dim=q.shape[-1], dtype=q.dtype, page_size=page_size, target=_target(q.device),
                            cache_dtype=F8, knobs=knobs)
    index = table if table is not None else torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    poisoned = torch.full_like(q, math.nan)
    out, lse = kernel(q, k_cache, v_cache, lengths, index, num_splits=num_splits, causal=causal, out=poisoned,
                      k_descale=kd, v_descale=vd)
    assert out is poisoned
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_tiles,dtype", [(None, torch.bfloat16), *((t, torch.bfloat16) for t in STAGED_TILES),
                                             ("fragments", torch.float16)],
                         ids=["default", *STAGED_TILES, "fragments-fp16"])
@pytest.mark.parametrize("page_size", [0, 256], ids=["contiguous", "paged256"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_cache_long_sequences_on_the_gpu(page_size, head_dim, fp8_tiles, dtype):
    """A decode step of a serving engine's shape (GQA 32/8, thousands of keys, ragged), every non-NaN byte in
    the caches, against the dequantised float64 reference; one module for every length. fp8_tiles: the sm80
    schedule's staged form (its own split counts)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    batch, heads_q, heads_kv = 4, 32, 8
    k_cache, v_cache, table, kd, vd = make_fp8_cache(batch, 3000, heads_kv, head_dim, "cuda", page_size, seed=head_dim,
                                                     every_byte=True)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype).cuda()
    lengths = torch.tensor([3000, 1, 1777, 256], dtype=torch.int32, device="cuda")
    poison_past_the_keys((k_cache, v_cache), table, lengths)
    if fp8_tiles is None:
        out, lse = run_both(q, k_cache, v_cache, lengths, table, kd, vd, page_size=page_size)
    else:
        out, lse = run_knobs(q, k_cache, v_cache, lengths, table, kd, vd, {"fp8_tiles": fp8_tiles},
                             page_size=page_size)
    error = check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=False, block_table=table)
    print(f"fp8 cache d{head_dim} {'paged' if page_size else 'contiguous'} {fp8_tiles or 'default'} "
          f"{str(dtype)[6:]}: max error {error:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_tiles", STAGED_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("seqlen_q,causal,num_splits", [(1, False, 1), (1, False, 3), (3, True, 0)],
                         ids=["one-split", "three-splits", "chunk-causal"])
def test_fp8_cache_staged_tiles_on_the_gpu(fp8_tiles, dtype, page_size, seqlen_q, causal, num_splits):
    """The staged form (the cache's bytes by cp.async, FP8_FRAGMENTS) as the numerics test
    above runs the default: GQA 8/2, ragged lengths (one shorter than a tile, one not a multiple of it, so
    that the zero-filled rows and the pipeline's epilogue are read), every byte value of e4m3."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    batch, heads_q, heads_kv, head_dim, capacity = 3, 8, 2, 64, 150
    k_cache, v_cache, table, kd, vd = make_fp8_cache(batch, capacity, heads_kv, head_dim, "cuda", page_size,
                                                     seed=seqlen_q + page_size, every_byte=True)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype).cuda()
    lengths = torch.tensor([150, 9, 77], dtype=torch.int32, device="cuda")
    poison_past_the_keys((k_cache, v_cache), table, lengths)
    out, lse = run_knobs(q, k_cache, v_cache, lengths, table, kd, vd, {"fp8_tiles": fp8_tiles}, causal=causal,
                         num_splits=num_splits, page_size=page_size)
    check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=causal, block_table=table)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_tiles", STAGED_TILES)
def test_fp8_cache_staged_tiles_of_several_warps_on_the_gpu(fp8_tiles):
    """GQA 6/2: a group of 3 heads takes 16 query tokens a task (``decode_query_tokens``), 48 rows, three
    warps, each converting the whole K and V tiles into its own fragments (FP8_FRAGMENTS)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    batch, heads_q, heads_kv, head_dim = 2, 6, 2, 64
    k_cache, v_cache, table, kd, vd = make_fp8_cache(batch, 200, heads_kv, head_dim, "cuda", seed=5)
    q = torch.randn(batch, 5, heads_q, head_dim, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    lengths = torch.tensor([200, 70], dtype=torch.int32, device="cuda")
    poison_past_the_keys((k_cache, v_cache), table, lengths)
    out, lse = run_knobs(q, k_cache, v_cache, lengths, table, kd, vd, {"fp8_tiles": fp8_tiles}, causal=True,
                         num_splits=2)
    check_fp8_decode(out, lse, q, k_cache, v_cache, lengths, kd, vd, causal=True, block_table=table)


def test_decode_error_is_the_decode_tests_check():
    """``decode_error`` (the tuner's) gives tests/test_decode_fp8.py's error on a sequence, and
    fails an output that is off by more than flash-attn's rule."""
    k8, v8, _, kd, vd = make_fp8_cache(1, 48, 2, 32, "cpu")
    q = torch.randn(1, 1, 4, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    lengths = torch.tensor([45], dtype=torch.int32)
    out, lse = tvmflash.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lengths, k_descale=kd, v_descale=vd,
                                                return_softmax_lse=True)
    error, allowed = decode_error(out, q, k8, v8, lengths, kd, vd)
    assert error == check_fp8_decode(out, lse, q, k8, v8, lengths, kd, vd, causal=False) and error <= allowed
    off = out.clone()
    off[0, 0, 0, 0] += 4 * allowed + 0.1
    assert decode_error(off, q, k8, v8, lengths, kd, vd)[0] > allowed
