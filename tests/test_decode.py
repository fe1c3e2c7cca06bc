"""Decode over a KV cache (tvmflash.flash_attn_with_kvcache, Flash-Decoding) against a float64
reference under flash-attn's error rule: contiguous and paged caches, ragged lengths, chunks of
queries (causal or not), GQA/MQA, split counts, appending k/v, cache_batch_idx, no recompile for a
new length, CUDA graphs (GPU) and bad input (cache_leftpad: tests/test_cache_leftpad.py)."""

import math
import subprocess

import pytest
import torch
from conftest import devices
from reference import check_attention, max_error, reference, torch_same_dtype

import tvmflash
from tvmflash import lowering
from tvmflash.kernels import decode

HEAD_DIM = 64
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_cache(batch, capacity, heads_kv, head_dim, dtype, device, page_size=0, seed=0, extra_rows=0):
    """(k_cache, v_cache, block_table or None) holding ``capacity`` keys per sequence: contiguous
    (batch + extra_rows rows), or paged with the pages of all sequences shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    if not page_size:
        shape = (batch + extra_rows, capacity, heads_kv, head_dim)
        return (torch.randn(shape, generator=gen).to(dtype=dtype, device=device),
                torch.randn(shape, generator=gen).to(dtype=dtype, device=device), None)
    pages_per_seq = -(-capacity // page_size)
    num_pages = batch * pages_per_seq + 3  # a few pages no sequence uses
    shape = (num_pages, page_size, heads_kv, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    return k, v, table.to(dtype=torch.int32, device=device)


def sequence_kv(k_cache, v_cache, b, length, block_table=None, cache_batch_idx=None, start=0):
    """The keys and values of sequence b at cache positions ``start`` .. ``length`` - 1 (flash-attn's
    cache_leftpad .. cache_seqlens - 1), (1, length - start, heads_kv, head_dim)."""
    if block_table is not None:
        pages = block_table[b].long()
        k = k_cache[pages].flatten(0, 1)
        v = v_cache[pages].flatten(0, 1)
    else:
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        k, v = k_cache[row], v_cache[row]
    return k[None, start:length], v[None, start:length]


def check_decode(out, lse, q, k_cache, v_cache, lengths, *, causal, block_table=None, cache_batch_idx=None,
                 softmax_scale=None, more=(), cache_leftpad=None, **variant):
    """Each sequence against the float64 reference over its visible keys (flash-attn's rule); ``more``:
    further (out, lse) pairs of the same problem, checked against the same references. cache_leftpad:
    sequence b's keys are at cache positions cache_leftpad[b] .. lengths[b] - 1; ``variant``:
    ``reference``'s window_size, softcap and alibi_slopes ((heads_q,) or (batch, heads_q))."""
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    block_table = None if block_table is None else block_table.cpu()
    cache_batch_idx = None if cache_batch_idx is None else cache_batch_idx.cpu()
    results = [(out.cpu(), lse.cpu()) for out, lse in [(out, lse), *more]]
    for out, lse in results:
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    q = q.cpu()
    slopes = variant.pop("alibi_slopes", None)
    for b, length in enumerate(lengths.tolist()):
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        k, v = sequence_kv(k_cache, v_cache, b, length, block_table, cache_batch_idx, start)
        if slopes is not None:  # the sequence's row of the slopes
            variant["alibi_slopes"] = slopes.cpu().expand(q.shape[0], -1)[b]
        ref_out, ref_lse = reference(q[b:b + 1], k, v, causal=causal, softmax_scale=softmax_scale, **variant)
        theirs = max_error(torch_same_dtype(q[b:b + 1], k, v, causal=causal, softmax_scale=softmax_scale, **variant),
                           ref_out)
        seen = torch.isfinite(ref_lse)
        for out, lse in results:
            ours = max_error(out[b:b + 1], ref_out)
            assert torch.isfinite(out[b:b + 1]).all(), f"sequence {b}: out has NaN/inf"
            assert ours <= 2 * theirs + 1e-5, f"sequence {b} ({length} keys): out error {ours:.3e} > 2 x torch's {theirs:.3e}"
            assert torch.equal(torch.isfinite(lse[b:b + 1]), seen), f"sequence {b}: lse -inf exactly where no key is seen"
            assert (lse[b:b + 1][~seen] == -math.inf).all()
            if seen.any():
                error = max_error(lse[b:b + 1][seen], ref_lse[seen])
                assert error <= 1e-4 * (1 + ref_lse[seen].abs().max().item()), f"sequence {b}: lse error {error:.3e}"


def random_q(batch, seqlen_q, heads_q, head_dim, dtype, device, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen) * scale).to(dtype=dtype, device=device)


