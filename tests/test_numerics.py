"""Forward numerics against a float64 reference, with flash-attn's error rule."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import ONE_LAYOUT_SHAPES, SHAPES, devices, poisoned_out, random_qkv
from reference import check_attention

import tvmflash
from tvmflash import program

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_float64(device, dtype, head_dim, causal):
    """The default kernels over SHAPES: its three head layouts (a module each) in bf16, one layout (GQA 4/2)
    in the other dtypes, on either device (the head mapping is the program's, whatever the dtype: the GPU
    suite's five minutes, and 16 of the CPU suite's builds)."""
    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal,
                              target="cpu" if device == "cpu" else None)
    for seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES if dtype == torch.bfloat16 else ONE_LAYOUT_SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        assert lse.shape == (2, heads_q, seqlen_q) and lse.dtype == torch.float32
        check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,causal", [(dtype, head_dim, causal) for head_dim in (32, 96, 256)
                                                   for dtype, causal in ((torch.float16, head_dim != 96),
                                                                         (torch.bfloat16, head_dim == 96))],
                         ids=lambda p: str(p).removeprefix("torch.") if not isinstance(p, bool) else
                         ("causal" if p else "full"))
def test_other_head_dims_on_the_gpu(dtype, head_dim, causal):
    """The other head_dims on what compile() picks for this GPU (on sm_90a: sm80 at 32; sm90 with
    the K/V tiles by TMA in the 64-byte swizzle at 96, one block an SM at 256), over the edge shapes
    of SHAPES in one head layout (the three are test_forward_matches_float64's)."""
    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal)
    for seqlen_q, seqlen_k, heads_q, heads_kv in ONE_LAYOUT_SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("knobs", [{"kv_layout": "core_matrices", "kv_copy": "cp.async", "num_stages": 1},
                                   {"q_layout": "swizzled", "q_copy": "tma"}], ids=["core_matrices", "q_by_tma"])
