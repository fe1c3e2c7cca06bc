"""The FP8 (e4m3) forward (issue 44, item 5): the program with ``AttentionSpec.fp8``, the sm90 schedule on
e4m3 wgmma (``schedules/sm90/forward_fp8.py``), ``kernels.fp8.Fp8Kernel`` and ``flash_attn_func``'s descales.

Numerics (the issue's rule): the output is compared with a float64 reference on the same dequantised
inputs, and its error must be at most twice that of a torch emulation that quantises the same places
(q, k, v and P to e4m3, the output to bf16, float32 math)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import tvmflash
from tvmflash.kernels.fp8 import FP8_TORCH, Fp8Kernel, Fp8VarlenKernel, fp8_kernel, transposed_v
from tvmflash.program import FP8, AttentionSpec
from tvmflash.program_forward import attention_forward
from tvmflash.fp8_reference import emulation, forward_error, lse_allowance, reference
from tvmflash.schedules.sm90.knobs import FP8_VARIANTS


@pytest.fixture(autouse=True)
def served_before_its_gpu_check(monkeypatch):
    """The FP8 forward is served where TVMFLASH_GPU_UNCHECKED=1 asks until its GPU tests pass
    (``Fp8Forward.unchecked_head_dims``): these tests, a GPU run's included, ask."""
    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")


def test_fp8_is_refused_unless_asked_until_its_gpu_tests_pass(monkeypatch):
    from tvmflash.schedules.sm90.knobs import FP8_UNCHECKED_HEAD_DIMS

    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")
    served = fp8_kernel(128, False, "sm90")  # built under the variable, and kept
    monkeypatch.delenv("TVMFLASH_GPU_UNCHECKED")
    for head_dim in FP8_UNCHECKED_HEAD_DIMS:
        for make in (Fp8Kernel, fp8_kernel):  # the kept kernel is not served without it
            with pytest.raises(NotImplementedError, match=f"the sm90 FP8 forward at head_dim {head_dim} has not "
                                                          r"passed the GPU tests yet \(TVMFLASH_GPU_UNCHECKED=1 serves it"):
                make(head_dim, False, "sm90")
    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")
    assert fp8_kernel(128, False, "sm90") is served

F8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------
# TVM 0.27's LLVM code converts e4m3 in software and gets zero and the subnormals wrong (0 becomes 2^-7;
# float32 -> e4m3 flushes them to 0; ``test_llvm_e4m3_conversions_are_wrong_at_zero_and_subnormals``): on the
# CPU the FP8 program converts by the bits instead (``program_e4m3``), so the CPU tests take any input, as the GPU's.
SMALLEST_NORMAL = 2.0 ** -6


def inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, device, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def e4m3(*shape):
        return (torch.randn(*shape, generator=generator) * 2).to(F8).to(device)

    def descale():
        return (torch.rand(batch, heads_kv, generator=generator) + 0.5).to(device)

    return (e4m3(batch, seqlen_q, heads_q, head_dim), e4m3(batch, seqlen_k, heads_kv, head_dim),
            e4m3(batch, seqlen_k, heads_kv, head_dim), descale(), descale(), descale())