def poisoned(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_float64(device, dtype, page_size):
    """Decode (one query token) and chunks (three or four, causal or not), ragged lengths with an
    empty sequence and a full one, GQA 4/2 or MQA 4/1 (each dtype and cache layout meets both over the
    cases: a head count is a module of its own), one split and several, each output poisoned first; the
    split-count heuristic (num_splits=0) too."""
    capacity = 200
    lengths = torch.tensor([0, 1, 77, 129, capacity], dtype=torch.int32)
    batch = len(lengths)
    both = [(4, 2), (4, 1)]
    for heads_q, heads_kv in [both[(page_size == 16) ^ (DTYPES.index(dtype) % 2)]]:
        k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, HEAD_DIM, dtype, device, page_size)
        kernel = tvmflash.compile_decode(head_dim=HEAD_DIM, dtype=dtype, page_size=page_size,
                                         target="cpu" if device == "cpu" else None)
        index = table if page_size else kernel.batch_rows(batch, torch.device(device))
        for seqlen_q, causal in [(1, False), (3, False), (4, True)]:
            q = random_q(batch, seqlen_q, heads_q, HEAD_DIM, dtype, device, seed=seqlen_q)
            results = [kernel(q, k_cache, v_cache, lengths.to(device), index, num_splits=num_splits, causal=causal,
                              out=poisoned(q)) for num_splits in (1, 3, 0)]
            check_decode(*results[0], q, k_cache, v_cache, lengths, causal=causal, block_table=table, more=results[1:])


def test_tensor_core_program_matches_float64_on_cpu(monkeypatch):
    """The program the tensor-core schedule maps (``decode_split(tensor_cores=True)``: query rows in q's
    dtype, P cast to it for P V) runs here on the CPU's schedule, so CI checks its numerics: decode and
    a causal chunk, GQA 4/2, ragged lengths, one split and several, against float64."""
    import dataclasses

    from tvmflash import schedules
    from tvmflash.schedules.contract import DecodeTasks

    cpu = schedules.SCHEDULES["cpu"]
    tensor_cores = dataclasses.replace(cpu.decode, tasks=DecodeTasks(tensor_cores=True))
    monkeypatch.setitem(schedules.SCHEDULES, "cpu", dataclasses.replace(cpu, decode=tensor_cores))
    kernel = tvmflash.DecodeKernel(HEAD_DIM, "bfloat16", 16, tvmflash.target.resolve("cpu"), None)
    assert kernel.tensor_cores
    capacity, dtype = 100, torch.bfloat16
    lengths = torch.tensor([0, 1, 63, capacity], dtype=torch.int32)
    k_cache, v_cache, table = make_cache(len(lengths), capacity, 2, HEAD_DIM, dtype, "cpu", page_size=16)
    for seqlen_q, causal in [(1, False), (3, True)]:
        q = random_q(len(lengths), seqlen_q, 4, HEAD_DIM, dtype, "cpu", seed=seqlen_q)
        results = [kernel(q, k_cache, v_cache, lengths, table, num_splits=n, causal=causal, out=poisoned(q))
                   for n in (1, 3)]
        check_decode(*results[0], q, k_cache, v_cache, lengths, causal=causal, block_table=table, more=results[1:])


