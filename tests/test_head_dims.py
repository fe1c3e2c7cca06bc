"""Every head_dim from 1 to 256, as flash-attn 2 takes them (issue 43): the kernels serve the multiples of
8 that their schedules declare, and the torch API zero-pads any other to one they serve
(``choice.head_dim_to_run``), with softmax_scale that of q's own head_dim and the output (and the
gradients) sliced back. Forward, backward, varlen, the packed forms, a variant, GQA and decode against
the float64 reference, on the CPU (tiny shapes: each test a build or two) and, marked ``gpu``, on a GPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import poisoned_out, random_qkv
from reference import check_attention, check_gradients, reference
from test_decode import check_decode, make_cache, random_q
from test_varlen import check_each_sequence, packed_problem

import tvmflash
from tvmflash import choice, kernels
from tvmflash import target as targets
from tvmflash.schedules.contract import GPU_CHECKED_HEAD_DIMS

# (seqlen_q, seqlen_k): one query, tails, seqlen_q > seqlen_k under causal (rows that see no key)
LENGTHS = [(1, 1), (17, 130), (130, 77)]
HEADS = (4, 2)  # GQA


def autograd_matches_float64(head_dim, dtype, causal, device="cpu", lengths=LENGTHS, **variant):
    """flash_attn_func's out, lse and gradients (of out and lse) against the float64 reference, over
    ``lengths``: out and the gradients keep q's head_dim."""
    for n, (seqlen_q, seqlen_k) in enumerate(lengths):
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, dtype, device, seed=n)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = tvmflash.flash_attn_func(*leaves, causal=causal, return_attn_probs=True, **variant)
        assert out.shape == q.shape and lse.shape == (2, HEADS[0], seqlen_q)
        check_attention(out.detach(), lse.detach(), q, k, v, causal=causal, **variant)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse) if n % 2 else None
        outputs, output_grads = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
        torch.autograd.backward(outputs, output_grads)
        grads = [t.grad for t in leaves]
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
        check_gradients(grads, q, k, v, dout, dlse, causal=causal, **variant)


# float32 and bfloat16, causal and not: one forward and one backward build each
# (111 pads as 59 does, 40 and 160 run as 80 and 224 do (multiples of 8 and 32), 192 as 224: the GPU
# grid has them, and test_kernels_at_a_multiple_of_8_write_every_element 40)
CPU_HEAD_DIMS = [(8, torch.float32, True), (59, torch.float32, True), (80, torch.bfloat16, True),
                 (224, torch.bfloat16, False), (256, torch.float32, True)]


@pytest.mark.parametrize("head_dim,dtype,causal", CPU_HEAD_DIMS, ids=lambda x: str(x).removeprefix("torch."))
def test_flash_attn_func_and_its_gradients_at_any_head_dim_on_cpu(head_dim, dtype, causal):
    autograd_matches_float64(head_dim, dtype, causal)


@pytest.mark.parametrize("head_dim", [8, 40])
def test_kernels_at_a_multiple_of_8_write_every_element(head_dim):
    """compile() and compile_backward() at a multiple of 8 the CPU serves: out, dq, dk and dv poisoned."""
    forward = tvmflash.compile(head_dim=head_dim, dtype=torch.float32, causal=True, target="cpu")
    backward = tvmflash.compile_backward(head_dim=head_dim, dtype=torch.float32, causal=True, target="cpu")
    for seqlen_q, seqlen_k in LENGTHS:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, torch.float32, "cpu")
        out, lse = forward(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=True)
        dout = torch.randn_like(out)
        grads = backward(q, k, v, out, dout, lse, dq=poisoned_out(q), dk=poisoned_out(k), dv=poisoned_out(v))
        check_gradients(grads, q, k, v, dout, causal=True)


def test_softmax_scale_defaults_to_one_over_the_square_root_of_qs_own_head_dim():
    """At head_dim 59 the kernel runs at 64: the default scale is still 1/sqrt(59), and a given one is
    taken as it is."""
    q, k, v = random_qkv(1, 20, 30, 2, 2, 59, torch.float32, "cpu")
    out, lse = tvmflash.attention(q, k, v, return_lse=True)
    want, want_lse = reference(q, k, v, softmax_scale=1 / math.sqrt(59))
    assert (out - want).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-4
    wrong, _ = reference(q, k, v, softmax_scale=1 / math.sqrt(64))
    assert (out - wrong).abs().max() > 1e-3
    out = tvmflash.attention(q, k, v, softmax_scale=0.3)
    check_attention(out, tvmflash.attention(q, k, v, softmax_scale=0.3, return_lse=True)[1], q, k, v,
                    softmax_scale=0.3)