def check_against_reference(run, shape, head_dim, causal, device):
    """run(q, k, v, qd, kd, vd, scale, out) -> (out, lse) against ``reference``: the error at most twice the
    emulation's, the LSE within ``lse_allowance`` (float32's rounding of the scores on the CPU, the GPU's own FP8
    product's error on a GPU), rows that see no key 0, no NaN."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, v, qd, kd, vd = inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, device)
    scale = head_dim ** -0.5
    poisoned = torch.full((batch, seqlen_q, heads_q, head_dim), math.nan, dtype=torch.bfloat16, device=device)
    out, lse = run(q, k, v, qd, kd, vd, scale, poisoned)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (batch, seqlen_q, heads_q, head_dim)
    assert not out.isnan().any(), "unwritten or NaN outputs"
    _, ref_lse = reference(q, k, v, qd, kd, vd, scale, causal)
    error, allowed = forward_error(out, q, k, v, qd, kd, vd, scale, causal)  # (the tuner's check too)
    emulation_error = allowed / 2
    assert emulation_error > 0  # the rule compares with a real quantisation error
    assert error <= allowed, (error, emulation_error)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen.to(lse.device))
    assert (lse.double()[seen] - ref_lse[seen]).abs().max().item() <= lse_allowance(q, k, qd, kd, scale)
    return error, emulation_error


# ----------------------------------------------------------------------------------------------------
# the program and the layouts (CPU)
# ----------------------------------------------------------------------------------------------------
def test_fp8_spec_takes_causal_gqa_and_varlen_only():
    AttentionSpec(64, FP8, True, 8, 2, varlen=True)
    for variant in ({"window_left": 16}, {"softcap": 30.0}, {"alibi": True}, {"dropout": True}, {"sinks": True}):
        with pytest.raises(NotImplementedError, match="FP8 forward takes causal, GQA and varlen only"):
            AttentionSpec(64, FP8, **variant)
    with pytest.raises(ValueError, match="multiple of 16"):
        AttentionSpec(40, FP8)


def test_fp8_program_takes_fa3s_arguments():
    """q, k and the transposed V in e4m3, the output bf16, FA3's three descales last; bf16's program has none."""
    func = attention_forward(AttentionSpec(128, FP8, True, 4, 2), 128, 128)
    names = [p.name for p in func.params]
    assert names[-3:] == ["q_descale", "k_descale", "v_descale"]
    params = {p.name: p for p in func.params}  # (0.27: a tensor parameter carries its dtype and shape)
    assert str(params["q_in"].dtype) == FP8 and str(params["o_in"].dtype) == "bfloat16"
    assert [str(e) for e in params["v_in"].shape] == ["batch", "2", "128", "v_keys"]  # keys contiguous
    assert all(str(params[f"{n}_descale"].dtype) == "float32" for n in "qkv")
    plain = attention_forward(AttentionSpec(128, "bfloat16", True, 4, 2), 128, 128)
    assert len(plain.params) == len(func.params) - 3


def test_fp8_key_order_puts_p_in_the_a_fragment():
    """For every element a of every thread's e4m3 A fragment (PTX ISA, "WGMMA .m64nNk32 register fragment
    layout for matrix A", written out here on its own), the K tile's row permutation (``fp8_key_row``)
    makes S's accumulator hold that key in the same thread, and ``fp8_a_index`` names that register."""
    from tvmflash.schedules.sm90.layouts import acc_layout, fp8_a_index, fp8_key_row

    assert sorted(fp8_key_row(j) for j in range(64)) == list(range(64))
    for t in range(128):
        for a in range(16):
            row = 16 * (t // 32) + (t % 32) // 4 + 8 * (a // 4 % 2)
            for ks in range(2):  # two k32 slices
                key = 32 * ks + 4 * (t % 4) + a % 4 + 16 * (a // 8)
                assert acc_layout(row, fp8_key_row(key))[0] == t, (t, a, key)
                assert fp8_a_index(row, key) == 16 * ks + a, (t, a, key)


def test_llvm_e4m3_conversions_are_wrong_at_zero_and_subnormals():
    """Why the FP8 program converts by the bits on the CPU (``program_e4m3``): TVM 0.27's LLVM conversions. When
    this fails, TVM converts correctly, and ``target.converts_fp8`` may say so for the CPU."""
    import tvm
    from tvm.script import tirx as T

    from tvmflash import target as targets

    @T.prim_func
    def convert(a: T.Buffer((256,), "float8_e4m3fn"), b: T.Buffer((256,), "float32")):
        for i in range(256):
            b[i] = T.cast(a[i], "float32")

    every = torch.arange(256, dtype=torch.uint8).view(F8)
    out = torch.empty(256)
    tvm.compile(tvm.IRModule({"main": convert}), target=targets.cpu_target())["main"](every, out)
    wrong = ~((out == every.float()) | (out.isnan() & every.float().isnan()))
    assert out[0].item() == 2.0 ** -7  # the zero byte
    normal = every.float().abs() >= SMALLEST_NORMAL
    assert wrong.any() and not (wrong & normal).any()


def test_the_bit_conversions_are_exact_as_cuda_cvt():
    """``program_e4m3`` on the CPU: every e4m3 byte to float32 exactly, and float32 to e4m3's value as
    cvt.rn.satfinite does (torch's rounding, to nearest even, subnormals included; past 448 saturating) at
    every e4m3 value, every midpoint between two and next to them, and random values of every scale."""
    import tvm
    from tvm.script import tirx as T

    from tvmflash import target as targets
    from tvmflash.program_e4m3 import e4m3_bits_to_float32, float32_to_e4m3_value

    every = torch.arange(256, dtype=torch.uint8)
    values = every.view(F8).float()
    finite = values[~values.isnan()].unique()
    middles = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, middles, middles.nextafter(torch.tensor(math.inf)), middles.nextafter(torch.tensor(-math.inf)),
                   torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-12, 3, 20000, 2.0),
                   torch.tensor([0.0, -0.0, 2.0 ** -10, 2.0 ** -126, 1e-45, 448.0, 460.0, 464.0, 1000.0, 3e38])])
    x = torch.cat([x, -x])
    n = x.numel()

    @T.prim_func
    def convert(a: T.Buffer((256,), "uint8"), b: T.Buffer((256,), "float32"), c: T.Buffer((n,), "float32"),
                d: T.Buffer((n,), "float32")):
        for i in range(256):
            b[i] = e4m3_bits_to_float32(a[i])
        for i in range(n):
            d[i] = float32_to_e4m3_value(c[i])

    read, rounded = torch.empty(256), torch.empty(n)
    tvm.compile(tvm.IRModule({"main": convert}), target=targets.cpu_target())["main"](every, read, x, rounded)
    assert torch.equal(read.isnan(), values.isnan()) and torch.equal(read[~values.isnan()], values[~values.isnan()])
    assert torch.equal(read.view(torch.int32)[~values.isnan()], values.view(torch.int32)[~values.isnan()])  # -0 too
    expected = x.clamp(-448, 448).to(F8).float()  # (torch's conversion gives NaN past 448: satfinite gives 448)
    assert torch.equal(rounded.view(torch.int32), expected.view(torch.int32)), (x[rounded != expected][:8],
                                                                                rounded[rounded != expected][:8])