@pytest.mark.parametrize("device", devices())
def test_paged_and_contiguous_caches_agree(device):
    """The same keys in a contiguous cache and scattered over pages of 16 give the same bits."""
    dtype, batch, capacity, heads_kv = torch.bfloat16, 3, 96, 2
    k_pages, v_pages, table = make_cache(batch, capacity, heads_kv, HEAD_DIM, dtype, device, page_size=16)
    k_cache = torch.stack([sequence_kv(k_pages, v_pages, b, capacity, table)[0][0] for b in range(batch)])
    v_cache = torch.stack([sequence_kv(k_pages, v_pages, b, capacity, table)[1][0] for b in range(batch)])
    q = random_q(batch, 2, 4, HEAD_DIM, dtype, device)
    lengths = torch.tensor([5, 96, 50], dtype=torch.int32, device=device)
    for num_splits in (1, 4):
        paged = tvmflash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table,
                                                 causal=True, num_splits=num_splits, return_softmax_lse=True)
        contiguous = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                      num_splits=num_splits, return_softmax_lse=True)
        assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    # The entries past a sequence's last page are not read, as in flash-attn (Transformers' continuous
    # batching leaves -1 there): the same bits.
    ragged = table.clone()
    for b, length in enumerate(lengths.tolist()):
        ragged[b, -(-length // 16):] = -1
    out = tvmflash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=ragged, causal=True,
                                           num_splits=4)
    assert torch.equal(out, paged[0])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("page_size", [0, 32], ids=["contiguous", "paged32"])
def test_new_keys_are_appended_in_place(device, page_size):
    """k and v are written into the cache at cache_seqlens (which stays as it was), and attended to
    with the rest: the speculative-decoding step (three new tokens, causal)."""
    dtype, batch, capacity, heads_kv, new = torch.float16, 3, 100, 2, 3
    k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, HEAD_DIM, dtype, device, page_size)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor([0, 40, capacity - new], dtype=torch.int32, device=device)
    q = random_q(batch, new, 4, HEAD_DIM, dtype, device)
    k_new, v_new = (random_q(batch, new, heads_kv, HEAD_DIM, dtype, device, seed=s) for s in (7, 8))
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                block_table=table, causal=True, num_splits=2,
                                                return_softmax_lse=True)
    assert cache_seqlens.tolist() == [0, 40, capacity - new]
    for b, start in enumerate(cache_seqlens.tolist()):
        k_seq, v_seq = sequence_kv(k_cache, v_cache, b, capacity, table)
        old_k, old_v = sequence_kv(before_k, before_v, b, capacity, table)
        assert torch.equal(k_seq[0, start:start + new], k_new[b]) and torch.equal(v_seq[0, start:start + new], v_new[b])
        assert torch.equal(k_seq[0, :start], old_k[0, :start]) and torch.equal(k_seq[0, start + new:], old_k[0, start + new:])
        assert torch.equal(v_seq[0, start + new:], old_v[0, start + new:])
    if page_size:  # the pages no sequence owns are untouched
        unused = sorted(set(range(k_cache.shape[0])) - set(table.flatten().tolist()))
        assert torch.equal(k_cache[unused], before_k[unused])
    check_decode(out, lse, q, k_cache, v_cache, cache_seqlens + new, causal=True, block_table=table)


@pytest.mark.parametrize("device", devices())
def test_cache_batch_idx_and_int_lengths(device):
    """cache_batch_idx picks each sequence's cache row (and appends there); an int cache_seqlens is
    every sequence's; None is the whole cache."""
    dtype, batch, capacity = torch.bfloat16, 3, 64
    k_cache, v_cache, _ = make_cache(batch, capacity, 1, HEAD_DIM, dtype, device, extra_rows=2)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    q = random_q(batch, 1, 4, HEAD_DIM, dtype, device)
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33, cache_batch_idx=rows,
                                                return_softmax_lse=True)
    check_decode(out, lse, q, k_cache, v_cache, torch.full((batch,), 33), causal=False, cache_batch_idx=rows)
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    check_decode(out, lse, q, k_cache, v_cache, torch.full((batch,), capacity), causal=False)
    k_new = random_q(batch, 1, 1, HEAD_DIM, dtype, device, seed=5)
    tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=10, cache_batch_idx=rows)
    assert torch.equal(k_cache[rows.long(), 10], k_new[:, 0]) and torch.equal(v_cache[rows.long(), 10], k_new[:, 0])


