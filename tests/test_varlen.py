"""flash-attn's varlen (sequences packed without padding, offsets in cu_seqlens on the device):
forward and gradients against the float64 reference run on each sequence alone, over odd lengths
with an empty sequence, a sequence without keys, seqlen_q != seqlen_k both ways, GQA, causal and a
window, and every variant at once (a window, softcap, ALiBi slopes per sequence); equality with the
dense kernel on equal lengths; the packed forms; torch.compile; the
checks of the arguments. The CPU tests share one module per variant (forward and backward)."""

import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import kv_loop_body, poisoned_out
from reference import check_attention, check_gradient_errors, gradient_references

import tvmflash

# (seqlen_q, seqlen_k) of each packed sequence: tails on both sides, no query, one query, no key,
# seqlen_q > seqlen_k (queries that see no key under causal)
LENGTHS = [(77, 200), (0, 5), (1, 129), (129, 129), (200, 77), (3, 0)]
GPU_LENGTHS = LENGTHS + [(1000, 1000), (300, 1000), (1000, 300)]  # the GPU's tiles are up to 128 x 128
HEADS = (4, 2)
CPU_DTYPE, CPU_HEAD_DIM = torch.float16, 32
# "alibi": slopes (batch, heads) drawn per problem, each sequence's row for its reference
VARIANTS = {"plain": {}, "causal": {"causal": True}, "window": {"window_size": (40, 7)},
            "all": {"causal": True, "window_size": (40, -1), "softcap": 3.0, "alibi": True}}
CAPPED = {"causal": True, "window_size": (40, -1), "softcap": 3.0}  # "all" but ALiBi (the CPU backward's)


def offsets(lengths, device):
    """cu_seqlens of ``lengths``: int32 (batch + 1,), 0 first."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_problem(lengths, heads, head_dim, dtype, device, seed=0):
    """q (total_q, heads_q, d), k, v (total_k, heads_kv, d), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k for ``lengths``, a list of (seqlen_q, seqlen_k)."""
    gen = torch.Generator().manual_seed(seed)
    lengths_q, lengths_k = zip(*lengths)
    q = torch.randn(sum(lengths_q), heads[0], head_dim, generator=gen)
    k = torch.randn(sum(lengths_k), heads[1], head_dim, generator=gen)
    v = torch.randn(sum(lengths_k), heads[1], head_dim, generator=gen)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    return q, k, v, offsets(lengths_q, device), offsets(lengths_k, device), max(lengths_q), max(lengths_k)


def sequence(t, cu, b):
    """Sequence b of the packed rows of t, as a batch of one: (1, seqlen, heads, d)."""
    return t[cu[b]:cu[b + 1]][None]


def options(name, batch, heads_q, device):
    """flash_attn_varlen_func's keyword arguments for VARIANTS[name], with ALiBi slopes (batch, heads_q)."""
    kwargs = dict(CAPPED if name == "capped" else VARIANTS[name])
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = (torch.rand(batch, heads_q, generator=torch.Generator().manual_seed(7)) * 0.3).to(device)
    return kwargs


