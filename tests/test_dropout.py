"""Dropout (flash-attn's dropout_p): Philox4x32-10 against Random123's known answers and a numpy
reference of the rule written here; the kernels drop the entries that ``tvmflash.dropout.dropout_kept``
names, forward and backward, dense and varlen, against float64 attention with that mask; the mask's
statistics; seeds and offsets from torch's generator; S_dmask; the refusals."""

import math
import re

import numpy as np
import pytest
import torch

import tvmflash
from tvmflash import dropout
from tests.conftest import captured_in_a_cuda_graph, poisoned_out, random_qkv
from tests.reference import check_attention, check_gradients

HEADS = (4, 2)  # GQA
WORD = 0xFFFFFFFF
# Random123's kat_vectors for philox4x32_10: (counter, key, output)
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
              ((WORD,) * 4, (WORD, WORD), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
              ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
               (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def numpy_philox(counter, key):
    """Philox4x32-10 on numpy uint64 arrays of uint32 values (Salmon et al. 2011), written apart from
    tvmflash's: the four output words."""
    c = [np.asarray(x, dtype=np.uint64) for x in counter]
    k = [np.asarray(x, dtype=np.uint64) for x in key]
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]  # exact: below 2^64
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & np.uint64(WORD), (p0 >> np.uint64(32)) ^ c[3] ^ k[1],
             p0 & np.uint64(WORD)]
        k = [(k[0] + np.uint64(0x9E3779B9)) & np.uint64(WORD), (k[1] + np.uint64(0xBB67AE85)) & np.uint64(WORD)]
    return c