def test_transposed_v_is_zero_past_the_keys():
    v = (torch.randn(2, 5, 3, 16) * 2).to(F8)
    vt = transposed_v(v, 32)
    assert vt.shape == (2, 3, 16, 32) and vt.is_contiguous()
    assert torch.equal(vt[..., :5].float(), v.permute(0, 2, 3, 1).float())
    assert not vt[..., 5:].float().any()


@pytest.mark.parametrize("head_dim,causal,shape", [
    (64, True, (2, 100, 130, 4, 2)),  # ragged, GQA, causal
    (128, False, (1, 70, 33, 2, 1)),  # fewer keys than a tile, MQA
    (64, True, (1, 90, 40, 2, 2)),  # causal with more queries than keys: rows that see no key
    (64, False, (2, 300, 517, 8, 2)),  # the GPU test's: several K/V tiles, the row max moving across them
], ids=["d64-causal-gqa", "d128-mqa", "d64-causal-empty-rows", "d64-ragged-gqa"])
def test_fp8_program_on_the_cpu(head_dim, causal, shape):
    """The FP8 program (the CPU schedule's build) against the float64 reference: what the sm90 kernel computes."""
    kernel = Fp8Kernel(head_dim, causal, "cpu")

    def run(q, k, v, qd, kd, vd, scale, out):
        return kernel(q, k, v, qd, kd, vd, softmax_scale=scale, return_lse=True, out=out)

    check_against_reference(run, shape, head_dim, causal, "cpu")


