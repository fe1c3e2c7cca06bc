"""The gradient of a captured float tensor that requires grad (a learnable bias) in flex_attention, made by dkdv
(``program_flex_gradient``) or by torch after the kernels' backward (``flex_gradient``), against float64
autograd of the reference attention (flash-attn's rule: at most 2x torch's same-dtype error + a small eps).

On the CPU, TVMFLASH_FLEX_GRADIENT=kernel runs dkdv's additions (its tiles in turn: LLVM has no atomics);
the GPU tests take the default, dkdv's atomic additions."""

from __future__ import annotations

import math

import shutil

import pytest
import torch
from reference import max_error
from torch.nn.attention.flex_attention import create_block_mask
from test_flex import CPU_DTYPE, CPU_HEAD_DIM, HEADS, flex_reference, random_qkv

import tvmflash
from tvmflash import choice, flex_gradient, program_flex, program_flex_gradient
from tvmflash.flex_trace import trace_mods

REACH = 32  # the relative table's: distances beyond it share its last entries


def relative(gen, device):
    """A learnable relative-position bias (heads, 2 REACH + 1) table, clamped: most of a long row's keys share
    the table's end entries (the merged runs' case), the diagonal's each its own."""
    table = torch.randn(HEADS[0], 2 * REACH + 1, generator=gen).to(device).requires_grad_()

    def mods(table):
        return lambda s, b, h, i, j: s + table[h, torch.clamp(i - j, -REACH, REACH) + REACH], None
    return [table], mods


def per_head(gen, device):
    """A per-head scalar bias and a per-head float16 temperature that multiplies the score (its derivative
    reads the score), beside a mask_mod that hides every key from some rows."""
    bias = torch.randn(HEADS[0], generator=gen).to(device).requires_grad_()
    temperature = (1 + torch.rand(HEADS[0], generator=gen) * 0.5).to(device=device, dtype=torch.float16)

    def mods(bias, temperature):
        def score_mod(s, b, h, i, j):
            return s * temperature[h] + bias[h]
        return score_mod, lambda b, h, i, j: (j <= i + 3) & (i % 4 != 1)
    return [bias, temperature.requires_grad_()], mods


def positions(gen, device, seqlen_q, seqlen_k):
    """A 2-D (seqlen_q, seqlen_k) bias: each element of the table its own (query, key)."""
    table = (torch.randn(seqlen_q, seqlen_k, generator=gen) * 0.5).to(device).requires_grad_()

    def mods(table):
        return lambda s, b, h, i, j: s + table[i, j], None
    return [table], mods


def causal_blocks(gen, device):
    """The relative table under a causal BlockMask of 32 x 32 blocks (``create_block_mask``): dkdv walks its
    lists, full blocks skip the mask, and the steps past a list visit tiles past the end (P 0: nothing added)."""
    tensors, mods = relative(gen, device)
    return tensors, lambda table: (mods(table)[0], lambda b, h, i, j: i >= j)


CASES = {"relative": relative, "per-head": per_head, "positions": positions, "causal-blocks": causal_blocks}


def learned_gradients_match_float64(device, dtype, head_dim, seqlen_q, seqlen_k, case, seed, where, monkeypatch):
    """The gradients of q, k, v and the case's learned tensors through out and lse, made ``where`` ("kernel":
    dkdv, "torch": flex_gradient, checked by whether flex_gradient runs), against float64 autograd."""
    monkeypatch.setenv(choice.FLEX_GRADIENT, where)
    calls = []
    torch_path = flex_gradient.capture_gradients
    monkeypatch.setattr(flex_gradient, "capture_gradients", lambda *a, **kw: calls.append(1) or torch_path(*a, **kw))
    gen = torch.Generator().manual_seed(seed)
    make = CASES[case]
    tensors, mods = make(gen, device, seqlen_q, seqlen_k) if case == "positions" else make(gen, device)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, dtype, device, head_dim, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    score_mod, mask_mod = mods(*tensors)
    block_mask = mask_mod if case != "causal-blocks" else create_block_mask(
        mask_mod, None, None, seqlen_q, seqlen_k, device=device, BLOCK_SIZE=32)
    out, lse = tvmflash.flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                       return_lse=True)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse.detach()), 0.0)
    for t in tensors:
        t.grad = None
    torch.autograd.backward([out, lse], [dout, dlse])
    assert bool(calls) == (where == "torch"), f"the gradient was not made by {where}"
    refs = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v, *tensors)]
        ref_out, ref_lse = flex_reference(*ref_leaves[:3], *mods(*ref_leaves[3:]), dtype=ref_dtype)
        loss = (ref_out * dout.to(ref_dtype)).sum()
        loss = loss + (ref_lse.masked_fill(ref_lse == -math.inf, 0) * dlse.to(ref_dtype)).sum()
        refs.append(torch.autograd.grad(loss, ref_leaves))
    for n, t in enumerate([*leaves, *tensors]):
        ours, ref, same = t.grad, refs[0][n], refs[1][n]
        assert ours is not None and ours.shape == ref.shape and ours.dtype == t.dtype, n
        assert torch.isfinite(ours).all(), n
        err, their_err = max_error(ours, ref), max_error(same, ref)
        floor = 1e-5 * (1 + ref.abs().max().item())
        assert err <= 2 * their_err + floor, f"tensor {n}: error {err:.3e} > 2 x torch's {their_err:.3e} + {floor:.1e}"