def numpy_kept(state, p, batch, heads, seqlen_q, seqlen_k):
    """The rule of ``program_dropout`` in numpy, entry by entry: (batch, heads, seqlen_q, seqlen_k) bool.
    state: (seed, offset) ints. Entry (r, c) is half c % 2 of word (r // 8 % 2) + 2 (c // 8 % 2) of the
    Philox call whose counter leaves bit 3 out of r and bits 0 and 3 out of c."""
    seed, offset = (int(x) % 2**64 for x in state)
    b, h, r, c = np.meshgrid(*(np.arange(n, dtype=np.uint64) for n in (batch, heads, seqlen_q, seqlen_k)),
                             indexing="ij")
    stream = (np.uint64(offset) + b * np.uint64(heads) + h)  # uint64, modulo 2^64

    r, c = r.astype(np.int64), c.astype(np.int64)
    row_counter = (r // 16) * 8 + r % 8  # without bit 3
    key_counter = (c // 16) * 4 + (c % 8) // 2  # without bits 0 and 3
    words = numpy_philox((row_counter, key_counter, stream & np.uint64(WORD), stream >> np.uint64(32)),
                         (np.uint64(seed & WORD), np.uint64(seed >> 32)))
    which = (r // 8) % 2 + 2 * ((c // 8) % 2)
    bits = np.choose(which, words) >> (16 * (c % 2)).astype(np.uint64) & np.uint64(0xFFFF)
    return bits >= math.ceil(float(np.float32(p)) * 2.0**16)


def test_philox_gives_random123s_known_answers():
    for counter, key, expected in PHILOX_KAT:
        assert [int(w) for w in numpy_philox(counter, key)] == list(expected)
        assert [int(w) for w in dropout.philox(counter, key)] == list(expected)


def test_dropout_kept_is_the_rule_written_in_numpy():
    """``dropout.dropout_kept`` (the torch reference the kernels are tested against) against the rule written
    apart here, for a seed with its high bit set and an offset that carries into the stream's high word;
    the eight entries that share a call take its eight 16-bit halves."""
    for state, p in [((-0x123456789ABCDEF, 2**32 - 3), 0.3), ((2**62 + 12345, 0), 0.9), ((7, 2**40), 0.05)]:
        seed = torch.tensor(state, dtype=torch.int64)
        expected = numpy_kept(state, p, 2, 3, 40, 37)
        assert torch.equal(dropout.dropout_mask(seed, p, 2, 3, 40, 37), torch.from_numpy(expected)), state


def dense_mask(seed, p, q, k):
    return dropout.dropout_mask(seed, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])


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
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    for p in (0.0, 0.1, 0.5, 0.9):
        kept = dropout.dropout_mask(seed, p, 2, 4, 256, 256).double()
        n = kept.numel()
        assert abs(kept.mean().item() - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, p
    kept = dropout.dropout_mask(seed, 0.5, 2, 4, 256, 256).double() - 0.5
    for shifted in (kept[..., 1:] * kept[..., :-1], kept[:, :, 1:] * kept[:, :, :-1], kept[:, 1:] * kept[:, :-1],
                    kept[1:] * kept[:-1]):
        assert abs(shifted.mean().item()) < 4 * 0.25 / math.sqrt(shifted.numel()), "correlated neighbours"
    for other_state in ([12345, 679], [12346, 678]):  # the next offset, another seed
        other = dropout.dropout_mask(torch.tensor(other_state), 0.5, 2, 4, 256, 256).double() - 0.5
        assert abs((kept * other).mean().item()) < 4 * 0.25 / math.sqrt(kept.numel())
    # (b, h) draws stream offset + b · heads + h: an offset 4 further (a call's batch · heads) moves it one batch
    shifted = dropout.dropout_mask(torch.tensor([12345, 678 + 4]), 0.5, 1, 4, 256, 256)
    assert torch.equal(shifted[0], dropout.dropout_mask(seed, 0.5, 2, 4, 256, 256)[1])


def check_kernel_keeps_dropout_kept(head_dim, dtype, device, seed, p=0.4, long=100):
    """The kernels' own bits, read out: with v one-hot over the keys, the forward's out[b, i, h, j] is
    P_ij · keep_ij / (1 - p); with dout one-hot over the queries, the backward's dv[b, j, h, i] is the same.
    Both nonzero exactly where ``dropout.dropout_kept`` keeps the entry (head_dim keys, resp. queries; ``long``
    of the other, so rows and keys pass bit 3 and beyond; heads 2/2)."""
    eye = torch.eye(head_dim, device=device, dtype=dtype)
    q, k, _ = random_qkv(2, long, head_dim, 2, 2, head_dim, dtype, device, scale=0.3)
    v = eye[None, :, None].expand(2, head_dim, 2, head_dim).contiguous()
    out = tvmflash.attention(q, k, v, dropout_p=p, dropout_seed=seed)
    assert torch.equal(out.permute(0, 2, 1, 3) != 0, dropout.dropout_mask(seed, p, 2, 2, long, head_dim))
    q, k, v = random_qkv(2, head_dim, long, 2, 2, head_dim, dtype, device, scale=0.3)
    v.requires_grad_()
    out = tvmflash.attention(q, k, v, dropout_p=p, dropout_seed=seed)
    out.backward(eye[None, :, None].expand(2, head_dim, 2, head_dim))
    assert torch.equal(v.grad.permute(0, 2, 3, 1) != 0, dropout.dropout_mask(seed, p, 2, 2, head_dim, long))


def test_the_cpu_kernels_keep_the_entries_dropout_kept_names():
    check_kernel_keeps_dropout_kept(32, torch.float32, "cpu", torch.tensor([-0x5DEECE66D, 2**32 - 2]))


def philox_calls(source: str) -> list[tuple[str, str]]:
    """(counter and key, word) of each call of the Philox helper in generated CUDA, the names of the
    simplifier's and CSE's variables (``rmod_12``, ``rdiv_7``, ``cse_v3``) made one, as nvcc sees equal values."""
    name, calls = "tvmflash_philox(", []
    start = source.find(name)
    while start >= 0:
        end, depth = start + len(name), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        arguments = re.sub(r"\b(rmod|rdiv|cse_v)_?\d+", r"\1", source[start + len(name):end - 1])
        if not arguments.startswith("unsigned"):  # the helper's definition
            calls.append(tuple(s.strip() for s in arguments.rsplit(",", 1)))
        start = source.find(name, end)
    return calls


def test_one_philox_call_serves_the_entries_a_thread_holds():
    """In sm90's wgmma kernels (cross-compiled: nothing runs) every Philox counter a thread computes is
    read for all four of its words: in the forward for eight entries (both halves of each word), in the
    backward (P transposed) for four, so nvcc computes one call for that many (``program_dropout``'s
    counter layout). (sm80's CUDA leaves the fragment loops for nvcc to unroll.)"""
    forward = tvmflash.compile(head_dim=128, dtype=torch.bfloat16, causal=True, target="sm90", dropout=True)
    backward = tvmflash.compile_backward(head_dim=128, dtype=torch.bfloat16, causal=True, target="sm90",
                                         dropout=True)
    for kernel, entries in ((forward, 8), (backward, 4)):
        calls = philox_calls(kernel.source(heads_q=4, heads_kv=2))
        words = {}
        for counter, word in calls:
            words.setdefault(counter, set()).add(word)
        assert calls and all(len(w) == 4 for w in words.values()), {len(w) for w in words.values()}
        if entries == 8:  # each entry one call site here: eight sites a counter
            assert len(calls) == 8 * len(words), (len(calls), len(words))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_with_dropout_on_cpu(dtype):
    """Dense, GQA 4/2, causal with seqlen_q != seqlen_k (bottom-right) and a row that sees no key: the
    kernels' out, lse and gradients against float64 with the same entries dropped."""
    seed = torch.tensor([7, 99], dtype=torch.int64)
    for n, (seqlen_q, seqlen_k) in enumerate([(70, 79), (130, 77)]):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, 32, dtype, "cpu", seed=n)
        check_autograd(q, k, v, 0.25, seed, causal=True)


def test_dropout_with_every_variant_and_the_kernel_api():
    """A window, softcap and ALiBi with dropout (float32), through ``compile`` and ``compile_backward``
    (outputs poisoned): the same entries dropped forward and backward, and the p of the call used."""
    seed = torch.tensor([-3, 2**32 - 1], dtype=torch.int64)  # the seed's high word set, the offset's carry
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
    seed = dropout.philox_state(q.device, 3 * HEADS[0])
    assert s_dmask.shape == (3, HEADS[0], max(lengths_q), max(lengths_k))
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(3):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t.detach()[None, r] for t, r in ((q, rows), (k, cols), (v, cols)))
        mask = dropout.dropout_kept(seed, p, HEADS[0], b, torch.arange(HEADS[0])[:, None, None],
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
    mask = dense_mask(dropout.philox_state(q.device, 2 * HEADS[0]), 0.2, q, k)
    probabilities = torch.softmax((torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / math.sqrt(32))
                                  .masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf), -1)
    assert torch.allclose(s_dmask.abs(), probabilities, atol=1e-6)
    visible = probabilities > 0
    assert torch.equal(s_dmask[visible] > 0, mask[visible])
    assert tvmflash.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_the_cpu_draw_is_torch_generators():
    """On the CPU (a Mersenne-twister generator, no Philox offset) seed and offset are drawn from torch's
    generator: torch.manual_seed repeats them, the next call draws others."""
    torch.manual_seed(3)
    first, second = dropout.philox_state(torch.device("cpu"), 8), dropout.philox_state(torch.device("cpu"), 8)
    torch.manual_seed(3)
    assert torch.equal(dropout.philox_state(torch.device("cpu"), 8), first) and not torch.equal(first, second)
    assert first.dtype == torch.int64 and first.shape == (2,) and bool((first >= 0).all())


def test_dropout_refusals():
    q, k, v = random_qkv(1, 8, 8, 2, 2, 32, torch.float32, "cpu")
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dropout_p: expected 0 <= dropout_p < 1"):
            tvmflash.flash_attn_func(q, k, v, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p: expected a float"):
        tvmflash.attention(q, k, v, dropout_p="0.1")
    with pytest.raises(ValueError, match=r"dropout_seed: expected an int64 tensor \(seed, offset\) of shape \(2,\)"):
        tvmflash.attention(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int32))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        pages = torch.zeros(1, 16, 2, 32)
        tvmflash.flash_attn_varlen_func(q[0], pages, pages, cu, cu, 8, 8, dropout_p=0.1,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32))
    plain = tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu")
    with pytest.raises(ValueError, match="compiled without dropout"):
        plain(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="compiled with dropout"):
        tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu", dropout=True)(q, k, v)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16),
                                            (256, torch.bfloat16)], ids=str)