def test_sm90_d96_layouts_on_the_gpu(monkeypatch, knobs, dtype, causal):
    """head_dim 96's other layouts in the tuning space (its default, the K/V tiles by TMA in the
    64-byte swizzle, is test_other_head_dims'): all tiles in padded core matrices by cp.async, or the
    Q tile swizzled too and copied by TMA (the output staged in its layout), over the edge shapes of
    SHAPES, on an sm_90a GPU."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=96, dtype=dtype, causal=causal, knobs=knobs)
    for seqlen_q, seqlen_k, heads_q, heads_kv in ONE_LAYOUT_SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 96, dtype, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("device", devices())
def test_attention_function_and_scale(device):
    q, k, v = random_qkv(1, 77, 55, 4, 2, 64, torch.bfloat16, device)
    out, lse = tvmflash.attention(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("device", devices())
def test_fully_masked_rows_give_zero_and_minus_inf(device):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key.
    q, k, v = random_qkv(2, 50, 20, 2, 2, 64, torch.float16, device)
    out, lse = tvmflash.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30]))
    assert (lse[:, :, :30] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 30:]).all()
    check_attention(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits(device, dtype):
    # |q . k| * scale around 1e4: exp overflows unless the running max is subtracted first.
    q, k, v = random_qkv(1, 130, 130, 2, 2, 64, dtype, device, scale=60.0)
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    ref_scores = (q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2)) / 8
    assert ref_scores.abs().max() > 1e4
    check_attention(out, lse, q, k, v)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_running_max_that_creeps_up(device, dtype):
    # Scores that rise along the keys, a few log2 units a 64-key tile (under RESCALE_THRESHOLD) and
    # many times that over the row: the running max lags the true one by up to the threshold, so P
    # reaches 2^8 before the max moves, and the result must stay exact.
    q, k, v = random_qkv(1, 200, 1000, 2, 2, 64, dtype, device)
    q = (q.abs().float() * (48 / q.abs().float().sum(-1, keepdim=True))).to(dtype)  # each query's sum 48
    # k's random part at half its scale: at full scale one draw in about 2,000 had a tile's max rise by
    # more than RESCALE_THRESHOLD over the one before (the assertion below); at half, the largest of
    # 2,000 draws rose by 5.2
    k = (0.5 * k.float() + torch.linspace(0, 4, 1000, device=device)[None, :, None, None]).to(dtype)
    scores = (q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2)) / 8 / math.log(2)
    tile_max = scores[..., :960].unflatten(-1, (15, 64)).amax(-1)  # each 64-key tile's max, in log2 units
    assert (tile_max.diff().amax() < program.RESCALE_THRESHOLD
            and (tile_max[..., -1] - tile_max[..., 0]).amin() > 3 * program.RESCALE_THRESHOLD)
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    check_attention(out, lse, q, k, v)


@pytest.mark.parametrize("device", devices())
def test_strided_views(device):
    # q, k, v as views into one packed qkv tensor: only the last dim is contiguous.
    qkv = torch.randn(2, 100, 3, 4, 64, dtype=torch.bfloat16, device=device)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    check_attention(out, lse, q, k, v)


def laid_out(t, layout):
    """``t`` (batch, seqlen, heads, head_dim), the same values in another layout: "bshd" itself;
    "bhsd" a (b, h, s, d) tensor seen through transpose(1, 2) (SDPA's layout); "padded" heads 16
    bytes apart in their rows (2-byte dtypes); "odd" heads 4 elements apart and "expanded" one head
    broadcast to all (stride 0): CUDA copies these two."""
    if layout == "bshd":
        return t
    if layout == "expanded":
        return t[:, :, :1].expand(t.shape)
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    pad = {"padded": 8, "odd": 4}[layout]
    wide = torch.zeros(*t.shape[:3], t.shape[3] + pad, dtype=t.dtype, device=t.device)
    return wide[..., :t.shape[3]].copy_(t)


# The CUDA schedules and copy paths that read and write strided tensors: what compile() picks
# (on sm_90a: sm90, K/V by TMA), sm80 (cp.async), sm90 with cp.async K/V, sm90 with the Q tile by TMA
# and the output stored from registers, the SIMT schedule (float32).
STRIDED_KERNELS = {
    "default": ({}, {}, torch.bfloat16),
    "sm80": ({"TVMFLASH_SM90": "0"}, {}, torch.bfloat16),
    "sm90-cp.async": ({"TVMFLASH_SM90": "1"}, {"kv_layout": "core_matrices", "num_stages": 2, "kv_copy": "cp.async"},
                      torch.bfloat16),
    "sm90-q-tma-direct": ({"TVMFLASH_SM90": "1"}, {"q_layout": "swizzled", "q_copy": "tma", "o_store": "direct"},
                          torch.float16),
    "simt": ({}, {}, torch.float32),
}


@pytest.mark.parametrize("device,kind,layout", [("cpu", "default", layout) for layout in ("bhsd", "padded", "odd")] + [
    pytest.param("cuda", kind, layout, marks=pytest.mark.gpu) for kind in STRIDED_KERNELS
    for layout in (("bhsd", "padded", "odd") if kind == "default" else ("odd",))], ids=lambda p: str(p))
def test_strided_layouts_match_contiguous(monkeypatch, device, kind, layout):
    """q, k, v and out in other layouts than (b, s, h, d) with a contiguous last dim: the same
    result as contiguous tensors, bit for bit, written into out itself, within flash-attn's rule."""
    env, knobs, dtype = STRIDED_KERNELS[kind]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if kind.startswith("sm90") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    for causal in (False, True):
        kernel = tvmflash.compile(head_dim=64, dtype=dtype, causal=causal, knobs=knobs or None,
                                  target="cpu" if device == "cpu" else None)
        for seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES[1::2]:
            q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 64, dtype, device)
            want, want_lse = kernel(q, k, v, return_lse=True)
            out = laid_out(poisoned_out(q), layout)
            got, lse = kernel(*(laid_out(t, layout) for t in (q, k, v)), out=out, return_lse=True)
            assert got is out and torch.equal(got, want) and torch.equal(lse, want_lse)
            check_attention(got, lse, q, k, v, causal=causal)


