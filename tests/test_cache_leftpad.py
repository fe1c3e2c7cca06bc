"""flash_attn_with_kvcache's cache_leftpad against the float64 reference, as flash-attn 2's own test
(tests/test_flash_attn.py, test_flash_attn_kvcache with has_leftpad) treats it: sequence b attends to
the cache positions cache_leftpad[b] .. cache_seqlens[b] - 1 and the new keys, appended at
cache_seqlens[b]; its causal mask, window and ALiBi distances count from its first key (flash-attn's
``key_leftpad``: seqlen_k is cache_seqlens[b] - cache_leftpad[b] + the new keys); rotary takes the cache
positions cache_seqlens[b], ... as without a leftpad. Ragged lengths and leftpads (0, the whole length,
tile boundaries crossed), GQA, causal or not, one split and several, each output poisoned first; the
bits of an unpadded cache; the checks of the argument."""

import math

import pytest
import torch
from conftest import captured_in_a_cuda_graph, devices
from test_decode import check_decode, make_cache, random_q, sequence_kv
from test_rotary import check_rotary_decode

import tvmflash
from tvmflash.kernels import decode

HEAD_DIM, HEADS = 64, (4, 2)  # GQA
CAPACITY = 200  # past three of the CPU's 64-key tiles
# (cache_seqlens, cache_leftpad) of five sequences, flash-attn's draws' edges: an empty sequence, one whose
# padding is all of it (it sees only its new keys, or none), a full cache, and keys across tiles that
# start off a tile's boundary
LENGTHS = [0, 9, 70, 150, CAPACITY]
LEFTPADS = [0, 9, 3, 77, 30]
# (seqlen_q, causal, new keys): decode, chunks, speculative steps that append as many keys as queries
STEPS = [(1, False, 0), (3, False, 0), (4, True, 0), (1, False, 1), (3, True, 3), (2, False, 2)]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every decode call of the test writes into an output full of NaN (flash_attn_with_kvcache takes
    no ``out``): any element the kernel fails to write shows up."""
    call = decode.DecodeKernel.__call__

    def poisoned(self, q, *args, out=None, **kwargs):
        return call(self, q, *args, out=torch.full_like(q, math.nan) if out is None else out, **kwargs)

    monkeypatch.setattr(decode.DecodeKernel, "__call__", poisoned)


def leftpad_matches_float64(device, dtype, head_dim, heads, capacity, steps=STEPS, **variant):
    """Each step of ``steps`` (new k and v appended first where it has them) over the five sequences,
    one split, several and the automatic count, against the float64 reference over each sequence's
    keys; the cache holds the new keys at cache_seqlens, the rest as it was; ``variant``:
    flash_attn_with_kvcache's window_size, softcap, alibi_slopes."""
    scale = capacity / CAPACITY
    for n, (seqlen_q, causal, new) in enumerate(steps):
        cache_seqlens = torch.tensor([min(int(x * scale), capacity - new) for x in LENGTHS], dtype=torch.int32)
        cache_leftpad = torch.minimum(torch.tensor([int(x * scale) for x in LEFTPADS], dtype=torch.int32), cache_seqlens)
        batch = len(cache_seqlens)
        k_cache, v_cache, _ = make_cache(batch, capacity, heads[1], head_dim, dtype, device, seed=n)
        q = random_q(batch, seqlen_q, heads[0], head_dim, dtype, device, seed=n)
        k_new, v_new = (random_q(batch, new, heads[1], head_dim, dtype, device, seed=n + s) if new else None
                        for s in (10, 20))
        before = k_cache.clone()
        results = [tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens.to(device),
                                                    cache_leftpad=cache_leftpad.to(device), causal=causal,
                                                    num_splits=num_splits, return_softmax_lse=True, **variant)
                   for num_splits in (1, 3, 0)]
        for b, start in enumerate(cache_seqlens.tolist()):  # appended at cache_seqlens, as without a leftpad
            if new:
                assert torch.equal(k_cache[b, start:start + new], k_new[b]) and torch.equal(v_cache[b, start:start + new], v_new[b])
            assert torch.equal(k_cache[b, :start], before[b, :start]) and torch.equal(k_cache[b, start + new:], before[b, start + new:])
        check_decode(*results[0], q, k_cache, v_cache, cache_seqlens + new, causal=causal, more=results[1:],
                     cache_leftpad=cache_leftpad, **variant)