def test_attention_with_dropout_on_the_gpu(head_dim, dtype):
    """The default CUDA schedules (sm90's wgmma forward and backward on an H100) with dropout, causal and
    not, GQA: out, lse and gradients against float64 with the same entries dropped."""
    seed = torch.tensor([7, 99], dtype=torch.int64, device="cuda")
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


@pytest.mark.gpu
@pytest.mark.parametrize("sm90,dtype", [("1", torch.bfloat16), ("0", torch.bfloat16), ("1", torch.float32)],
                         ids=["sm90", "sm80", "simt-float32"])
def test_the_gpu_kernels_keep_the_entries_dropout_kept_names(sm90, dtype, monkeypatch):
    """sm90's wgmma kernels, sm80's mma.sync kernels and the SIMT kernels of float32 (forward and
    backward) drop exactly the entries of ``dropout_kept`` (``check_kernel_keeps_dropout_kept``)."""
    monkeypatch.setenv("TVMFLASH_SM90", sm90)
    check_kernel_keeps_dropout_kept(64, dtype, "cuda", torch.tensor([-0x5DEECE66D, 2**32 - 2], device="cuda"), long=300)


@pytest.mark.gpu
def test_the_seed_and_offset_are_the_cuda_generators():
    """Eagerly, as flash-attn's philox_cuda_state: the default CUDA generator's seed and Philox offset, the
    offset then advanced by batch · heads (rounded up to 4); torch.manual_seed repeats them."""
    device = torch.cuda.current_device()  # initialises CUDA, which fills default_generators
    generator = torch.cuda.default_generators[device]
    torch.manual_seed(1234)
    assert dropout.philox_state(torch.device("cuda"), 2 * 5).tolist() == [1234, 0] and generator.get_offset() == 12
    assert dropout.philox_state(torch.device("cuda"), 3).tolist() == [1234, 12] and generator.get_offset() == 16
    q, k, v = random_qkv(2, 64, 64, *HEADS, 64, torch.bfloat16, "cuda")
    torch.manual_seed(1234)
    out, lse, s_dmask = tvmflash.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    assert generator.get_offset() == 2 * HEADS[0]
    assert torch.equal(s_dmask > 0, dense_mask(torch.tensor([1234, 0], device="cuda"), 0.3, q, k))


@pytest.mark.gpu
def test_a_captured_cuda_graph_draws_new_bits_at_each_replay():
    """Under CUDA graph capture the seed is drawn on the device (a value read on the host would be frozen
    into the graph): each replay drops other entries."""
    q, k, v = random_qkv(2, 128, 128, *HEADS, 64, torch.bfloat16, "cuda")
    graph, out = captured_in_a_cuda_graph(lambda: tvmflash.flash_attn_func(q, k, v, dropout_p=0.2))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)