def test_strided_inputs_are_not_copied(monkeypatch):
    """(b, h, s, d) tensors seen through a transpose reach the TVM function as they are (the kernel
    used to copy them with .contiguous()), out= included."""
    kernel = tvmflash.compile(head_dim=64, dtype=torch.bfloat16, target="cpu")
    q, k, v = (laid_out(t, "bhsd") for t in random_qkv(2, 70, 50, 4, 2, 64, torch.bfloat16, "cpu"))
    out = laid_out(torch.empty_like(q), "bhsd")
    module = kernel.module(4, 2)
    received = []
    monkeypatch.setattr(module, "function", lambda *args: received.append(args))
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda *args, **kwargs: pytest.fail("contiguous() was called"))
    assert kernel(q, k, v, out=out) is out
    (args,) = received
    assert all(got is given for got, given in zip(args, (q, k, v, out)))


@pytest.mark.parametrize("layout,copied", [("bshd", False), ("bhsd", False), ("padded", False), ("odd", True),
                                           ("expanded", True)])
def test_which_layouts_a_cuda_kernel_copies(layout, copied):
    """What the README says: on CUDA, a tensor whose batch, sequence or head stride is no multiple
    of 16 bytes is copied; the others are read in place (checked here without a GPU: the decision is
    the kernel's, before the call). The CPU copies none."""
    cuda = tvmflash.compile(head_dim=64, dtype=torch.bfloat16, target="sm80")
    cpu = tvmflash.compile(head_dim=64, dtype=torch.bfloat16, target="cpu")
    t = laid_out(torch.randn(2, 9, 3, 64).bfloat16(), layout)
    assert (cuda.arguments.usable(t, "q") is not t) == copied
    assert torch.equal(cuda.arguments.usable(t, "q"), t)
    assert cpu.arguments.usable(t, "q") is t


@pytest.mark.parametrize("device", devices())
def test_empty_inputs(device):
    q, k, v = random_qkv(0, 10, 10, 2, 2, 64, torch.float16, device)
    assert tvmflash.attention(q, k, v).shape == q.shape
    q, k, v = random_qkv(1, 0, 10, 2, 2, 64, torch.float16, device)
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)
    for causal in (False, True):  # no key at all: every row sees none, so 0 and an LSE of -inf
        q, k, v = random_qkv(1, 70, 0, 2, 2, 64, torch.float16, device)
        kernel = tvmflash.compile(head_dim=64, dtype=torch.float16, causal=causal,
                                  target="cpu" if device == "cpu" else None)
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_custom_op_under_torch_compile():
    q, k, v = random_qkv(1, 40, 40, 2, 2, 64, torch.float32, "cpu")

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return tvmflash.attention(q, k, v, causal=True) * 2

    out = f(q, k, v)
    assert torch.allclose(out, 2 * tvmflash.attention(q, k, v, causal=True))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal,return_lse,given_out", [(False, False, False), (True, True, False),
                                                         (False, True, True), (True, False, True)],
                         ids=["full", "causal-lse", "full-lse-out", "causal-out"])