@pytest.mark.parametrize("device", devices())
def test_cache_leftpad_matches_float64(device, poisoned_outputs):
    """Decode, chunks and speculative steps (appending k and v), causal or not, GQA 4/2."""
    leftpad_matches_float64(device, torch.float16, HEAD_DIM, HEADS, CAPACITY)


@pytest.mark.parametrize("device", devices())
def test_cache_leftpad_with_a_window_and_alibi(device, poisoned_outputs):
    """A window (both edges: its left one skips tiles) and ALiBi slopes per sequence, their distances from
    each sequence's first key (flash-attn's construct_local_mask and attn_bias_from_alibi_slopes with
    key_leftpad): one module, so not causal (causal would drop the right edge, another module)."""
    slopes = (torch.rand(len(LENGTHS), HEADS[0], generator=torch.Generator().manual_seed(0)) * 0.3).to(device)
    leftpad_matches_float64(device, torch.float16, HEAD_DIM, HEADS, CAPACITY,
                            steps=[s for s in STEPS if not s[1]], window_size=(70, 2), alibi_slopes=slopes)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad_with_rotary(device, causal):
    """Rotary at the cache positions cache_seqlens[b], ... (flash-attn's kernel offsets cos/sin by the
    leftpad back to them, and its test rotates at cache_seqlens): a leftpad moves no position."""
    check_rotary_decode(device, torch.float16, interleaved=True, rotary_dim=32, seqlen_q=3, causal=causal,
                        cache_leftpad=True)


@pytest.mark.parametrize("device", devices())
def test_a_padded_cache_gives_the_bits_of_an_unpadded_one(device):
    """Keys after cache_leftpad[b] rows of padding (garbage, never read) give the bits of the same keys from
    row 0 with no leftpad: the tiles start at each sequence's first key; and a leftpad of 0 is none."""
    dtype, capacity = torch.float16, 150  # the modules of the tests above
    lengths = torch.tensor([150, 64, 1, 99], dtype=torch.int32)
    cache_leftpad = torch.tensor([50, 13, 0, 35], dtype=torch.int32)
    k_cache, v_cache, _ = make_cache(len(lengths), capacity, HEADS[1], HEAD_DIM, dtype, device)
    k_plain, v_plain = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for b, (length, pad) in enumerate(zip(lengths.tolist(), cache_leftpad.tolist())):
        k_plain[b, :length - pad], v_plain[b, :length - pad] = k_cache[b, pad:length], v_cache[b, pad:length]
    q = random_q(len(lengths), 3, HEADS[0], HEAD_DIM, dtype, device)
    for num_splits in (1, 3):
        padded = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.to(device),
                                                  cache_leftpad=cache_leftpad.to(device), causal=True,
                                                  num_splits=num_splits, return_softmax_lse=True)
        plain = tvmflash.flash_attn_with_kvcache(q, k_plain, v_plain, cache_seqlens=(lengths - cache_leftpad).to(device),
                                                 causal=True, num_splits=num_splits, return_softmax_lse=True)
        assert torch.equal(padded[0], plain[0]) and torch.equal(padded[1], plain[1])
        zero = tvmflash.flash_attn_with_kvcache(q, k_plain, v_plain, cache_seqlens=(lengths - cache_leftpad).to(device),
                                                cache_leftpad=torch.zeros_like(lengths).to(device), causal=True,
                                                num_splits=num_splits, return_softmax_lse=True)
        assert torch.equal(zero[0], plain[0]) and torch.equal(zero[1], plain[1])