def check_varlen(kernel, head_dim, causal, lengths_q, lengths_k, heads_q, heads_kv, device):
    """A varlen FP8 kernel against each sequence's float64 reference (``reference``), the error at most
    twice the emulation's over all sequences, the output poisoned with NaN first."""
    q, k, v, _, _, _ = inputs(1, sum(lengths_q), sum(lengths_k), heads_q, heads_kv, head_dim, device)
    q, k, v = q[0], k[0], v[0]
    batch = len(lengths_q)
    generator = torch.Generator().manual_seed(1)
    qd, kd, vd = ((torch.rand(batch, heads_kv, generator=generator) + 0.5).to(device) for _ in range(3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    scale = head_dim ** -0.5
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device=device)
    out, lse = kernel(q, k, v, cu_q, cu_k, max(lengths_q), qd, kd, vd, softmax_scale=scale, return_lse=True, out=out)
    assert not out.isnan().any()
    error = emulation_error = 0.0
    for b in range(batch):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [t[None] for t in (q[rows], k[keys], v[keys])] + [d[b:b + 1] for d in (qd, kd, vd)]
        ref, ref_lse = reference(*one, scale, causal)
        if ref.numel():
            error = max(error, (out[rows].double() - ref[0]).abs().max().item())
            emulation_error = max(emulation_error, (emulation(*one, scale, causal)[0].double() - ref[0]).abs().max().item())
            seen = torch.isfinite(ref_lse[0])
            assert torch.equal(torch.isfinite(lse[:, rows]), seen.to(lse.device))
            assert (lse[:, rows].double()[seen] - ref_lse[0][seen]).abs().max().item() <= lse_allowance(
                one[0], one[1], one[3], one[4], scale)
    assert 0 < error <= 2 * emulation_error, (error, emulation_error)
    return error, emulation_error


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_varlen_program_on_the_cpu(causal):
    """The packed sequences (an empty one, more queries than keys, tails) against each one's reference."""
    check_varlen(Fp8VarlenKernel(64, causal, "cpu"), 64, causal, [37, 0, 100, 20], [50, 20, 130, 9], 4, 2, "cpu")


def test_fp8_varlen_v_rows_start_aligned_for_the_16_byte_copies(monkeypatch):
    """The sm90 schedule copies the transposed V's rows 16 bytes at a time (cp.async): each packed sequence's
    keys, wherever cu_seqlens_k starts them (here at 517, 581, ...), must start at a 16-byte aligned column,
    where the program reads them (``program.fp8_v_first``), with zeros between the sequences."""
    from tvmflash import program
    from tvmflash.kernels.build import Build

    lengths = [517, 64, 0, 300, 1000, 9]
    kernel = Fp8VarlenKernel(64, False, "cpu")
    q, k, v, _, _, _ = inputs(1, len(lengths), sum(lengths), 2, 1, 64, "cpu")
    q, k, v = q[0], k[0], v[0]
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    passed = {}
    module_for = Build.module_for

    def capture(self, *args, **tensors):
        passed.update(tensors)
        return module_for(self, *args, **tensors)

    monkeypatch.setattr(Build, "module_for", capture)
    kernel(q, k, v, cu_q, cu_k, 1)
    vt = passed["v"]
    assert vt.shape[-1] % 16 == 0 and vt.is_contiguous()
    written = torch.zeros(vt.shape[-1], dtype=torch.bool)
    for b, length in enumerate(lengths):
        first = program.fp8_v_first(int(cu_k[b]), b)
        assert first % 16 == 0 and not written[first]  # after the sequence before's keys
        keys = vt[0, ..., first:first + length].view(torch.uint8)
        assert torch.equal(keys, v[cu_k[b]:cu_k[b + 1]].view(torch.uint8).permute(1, 2, 0))
        written[first:first + length] = True
    assert not vt[0, ..., ~written].view(torch.uint8).any()


def test_fp8_descales_default_to_one():
    kernel = Fp8Kernel(64, False, "cpu")
    q, k, v, *_ = inputs(1, 20, 30, 2, 1, 64, "cpu")
    ones = torch.ones(1, 1)
    assert torch.equal(kernel(q, k, v), kernel(q, k, v, ones, ones, ones))
    assert not torch.equal(kernel(q, k, v), kernel(q, k, v, ones, ones, 2 * ones))


# ----------------------------------------------------------------------------------------------------
# the sm90 build (cross-compiled on the CPU)
# ----------------------------------------------------------------------------------------------------
def test_fp8_sm90_source_runs_on_e4m3_wgmma():
    """QK^T on the "ss" form, P V on the "rs" form, both m64nNk32 e4m3; no 16-bit wgmma."""
    src = Fp8Kernel(128, True, "sm90").source(heads_q=4, heads_kv=2)
    assert "wgmma_fp8_ss_mma_async_sync_aligned_m64n128k32_f32_e4m3_e4m3" in src
    assert "wgmma_fp8_rs_mma_async_sync_aligned_m64n128k32_f32_e4m3_e4m3" in src
    assert "bf16_ss" not in src and "bf16_rs" not in src
    assert "nv_bfloat16* __restrict__ O_ptr" in src  # the output in bf16


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_sm90_builds_without_spills(head_dim, causal):
    from conftest import ptxas_report

    report = ptxas_report(Fp8Kernel(head_dim, causal, "sm90").source(heads_q=4, heads_kv=2), "sm_90a")
    assert len(report) == 1
    for name, lines in report.items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_sm90_varlen_builds_without_spills(head_dim):
    from conftest import ptxas_report

    for name, lines in ptxas_report(Fp8VarlenKernel(head_dim, True, "sm90").source(heads_q=4, heads_kv=2),
                                    "sm_90a").items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim,variant", [(d, name) for d, named in sorted(FP8_VARIANTS.items()) for name in named])
def test_fp8_sm90_variants_build_without_spills(head_dim, variant):
    from conftest import ptxas_report

    kernel = Fp8Kernel(head_dim, True, "sm90", knobs=FP8_VARIANTS[head_dim][variant])
    for name, lines in ptxas_report(kernel.source(heads_q=4, heads_kv=2), "sm_90a").items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


# ----------------------------------------------------------------------------------------------------
# what it refuses
# ----------------------------------------------------------------------------------------------------
def test_fp8_refusals():
    q, k, v, qd, kd, vd = inputs(1, 16, 16, 2, 1, 64, "cpu")
    with pytest.raises(NotImplementedError, match="sm90"):  # the CPU
        tvmflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    for options in ({"dropout_p": 0.1}, {"window_size": (8, 0)}, {"softcap": 30.0}, {"alibi_slopes": torch.ones(2)},
                    {"sinks": torch.zeros(2)}):
        with pytest.raises(NotImplementedError, match=next(iter(options))):
            tvmflash.flash_attn_func(q, k, v, q_descale=qd, **options)
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # descales with bf16 tensors
        tvmflash.flash_attn_func(q.to(torch.bfloat16), k, v, q_descale=qd)
    for target in ("sm80", "sm89"):
        with pytest.raises(NotImplementedError, match="sm90"):
            Fp8Kernel(64, False, target)
    with pytest.raises(NotImplementedError, match="head_dim"):
        Fp8Kernel(96, False, "sm90")
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sm90"):
        tvmflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16)
    with pytest.raises(NotImplementedError, match="block_table"):
        tvmflash.flash_attn_varlen_func(q[0], k, v, cu, cu, 16, 16, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="FP8"):
        tvmflash.flash_attn_with_kvcache(q, k, v)
    with pytest.raises(NotImplementedError, match="flash_attn_func"):  # the other entry points name the one that serves
        tvmflash.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="flash_attn_func"):
        tvmflash.compile(head_dim=64, dtype=FP8, target="sm90")
    kernel = fp8_kernel(64, False, "cpu")
    with pytest.raises(NotImplementedError, match="no backward"):
        kernel(q, k, v.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"q_descale: expected shape"):
        kernel(q, k, v, torch.ones(2, 2))
    with pytest.raises(ValueError, match="multiple"):
        kernel(q, k[:, :, :1].expand(1, 16, 3, 64).contiguous(), v[:, :, :1].expand(1, 16, 3, 64).contiguous())