def check_each_sequence(out, lse, q, k, v, cu_q, cu_k, alibi_slopes=None, **kwargs):
    """out and lse (heads, total_q) of every sequence against the float64 reference of that sequence
    alone (with its row of the ALiBi slopes), under flash-attn's rule."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] > cu_q[b]:
            slopes = None if alibi_slopes is None else alibi_slopes[b].cpu()
            check_attention(sequence(out, cu_q, b).cpu(), lse[None, :, cu_q[b]:cu_q[b + 1]].cpu(),
                            *(sequence(t, cu, b).cpu() for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k))),
                            alibi_slopes=slopes, **kwargs)


def forward_matches_float64(device, dtype, head_dim, name, lengths):
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(lengths, HEADS, head_dim, dtype, device)
    kwargs = options(name, len(lengths), HEADS[0], device)
    out, lse, probs = tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True,
                                                      **kwargs)
    assert probs is None and out.shape == q.shape and lse.shape == (HEADS[0], q.shape[0])
    check_each_sequence(out, lse, q, k, v, cu_q, cu_k, **kwargs)
    # a kept kernel writes into a given out, every row of it
    slopes = kwargs.pop("alibi_slopes", None)
    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, target="cpu" if device == "cpu" else None,
                              varlen=True, alibi=slopes is not None, **kwargs)
    given = poisoned_out(q)
    assert kernel(q, k, v, cu_q, cu_k, max_q, out=given, alibi_slopes=slopes) is given
    assert torch.equal(given, out)


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_matches_float64_on_cpu(name):
    forward_matches_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name, LENGTHS)


def gradients_match_float64(device, dtype, head_dim, name, lengths, with_lse, heads=HEADS):
    """Autograd through flash_attn_varlen_func (out, and lse with ``with_lse``) against float64
    autograd of the reference of each sequence alone, under flash-attn's rule over the packed gradients."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(lengths, heads, head_dim, dtype, device, seed=1)
    kwargs = options(name, len(lengths), heads[0], device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = tvmflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, return_attn_probs=True,
                                                  **kwargs)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse.detach()), 0) if with_lse else None
    torch.autograd.backward([out, lse] if with_lse else [out], [dout, dlse] if with_lse else [dout])
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    references = []  # each sequence's (float64, same-dtype) gradients
    for b in range(len(cu_q) - 1):
        inputs = [sequence(t, cu, b).cpu() for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
        seq_dlse = None if dlse is None else dlse[None, :, cu_q[b]:cu_q[b + 1]].cpu()
        seq_kwargs = {**kwargs, **({"alibi_slopes": kwargs["alibi_slopes"][b].cpu()} if "alibi_slopes" in kwargs else {})}
        references.append(gradient_references(*inputs, sequence(dout, cu_q, b).cpu(), seq_dlse, **seq_kwargs))
    # The rule over the packed gradients, as flash-attn's varlen tests apply it: alone, a sequence of
    # one query row makes torch's own error, the yardstick, a sample of a few elements.
    packed = [[torch.cat([refs[kind][i] for refs in references], dim=1)[0] for i in range(3)] for kind in range(2)]
    check_gradient_errors([t.grad.cpu() for t in leaves], *packed, dtype)


# causal on heads (2, 2), whose modules test_packed_forms shares; a window with GQA and dlse; every
# variant but ALiBi at once. ALiBi's varlen backward is the GPU tests' ("all"): on the CPU its build
# takes about 8 s (d32, a 2-core box; "capped" 4.5 s, the dense "all" 3 s), mostly LLVM codegen, too long
# for the CPU suite. (It took 30 s or more while the distance's abs was an integer select, three copies
# of each sequence's lengths loaded from cu_seqlens a score; binding those loads once a task, as
# uniformity.BindStepLoads would, made it no faster.)
@pytest.mark.parametrize("name,with_lse,heads", [("causal", False, (2, 2)), ("window", True, HEADS),
                                                 ("capped", False, HEADS)])
def test_gradients_match_float64_on_cpu(name, with_lse, heads):
    gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name, LENGTHS, with_lse, heads)


def test_equals_the_dense_kernel_on_equal_lengths():
    """Sequences of one length packed are a batch: the varlen kernel gives the dense kernel's
    output and lse bit for bit (the same tiles, in the same order)."""
    batch, seqlen_q, seqlen_k = 3, 70, 90
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem([(seqlen_q, seqlen_k)] * batch, HEADS, CPU_HEAD_DIM,
                                                       CPU_DTYPE, "cpu", seed=2)
    out, lse = tvmflash.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    dense_out, dense_lse = tvmflash.attention(q.view(batch, seqlen_q, *q.shape[1:]),
                                              k.view(batch, seqlen_k, *k.shape[1:]),
                                              v.view(batch, seqlen_k, *v.shape[1:]), causal=True, return_lse=True)
    assert torch.equal(out, dense_out.reshape(out.shape))
    assert torch.equal(lse, dense_lse.transpose(0, 1).reshape(lse.shape))


def test_new_lengths_need_no_rebuild():
    """One module serves every packing: a second call with other lengths and another batch builds
    nothing."""
    kernel = tvmflash.compile(head_dim=CPU_HEAD_DIM, dtype=CPU_DTYPE, target="cpu", varlen=True)
    for lengths in (LENGTHS, [(5, 9), (130, 60)]):
        q, k, v, cu_q, cu_k, max_q, _ = packed_problem(lengths, HEADS, CPU_HEAD_DIM, CPU_DTYPE, "cpu")
        out, lse = kernel(q, k, v, cu_q, cu_k, max_q, return_lse=True)
        check_each_sequence(out, lse, q, k, v, cu_q, cu_k)
        module = kernel.module(*HEADS)
    assert kernel.module(*HEADS) is module and len(kernel.info()["modules"]) == 1