def test_a_kernel_takes_cache_leftpad_exactly_when_compiled_with_leftpad():
    """compile_decode(leftpad=True): each call takes cache_leftpad, and only such a kernel; a paged cache
    takes none (flash-attn's rule)."""
    k_cache, v_cache, _ = make_cache(2, 16, 1, HEAD_DIM, torch.float16, "cpu")
    q = random_q(2, 1, 2, HEAD_DIM, torch.float16, "cpu")
    lengths, rows = torch.tensor([3, 5], dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_leftpad: this kernel was compiled without leftpad"):
        tvmflash.compile_decode(head_dim=HEAD_DIM, dtype="float16", target="cpu")(
            q, k_cache, v_cache, lengths, rows, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    kernel = tvmflash.compile_decode(head_dim=HEAD_DIM, dtype="float16", target="cpu", leftpad=True)
    with pytest.raises(ValueError, match=r"cache_leftpad: this kernel was compiled with leftpad: pass cache_leftpad"):
        kernel(q, k_cache, v_cache, lengths, rows)
    assert kernel.info()["leftpad"] and "leftpad=True" in repr(kernel)
    with pytest.raises(ValueError, match="leftpad: a paged cache takes no cache_leftpad"):
        tvmflash.compile_decode(head_dim=HEAD_DIM, dtype="float16", target="cpu", page_size=16, leftpad=True)


@pytest.mark.parametrize("schedule", ["sm80", "simt"])
def test_cuda_leftpad_source_builds(schedule):
    """Each GPU decode schedule maps the program with cache_leftpad as it is (no GPU here: the CUDA
    source, through nvcc where it is installed, with no stack frame and no spill): the leftpad a kernel
    parameter, read once into the task's registers and added to the cache positions it loads."""
    import shutil

    from conftest import ptxas_report

    kernel = tvmflash.compile_decode(head_dim=128, dtype="bfloat16", target="sm90", leftpad=True, schedule=schedule)
    src = kernel.source(heads_q=32, heads_kv=8)
    for name in ("split_kernel", "single_kernel"):
        signature = src[src.index(f"{name}("):src.index(")", src.index(f"{name}("))]
        assert "CacheLeftpad_ptr" in signature, signature
    assert "bounds_local_ptr[3] = min(max(CacheLeftpad_ptr[" in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    report = ptxas_report(src, "sm_90a")
    for name in ("single_kernel", "split_kernel"):
        assert "0 bytes stack frame, 0 bytes spill stores" in report[name], report[name]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sm80", "simt"])
def test_cache_leftpad_on_the_gpu(schedule, monkeypatch, poisoned_outputs):
    """GQA 32/8 at head_dim 128 in bf16 on either schedule (TVMFLASH_DECODE): the steps of the CPU test
    over a cache of 1000, with and without a window and ALiBi."""
    monkeypatch.setenv("TVMFLASH_DECODE", schedule)
    leftpad_matches_float64("cuda", torch.bfloat16, 128, (32, 8), 1000)
    slopes = torch.rand(len(LENGTHS), 32, generator=torch.Generator().manual_seed(0)).cuda() * 0.3
    leftpad_matches_float64("cuda", torch.bfloat16, 128, (32, 8), 1000, steps=[s for s in STEPS if not s[1]],
                            window_size=(300, 5), alibi_slopes=slopes)


@pytest.mark.gpu
def test_cache_leftpad_in_a_cuda_graph():
    """cache_leftpad is read on the device: a decode step captured once replays with new leftpads (and
    lengths), each replay against the reference over the cache as it then is."""
    dtype, batch, capacity = torch.bfloat16, 3, 700
    k_cache, v_cache, _ = make_cache(batch, capacity, 8, 128, dtype, "cuda")
    cache_seqlens = torch.tensor([10, 100, 200], dtype=torch.int32, device="cuda")
    cache_leftpad = torch.zeros(batch, dtype=torch.int32, device="cuda")
    q = random_q(batch, 1, 32, 128, dtype, "cuda")
    k_new, v_new = (random_q(batch, 1, 8, 128, dtype, "cuda", seed=s) for s in (3, 4))

    def step():
        return tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                cache_leftpad=cache_leftpad, return_softmax_lse=True)

    graph, (out, lse) = captured_in_a_cuda_graph(step)
    for lengths, pads in (([10, 100, 200], [3, 0, 199]), ([500, 0, 698], [250, 0, 1]), ([64, 65, 66], [64, 1, 0])):
        cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        cache_leftpad.copy_(torch.tensor(pads, dtype=torch.int32))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        for b, length in enumerate(lengths):  # the appended token is in the cache
            assert torch.equal(sequence_kv(k_cache, v_cache, b, capacity)[0][0, length], k_new[b, 0])
        check_decode(out, lse, q, k_cache, v_cache, torch.tensor(lengths) + 1, causal=False,
                     cache_leftpad=torch.tensor(pads))
