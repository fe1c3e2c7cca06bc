"""flash-attn's variants (a sliding window, a softcap, ALiBi) in the forward, the backward and decode,
against the float64 reference under flash-attn's error rule: odd lengths, seqlen_q != seqlen_k both
ways, GQA, causal, and windows that leave some queries no key (0 and an LSE of -inf, gradients 0);
the API's checks of the options. Each variant is one module per program: the CPU tests share them
(the forward's by the forward and gradient tests) and keep to one head layout."""

import math

import pytest
import torch
from conftest import devices, poisoned_out, random_qkv
from reference import check_attention, check_gradients
from test_decode import check_decode, make_cache, random_q

import tvmflash
from tvmflash.kernels.checks import resolve_variant

# name: flash-attn's options, "alibi" standing for slopes of that shape ("heads": (heads,), "batch":
# (batch, heads)). Windows leave queries no key where seqlen_q > seqlen_k (the right edge).
VARIANTS = {
    "window": {"window_size": (5, 3)},
    "window-left-causal": {"causal": True, "window_size": (7, -1)},
    "window-right": {"window_size": (-1, 4)},
    # wider than a Q block and a K/V tile (the CPU's 64, the GPU's up to 128): unmasked tiles inside,
    # masked ones where the left edge crosses a block between its first row and its last
    "window-wide": {"window_size": (100, 70)},
    "window-wider": {"window_size": (300, 200)},
    "softcap": {"softcap": 5.0},
    "alibi-batch": {"alibi": "batch"},
    "causal-all": {"causal": True, "window_size": (20, -1), "softcap": 2.0, "alibi": "heads"},
    "all": {"window_size": (40, 10), "softcap": 3.0, "alibi": "batch"},
}
# (seqlen_q, seqlen_k): tails on both sides, one query, and seqlen_q > seqlen_k (queries that see no
# key under a causal mask or a right window edge)
LENGTHS = [(77, 200), (200, 77), (1, 129), (129, 129)]
GPU_LENGTHS = LENGTHS + [(1000, 1000), (300, 1000)]  # the GPU's tiles are up to 128 x 128
HEADS = (4, 2)
CPU_DTYPE, CPU_HEAD_DIM = torch.float16, 32


def options(variant, batch, heads_q, device, seed=0):
    """The keyword arguments of a variant (a value of ``VARIANTS``) for tvmflash.attention,
    flash_attn_func and flash_attn_with_kvcache, with ALiBi slopes (positive, as ALiBi's) drawn for
    ``batch`` and ``heads_q``."""
    kwargs = dict(variant)
    alibi = kwargs.pop("alibi", None)
    if alibi:
        shape = (heads_q,) if alibi == "heads" else (batch, heads_q)
        kwargs["alibi_slopes"] = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 0.3).to(device)
    return kwargs


def compile_options(kwargs):
    """compile()'s variant arguments for attention()'s keyword arguments."""
    return {"causal": kwargs.get("causal", False), "window_size": kwargs.get("window_size", (-1, -1)),
            "softcap": kwargs.get("softcap", 0.0), "alibi": "alibi_slopes" in kwargs}


def forward_matches_float64(device, dtype, head_dim, name):
    target = "cpu" if device == "cpu" else None
    for seqlen_q, seqlen_k in LENGTHS if device == "cpu" else GPU_LENGTHS:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, dtype, device, seed=seqlen_q)
        kwargs = options(VARIANTS[name], 2, HEADS[0], device, seed=seqlen_k)
        kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, target=target, **compile_options(kwargs))
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True, alibi_slopes=kwargs.get("alibi_slopes"))
        check_attention(out, lse, q, k, v, **kwargs)


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_matches_float64_on_cpu(name):
    forward_matches_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name)


# The GPU grids: every variant on the default schedules of bf16 d128 and fp16 d64 (on sm_90a: sm90),
# and the combined ones on the other schedules and head_dims (sm80 at d32, SIMT in float32, sm90 at
# d256 with one block an SM). One build each: 24 forward, 9 backward, 5 decode.
GPU_CONFIGS = [(torch.bfloat16, 128), (torch.float16, 64)]
GPU_OTHER_CONFIGS = [(torch.float16, 32), (torch.float32, 64), (torch.bfloat16, 256), (torch.bfloat16, 96)]


