"""The backward pass: gradients against float64 autograd with flash-attn's rule, determinism,
autograd and torch.compile wiring, the flash-attn API, and the backward's errors."""

import math

import pytest
import torch
import tvm
from conftest import poisoned_out, random_qkv
from reference import check_gradients

import tvmflash
from tvmflash import kernels, program_backward
from tvmflash.kernels import build

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (seqlen_q, seqlen_k, heads_q, heads_kv): tails on both sides, Lq != Lk both ways (causal with
# Lq > Lk: rows that see no key), and MHA 2/2, GQA 4/2 and MQA 4/1 (one build each).
SHAPES = [
    (1, 1, 2, 2),
    (17, 17, 4, 2),
    (129, 129, 2, 2),
    (1, 129, 4, 1),
    (129, 17, 4, 2),
    (77, 200, 2, 2),
    (200, 77, 4, 1),
]
# CPU CI: every dtype and the head_dims 32, 64, 128 once each; to keep the builds few (one per
# head layout), float32 takes SHAPES' three head layouts and the others one each (GQA, MQA).
CPU_GRID = [(torch.float32, 32, None), (torch.bfloat16, 64, (4, 2)), (torch.float16, 128, (4, 1))]
# The GPU tests of structures beside the default schedule and knobs (their head mapping is the
# defaults', tested in the three layouts): SHAPES in GQA 4/2 alone, one backward build instead of three.
STRUCTURE_HEADS = (4, 2)


def gradients_match_float64(device, dtype, head_dim, causal, heads=None, knobs=None, deterministic=False):
    """Over SHAPES (in these (heads_q, heads_kv) if given), half of them with a gradient on lse
    too: the backward kernel (of these backward ``knobs``, ``deterministic`` or not), its outputs
    poisoned, against float64 autograd."""
    target = "cpu" if device == "cpu" else None
    forward = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, target=target)
    backward = tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=causal, target=target, knobs=knobs,
                                         deterministic=deterministic)
    for n, (seqlen_q, seqlen_k, heads_q, heads_kv) in enumerate(SHAPES):
        heads_q, heads_kv = heads or (heads_q, heads_kv)
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
        out, lse = forward(q, k, v, return_lse=True)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse) if n % 2 else None
        grads = backward(q, k, v, out, dout, lse, dlse=dlse, dq=poisoned_out(q), dk=poisoned_out(k), dv=poisoned_out(v))
        check_gradients(grads, q, k, v, dout, dlse, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,head_dim,heads", CPU_GRID, ids=lambda x: str(x).removeprefix("torch."))
def test_gradients_match_float64_on_cpu(dtype, head_dim, heads, causal):
    gradients_match_float64("cpu", dtype, head_dim, causal, heads)


# The GPU suite's five minutes on a fresh machine (each case a backward build): every head_dim both ways in
# bf16, fp16 (the same kernels' other operand type) and float32 (SIMT) on a few.
GPU_GRADIENT_CASES = ([(torch.bfloat16, d, c) for d in (32, 64, 96, 128, 256) for c in (False, True)]
                      + [(torch.float16, 64, True), (torch.float16, 96, False), (torch.float16, 128, False),
                         (torch.float32, 64, True), (torch.float32, 128, False)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,causal", GPU_GRADIENT_CASES,
                         ids=lambda p: str(p).removeprefix("torch.") if not isinstance(p, bool) else
                         ("causal" if p else "full"))
def test_gradients_match_float64_on_the_gpu(dtype, head_dim, causal):
    """The default schedules: for fp16/bf16 sm90's (wgmma) at head_dim 64, 96, 128 and 256 on sm_90a, sm80's
    (mma.sync) up to head_dim 128 on sm80 and newer; the SIMT one otherwise. SHAPES' three head layouts (a
    forward and a backward module each, about 50 s of builds) in bf16 at 64 and 128, GQA 4/2 elsewhere."""
    heads = None if dtype == torch.bfloat16 and head_dim in (64, 128) else STRUCTURE_HEADS
    gradients_match_float64("cuda", dtype, head_dim, causal, heads)


def test_dkdv_slices_match_float64_on_cpu(monkeypatch, tmp_path):
    """The program's dkdv_slices (sm90's at d256), unscheduled on the CPU against float64: dk, dv and dq's
    share made in two slices of the columns, the tile's rows its keys once a slice ("rows": key_of, each
    row's slice's columns, dq's share from its column's slice's rows of dsᵀ), causal, GQA 4/2, with dq by
    atomics. (The grid's slicing and the dq pass checked the same way, outside the suite, 2026-12-07.)"""
    from tvmflash.kernels import backward as kernels_backward

    def scheduled(self, spec):  # the program alone: its blocks in order, serial
        return tvm.s_tir.Schedule(program_backward.attention_backward(spec, 32, 32, dq_atomic=True, dkdv_slices=2,
                                                                      dkdv_slicing="rows"))

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))  # modules of these programs in no shared cache
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(kernels_backward.BackwardKernel, "_scheduled", scheduled)
    monkeypatch.setattr(kernels_backward.BackwardKernel, "dq_atomic", property(lambda self: True))
    monkeypatch.setattr(kernels_backward.BackwardKernel, "dq_accumulator", lambda self, q: (torch.zeros(
        (q.shape[0], program_backward.dq_accumulator_rows(q.shape[1], 32), *q.shape[2:]), dtype=torch.float32),))
    forward = tvmflash.compile(head_dim=64, dtype=torch.float32, causal=True, target="cpu")
    # knobs of their own: a kernel (and module) apart from the CPU schedule's
    backward = tvmflash.compile_backward(head_dim=64, dtype=torch.float32, causal=True, target="cpu",
                                         knobs={"block_m": 32, "block_n": 32, "vector": 4})
    for n, (seqlen_q, seqlen_k) in enumerate([(70, 45), (33, 100)]):
        q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 2, 64, torch.float32, "cpu")
        out, lse = forward(q, k, v, return_lse=True)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse) if n else None
        grads = backward(q, k, v, out, dout, lse, dlse=dlse, dq=poisoned_out(q), dk=poisoned_out(k), dv=poisoned_out(v))
        check_gradients(grads, q, k, v, dout, dlse, causal=True)


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", devices())
def test_autograd_through_out_and_lse(device):
    """loss.backward() through tvmflash.attention, with the gradient of lse: causal with
    seqlen_q > seqlen_k, so the first rows see no key and get zero gradients, never NaN."""
    q, k, v = random_qkv(2, 50, 20, 4, 2, 64, torch.bfloat16, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tvmflash.attention(*leaves, causal=True, softmax_scale=0.3, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    grads = [t.grad for t in leaves]
    assert torch.equal(grads[0][:, :30], torch.zeros_like(grads[0][:, :30]))  # rows that see no key
    check_gradients(grads, q, k, v, dout, dlse, causal=True, softmax_scale=0.3)
    # only lse in the loss: out's gradient is None inside the backward
    for t in leaves:
        t.grad = None
    (tvmflash.attention(*leaves, causal=True, return_lse=True)[1][:, :, 30:] * dlse[:, :, 30:]).sum().backward()
    check_gradients([t.grad for t in leaves], q, k, v, torch.zeros_like(dout), dlse, causal=True)


@pytest.mark.parametrize("device", devices())
def test_deterministic_gradients_are_bitwise_equal(device):
    q, k, v = random_qkv(2, 300, 300, 8, 2, 64, torch.bfloat16, device)
    dout = torch.randn_like(q)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        tvmflash.flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
        return [t.grad for t in leaves]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


class TinyAttention(torch.nn.Module):
    def __init__(self, width=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        return self.proj(tvmflash.attention(q, k, v, causal=True).flatten(-2))


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph_forward_and_backward(device):
    """One graph (fullgraph: a break raises), AOTAutograd traces the backward through
    tvmflash::backward's fake implementation, and the gradients are eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = TinyAttention().to(device)
    x = torch.randn(2, 40, 128, device=device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    compiled(x).square().mean().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    assert counter.frame_count == 1
    for compiled_grad, p in zip(compiled_grads, model.parameters()):
        torch.testing.assert_close(compiled_grad, p.grad)


def test_flash_attn_api():
    q, k, v = random_qkv(2, 33, 45, 4, 2, 64, torch.float16, "cpu")
    out = tvmflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, tvmflash.attention(q, k, v, causal=True))
    out, lse, probs = tvmflash.flash_attn_func(q, k, v, softmax_scale=0.2, return_attn_probs=True)
    ref_out, ref_lse = tvmflash.attention(q, k, v, softmax_scale=0.2, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and probs is None
    # packed forms: the same values, and the gradients flow back into the packed tensor
    qkv = torch.stack([q, q, q], dim=2).requires_grad_()
    packed = tvmflash.flash_attn_qkvpacked_func(qkv, causal=True)
    assert torch.equal(packed, tvmflash.attention(q, q, q, causal=True))
    packed.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(tvmflash.flash_attn_kvpacked_func(q, kv), tvmflash.attention(q, k, v))


@pytest.mark.parametrize("flag", ["causal", "deterministic", "return_attn_probs"])
def test_flags_refuse_strings(flag):
    """As flash-attn's binding: a flag's string is a TypeError (``causal="False"`` is truthy)."""
    q, k, v = random_qkv(1, 8, 8, 2, 2, 64, torch.float16, "cpu")
    with pytest.raises(TypeError, match=f"{flag}: expected True or False"):
        tvmflash.flash_attn_func(q, k, v, **{flag: "False"})


@pytest.fixture(scope="module")
def backward_kernel():
    return tvmflash.compile_backward(head_dim=64, dtype="float16", target="cpu")


def test_backward_input_errors(backward_kernel):
    q, k, v = random_qkv(1, 8, 8, 4, 2, 64, torch.float16, "cpu")
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout: expected a tensor of shape \(1, 8, 4, 64\), dtype torch.float16"):
        backward_kernel(q, k, v, out, out[:, :4], lse)
    with pytest.raises(ValueError, match=r"lse: expected a tensor of shape \(1, 4, 8\), dtype torch.float32"):
        backward_kernel(q, k, v, out, out, lse.half())
    with pytest.raises(ValueError, match=r"dk: expected a contiguous tensor"):
        backward_kernel(q, k, v, out, out, lse, dk=torch.empty(1, 2, 8, 64).half().transpose(1, 2))
    with pytest.raises(TypeError, match=r"v: expected dtype torch.float16"):
        backward_kernel(q, k, v.float(), out, out, lse)
    with pytest.raises(ValueError, match=r"knobs: \['blockm'\] are not backward knobs of the cpu schedule"):
        tvmflash.compile_backward(head_dim=64, dtype="float16", target="cpu", knobs={"blockm": 16})


def test_empty_inputs_give_zero_gradients(backward_kernel):
    for seqlen_q, seqlen_k in ((0, 10), (10, 0)):
        q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 2, 64, torch.float16, "cpu")
        out, lse = tvmflash.attention(q, k, v, return_lse=True)
        dq, dk, dv = backward_kernel(q, k, v, out, torch.randn_like(out), lse, dq=poisoned_out(q),
                                     dk=poisoned_out(k), dv=poisoned_out(v))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in (dq, dk, dv))


def test_backward_modules_are_cached(backward_kernel, monkeypatch):
    """A second BackwardKernel loads the module from disk (as a new process would, with nothing in
    memory); the forward's module of the same spec and knobs is another file."""
    backward_kernel.module(2, 1)
    monkeypatch.setattr(build, "_MODULES", {})
    again = kernels.BackwardKernel(
        {"head_dim": 64, "dtype": "float16", "causal": False}, backward_kernel.target, None)
    assert again.module(2, 1).origin == "disk cache"
    tiles = {name: value for name, value in backward_kernel.knobs.items() if name != "dq_atomic"}  # the forward's too
    forward = tvmflash.compile(head_dim=64, dtype="float16", target="cpu", knobs=tiles)
    assert forward.build.key(forward.spec(2, 1)) != backward_kernel.build.key(backward_kernel.spec(2, 1))
    assert again.info()["pass"] == "backward"


def test_a_training_step_finds_its_backward_kernel_without_compile(monkeypatch):
    """loss.backward() through attention() looks its backward kernel up by (device, dtype, head_dim,
    variant), as the forward does: compile_backward resolves a target and hashes its arguments (some
    250 us a call), which at small sizes left the GPU idle between the kernels of a step."""
    q, k, v = (torch.randn(1, 8, 2, 32, requires_grad=True) for _ in range(3))
    tvmflash.attention(q, k, v, causal=True).sum().backward()  # builds (or loads) and keeps the kernels
    monkeypatch.setattr(tvmflash.ops, "compile_backward", lambda **kw: pytest.fail("compile_backward on a step"))
    monkeypatch.setattr(tvmflash.ops, "compile", lambda **kw: pytest.fail("compile on a step"))
    for t in (q, k, v):
        t.grad = None
    tvmflash.attention(q, k, v, causal=True).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_simt_backward_builds_cuda_source(monkeypatch, dtype):
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")  # sm80's serves bfloat16 at head_dim 128 by default
    kernel = tvmflash.compile_backward(head_dim=128, dtype=dtype, causal=True, target="sm80")
    src = kernel.source(heads_q=8, heads_kv=2)
    for name in ("delta_kernel", "dkdv_kernel", "dq_kernel"):
        assert "__global__ void __launch_bounds__" in src and name in src
    assert kernel.info()["schedule"] == "simt" and "atomicAdd" not in src


@pytest.mark.gpu
def test_peak_memory_at_16k_tokens():
    """Extra memory stays O(N): above q, k, v, out, dout and the gradients themselves, the backward
    takes only lse-sized rows (delta; dlse zeros) and, where it sums dq by atomics (dq_atomic), dq's
    fp32 accumulator -- nothing of seqlen_q x seqlen_k."""
    batch, seqlen, heads, head_dim = 1, 16384, 8, 128
    q, k, v = random_qkv(batch, seqlen, seqlen, heads, heads, head_dim, torch.bfloat16, "cuda")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = tvmflash.attention(*leaves, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)  # build and warm up
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = tvmflash.attention(*leaves, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    tensor_bytes = q.numel() * q.element_size()
    row_bytes = batch * heads * seqlen * 4
    kernel = tvmflash.ops.backward_kernel_for(q, True)
    accumulator = (batch * program_backward.dq_accumulator_rows(seqlen, kernel.knobs["block_m"]) * heads * head_dim * 4
                   if kernel.dq_atomic else 0)
    # out and the three gradients are q-sized; lse, delta and dlse rows; dq's accumulator; 1 MiB of slack
    assert extra <= 4 * tensor_bytes + 4 * row_bytes + accumulator + 2**20, f"{extra / 2**20:.1f} MiB"
    assert extra < batch * heads * seqlen * seqlen * 2 / 8  # far below one bf16 score matrix


@pytest.mark.gpu
def test_torch_compile_trains_on_the_gpu():
    torch.manual_seed(0)
    model = TinyAttention().cuda().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    losses = []
    for _ in range(5):
        loss = compiled(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_simt_backward_default_knobs_fit_static_shared_memory():
    from tvmflash.schedules import simt

    for head_dim in (32, 64, 96, 128, 256):
        kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="float32", target="sm80")
        assert simt.backward_shared_memory_bytes(head_dim, "float32", kernel.knobs) <= 48 * 1024
    with pytest.raises(ValueError, match=r"need 64 KiB of shared memory, the simt backward on cuda sm_80 has 48 KiB"):
        tvmflash.compile_backward(head_dim=256, dtype="float32", target="sm80", knobs={"block_m": 32, "block_n": 32})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_strided_q_k_v_are_read_in_place(device, monkeypatch):
    """q, k and v as a packed qkv's thirds (a GPT layer's ``qkv.unflatten(-1, (3, h, d)).unbind(2)``)
    and as transposed (b, h, s, d) tensors: the backward reads them through their strides, as the
    forward does (flash-attn's too), and gives the gradients of compact copies bit for bit."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, seqlen, heads, head_dim = 2, 77, 4, 64
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(batch, seqlen, 3 * heads * head_dim, generator=gen).to(device=device, dtype=dtype)
    packed = qkv.unflatten(-1, (3, heads, head_dim)).unbind(2)
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in packed]
    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=True)
    out, lse = tvmflash.attention(*packed, causal=True, return_lse=True)
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    expected = kernel(*(t.contiguous() for t in packed), out, dout, lse)
    copies, contiguous, clone = [], torch.Tensor.contiguous, torch.Tensor.clone

    def copied(copy):
        def call(t, *args, **kwargs):
            result = copy(t, *args, **kwargs)
            if result.data_ptr() != t.data_ptr():
                copies.append(tuple(t.shape))
            return result
        return call

    monkeypatch.setattr(torch.Tensor, "contiguous", copied(contiguous))
    monkeypatch.setattr(torch.Tensor, "clone", copied(clone))
    for views in (packed, transposed):
        assert not any(t.is_contiguous() for t in views)
        grads = kernel(*views, out, dout, lse)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
        assert all(g.is_contiguous() for g in grads)
    assert not copies  # (a view the programs cannot read is cloned: none here)


@pytest.mark.gpu
def test_misaligned_and_strided_gradient_views_on_the_gpu():
    """dout as a view that starts 2 bytes into its storage, and as an expanded (stride 0) tensor."""
    q, k, v = random_qkv(1, 100, 100, 2, 2, 64, torch.float16, "cuda")
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    kernel = tvmflash.compile_backward(head_dim=64, dtype=torch.float16)
    dout = torch.randn(out.numel() + 1, dtype=out.dtype, device="cuda")[1:].view(out.shape)
    assert dout.data_ptr() % 16
    check_gradients(kernel(q, k, v, out, dout, lse), q, k, v, dout)
    ones = torch.ones((), dtype=out.dtype, device="cuda").expand(out.shape)
    check_gradients(kernel(q, k, v, out, ones, lse), q, k, v, ones)


# bf16 d128: the module test_generated_cuda pins (built once in a run); fp16 at d32 builds in a fraction
# of d128's two minutes
@pytest.mark.parametrize("dtype,head_dim", [("float16", 32), ("bfloat16", 128)])
def test_sm80_backward_builds_cuda_source(monkeypatch, dtype, head_dim):
    """fp16/bf16 on sm80: dkdv and dq on mma.sync with ldmatrix operands, their next tiles loaded by
    cp.async; TVMFLASH_BACKWARD=simt and head_dim 256 take the SIMT schedule."""
    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=True, target="sm80")
    assert kernel.info()["schedule"] == "sm80"
    src = kernel.source(heads_q=4, heads_kv=2)
    dq = src[src.rindex("dq_kernel("):]  # the definitions, after the declarations
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("dq_kernel(")]
    ptx_type = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for program in (dq, dkdv):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in program and "ldmatrix" in program
        assert "cp_async_commit_group" in program
    assert tvmflash.compile_backward(head_dim=256, dtype=dtype, target="sm80").info()["schedule"] == "simt"
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")
    assert tvmflash.compile_backward(head_dim=128, dtype=dtype, target="sm80").info()["schedule"] == "simt"


def test_sm80_backward_with_atomic_dq_builds_cuda_source(monkeypatch):
    """The knob dq_atomic: no dq program; dkdv adds ds k into the fp32 dq_accum, by red.global.add.v2.f32
    on sm_90 and atomicAdd before, and convert_dq rounds it into dq."""
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm80")  # on sm_90a too
    for target, reduction in (("sm80", "atomicAdd("), ("sm90", "red.global.add.v2.f32")):
        kernel = tvmflash.compile_backward(head_dim=64, dtype="bfloat16", causal=True, target=target,
                                           knobs={"dq_atomic": True})
        assert kernel.info()["schedule"] == "sm80" and kernel.dq_atomic
        src = kernel.source(heads_q=4, heads_kv=2)
        assert " dq_kernel(" not in src and "convert_dq_kernel(" in src
        dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
        assert dkdv.count("DQaccum_ptr[") >= 1 and reduction in src


def _on_sm_90a_only(schedule):
    if schedule == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward needs sm_90a")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule,head_dim,causal", [("sm80", 64, True), ("sm80", 128, False), ("sm90", 64, False),
                                                      ("sm90", 128, True)],
                         ids=lambda p: {True: "causal", False: "full"}.get(p, p) if isinstance(p, bool) else str(p))
def test_atomic_dq_gradients_on_the_gpu(monkeypatch, schedule, head_dim, causal):
    """The knob dq_atomic (dq summed by fp32 atomics from dkdv) over SHAPES, on each tensor-core schedule."""
    _on_sm_90a_only(schedule)
    monkeypatch.setenv("TVMFLASH_BACKWARD", schedule)
    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype=torch.bfloat16, causal=causal,
                                       knobs={"dq_atomic": True})
    assert kernel.info()["schedule"] == schedule
    gradients_match_float64("cuda", torch.bfloat16, head_dim, causal, STRUCTURE_HEADS, knobs={"dq_atomic": True})


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_gradients_match_float64_on_the_gpu(head_dim, causal):
    """deterministic=True where the default sums dq by atomics (sm90): the dq pass, over SHAPES."""
    gradients_match_float64("cuda", torch.bfloat16, head_dim, causal, STRUCTURE_HEADS, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,causal", [(torch.float16, 64, True), (torch.bfloat16, 64, False),
                                                   (torch.float16, 128, False), (torch.bfloat16, 128, True)],
                         ids=lambda p: str(p).removeprefix("torch.") if not isinstance(p, bool) else
                         ("causal" if p else "full"))
def test_sm80_backward_gradients_on_the_gpu(monkeypatch, dtype, head_dim, causal):
    """The sm80 backward (mma.sync) where sm90's serves by default (TVMFLASH_BACKWARD=sm80 on sm_90a),
    over SHAPES."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm80's is the default here: test_gradients_match_float64_on_the_gpu")
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm80")
    assert tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=causal).info()["schedule"] == "sm80"
    gradients_match_float64("cuda", dtype, head_dim, causal, STRUCTURE_HEADS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,causal", [(torch.float16, 32, True), (torch.float16, 96, False),
                                                   (torch.bfloat16, 64, False), (torch.bfloat16, 128, True),
                                                   (torch.float16, 128, False)],
                         ids=lambda p: str(p).removeprefix("torch.") if not isinstance(p, bool) else
                         ("causal" if p else "full"))
def test_simt_backward_gradients_on_the_gpu(monkeypatch, dtype, head_dim, causal):
    """The SIMT backward where a tensor-core one serves by default (TVMFLASH_BACKWARD=simt), over SHAPES;
    the default schedules are test_gradients_match_float64_on_the_gpu's."""
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")
    assert tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=causal).info()["schedule"] == "simt"
    gradients_match_float64("cuda", dtype, head_dim, causal, STRUCTURE_HEADS)