def test_kept_kernel_under_torch_compile(device, causal, return_lse, given_out):
    """A kept Kernel traces under torch.compile (it failed on a TVM object in its argument checks:
    'Dynamo does not know how to trace method __call__ of class FieldGetter')."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kernel = tvmflash.compile(head_dim=64, dtype=dtype, causal=causal, target="cpu" if device == "cpu" else None)
    q, k, v = random_qkv(1, 40, 33, 4, 2, 64, dtype, device)

    @torch.compile(fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    def f(q, k, v, out):
        result = kernel(q, k, v, softmax_scale=0.3, out=out, return_lse=return_lse)
        return (result[0] * 2, result[1]) if return_lse else result * 2

    out = poisoned_out(q) if given_out else None
    got = f(q, k, v, out)
    want_out, want_lse = kernel(q, k, v, softmax_scale=0.3, return_lse=True)
    if return_lse:
        got, lse = got
        assert torch.equal(lse, want_lse)
    assert torch.equal(got, 2 * want_out)
    if given_out:
        assert torch.equal(out, want_out)


def test_eager_call_stays_off_the_custom_op(monkeypatch):
    """Eagerly, with nothing for autograd to record, attention calls the kernel directly: the custom
    op's dispatch costs host time every call, and its first call imports torch._dynamo (about 1 s)."""
    from tvmflash import ops

    def refuse(*args):
        raise AssertionError("the custom op was called")

    monkeypatch.setattr(ops, "forward", refuse)
    q, k, v = random_qkv(1, 40, 40, 2, 2, 32, torch.float32, "cpu")
    out = tvmflash.attention(q, k, v)
    with torch.no_grad():
        q.requires_grad_()
        assert torch.equal(tvmflash.attention(q, k, v), out)
    # autograd records the call: eagerly its autograd Function (ops.eager_autograd), still no dispatch
    out = tvmflash.attention(q, k, v)
    out.sum().backward()
    assert out.grad_fn.name().startswith("ForwardFunction") and q.grad is not None
    code = ("import sys, torch, tvmflash; q = torch.randn(1, 8, 2, 32); tvmflash.attention(q, q, q); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stdout


def test_attention_finds_its_kernel_without_compile(monkeypatch):
    """attention() runs at every step of a model: after the first call it finds its kernel without
    compile(), which resolves a target (a TVM object) and hashes its arguments, some 100 us."""
    from tvmflash import ops

    q, k, v = random_qkv(1, 9, 9, 2, 2, 32, torch.float32, "cpu")
    out = tvmflash.attention(q, k, v)
    monkeypatch.setattr(ops, "compile", lambda **kwargs: pytest.fail("compile() was called"))
    assert torch.equal(tvmflash.attention(q, k, v), out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 64), (128, 128)])
def test_sm90_producer_warpgroup_on_the_gpu(monkeypatch, head_dim, block_n, causal):
    """The sm90 schedule with a producer warpgroup (FA3's: it issues the TMA copies, the consumer
    warpgroups take its registers), over the edge shapes of SHAPES, on an sm_90a GPU."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    monkeypatch.setenv("TVMFLASH_SM90", "1")  # the sm90 schedule's knobs, whatever this GPU's records say
    kernel = tvmflash.compile(head_dim=head_dim, dtype=torch.bfloat16, causal=causal,
                              knobs={"producer": "warpgroup", "min_blocks_per_sm": 1, "block_n": block_n})
    for seqlen_q, seqlen_k, heads_q, heads_kv in ONE_LAYOUT_SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.bfloat16, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("producer,q_copy,o_store,overlap,causal", [
    ("thread", "threads", "staged", 0, True), ("warpgroup", "threads", "staged", 0, False),
    ("warpgroup", "tma", "staged", 0, True), ("thread", "tma", "direct", 0, False), ("warpgroup", "tma", "direct", 0, True),
    ("thread", "threads", "staged", 1, False), ("warpgroup", "tma", "direct", 1, True), ("warpgroup", "tma", "direct", 1, False)],
    ids=lambda p: {True: "causal", False: "full"}.get(p, p) if isinstance(p, bool) else str(p))
def test_sm90_three_stages_swizzled_q_on_the_gpu(monkeypatch, producer, q_copy, o_store, overlap, causal):
    """Three TMA stages of block_n 128 with the Q tile swizzled (q_layout; copied by the threads or by
    TMA, q_copy; the output staged or stored from the registers, o_store; FA3's overlap or not), over the edge shapes of
    SHAPES: the prologue issues two tiles, every Q block visits at least two K/V tiles (short keys: an
    all-masked one)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=128, dtype=torch.bfloat16, causal=causal,
                              knobs={"producer": producer, "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3,
                                     "q_layout": "swizzled", "q_copy": q_copy, "o_store": o_store,
                                     "overlap": overlap})
    for seqlen_q, seqlen_k, heads_q, heads_kv in ONE_LAYOUT_SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 128, torch.bfloat16, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)