# Every variant on the first config; on the second the ones that combine them (each case one more build in
# the GPU suite's five minutes)
GPU_FORWARD_CASES = ([(*GPU_CONFIGS[0], name) for name in VARIANTS]
                     + [(*GPU_CONFIGS[1], name) for name in ("window-wide", "causal-all", "all")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name", GPU_FORWARD_CASES, ids=str)
def test_forward_matches_float64_on_the_gpu(dtype, head_dim, name):
    forward_matches_float64("cuda", dtype, head_dim, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name", [(*config, ("causal-all", "all")[n % 2])
                                                 for n, config in enumerate(GPU_OTHER_CONFIGS)], ids=str)
def test_forward_matches_float64_on_the_other_gpu_schedules(dtype, head_dim, name):
    forward_matches_float64("cuda", dtype, head_dim, name)


def gradients_match_float64(device, dtype, head_dim, name):
    """Autograd through tvmflash.attention (out and, every other shape, lse in the loss) against
    float64 autograd of the reference; the rows that see no key get zero gradients."""
    for n, (seqlen_q, seqlen_k) in enumerate(LENGTHS if device == "cpu" else GPU_LENGTHS):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, dtype, device, seed=seqlen_q)
        kwargs = options(VARIANTS[name], 2, HEADS[0], device, seed=seqlen_k)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = tvmflash.attention(*leaves, return_lse=True, **kwargs)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse) if n % 2 else None
        torch.autograd.backward([out, lse] if n % 2 else [out], [dout, dlse] if n % 2 else [dout])
        grads = [t.grad for t in leaves]
        unseen = ~torch.isfinite(lse.detach()).any(1)  # (batch, seqlen_q): rows no head of which sees a key
        assert torch.equal(grads[0][unseen], torch.zeros_like(grads[0][unseen]))
        check_gradients(grads, q, k, v, dout, dlse, **kwargs)


# The variants whose backward differs (both window edges, rows that see no key, unmasked tiles in a
# window, causal with a left edge, the softcap's derivative, ALiBi): each one more backward build in CI.
CPU_GRADIENT_VARIANTS = ["window", "window-right", "window-wide", "causal-all", "all"]


@pytest.mark.parametrize("name", CPU_GRADIENT_VARIANTS)
def test_gradients_match_float64_on_cpu(name):
    gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*CPU_GRADIENT_VARIANTS, "softcap"])