@pytest.mark.parametrize("device", devices())
def test_large_scores_and_softmax_scale(device):
    """|q . k| * scale in the hundreds (the running max keeps exp2 finite) and a given scale; the
    splits' LSEs merge without overflow."""
    dtype, batch, capacity = torch.float32, 2, 300
    k_cache, v_cache, _ = make_cache(batch, capacity, 2, HEAD_DIM, dtype, device)
    q = random_q(batch, 1, 4, HEAD_DIM, dtype, device, scale=40.0)
    lengths = torch.tensor([300, 211], dtype=torch.int32, device=device)
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, softmax_scale=0.5,
                                                num_splits=5, return_softmax_lse=True)
    assert lse.abs().max() > 300  # exp(300) overflows float32: the max must come out first
    check_decode(out, lse, q, k_cache, v_cache, lengths, causal=False, softmax_scale=0.5)


def test_a_new_length_batch_chunk_or_split_count_never_rebuilds(monkeypatch):
    """After the first call, other lengths, batch sizes, chunk lengths and split counts run the same
    module: building again would raise."""
    dtype = torch.bfloat16
    k_cache, v_cache, _ = make_cache(4, 128, 2, HEAD_DIM, dtype, "cpu")
    q = random_q(2, 1, 4, HEAD_DIM, dtype, "cpu")
    tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)

    def no_build(*args, **kwargs):
        raise AssertionError("a decode step built a module")

    monkeypatch.setattr(lowering, "build", no_build)
    for batch, seqlen_q, length, num_splits in [(2, 1, 6, 0), (4, 1, 127, 3), (3, 2, 64, 1), (1, 4, 128, 7)]:
        q = random_q(batch, seqlen_q, 4, HEAD_DIM, dtype, "cpu")
        lengths = torch.full((batch,), length, dtype=torch.int32)
        out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                    num_splits=num_splits, return_softmax_lse=True)
        check_decode(out, lse, q, k_cache, v_cache, lengths, causal=True)


def test_a_second_process_loads_the_decode_module_from_disk(tmp_path, monkeypatch):
    """DecodeKernel caches its module on disk as the forward's Kernel does: built here (in a fresh cache
    dir, nothing in memory), a second process loads it (one process, not two: each imports TVM and torch)."""
    import json
    import os
    import sys

    from tvmflash import kernels
    from tvmflash.kernels import build

    script = (
        "import json, torch, tvmflash\n"
        "kernel = tvmflash.compile_decode(head_dim=32, dtype='float32', page_size=16, target='cpu', heads_q=2, heads_kv=1)\n"
        "q, pages = torch.randn(1, 1, 2, 32), torch.randn(2, 16, 1, 32)\n"
        "out = tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=20, block_table=torch.tensor([[1, 0]], dtype=torch.int32))\n"
        "print(json.dumps({'info': kernel.info(), 'finite': bool(torch.isfinite(out).all())}))\n")
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_DECODE_KERNELS", {})
    monkeypatch.setattr(build, "_MODULES", {})
    printed = []
    exec(script, {"print": printed.append})  # noqa: S102 - the script the second process runs, here
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(tmp_path))
    runs = [json.loads(printed[0]), json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                                              text=True, check=True).stdout.strip().splitlines()[-1])]
    (first,), (second,) = (run["info"]["modules"].values() for run in runs)
    assert first["origin"] == "built" and second["origin"] == "disk cache" and first["path"] == second["path"]
    assert runs[0]["finite"] and runs[1]["finite"] and runs[0]["info"]["pass"] == "decode"