def test_packed_forms():
    """flash_attn_varlen_qkvpacked_func and _kvpacked_func are flash_attn_varlen_func of their
    parts, and the gradient flows back into the packed tensor."""
    lengths = [(33, 33), (0, 0), (64, 64)]
    q, k, v, cu, _, max_len, _ = packed_problem(lengths, (2, 2), CPU_HEAD_DIM, CPU_DTYPE, "cpu", seed=3)
    expected = tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    out = tvmflash.flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, causal=True)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(tvmflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max_len, max_len, causal=True),
                       expected)


def test_torch_compile_traces_forward_and_backward():
    """fullgraph: the varlen custom ops trace without a graph break, forward and backward, and give
    eager's gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    # heads (2, 2): the causal gradient test's modules
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(LENGTHS, (2, 2), CPU_HEAD_DIM, CPU_DTYPE, "cpu", seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def loss(q, k, v, cu_q, cu_k):
        return tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    torch.compile(loss, fullgraph=True, backend=counter)(*leaves, cu_q, cu_k).backward()
    compiled = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss(*leaves, cu_q, cu_k).backward()
    assert counter.frame_count == 1
    for a, t in zip(compiled, leaves):
        torch.testing.assert_close(a, t.grad)

    # dynamic: the lengths traced as SymInts, one graph for two packings
    def attend(q, k, v, cu_q, cu_k, max_q, max_k):
        return tvmflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)

    dynamic = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    for lengths in (LENGTHS, [(5, 9), (130, 60)]):
        problem = packed_problem(lengths, (2, 2), CPU_HEAD_DIM, CPU_DTYPE, "cpu", seed=5)
        assert torch.equal(dynamic(*problem), attend(*problem))


def bad_arguments():
    """(change to the good arguments, error, message)."""
    return [
        ({"cu_seqlens_q": lambda a: a["cu_seqlens_q"].long()}, TypeError, "cu_seqlens_q: expected dtype torch.int32"),
        ({"cu_seqlens_k": lambda a: a["cu_seqlens_k"].tolist()}, TypeError, "cu_seqlens_k: expected an int32 tensor"),
        ({"cu_seqlens_k": lambda a: a["cu_seqlens_k"][:-1]}, ValueError, "cu_seqlens_k: expected offsets from 0 to"),
        ({"cu_seqlens_q": lambda a: a["cu_seqlens_q"][None]}, ValueError, r"cu_seqlens_q: expected shape \(batch \+ 1,\)"),
        ({"cu_seqlens_q": lambda a: a["cu_seqlens_q"].flip(0)}, ValueError, "cu_seqlens_q: expected offsets from 0"),
        ({"cu_seqlens_q": lambda a: torch.tensor([0, 5, 3, 6], dtype=torch.int32)}, ValueError,
         "cu_seqlens_q: expected non-decreasing offsets"),
        ({"cu_seqlens_q": lambda a: torch.tensor([0, 6], dtype=torch.int32)}, ValueError,
         "cu_seqlens_k: expected the shape of cu_seqlens_q"),
        ({"cu_seqlens_k": lambda a: a["cu_seqlens_k"].to("meta")}, ValueError,
         r"cu_seqlens_k: expected device cpu \(q's\), got meta"),
        ({"max_seqlen_q": lambda a: 5.0}, TypeError, "max_seqlen_q: expected an int"),
        ({"max_seqlen_k": lambda a: torch.tensor(5)}, TypeError, "max_seqlen_k: expected an int"),
        ({"max_seqlen_q": lambda a: -1}, ValueError, "max_seqlen_q: expected an int >= 0"),
        # a sequence longer than max_seqlen left rows uncomputed (136 of 200 wrong, or NaN)
        ({"max_seqlen_q": lambda a: a["max_seqlen_q"] - 1}, ValueError,
         "max_seqlen_q: expected at least the longest sequence's length in cu_seqlens_q, 4, got 3"),
        ({"max_seqlen_k": lambda a: 1}, ValueError,
         "max_seqlen_k: expected at least the longest sequence's length in cu_seqlens_k, 3, got 1"),
        ({"q": lambda a: a["q"][None]}, ValueError, r"q: expected 3 dims \(total_q, heads, head_dim\)"),
        ({"k": lambda a: a["k"][:, :1].expand(-1, 3, -1), "v": lambda a: a["v"][:, :1].expand(-1, 3, -1)}, ValueError, r"q: expected heads_q \(4\) to be a multiple of heads_kv \(3\)"),
        ({"v": lambda a: a["v"][:-1]}, ValueError, "v: expected the shape of k"),
        ({"block_table": lambda a: torch.zeros(2, 1, dtype=torch.int32)}, ValueError,
         r"k_cache: expected 4 dims, got shape \(6, 2, 32\)"),
        ({"dropout_p": lambda a: 1.0}, ValueError, "dropout_p: expected 0 <= dropout_p < 1"),
    ]


def paged(k, v, cu_k, page_size, seed=0):
    """The packed keys and values as flash-attn's paged cache: (k_pages, v_pages, block_table), each
    sequence's keys in the first rows of its pages, the pages in a random order with spare ones between."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    per_sequence = max(1, -(-max(lengths, default=1) // page_size))
    order = torch.randperm(2 * len(lengths) * per_sequence, generator=torch.Generator().manual_seed(seed))
    table = order[:len(lengths) * per_sequence].reshape(len(lengths), per_sequence).to(torch.int32)
    k_pages = k.new_full((order.numel(), page_size, *k.shape[1:]), float("nan"))  # unused rows: never read
    v_pages = v.new_full(k_pages.shape, float("nan"))
    for b, length in enumerate(lengths):
        for row in range(length):
            page, offset = table[b, row // page_size], row % page_size
            k_pages[page, offset], v_pages[page, offset] = k[cu_k[b] + row], v[cu_k[b] + row]
    return k_pages, v_pages, table.to(k.device)


@pytest.mark.parametrize("name", ["causal", "all"])
def test_paged_cache_matches_float64_on_cpu(name):
    """block_table: the packed queries over a paged cache (a prefill chunk in a serving engine), each
    sequence against the float64 reference of its own keys, masks bottom-right per sequence; the same
    as the contiguous varlen's output."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(LENGTHS, HEADS, CPU_HEAD_DIM, CPU_DTYPE, "cpu")
    kwargs = options(name, len(LENGTHS), HEADS[0], "cpu")
    k_pages, v_pages, table = paged(k, v, cu_k, page_size=16)
    out, lse, _ = tvmflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, block_table=table,
                                                  return_attn_probs=True, **kwargs)
    assert out.shape == q.shape and lse.shape == (HEADS[0], q.shape[0])
    check_each_sequence(out, lse, q, k, v, cu_q, cu_k, **kwargs)
    # a tile longer than needed changes nothing; autograd is refused
    more, more_lse, _ = tvmflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q + 5, max_k,
                                                        block_table=table, return_attn_probs=True, **kwargs)
    assert torch.equal(more, out) and torch.equal(more_lse, lse)
    with pytest.raises(NotImplementedError, match="block_table: the paged varlen forward has no backward"):
        tvmflash.flash_attn_varlen_func(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, max_q, max_k,
                                        block_table=table, **kwargs)
    with pytest.raises(ValueError, match="max_seqlen_q: expected at least the longest sequence's length"):
        tvmflash.flash_attn_varlen_func(q.detach(), k_pages, v_pages, cu_q, cu_k, max_q - 1, max_k,
                                        block_table=table, **kwargs)


@pytest.mark.parametrize("change,error,message", bad_arguments())
def test_bad_arguments_name_the_argument(change, error, message):
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem([(2, 3), (4, 3)], HEADS, CPU_HEAD_DIM, CPU_DTYPE, "cpu")
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
            "max_seqlen_k": max_k}
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(error, match=message):
        tvmflash.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "dense"])
def test_sm90_q_tile_is_fenced_for_wgmma_after_its_stores(varlen):
    """On sm90 the threads store the Q tile to shared memory and wgmma (the async proxy) reads it: a
    fence.proxy.async and a barrier must come after the last of those stores and before the K/V
    pipeline starts. Under varlen's early-return test (``loops_and_blocks.RunBlocksIf``) the fence went in
    before the test, ahead of the stores, and on the H200 some Q blocks then read a stale tile
    (d128 causal, 8 x 2048 tokens: errors up to 0.14 in 3 of 8 sequences; tree 9e96fc7). Heads 4/2: the
    dense module is the cross-compile tests' (tests/test_generated_cuda.py's sm90-d128-causal)."""
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", causal=True, varlen=varlen).source(4, 2)
    kernel = src[src.index("main_kernel(", src.index("__global__ void __launch_bounds__")):]
    first_copy = kernel.index("tvmflash_tma_load_5d(")
    last_q_load = kernel.rindex("Q_ptr", 0, first_copy)
    between = kernel[last_q_load:first_copy]
    assert "tvmflash_fence_proxy_async();" in between and "__syncthreads();" in between


def test_sm90_dkdv_waits_for_dv_before_writing_ds_where_threads_copy_the_q_block():
    """With the threads' copies of the Q block (varlen's; no TMA), TVM's shared-memory planner gives dsᵀ's
    tile the bytes of dout's, whose last reader in program order is dv's wgmma: dv's wgmma must be waited
    for before dsᵀ is written (FA3's order, dv still running under dq's share, is the TMA path's alone;
    here dq's share still runs under dk's, which ends both).
    Without the wait dv read dsᵀ for dout on an H100 (varlen d128 bf16: dv off by 2.9; tree 6657c87)."""
    src = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", varlen=True).source(4, 2)
    kernel = src[src.index("dkdv_kernel("):]
    dv = kernel.index("_rs_mma_async_sync_aligned_m64n128k16_f32_bf16_bf16_1_1_1(dv_acc")
    commit = kernel.index("tvm_builtin_ptx_wgmma_commit_group_commit_group_sync_aligned();", dv)
    ds_store = kernel.index("= *(nv_bfloat162*)(dSc_local_ptr", commit)
    assert "wgmma_wait_group" in kernel[commit:ds_store]


def test_cuda_schedules_build_varlen(monkeypatch):
    """The CUDA schedules take varlen (here, with no GPU: the source): the forward on sm80 (mma.sync),
    SIMT (float32) and sm90 (wgmma, TMA K/V tiles over the packed tensor, the output stored from the
    registers: the o_store knob's varlen value, ``sm90.knobs.FORWARD``), the sm80 and SIMT backward. Each kernel reads its sequence's
    offsets once (``lowering.uniformity.BindBlockUniformLoads``): the K/V loop reads no cu_seqlens, and a
    causal step tests its tile once, not each score (``HoistBlockIndexConditions``)."""
    sources = {
        "sm80": tvmflash.compile(head_dim=32, dtype="float16", target="sm80", causal=True, varlen=True),
        "simt": tvmflash.compile(head_dim=32, dtype="float32", target="sm80", window_size=(30, 5), varlen=True),
        "sm90": tvmflash.compile(head_dim=64, dtype="bfloat16", target="sm90", causal=True, varlen=True),
        "backward-sm80": tvmflash.compile_backward(head_dim=32, dtype="bfloat16", target="sm80", causal=True,
                                                   varlen=True),
        "backward-simt": tvmflash.compile_backward(head_dim=32, dtype="float32", target="sm80", varlen=True),
    }
    for name, kernel in sources.items():
        src = kernel.source(heads_q=4, heads_kv=2)
        assert "CuSeqlensQ" in src[src.index("__global__"):], name
        if not name.startswith("backward"):
            assert "CuSeqlens" not in kv_loop_body(src), name
    assert "mma.sync" in sources["sm80"].source() and "mma.sync" in sources["backward-sm80"].source()
    hopper = sources["sm90"]
    assert hopper.info()["schedule"] == "sm90" and hopper.knobs["o_store"] == "direct"
    src = hopper.source()
    assert "wgmma.mma_async" in src and "tvmflash_tma_load_5d" in src
    # the causal tile test (its last key inside the sequence's keys) once a step, not once a score: on
    # sm90 the score loops are unrolled, on sm80 the test sits in the K/V step itself
    tile_test = r"if \(\(\(\(kb \* (\d+)\) \+ \d+\) < \(cuseqlensk"
    assert len(re.findall(tile_test, kv_loop_body(src))) == 1
    step = [line for line in kv_loop_body(sources["sm80"].source()).split("\n") if line.strip()]
    top = len(step[0]) - len(step[0].lstrip())  # the indent of the K/V step's own statements
    assert any(re.match(" " * top + tile_test, line) for line in step)
    monkeypatch.setenv("TVMFLASH_SM90", "1")  # (given knobs take sm80's schedule on sm_90a without it)
    with pytest.raises(ValueError, match="varlen on the sm90 schedule takes"):
        tvmflash.compile(head_dim=64, dtype="bfloat16", target="sm90", varlen=True, knobs={"o_store": "staged"})


def test_sm90_varlen_masks_its_diagonal_tile_as_cheaply_as_dense():
    """varlen's masked K/V tile costs what the dense kernel's does. On the H200 (d64 causal, 8 x 2048
    tokens) it took 1.23x the dense time with 34% more instructions, from two things the test reads
    in the generated CUDA: the pipeline's last step tested its tile once a score, not once, because
    HoistIfThenElse kept a test on a let variable (the tile count) in the score loops
    (``uniformity._block_uniform``); and a score's bounds were joined by ``&&``, which nvcc compiled to
    a branch a score (``program.key_visible``: ``&``). (Heads 4/2: test_cuda_schedules_build_varlen's module.)"""
    src = tvmflash.compile(head_dim=64, dtype="bfloat16", target="sm90", causal=True, varlen=True).source(4, 2)
    tests = [line for line in src.split("\n") if line.lstrip().startswith("if (")]
    last_tile_tests = [line for line in tests if "kb_extent" in line and "threadIdx" not in line]
    assert len(last_tile_tests) == 1
    score_tests = [line for line in tests if "((int)threadIdx.x) & 3) * 2)" in line]
    assert score_tests and not any("&&" in line for line in score_tests)


# ------------------------------------------------------------------------------------------------
# GPU (the default schedules: on sm_90a sm90's wgmma for fp16/bf16, SIMT for float32)
GPU_CONFIGS = [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 32), (torch.bfloat16, 96)]


# Every variant on bf16 d128 and d96 (the 64-byte swizzle); plain and all on the others (each case a build
# in the GPU suite's five minutes)
GPU_FORWARD_CASES = ([(*config, name) for config in (GPU_CONFIGS[0], GPU_CONFIGS[3]) for name in VARIANTS]
                     + [(*config, name) for config in GPU_CONFIGS[1:3] for name in ("plain", "all")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name", GPU_FORWARD_CASES, ids=str)
def test_forward_matches_float64_on_the_gpu(dtype, head_dim, name):
    forward_matches_float64("cuda", dtype, head_dim, name, GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "all"])
def test_forward_on_the_sm80_schedule_on_the_gpu(monkeypatch, name):
    """On sm_90a varlen takes the sm90 schedule (fp16/bf16, d64 and up); the sm80 schedule's, which
    sm_80 GPUs run, here with TVMFLASH_SM90=0."""
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    forward_matches_float64("cuda", torch.bfloat16, 64, name, GPU_LENGTHS)


@pytest.mark.gpu
def test_a_max_seqlen_shorter_than_a_sequence_fails_on_the_gpu():
    """A sequence longer than max_seqlen_q left rows uncomputed (136 of 200, or NaN): on a GPU the
    device asserts the lengths, so the call fails. In a process of its own (the failed assertion ends
    its CUDA context), on the kernel of the forward tests (the disk cache's)."""
    script = """
import torch, tvmflash
q = torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, 199, 200)
torch.cuda.synchronize()
print("no error")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "no error" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "assert" in done.stderr.lower(), done.stderr[-2000:]


@pytest.mark.gpu
def test_paged_cache_matches_float64_on_the_gpu():
    """block_table on the GPU: the decode kernel over the pages (sm80's tensor cores), tiles of up to
    1000 query rows."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(GPU_LENGTHS, HEADS, 128, torch.bfloat16, "cuda")
    kwargs = options("all", len(GPU_LENGTHS), HEADS[0], "cuda")
    k_pages, v_pages, table = paged(k.cpu(), v.cpu(), cu_k.cpu(), page_size=64)
    out, lse, _ = tvmflash.flash_attn_varlen_func(q, k_pages.cuda(), v_pages.cuda(), cu_q, cu_k, max_q, max_k,
                                                  block_table=table.cuda(), return_attn_probs=True, **kwargs)
    check_each_sequence(out, lse, q, k, v, cu_q, cu_k, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name,with_lse", [
    (*GPU_CONFIGS[0], "plain", True), (*GPU_CONFIGS[0], "causal", False), (*GPU_CONFIGS[0], "window", True),
    (*GPU_CONFIGS[0], "all", False), (*GPU_CONFIGS[1], "all", True),
    (torch.bfloat16, 256, "all", True)], ids=str)  # d256: sm90's dkdv in two slices of the columns, by cp.async
def test_gradients_match_float64_on_the_gpu(dtype, head_dim, name, with_lse):
    gradients_match_float64("cuda", dtype, head_dim, name, GPU_LENGTHS, with_lse)


@pytest.mark.gpu
def test_equals_the_dense_kernel_on_the_gpu():
    """On equal lengths, the varlen kernel against the dense one (both the target's default: sm90
    on sm_90a, whose output the dense kernel stages through shared memory) under flash-attn's rule, and a CUDA graph replayed over new offsets of the same
    totals gives the new packing's output (the kernel reads the offsets on the device)."""
    batch, seqlen = 4, 500
    q, k, v, cu, _, max_len, _ = packed_problem([(seqlen, seqlen)] * batch, HEADS, 128, torch.bfloat16, "cuda")
    out, lse = tvmflash.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True, return_lse=True)
    check_each_sequence(out, lse, q, k, v, cu, cu, causal=True)
    dense = tvmflash.attention(*(t.view(batch, seqlen, *t.shape[1:]) for t in (q, k, v)), causal=True)
    assert (out.float() - dense.reshape(out.shape).float()).abs().max().item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    static_cu = cu.clone()
    with torch.cuda.graph(graph):
        graphed = tvmflash.varlen_attention(q, k, v, static_cu, static_cu, 2 * seqlen, 2 * seqlen, causal=True)
    static_cu.copy_(offsets([2 * seqlen, 0, seqlen, seqlen], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    expected = tvmflash.varlen_attention(q, k, v, static_cu, static_cu, 2 * seqlen, 2 * seqlen, causal=True)
    assert torch.equal(graphed, expected)
    assert math.isfinite(graphed.float().sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_long_packed_sequences_on_the_gpu(causal):
    """Sequences of 2k tokens and ragged ones, many Q blocks each (d128, the sm90 default on sm_90a):
    every sequence against float64. At these lengths a stale Q tile (wgmma reading it before the
    threads' stores were fenced for the async proxy) showed in some sequences and not others."""
    lengths = [(n, n) for n in (2048, 2048, 2048, 2048, 700, 2048, 1300)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(lengths, (8, 8), 128, torch.bfloat16, "cuda", seed=3)
    out, lse = tvmflash.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
    check_each_sequence(out, lse, q, k, v, cu_q, cu_k, causal=causal)
    for _ in range(3):  # the forward is deterministic: a race shows as a run that differs
        assert torch.equal(tvmflash.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal), out)


def test_tiles_past_their_sequence_run_nothing():
    """varlen's grid covers the longest sequence's rows; a tile past its own sequence's end returns at
    once (flash-attn's early return) instead of loading zeros and running a masked step: the
    forward's tile and the backward's dkdv and dq tiles carry ``RUNS_IF``, which the lowering
    (``loops_and_blocks.RunBlocksIf``) makes one test around the tile, uniform over its threads. Dense
    programs have no such test. (The numerics tests above run such tiles: lengths of 0 to 200.)"""
    import tvm

    from tvmflash import program, program_backward, program_forward
    from tvmflash.lowering import loops_and_blocks
    from tvmflash.lowering.annotations import RUNS_IF
    from tvmflash.lowering.ir import find

    def tiles(mod):
        return [block for func in mod.functions.values()
                for block in find(func.body, tvm.s_tir.SBlock, lambda n: n.name_hint == "tile")]

    for varlen in (True, False):
        spec = program.AttentionSpec(32, "float16", True, 2, 2, varlen=varlen)
        mod = tvm.IRModule({"main": program_forward.attention_forward(spec, 64, 64)})
        backward = program_backward.attention_backward(spec, 64, 64)
        for module, count in ((mod, 1), (backward, 2)):  # the forward's tile; dkdv's and dq's
            blocks = tiles(module)
            assert len(blocks) == count and all((RUNS_IF in block.annotations) == varlen for block in blocks)
            for block in tiles(loops_and_blocks.RunBlocksIf()(module)):
                guarded = isinstance(block.body, tvm.tirx.IfThenElse)
                assert guarded == varlen and RUNS_IF not in block.annotations
                if guarded:
                    assert block.body.condition.op.name == "tirx.tvm_thread_invariant"