def test_gradients_match_float64_on_the_gpu(name):
    gradients_match_float64("cuda", *GPU_CONFIGS[0], name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal-all", "all"])
def test_gradients_at_d256_match_float64_on_the_gpu(name):
    """The variants' backward at head_dim 256 on an sm_90a GPU: sm90's dkdv in two slices of the columns
    (``dkdv_slices``), each recomputing p and ds under the mask, softcap and ALiBi."""
    gradients_match_float64("cuda", torch.bfloat16, 256, name)


@pytest.mark.parametrize("device", devices())
def test_a_window_skips_the_tiles_it_does_not_reach(device):
    """100 queries over 300 keys in a window of 16 to the left: query i sees keys 184 + i ... 200 + i,
    so no K/V tile of keys before 128 is visited. NaN values there leave the output as it was (a
    visited tile, even masked, would spread them: p v is 0 · NaN)."""
    q, k, v = random_qkv(1, 100, 300, 2, 2, 64, torch.bfloat16, device)
    window = {"causal": True, "window_size": (16, -1)}
    out, lse = tvmflash.attention(q, k, v, return_lse=True, **window)
    check_attention(out, lse, q, k, v, **window)
    v[:, :100] = float("nan")
    assert torch.equal(tvmflash.attention(q, k, v, **window), out)


def test_a_left_window_edge_of_0_is_kept():
    """window_size=(0, -1): a query sees the keys from its diagonal on, none before (a left edge of 0 is a
    bound, not "off"; ring attention's steps make such windows)."""
    q, k, v = random_qkv(1, 40, 56, 2, 2, 32, torch.float32, "cpu", seed=3)
    for window in ((0, -1), (0, 5)):
        out, lse = tvmflash.attention(q, k, v, window_size=window, return_lse=True)
        check_attention(out, lse, q, k, v, window_size=window)
    out, lse = tvmflash.flash_attn_with_kvcache(q[:, :3], k, v, window_size=(0, -1), return_softmax_lse=True)
    check_attention(out, lse, q[:, :3], k, v, window_size=(0, -1))  # decode: the same window
    assert resolve_variant(False, (0, -1)) == {"causal": False, "window_left": 0}
    assert resolve_variant(True, (0, -1)) == {"causal": True, "window_left": 0}


def test_flash_attn_api_takes_the_variants():
    """flash_attn_func and the packed forms take the variants, as tvmflash.attention does."""
    q, k, v = random_qkv(2, 33, 45, 4, 2, 32, CPU_DTYPE, "cpu")
    kwargs = options(VARIANTS["all"], 2, 4, "cpu")
    out, lse, probs = tvmflash.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert probs is None
    ref_out, ref_lse = tvmflash.attention(q, k, v, return_lse=True, **kwargs)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(tvmflash.flash_attn_kvpacked_func(q, kv, **kwargs), ref_out)


def test_torch_compile_traces_the_variants():
    """fullgraph: the custom ops take the window, softcap and slopes without a graph break, forward
    and backward (the modules of the tests above)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = random_qkv(2, 40, 40, *HEADS, CPU_HEAD_DIM, CPU_DTYPE, "cpu")
    kwargs = options(VARIANTS["causal-all"], 2, HEADS[0], "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def loss(q, k, v, alibi_slopes):
        return tvmflash.attention(q, k, v, causal=True, window_size=(20, -1), softcap=2.0,
                                  alibi_slopes=alibi_slopes).float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    torch.compile(loss, fullgraph=True, backend=counter)(*leaves, kwargs["alibi_slopes"]).backward()
    compiled = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss(*leaves, kwargs["alibi_slopes"]).backward()
    assert counter.frame_count == 1
    for a, t in zip(compiled, leaves):
        torch.testing.assert_close(a, t.grad)


def test_variants_build_cuda_source():
    """The CUDA schedules take a variant as they are (here, with no GPU: the source): the forward on
    sm90 (wgmma) and sm80 (mma.sync), the SIMT backward and decode, each with the slopes a kernel
    parameter and the softcap's tanh in its code; a window alone adds neither."""
    variant = {"causal": True, "window_size": (100, -1), "softcap": 30.0, "alibi": True}
    sources = {
        "sm90": tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", **variant).source(heads_q=4, heads_kv=2),
        "sm80": tvmflash.compile(head_dim=64, dtype="float16", target="sm80", **variant).source(heads_q=4, heads_kv=2),
        "backward": tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm80",
                                              **variant).source(heads_q=4, heads_kv=2),
        "decode": tvmflash.compile_decode(head_dim=128, dtype="bfloat16", target="sm90", window_size=(100, -1),
                                          softcap=30.0, alibi=True).source(heads_q=32, heads_kv=8),
    }
    for name, src in sources.items():
        kernels = src[src.index("__global__"):]
        assert "AlibiSlopes" in kernels and "tanhf(" in kernels, name
    window = tvmflash.compile(head_dim=64, dtype="float16", target="sm80", window_size=(100, 3)).source(heads_q=4)
    assert "AlibiSlopes" not in window and "tanhf(" not in window[window.index("__global__"):]
    assert "wgmma" in sources["sm90"] and "mma.sync" in sources["sm80"]


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------
# name: (flash_attn_with_kvcache's options as in VARIANTS, page_size)
DECODE_VARIANTS = {
    "window-paged": ({"window_size": (30, 2)}, 16),
    "window-left": ({"window_size": (5, -1)}, 0),
    "window-right": ({"window_size": (-1, 1)}, 0),
    "softcap-alibi": ({"softcap": 3.0, "alibi": "batch"}, 0),
    "all-paged": ({"window_size": (40, 7), "softcap": 2.0, "alibi": "heads"}, 16),
}


def decode_matches_float64(device, dtype, head_dim, heads, name, capacity):
    """Decode and chunks of three or four tokens (causal or not) over ragged lengths (an empty
    sequence and a full one), one split and several, each sequence against the float64 reference
    over its own keys (ALiBi's and the window's distances from its length)."""
    variant, page_size = DECODE_VARIANTS[name]
    lengths = torch.tensor([0, 1, capacity // 3, capacity - 71, capacity], dtype=torch.int32)
    batch = len(lengths)
    k_cache, v_cache, table = make_cache(batch, capacity, heads[1], head_dim, dtype, device, page_size)
    for seqlen_q, causal in [(1, False), (3, False), (4, True)]:
        q = random_q(batch, seqlen_q, heads[0], head_dim, dtype, device, seed=seqlen_q)
        kwargs = options({**variant, "causal": causal}, batch, heads[0], device, seed=seqlen_q)
        results = [tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.to(device),
                                                    block_table=table, num_splits=num_splits,
                                                    return_softmax_lse=True, **kwargs) for num_splits in (1, 3)]
        check_decode(*results[0], q, k_cache, v_cache, lengths, block_table=table, more=results[1:], **kwargs)


@pytest.mark.parametrize("name", DECODE_VARIANTS)
def test_decode_matches_float64_on_cpu(name):
    decode_matches_float64("cpu", CPU_DTYPE, 64, HEADS, name, capacity=200)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODE_VARIANTS)