@pytest.fixture
def padded_to_48(monkeypatch):
    """head_dim 40 padded to 48, as on a GPU whose tensor-core kernels serve 48 and not 40 (the CPU's
    serve 40 itself)."""
    real = choice.head_dim_to_run
    monkeypatch.setattr(choice, "head_dim_to_run",
                        lambda programs, target, dtype, head_dim: 48 if head_dim == 40 else real(programs, target,
                                                                                                 dtype, head_dim))
    kernels.forget_kernels()  # and the API's head_dims to run
    yield
    kernels.forget_kernels()


def test_the_padded_path_matches_the_native_one(padded_to_48):
    """attention at head_dim 40 padded to 48: the 48 kernel on the zero-padded tensors, bit for bit,
    sliced back; and within rounding of the native 40 kernel, forward and gradients."""
    q, k, v = random_qkv(2, 33, 70, *HEADS, 40, torch.float32, "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tvmflash.attention(*leaves, causal=True, return_lse=True)
    assert out.shape == q.shape
    kernel48 = tvmflash.compile(head_dim=48, dtype=torch.float32, causal=True, target="cpu")
    want, want_lse = kernel48(*(F.pad(t, (0, 8)) for t in (q, k, v)), softmax_scale=1 / math.sqrt(40),
                              return_lse=True)
    assert torch.equal(out, want[..., :40]) and torch.equal(lse, want_lse)
    native, native_lse = tvmflash.compile(head_dim=40, dtype=torch.float32, causal=True, target="cpu")(
        q, k, v, return_lse=True)
    assert (out - native).abs().max() < 1e-5 and (lse - native_lse).abs().max() < 1e-5
    dout = torch.randn_like(q)
    out.backward(dout)
    grads = [t.grad for t in leaves]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    check_gradients(grads, q, k, v, dout, causal=True)


def test_a_padded_head_dim_checks_k_and_v():
    """Padded, a k or v of another head_dim than q's would go unnoticed: it is a ValueError."""
    q = torch.randn(1, 4, 2, 59)
    k = torch.randn(1, 4, 2, 60)
    with pytest.raises(ValueError, match=r"k: expected head_dim 59 in the last dim, got shape \(1, 4, 2, 60\)"):
        tvmflash.attention(q, k, q)
    with pytest.raises(ValueError, match=r"v: expected head_dim 59 in the last dim, got shape \(1, 4, 2, 60\)"):
        tvmflash.attention(q, q, k)


def test_packed_forms_at_head_dim_59():
    """qkvpacked and kvpacked at a head_dim the kernels run padded: the gradient flows back into the
    packed tensor, at its own head_dim."""
    qkv = torch.randn(2, 45, 3, 2, 59, requires_grad=True)
    out = tvmflash.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.detach().unbind(2)
    check_attention(out.detach(), tvmflash.attention(q, k, v, causal=True, return_lse=True)[1], q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert qkv.grad.shape == qkv.shape
    check_gradients(qkv.grad.unbind(2), q, k, v, dout, causal=True)
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(tvmflash.flash_attn_kvpacked_func(q, kv, causal=True), tvmflash.flash_attn_func(q, k, v, causal=True))


def test_a_variant_at_head_dim_59():
    """A window, softcap and ALiBi slopes at once, forward and gradients, at a head_dim the kernels run
    padded (the slopes' distances and the cap see the scores of q's own head_dim)."""
    slopes = torch.rand(HEADS[0]) * 0.3
    autograd_matches_float64(59, torch.float32, False, lengths=[(17, 130), (130, 77)], window_size=(24, 8),
                             softcap=5.0, alibi_slopes=slopes)


@pytest.mark.parametrize("head_dim", [8, 59])
def test_varlen_at_any_head_dim(head_dim):
    """flash_attn_varlen_func (an empty sequence, one without keys, causal) and its gradients at head_dim
    8 (served on the CPU) and 59 (padded to 64), each sequence against its own float64 reference."""
    lengths = [(17, 130), (0, 5), (130, 77), (3, 0)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_problem(lengths, HEADS, head_dim, torch.float32, "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = tvmflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True,
                                                  return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (HEADS[0], q.shape[0])
    check_each_sequence(out.detach(), lse.detach(), q, k, v, cu_q, cu_k, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths)):
        if cu_q[b + 1] > cu_q[b]:
            rows = [slice(cu[b], cu[b + 1]) for cu in (cu_q, cu_k, cu_k)]
            check_gradients([t.grad[r][None] for t, r in zip(leaves, rows)], *(t[r][None] for t, r in zip((q, k, v), rows)),
                            dout[rows[0]][None], causal=True)


def test_torch_compile_fullgraph_pads_without_a_break():
    """Under torch.compile (fullgraph: a break raises) the head_dim to run is a constant of the graph:
    head_dim 59, forward and backward, as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = random_qkv(1, 20, 30, *HEADS, 59, torch.float32, "cpu")

    def loss(q, k, v):
        return tvmflash.flash_attn_func(q, k, v, causal=True).square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(loss, fullgraph=True, backend=counter)(*leaves).backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*eager).backward()
    assert counter.frame_count == 1
    for compiled, want in zip(leaves, eager):
        torch.testing.assert_close(compiled.grad, want.grad)


def test_kvcache_at_a_multiple_of_8_and_a_clear_error_otherwise():
    """flash_attn_with_kvcache writes the caches in place, so it pads no head_dim: on the CPU every
    multiple of 8 (here 40, new keys appended, GQA); 59 is a ValueError that names what is served."""
    batch, capacity, new = 3, 70, 2
    k_cache, v_cache, _ = make_cache(batch, capacity, HEADS[1], 40, torch.float32, "cpu")
    cache_seqlens = torch.tensor([0, 31, capacity - new], dtype=torch.int32)
    q = random_q(batch, new, HEADS[0], 40, torch.float32, "cpu")
    k_new, v_new = (random_q(batch, new, HEADS[1], 40, torch.float32, "cpu", seed=s) for s in (7, 8))
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                causal=True, return_softmax_lse=True)
    assert torch.equal(k_cache[1, 31:33], k_new[1])
    check_decode(out, lse, q, k_cache, v_cache, cache_seqlens + new, causal=True)
    q59 = torch.randn(1, 1, 2, 59)
    cache59 = torch.randn(1, 8, 2, 59)
    with pytest.raises(ValueError, match=r"head_dim: expected one the decode kernels serve for float32 on llvm.* \(the "
                                         r"multiples of 8 up to 256\), got 59: flash_attn_with_kvcache writes k_cache "
                                         r"and v_cache in place and pads no head_dim; zero-pad q, the caches, k and v"):
        tvmflash.flash_attn_with_kvcache(q59, cache59, cache59)


def test_head_dim_to_run_on_each_target():
    """What the API runs each head_dim at (no build): on the CPU the next multiple of 8; on a GPU the
    next head_dim checked on a GPU (``contract.GPU_CHECKED_HEAD_DIMS``: the multiples of 16), which
    tensor-core schedules serve for the forward and, up to 128, the backward; on sm_90a padded up to 4/3
    further where sm90 then serves what sm80 would (48 to 64, 80 to 96, 112 to 128; 32 stays at 32), and
    from 136 with the backward to 256, where sm90's wgmma serves it (elsewhere SIMT's at the head_dim).
    Decode serves every multiple of 8 on the CPU, and on a GPU the head_dims checked there."""
    both = ("forward", "backward")
    cases = {("cpu", "bfloat16"): {1: 8, 40: 40, 59: 64, 111: 112, 250: 256},
             ("sm80", "bfloat16"): {1: 16, 8: 16, 40: 48, 59: 64, 80: 80, 111: 112, 136: 144, 250: 256},
             ("sm90", "float16"): {16: 16, 32: 32, 40: 64, 48: 64, 80: 96, 96: 96, 112: 128, 136: 256, 176: 256,
                                   200: 256, 224: 256},
             ("sm80", "float32"): {1: 16, 40: 48, 59: 64, 136: 144}}
    for (target, dtype), runs in cases.items():
        resolved = targets.resolve(target)
        for head_dim, run in runs.items():
            assert choice.head_dim_to_run(both, resolved, dtype, head_dim) == run, (target, dtype, head_dim)
    sm90 = targets.resolve("sm90")  # the forward alone: sm90 at 256 serves what sm80 does at 192 to 240
    assert [choice.head_dim_to_run(("forward",), sm90, "bfloat16", d) for d in (80, 176, 192, 240)] == [96, 176, 256, 256]
    assert choice.native_head_dims("decode", targets.resolve("cpu"), "float16") == tuple(range(8, 257, 8))
    for target, dtype in (("sm80", "bfloat16"), ("sm90", "float16")):
        assert choice.native_head_dims("decode", targets.resolve(target), dtype) == GPU_CHECKED_HEAD_DIMS
    # float32 decodes on SIMT, whose decode takes the multiples of 32
    assert choice.native_head_dims("decode", targets.resolve("sm80"), "float32") == tuple(range(32, 257, 32))


def test_the_environments_backward_schedule_pads_as_the_default(monkeypatch):
    """TVMFLASH_BACKWARD=simt asks for the SIMT backward, which on a GPU serves the head_dims checked
    there as the tensor-core ones do: 120 runs at 128 either way, the backward alone too."""
    sm80 = targets.resolve("sm80")
    assert choice.head_dim_to_run(("forward", "backward"), sm80, "float16", 120) == 128
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")
    assert choice.head_dim_to_run(("forward", "backward"), sm80, "float16", 120) == 128
    assert choice.head_dim_to_run(("backward",), sm80, "float16", 120) == 128


def test_simt_knobs_fit_static_shared_memory_at_every_head_dim():
    """The SIMT forward and backward keep their tiles in static shared memory, 48 KiB at most (ptxas
    refused the float32 forward's 64 KiB at d256 and the backward's defaults failed from d192): their
    knobs shrink to fit at every multiple of 8 (no build)."""
    from tvmflash.schedules import simt

    sm80 = targets.resolve("sm80")
    for head_dim in choice.native_head_dims("forward", sm80, "float32"):
        spec = {"head_dim": head_dim, "dtype": "float32", "causal": False}
        forward = choice.forward(sm80, spec, None)
        assert forward.schedule.name == "simt"
        assert simt.shared_memory_bytes(head_dim, "float32", forward.knobs) <= 48 * 1024, head_dim
        backward = choice.backward(sm80, spec, None)
        assert simt.backward_shared_memory_bytes(head_dim, "float32", backward.knobs) <= 48 * 1024, head_dim


@pytest.mark.parametrize("kind", ["forward", "backward", "decode"])
def test_compile_refuses_a_head_dim_not_checked_on_a_gpu(kind):
    """The GPU schedules serve the head_dims checked on a GPU (the multiples of 16), though their programs
    take every multiple of 8: compile() at 72 names those served, and the torch API pads 72 to 80."""
    compile_ = {"forward": tvmflash.compile, "backward": tvmflash.compile_backward,
                "decode": tvmflash.compile_decode}[kind]
    options = {} if kind == "decode" else {"causal": True}
    with pytest.raises(ValueError, match=r"head_dim.*multiples of 16.*got 72|head_dim 72"):
        compile_(head_dim=72, dtype="bfloat16", target="sm80", **options)
    assert choice.head_dim_to_run((kind,), targets.resolve("sm80"), "bfloat16", 72) == 80


# ----------------------------------------------------------------------------------------------- GPU
# flash-attn 2's grid of head_dims and the other multiples of 16 (16, 48, 112, 144, ...), bfloat16, GQA 4/2,
# causal: each runs at the head_dim ``choice.head_dim_to_run`` gives (GPU_CHECKED_HEAD_DIMS), one forward and
# one backward build for each head_dim run.
GPU_HEAD_DIMS = sorted({32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256, *range(16, 257, 16)})


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
def test_flash_attn_func_and_its_gradients_at_any_head_dim_on_the_gpu(head_dim):
    autograd_matches_float64(head_dim, torch.bfloat16, causal=True,
                             device="cuda", lengths=[(1, 1), (17, 130), (130, 77), (300, 300)])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [160, 192, 224])
def test_sm90_forward_at_its_new_head_dims(monkeypatch, head_dim):
    """The sm90 forward serves the multiples of 32 from 160 to 224 (one block an SM), asked for by
    TVMFLASH_SM90=1: kernels whose output is poisoned first, on an sm_90a GPU."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    if head_dim not in GPU_CHECKED_HEAD_DIMS:  # the check that admits it: run with it widened
        pytest.skip(f"head_dim {head_dim} is not in GPU_CHECKED_HEAD_DIMS yet (schedules/contract.py)")
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=head_dim, dtype=torch.bfloat16, causal=True)
    assert kernel.schedule.name == "sm90"
    for seqlen_q, seqlen_k in [(1, 1), (17, 130), (130, 77), (300, 300)]:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS, head_dim, torch.bfloat16, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(80, torch.bfloat16), (160, torch.float32)], ids=str)
def test_decode_at_new_head_dims_on_the_gpu(head_dim, dtype):
    """flash_attn_with_kvcache at a head_dim the sm80 decode (80, bf16) or the SIMT one (160, float32)
    serves that it did not before: new keys appended, GQA, causal chunks."""
    if head_dim not in GPU_CHECKED_HEAD_DIMS:  # the check that admits it: run with it widened
        pytest.skip(f"head_dim {head_dim} is not in GPU_CHECKED_HEAD_DIMS yet (schedules/contract.py)")
    batch, capacity, new = 3, 200, 3
    k_cache, v_cache, _ = make_cache(batch, capacity, HEADS[1], head_dim, dtype, "cuda")
    cache_seqlens = torch.tensor([0, 77, capacity - new], dtype=torch.int32, device="cuda")
    q = random_q(batch, new, HEADS[0], head_dim, dtype, "cuda")
    k_new, v_new = (random_q(batch, new, HEADS[1], head_dim, dtype, "cuda", seed=s) for s in (7, 8))
    out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                causal=True, num_splits=2, return_softmax_lse=True)
    check_decode(out, lse, q, k_cache, v_cache, cache_seqlens + new, causal=True)