def test_one_split_runs_one_kernel_and_no_merge(monkeypatch):
    """num_splits=1 runs the module's ``single`` function alone, which writes the output and the LSE
    itself (no partial buffers, no merge); more splits run ``split`` then ``merge``. Both right."""
    kernel = tvmflash.compile_decode(head_dim=HEAD_DIM, dtype=torch.float32, target="cpu")
    k_cache, v_cache, _ = make_cache(3, 64, 1, HEAD_DIM, torch.float32, "cpu")
    lengths = torch.tensor([0, 5, 64], dtype=torch.int32)
    index = kernel.batch_rows(3, torch.device("cpu"))
    module = kernel.module(2, 1)
    calls = []

    def counted(name, function):
        def call(*args):
            calls.append(name)
            return function(*args)
        return call

    monkeypatch.setattr(module, "function", {name: counted(name, f) for name, f in module.function.items()})
    for seqlen_q, causal in [(1, False), (3, True)]:
        q = random_q(3, seqlen_q, 2, HEAD_DIM, torch.float32, "cpu")
        results = []
        for num_splits, functions in [(1, ["single"]), (2, ["split", "merge"])]:
            calls.clear()
            results.append(kernel(q, k_cache, v_cache, lengths, index, num_splits=num_splits, causal=causal,
                                  out=poisoned(q)))
            assert calls == functions
        check_decode(*results[0], q, k_cache, v_cache, lengths, causal=causal, more=results[1:])


def test_empty_problems():
    k_cache, v_cache, _ = make_cache(2, 16, 1, HEAD_DIM, torch.float16, "cpu")
    q = random_q(0, 1, 2, HEAD_DIM, torch.float16, "cpu")
    assert tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0).shape == q.shape
    q = random_q(2, 0, 2, HEAD_DIM, torch.float16, "cpu")
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, 0)


def test_choose_num_splits():
    """flash-attn's rule: no split when the tasks fill the device, splits that fill it in efficient
    waves otherwise, never more than the tiles or the cap."""
    assert decode.choose_num_splits(tasks=256, tiles=512, slots=264) == 1
    assert decode.choose_num_splits(tasks=8, tiles=512, slots=264) == 29  # 232 of 264 slots: 88% (85% of 33 splits' 100%)
    assert decode.choose_num_splits(tasks=8, tiles=3, slots=264) == 3
    assert decode.MAX_AUTO_SPLITS == 128  # the best is 128 splits: 109 reach 85% of its efficiency
    assert decode.choose_num_splits(tasks=1, tiles=4096, slots=10_000) == 109
    assert decode.choose_num_splits(tasks=8, tiles=0, slots=264) == 1