def test_decode_matches_float64_on_the_gpu(name):
    decode_matches_float64("cuda", torch.bfloat16, 128, (32, 8), name, capacity=1000)


def test_decode_window_right_edge_zero_is_causal():
    """flash-attn's rule: a window's right edge 0 is causal, whatever causal says."""
    k_cache, v_cache, _ = make_cache(2, 64, 2, 64, CPU_DTYPE, "cpu")
    q = random_q(2, 3, 4, 64, CPU_DTYPE, "cpu")
    windowed = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50, window_size=(5, 0))
    causal = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50, window_size=(5, -1), causal=True)
    assert torch.equal(windowed, causal)
    with pytest.raises(ValueError, match="a right edge of 0 is causal"):
        tvmflash.compile_decode(head_dim=64, dtype=CPU_DTYPE, target="cpu", window_size=(5, 0))


# ------------------------------------------------------------------------------------------------
# bad options
# ------------------------------------------------------------------------------------------------
def bad_options():
    """(keyword arguments, exception, message) for attention(), flash_attn_func() and decode on
    2 x 8 queries of 4 heads."""
    return [
        ({"window_size": (-2, 0)}, ValueError, r"window_size: expected ints >= -1"),
        ({"window_size": (1.5, 0)}, TypeError, r"window_size: expected two ints"),
        ({"window_size": 5}, TypeError, r"window_size: expected two ints"),
        ({"softcap": -1.0}, ValueError, r"softcap: expected a finite float >= 0"),
        ({"softcap": math.inf}, ValueError, r"softcap: expected a finite float >= 0"),
        ({"softcap": "30"}, TypeError, r"softcap: expected a float"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes: expected shape \(4,\) or \(2, 4\)"),
        ({"alibi_slopes": torch.ones(4, 2)}, ValueError, r"alibi_slopes: expected shape \(4,\) or \(2, 4\)"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.float16)}, TypeError, r"alibi_slopes: expected dtype torch.float32"),
        ({"alibi_slopes": torch.ones(4, device="meta")}, ValueError, r"alibi_slopes: expected device cpu"),
        ({"alibi_slopes": [1.0] * 4}, TypeError, r"alibi_slopes: expected a float32 tensor"),
    ]


@pytest.mark.parametrize("kwargs,error,message", bad_options())
def test_bad_options_name_the_argument(kwargs, error, message):
    q, k, v = random_qkv(2, 8, 8, 4, 2, 64, torch.float16, "cpu")
    with pytest.raises(error, match=message):
        tvmflash.attention(q, k, v, **kwargs)
    with pytest.raises(error, match=message):
        tvmflash.flash_attn_func(q, k, v, **kwargs)
    k_cache, v_cache, _ = make_cache(2, 16, 2, 64, torch.float16, "cpu")
    k_cache.zero_(), v_cache.zero_()
    with pytest.raises(error, match=message):  # checked before the new key is written to the cache
        tvmflash.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], cache_seqlens=3, **kwargs)
    assert not k_cache.any() and not v_cache.any()


def test_a_kernel_takes_slopes_exactly_when_compiled_with_alibi():
    q, k, v = random_qkv(2, 8, 8, 4, 2, 64, torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"alibi_slopes: this kernel was compiled without ALiBi"):
        tvmflash.compile(head_dim=64, dtype="float16", target="cpu")(q, k, v, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match=r"alibi_slopes: this kernel was compiled with ALiBi: pass the slopes"):
        tvmflash.compile(head_dim=64, dtype="float16", target="cpu", alibi=True)(q, k, v)


def test_variant_kernels_are_named_and_keyed_by_their_options():
    """causal and a window's right edge 0 are one kernel (flash-attn's rule); a window bound past any
    sequence is no bound; the kernel says what it computes; a variant keeps the plain workload's
    tuning records (its key has no variant fields)."""
    def compile(**kwargs):
        return tvmflash.compile(head_dim=64, dtype="float16", target="cpu", **kwargs)

    assert compile(window_size=(8, 0)) is compile(causal=True, window_size=(8, 5))
    assert compile(window_size=(2**31, -1)) is compile()
    kernel = compile(causal=True, window_size=(8, -1), softcap=30.0, alibi=True)
    assert kernel.info()["window_left"] == 8 and kernel.info()["softcap"] == 30.0 and kernel.info()["alibi"]
    assert "window_left=8, softcap=30.0, alibi=True" in repr(kernel)
    assert "window_left" not in compile().info()