def test_cpu_dq_accumulation_matches_float64_and_is_bitwise_reproducible(monkeypatch):
    """The CPU's dq_atomic pinned on (dkdv adds each K/V block's share of dq, one task a sequence and K/V
    head walking its blocks in turn): causal with a left window, a softcap, ALiBi and dropout, GQA 4/2,
    float32, Q and K/V blocks past the first (the shares' order matters), against float64 with the same
    entries dropped; ``deterministic=True`` keeps it (its order is fixed), and a second run is bitwise the
    same. Where its (batch, K/V head) tasks leave threads idle, the call takes the dq pass instead
    (``BackwardKernel._for_tasks``) unless dq_atomic is given."""
    from tvmflash import dropout
    from tvmflash.kernels import backward as kernels_backward

    variant = {"causal": True, "window_size": (90, -1), "softcap": 2.0}
    options = {"head_dim": 32, "dtype": torch.float32, "target": "cpu", "alibi": True, "dropout": True, **variant}
    forward = tvmflash.compile(**options)
    backward = tvmflash.compile_backward(**options, knobs={"dq_atomic": True}, deterministic=True)
    assert backward.dq_atomic and "convert_dq" in backward.build.module(4, 2).function
    for n, (seqlen_q, seqlen_k) in enumerate([(200, 150), (77, 200)]):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float32, "cpu", seed=n)
        slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(n)) * 0.3
        drop = {"dropout_p": 0.2, "dropout_seed": torch.tensor([3, n])}
        out, lse = forward(q, k, v, return_lse=True, alibi_slopes=slopes, **drop)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse) if n else None
        runs = [backward(q, k, v, out, dout, lse, dlse=dlse, alibi_slopes=slopes, dq=poisoned_out(q),
                         dk=poisoned_out(k), dv=poisoned_out(v), **drop) for _ in range(2)]
        mask = dropout.dropout_mask(drop["dropout_seed"], 0.2, 2, 4, seqlen_q, seqlen_k)
        check_gradients(runs[0], q, k, v, dout, dlse, alibi_slopes=slopes, dropout_p=0.2, dropout_mask=mask, **variant)
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    # pinned: no dq pass even with more threads than tasks; by default, the dq pass there
    monkeypatch.setattr(kernels_backward, "cpu_threads", lambda: 64)
    assert backward._for_tasks(2, 2) is backward
    default = kernels.BackwardKernel({"head_dim": 32, "dtype": "float32", "causal": True}, backward.target, None)
    assert default.dq_atomic and default._for_tasks(32, 2) is default
    assert not default._for_tasks(2, 2).dq_atomic and default._for_tasks(1, 2) is default._for_tasks(2, 2)
    monkeypatch.setattr(kernels_backward, "cpu_threads", lambda: 4)  # at least 5/7 of a round's threads busy
    assert default._for_tasks(3, 1) is default and default._for_tasks(5, 1) is not default


def test_cpu_dq_accumulation_of_packed_sequences():
    """varlen (a window, GQA 4/2; test_varlen's modules): the CPU's dq_atomic pinned on against the dq pass
    (both checked against float64 by test_varlen, through the defaults): dk and dv are the same programs'
    bitwise, dq the same sum in another order."""
    from test_varlen import VARIANTS, packed_problem

    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem([(77, 200), (200, 77), (1, 129)], (4, 2), 32,
                                                       torch.float16, "cpu")
    options = {"head_dim": 32, "dtype": torch.float16, "target": "cpu", "varlen": True, **VARIANTS["window"]}
    out, lse = tvmflash.compile(**options)(q, k, v, cu_q, cu_k, max_q, return_lse=True)
    dout = torch.randn_like(out)
    grads = [tvmflash.compile_backward(**options, knobs={"dq_atomic": atomic})(
        q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, dq=poisoned_out(q), dk=poisoned_out(k),
        dv=poisoned_out(v)) for atomic in (True, False)]
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=2e-3, atol=2e-3)