# ----------------------------------------------------------------------------------------------------
# on the GPU (sm90)
# ----------------------------------------------------------------------------------------------------
def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 300, 517, 8, 2), (1, 1000, 1000, 8, 2), (2, 333, 129, 8, 1)],
                         ids=["ragged-gqa", "square", "more-queries-mqa"])
def test_fp8_forward_on_sm90(head_dim, causal, shape):
    """flash_attn_func in FP8 against the float64 reference of the dequantised inputs (the issue's rule),
    outputs poisoned with NaN first."""
    if not _sm90():
        pytest.skip("needs an sm90 GPU (H100, H200)")

    def run(q, k, v, qd, kd, vd, scale, out):
        kernel = fp8_kernel(head_dim, causal, None)
        assert kernel.info()["schedule"] == "sm90"
        out, lse = kernel(q, k, v, qd, kd, vd, softmax_scale=scale, return_lse=True, out=out)
        public, public_lse, _ = tvmflash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, q_descale=qd,
                                                         k_descale=kd, v_descale=vd, return_attn_probs=True)
        assert torch.equal(public, out) and torch.equal(public_lse, lse)
        return out, lse

    error, emulation_error = check_against_reference(run, shape, head_dim, causal, "cuda")
    print(f"fp8 d{head_dim} {'causal' if causal else 'full'} {shape}: max error {error:.3g}, "
          f"emulation's {emulation_error:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_varlen_on_sm90(head_dim, causal):
    """flash_attn_varlen_func in FP8 against each sequence's float64 reference."""
    if not _sm90():
        pytest.skip("needs an sm90 GPU (H100, H200)")

    def call(q, k, v, cu_q, cu_k, max_q, qd, kd, vd, softmax_scale, return_lse, out):
        kernel = fp8_kernel(head_dim, causal, None, varlen=True)
        out, lse = kernel(q, k, v, cu_q, cu_k, max_q, qd, kd, vd, softmax_scale=softmax_scale, return_lse=True,
                          out=out)
        public, public_lse, _ = tvmflash.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, 0, softmax_scale=softmax_scale, causal=causal, q_descale=qd, k_descale=kd,
            v_descale=vd, return_attn_probs=True)
        assert torch.equal(public, out) and torch.equal(public_lse, lse)
        return out, lse

    error, emulation_error = check_varlen(call, head_dim, causal, [300, 0, 517, 129, 1000], [517, 64, 300, 1000, 1000],
                                          8, 2, "cuda")
    print(f"fp8 varlen d{head_dim} {'causal' if causal else 'full'}: max error {error:.3g}, "
          f"emulation's {emulation_error:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,variant", [(d, name) for d, named in sorted(FP8_VARIANTS.items()) for name in named])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_knob_variants_on_sm90(head_dim, variant, causal):
    """The other knobs benchmarks/fp8_bench.py measures (``knobs.FP8_VARIANTS``) are as correct."""
    if not _sm90():
        pytest.skip("needs an sm90 GPU (H100, H200)")
    kernel = Fp8Kernel(head_dim, causal, None, knobs=FP8_VARIANTS[head_dim][variant])

    def run(q, k, v, qd, kd, vd, scale, out):
        return kernel(q, k, v, qd, kd, vd, softmax_scale=scale, return_lse=True, out=out)

    check_against_reference(run, (2, 300, 517, 8, 2), head_dim, causal, "cuda")


def test_a_view_at_an_unaligned_offset_is_copied_for_the_16_byte_copies():
    """The FP8 kernel reads q and k by 16-byte copies: a compact view whose data is not 16-byte aligned
    (an offset of one e4m3 element) is copied, never passed in place; an aligned one is."""
    kernel = Fp8Kernel(64, False, "sm90")
    storage = torch.randn(1 + 2 * 3 * 4 * 64).to(FP8_TORCH)
    base = storage[:-1].view(2, 3, 4, 64)
    shifted = storage[1:].view(2, 3, 4, 64)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    copied = kernel._usable(shifted)
    assert copied.data_ptr() % 16 == 0 and torch.equal(copied.view(torch.uint8), shifted.view(torch.uint8))
    if base.data_ptr() % 16 == 0:
        assert kernel._usable(base) is base