def bad_input_cases():
    """(keyword overrides, exception, message) for flash_attn_with_kvcache on a valid base call."""
    i32 = torch.int32
    return [
        ({"cache_seqlens": torch.tensor([3, 4], dtype=torch.int64)}, ValueError, r"cache_seqlens: expected int32 of shape \(2,\)"),
        ({"cache_seqlens": torch.tensor([3], dtype=i32)}, ValueError, r"cache_seqlens: expected int32 of shape \(2,\)"),
        ({"cache_seqlens": 3.0}, TypeError, "cache_seqlens: expected an int"),
        ({"cache_seqlens": torch.tensor([3, 17], dtype=i32)}, ValueError, r"cache_seqlens: expected lengths from 0 to the cache's 16"),
        ({"cache_seqlens": torch.tensor([3, -1], dtype=i32)}, ValueError, "cache_seqlens: expected lengths from 0"),
        ({"k_cache": torch.zeros(2, 16, 1, HEAD_DIM, dtype=torch.bfloat16)}, TypeError, r"k_cache: expected dtype torch.float16"),
        ({"v_cache": torch.zeros(2, 15, 1, HEAD_DIM, dtype=torch.float16)}, ValueError, r"v_cache: expected the shape of k_cache"),
        ({"k_cache": torch.zeros(2, 16, 2, HEAD_DIM, dtype=torch.float16), "v_cache": torch.zeros(2, 16, 2, HEAD_DIM, dtype=torch.float16),
          "q": torch.zeros(2, 1, 3, HEAD_DIM, dtype=torch.float16)}, ValueError, r"q: expected heads_q \(3\) to be a multiple of the cache's heads_kv \(2\)"),
        ({"q": torch.zeros(2, 1, 4, 48, dtype=torch.float16)}, ValueError, "head_dim"),
        ({"cache_batch_idx": torch.tensor([0, 2], dtype=i32)}, ValueError, "cache_batch_idx: expected cache row indices from 0 to 1"),
        ({"cache_batch_idx": torch.tensor([0, 1])}, ValueError, "cache_batch_idx: expected int32"),
        ({"v": None}, ValueError, "v: expected k and v both or neither"),
        ({"k": torch.zeros(2, 1, 2, HEAD_DIM, dtype=torch.float16), "v": torch.zeros(2, 1, 2, HEAD_DIM, dtype=torch.float16)},
         ValueError, r"k: expected shape \(batch, seqlen_new, heads_kv, head_dim\)"),
        ({"k": torch.zeros(2, 14, 1, HEAD_DIM, dtype=torch.float16), "v": torch.zeros(2, 14, 1, HEAD_DIM, dtype=torch.float16)},
         ValueError, "less the 14 new ones"),
        ({"num_splits": -1}, ValueError, "num_splits: expected an int from 0"),
        ({"causal": "yes"}, TypeError, "causal: expected True or False"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ({"cache_leftpad": torch.tensor([0, 1])}, ValueError, r"cache_leftpad: expected int32 of shape \(2,\)"),
        ({"cache_leftpad": torch.tensor([0], dtype=i32)}, ValueError, r"cache_leftpad: expected int32 of shape \(2,\)"),
        ({"cache_leftpad": [0, 1]}, TypeError, "cache_leftpad: expected an int32 tensor"),
        ({"cache_leftpad": torch.zeros(2, dtype=i32, device="meta")}, ValueError, "cache_leftpad: expected device cpu"),
        ({"cache_leftpad": torch.zeros(4, dtype=i32)[::2]}, ValueError, "cache_leftpad: expected a contiguous tensor"),
        ({"cache_leftpad": torch.tensor([0, -1], dtype=i32)}, ValueError,
         r"cache_leftpad: expected each sequence's first key from 0 to its cache_seqlens \[3, 3\], got \[0, -1\]"),
        ({"cache_leftpad": torch.tensor([4, 0], dtype=i32)}, ValueError,
         r"cache_leftpad: expected each sequence's first key from 0 to its cache_seqlens"),
    ]


@pytest.mark.parametrize("overrides,error,message", bad_input_cases())
def test_bad_input_names_the_argument(overrides, error, message):
    """A ValueError or TypeError naming the argument, raised before the cache is written to."""
    args = {"q": torch.zeros(2, 1, 4, HEAD_DIM, dtype=torch.float16),
            "k_cache": torch.zeros(2, 16, 1, HEAD_DIM, dtype=torch.float16),
            "v_cache": torch.zeros(2, 16, 1, HEAD_DIM, dtype=torch.float16), "cache_seqlens": 3,
            "k": torch.ones(2, 1, 1, HEAD_DIM, dtype=torch.float16), "v": torch.ones(2, 1, 1, HEAD_DIM, dtype=torch.float16)}
    args.update(overrides)
    with pytest.raises(error, match=message):
        tvmflash.flash_attn_with_kvcache(**args)
    assert not args["k_cache"].any() and not args["v_cache"].any()


def test_paged_cache_errors():
    q = torch.zeros(2, 1, 4, HEAD_DIM, dtype=torch.float16)
    pages = torch.zeros(5, 24, 1, HEAD_DIM, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size: expected a power of two >= 16, got 24"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table)
    pages = torch.zeros(5, 16, 1, HEAD_DIM, dtype=torch.float16)
    # a page past the cache (flash-attn raises): >= the number of pages, or negative, among the pages a
    # sequence's keys fill; read on the CPU (on a GPU the kernel clamps it into the cache instead: checking it
    # would wait for the device)
    with pytest.raises(ValueError, match="block_table: expected page indices from 0 to 4, got values from 2 to 5"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=20, block_table=table + 2)
    with pytest.raises(ValueError, match="block_table: expected page indices from 0 to 4, got values from -1 to 1"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table - 1)
    with pytest.raises(ValueError, match="cache_batch_idx: a paged cache"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table,
                                         cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad: a paged cache .*We don.t support Paged KV and leftpad"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table,
                                         cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table: expected int32"):
        tvmflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=table.long())
    with pytest.raises(ValueError, match="k_cache: expected a contiguous tensor"):
        tvmflash.flash_attn_with_kvcache(q, pages[:, ::2], pages[:, ::2], cache_seqlens=3)


ROUTED_CASES = [(1, {}), (3, {"causal": True}), (16, {"window_size": (100, 0)}),
                (5, {"causal": True, "softcap": 5.0, "alibi": True})]


def routed_calls_match_float64(device, dtype, monkeypatch, route=None, cases=ROUTED_CASES):
    """attention() and flash_attn_func() on decode-shaped problems (1 to 16 query rows over 600 keys, GQA,
    causal, a window, a softcap, ALiBi), poisoned nowhere (they return new tensors) but each against the
    float64 reference; ``route``: decode_shaped's answer forced (the CPU's: never on its own). Returns how
    many calls the decode kernel served."""
    from tvmflash import ops

    served = []
    decode_forward = ops.decode_forward
    monkeypatch.setattr(ops, "decode_forward", lambda *a, **k: served.append(1) or decode_forward(*a, **k))
    if route is not None:
        monkeypatch.setattr(ops, "decode_shaped", lambda q, k, v: route)
    for n, (seqlen_q, variant) in enumerate(cases):
        variant = dict(variant)
        q = random_q(2, seqlen_q, 8, HEAD_DIM, dtype, device, seed=n)
        k, v, _ = make_cache(2, 600, 2, HEAD_DIM, dtype, device, seed=n)
        if variant.pop("alibi", False):
            variant["alibi_slopes"] = torch.rand(8, generator=torch.Generator().manual_seed(n)).to(device) * 0.3
        out, lse = tvmflash.attention(q, k, v, return_lse=True, **variant)
        flash = tvmflash.flash_attn_func(q, k, v, **variant)
        slopes = variant.pop("alibi_slopes", None)
        causal = variant.pop("causal", False)
        for result in (out, flash):
            check_attention(result.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal=causal,
                            alibi_slopes=None if slopes is None else slopes.cpu(), **variant)
    return len(served)


def test_decode_shaped_calls_run_on_the_decode_kernel_on_cpu(monkeypatch):
    """A generation step through attention() or flash_attn_func (a few query rows over many keys) runs on
    the split-KV decode kernel on a GPU (``ops.decode_shaped``): forced here, the decode kernel gives the
    forward's answers; on the CPU the forward runs them on its own."""
    from tvmflash import ops

    assert not ops.decode_shaped(*(torch.zeros(2, n, h, HEAD_DIM) for n, h in ((1, 8), (600, 2), (600, 2))))
    assert routed_calls_match_float64("cpu", torch.float16, monkeypatch, cases=ROUTED_CASES[:1]) == 0
    assert routed_calls_match_float64("cpu", torch.float16, monkeypatch, route=True) == 8


@pytest.mark.gpu
def test_decode_shaped_calls_run_on_the_decode_kernel_on_the_gpu(monkeypatch):
    """On a GPU decode-shaped calls take the decode kernel on their own, and calls autograd records (the
    decode kernel has no backward), longer query blocks or strided keys the forward's."""
    from tvmflash import ops

    assert routed_calls_match_float64("cuda", torch.bfloat16, monkeypatch) == 8
    q = torch.zeros(2, 1, 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(2, 600, 2, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    assert ops.decode_shaped(q, k, k)
    assert not ops.decode_shaped(torch.zeros(2, 17, 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16), k, k)
    assert not ops.decode_shaped(q, k[:, :511], k[:, :511])
    assert not ops.decode_shaped(q, k.transpose(1, 2).contiguous().transpose(1, 2), k)