# torch's way under a BlockMask is the same code as without one (the traced tree evaluated with torch, the mask
# applied): its build of the BlockMask's kernels is left to the kernel's case
@pytest.mark.parametrize("case, where", [(case, where) for case in sorted(CASES) for where in ("kernel", "torch")
                                         if (case, where) != ("causal-blocks", "torch")])
def test_a_learned_bias_gets_its_gradient_on_the_cpu(case, where, monkeypatch):
    learned_gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, 77, 130, case, 11, where, monkeypatch)


def test_a_learned_bias_gets_its_gradient_from_dkdv_in_bfloat16_on_the_cpu(monkeypatch):
    """bfloat16: on a CPU with AMX its schedule's dkdv (its tiles in turn, as the CPU schedule's). The BlockMask's
    walk is float32's (``test_a_learned_bias_gets_its_gradient_on_the_cpu``), so that the CPU suite builds it once."""
    learned_gradients_match_float64("cpu", torch.bfloat16, 64, 77, 130, "relative", 12, "kernel", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case, dtype", [(case, torch.bfloat16) for case in sorted(CASES)] + [("relative", torch.float16)])
def test_a_learned_bias_gets_its_gradient_from_dkdv_on_the_gpu(case, dtype, monkeypatch):
    for seqlen_q, seqlen_k in ((1000, 1000), (300, 1000), (130, 77)):
        learned_gradients_match_float64("cuda", dtype, 128, seqlen_q, seqlen_k, case, seqlen_q + seqlen_k, "kernel",
                                        monkeypatch)


@pytest.mark.gpu
def test_a_learned_bias_gets_its_gradient_from_dkdvs_slices_at_head_dim_256(monkeypatch):
    """sm90's dkdv at d256 makes dk and dv in slices of the columns, each key's dS in both: one adds it."""
    learned_gradients_match_float64("cuda", torch.bfloat16, 256, 300, 1000, "relative", 5, "kernel", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sm80", "simt"])
def test_a_learned_bias_gets_its_gradient_from_the_other_gpu_schedules(schedule, monkeypatch):
    monkeypatch.setenv("TVMFLASH_BACKWARD", schedule)
    learned_gradients_match_float64("cuda", torch.float16, 64, 300, 1000, "relative", 3, "kernel", monkeypatch)


def test_deterministic_algorithms_and_the_cpu_take_torchs_way_unless_asked(monkeypatch):
    monkeypatch.delenv(choice.FLEX_GRADIENT, raising=False)
    monkeypatch.setenv(choice.GPU_UNCHECKED, "1")
    assert choice.capture_gradients_in_kernel("cuda", False)
    monkeypatch.setattr(choice, "GRADIENT_UNCHECKED", True)  # until the GPU tests pass: torch's way unless asked
    monkeypatch.delenv(choice.GPU_UNCHECKED)
    assert not choice.capture_gradients_in_kernel("cuda", False)
    monkeypatch.setattr(choice, "GRADIENT_UNCHECKED", False)
    assert choice.capture_gradients_in_kernel("cuda", False)
    assert not choice.capture_gradients_in_kernel("cuda", True)
    assert not choice.capture_gradients_in_kernel("cpu", False)
    monkeypatch.setenv(choice.FLEX_GRADIENT, "kernel")
    assert choice.capture_gradients_in_kernel("cpu", False) and not choice.capture_gradients_in_kernel("cpu", True)
    monkeypatch.setenv(choice.FLEX_GRADIENT, "atomics")
    with pytest.raises(ValueError, match="TVMFLASH_FLEX_GRADIENT"):
        choice.capture_gradients_in_kernel("cuda", False)


def test_the_derivative_in_a_load_is_torchs():
    """d score_mod / d (a load): the rules of the score's derivative, a product's other factor alone."""
    table, w = torch.zeros(4, 9), torch.zeros(4)
    mods, _ = trace_mods(lambda s, b, h, i, j: s * w[h] + torch.tanh(table[h, i - j + 4]) * 2, None)
    loads = program_flex_gradient.learned_loads(program_flex.FlexMods(mods.score, None, mods.captures, learned=(0, 1)))
    w_load, table_load = sorted(loads, key=lambda load: load.value)  # w is captured first
    assert program_flex.derivative(mods.score, w_load) == program_flex.SCORE  # d(s * w) / dw = s
    tanh = program_flex.make("tanh", table_load)
    expected = program_flex.make("mul", program_flex.make("sub", 1.0, program_flex.make("mul", tanh, tanh)), 2.0)
    assert program_flex.derivative(mods.score, table_load) == expected


def test_the_gradient_buffers_are_parameters_of_dkdv_only_where_a_capture_is_learned():
    from tvmflash import program_backward
    from tvmflash.program import AttentionSpec
    table = torch.zeros(4, 9)
    mods, _ = trace_mods(lambda s, b, h, i, j: s + table[h, torch.clamp(i - j, -4, 4) + 4], None)
    modules = [program_backward.attention_backward(AttentionSpec(32, "float32", False, 4, 4, flex=program_flex.FlexMods(
        mods.score, None, mods.captures, learned=learned)), 32, 32) for learned in ((), (0,))]
    plain, learning = ({name: module[name] for name in ("dkdv", "dq")} for module in modules)
    assert len(learning["dkdv"].params) == len(plain["dkdv"].params) + 1
    assert "Captured0Grad" in learning["dkdv"].script() and "capture_gradient" in learning["dkdv"].script()
    assert "capture_gradient" not in plain["dkdv"].script()
    assert learning["dq"].script() == plain["dq"].script()
    with pytest.raises(ValueError, match="learned"):
        program_flex.FlexMods(mods.score, None, mods.captures, learned=(1,))


def learned_relative_table_mods():
    table = torch.zeros(4, 2 * REACH + 1, requires_grad=True)
    mods, _ = trace_mods(lambda s, b, h, i, j: s + table[h, torch.clamp(i - j, -REACH, REACH) + REACH], None)
    return program_flex.FlexMods(mods.score, None, mods.captures, learned=(0,))


@pytest.mark.parametrize("target, schedule", [("sm80", "sm80"), ("sm80", "simt"), ("sm90", "sm90")])
def test_the_gpu_schedules_add_the_gradient_in_runs_of_atomics(target, schedule):
    """Built without a GPU: each schedule's dkdv adds into the gradient by atomics, a thread's run of additions to
    one element summed first (``MERGED_ATOMIC_ADD_PRAGMA``), and no other program takes the gradient. (The GPU
    tests check what they add.)"""
    kernel = tvmflash.compile_backward(head_dim=64, dtype="float16", target=target, flex=learned_relative_table_mods(),
                                       schedule=schedule)
    source = kernel.source(heads_q=4, heads_kv=2)
    dkdv = source[source.index("dkdv_kernel("):]
    assert "Captured0Grad_run_sum" in dkdv and "atomic_add((&(Captured0Grad_ptr[" in dkdv
    # whole warps (tensor cores' schedules): a warp's last runs on one element added once
    assert ("tvmflash_warp_merged_add((&(Captured0Grad_ptr[0]))" in dkdv) == (schedule != "simt")
    assert source.count("Captured0Grad_ptr") == dkdv.count("Captured0Grad_ptr")


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_sm90_cuda_of_the_learned_gradient_compiles_with_nvcc():
    from tvm.support import nvcc
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", flex=learned_relative_table_mods())
    with kernel.target:
        cubin = nvcc.compile_cuda(kernel.source(heads_q=4, heads_kv=2), target_format="cubin", arch="sm_90a",
                                  compiler="nvcc")
    assert len(cubin) > 1000


def test_a_learned_tensor_read_only_as_an_index_gets_a_zero_gradient(monkeypatch):
    """A float tensor that requires grad but reaches the logit only through an index: no addition, zeros."""
    monkeypatch.setenv(choice.FLEX_GRADIENT, "kernel")
    offsets = torch.tensor([0.0, 1.0, 2.0, 3.0], requires_grad=True)
    table = torch.randn(4, 8, requires_grad=True)
    q, k, v = random_qkv(1, 20, 20, torch.float32, "cpu", CPU_HEAD_DIM, seed=1)
    out = tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, torch.clamp(offsets[h].int(), 0, 3) + 4],
                                  enable_gqa=True)
    out.sum().backward()
    assert offsets.grad is not None and torch.equal(offsets.grad, torch.zeros(4))
    assert table.grad is not None and table.grad.abs().sum() > 0
