"""The AMX schedule (``schedules/amx/``): chosen only where the llvm target's CPU has AMX bf16, whatever the
host; its numerics only on a host with AMX (elsewhere skipped; the plain CPU schedule serves there)."""

import pytest
import torch
from conftest import poisoned_out, random_qkv
from reference import check_attention

import tvmflash
from tvmflash import target as targets

SAPPHIRE_RAPIDS = {"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2}
needs_amx = pytest.mark.skipif(not targets.host_amx(), reason="needs a host CPU with AMX bf16 (amx_tile, amx_bf16)")


def test_the_cpu_target_has_amx_exactly_where_the_host_does():
    assert targets.llvm_has_features(targets.cpu_target(), targets.AMX_FEATURES) == targets.host_amx()


@pytest.mark.parametrize("target, dtype, head_dim, schedule", [
    (SAPPHIRE_RAPIDS, "bfloat16", 64, "amx"),
    (SAPPHIRE_RAPIDS, "bfloat16", 96, "amx"),
    (SAPPHIRE_RAPIDS, "bfloat16", 40, "cpu"),  # no multiple of 32
    (SAPPHIRE_RAPIDS, "float16", 64, "cpu"),
    (SAPPHIRE_RAPIDS, "float32", 64, "cpu"),
    ({**SAPPHIRE_RAPIDS, "mattr": ["-amx-bf16", "-amx-tile"]}, "bfloat16", 64, "cpu"),  # AMX hidden
    ({"kind": "llvm", "mcpu": "icelake-server", "num-cores": 2}, "bfloat16", 64, "cpu"),
    ({"kind": "llvm", "mcpu": "znver4", "num-cores": 2}, "bfloat16", 64, "cpu"),
    ({"kind": "llvm", "mcpu": "icelake-server", "mattr": ["+amx-tile", "+amx-bf16"]}, "bfloat16", 64, "amx"),
])
def test_amx_serves_the_bf16_forward_and_backward_where_the_target_has_amx(target, dtype, head_dim, schedule):
    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, target=target)
    assert kernel.info()["schedule"] == schedule
    assert tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, target=target).info()["schedule"] == schedule


@needs_amx
@pytest.mark.parametrize("head_dim, knobs, causal", [(64, None, True), (96, {"block_m": 32, "block_n": 32}, False),
                                                     (256, {"block_m": 64, "block_n": 128}, True),
                                                     (128, {"block_m": 256}, False)])
def test_amx_forward_matches_float64(head_dim, knobs, causal):
    """Beside test_numerics' defaults at d64 and d128 (which run here on AMX): other tiles and
    head_dims, tails on both sides, GQA."""
    kernel = tvmflash.compile(head_dim=head_dim, dtype=torch.bfloat16, causal=causal, target="cpu", knobs=knobs)
    assert kernel.info()["schedule"] == "amx"
    for seqlen_q, seqlen_k, heads_q, heads_kv in [(1, 1, 4, 2), (129, 257, 4, 2), (300, 95, 4, 2)]:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.bfloat16, "cpu")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)


@needs_amx
def test_amx_variants_and_varlen_match_float64():
    """A window, softcap and ALiBi, dense and varlen (bf16, d32: the AMX forward's smallest head_dim);
    test_variants and test_varlen run these on the CPU in float16, which AMX leaves to the plain schedule."""
    import test_variants
    import test_varlen

    test_variants.forward_matches_float64("cpu", torch.bfloat16, 32, "all")
    test_varlen.forward_matches_float64("cpu", torch.bfloat16, 32, "all", test_varlen.LENGTHS)
    assert tvmflash.compile(head_dim=32, dtype=torch.bfloat16, target="cpu", varlen=True).info()["schedule"] == "amx"


@needs_amx
@pytest.mark.parametrize("head_dim, knobs, causal", [(96, {"block_m": 32, "block_n": 32}, False),
                                                     (128, {"block_m": 128, "block_n": 64}, True),
                                                     (32, {"block_m": 64, "block_n": 128, "dq_atomic": False}, True)])
def test_amx_backward_matches_float64(head_dim, knobs, causal):
    """Beside test_backward's bf16 grid (d64 GQA, which runs here on AMX): other tiles (dkdv's and dq's
    products with rows, columns and reductions of 32 to 128) and head_dims, over test_backward's shapes
    (tails on both sides, rows that see no key), GQA, with and without dlse; dq by dkdv's shares (the
    default, ``dq_atomic``: dsᵀ's transposed copy in blocks of 32 x 32) and once by the dq pass."""
    import test_backward

    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype=torch.bfloat16, causal=causal, target="cpu", knobs=knobs)
    assert kernel.info()["schedule"] == "amx"
    test_backward.gradients_match_float64("cpu", torch.bfloat16, head_dim, causal, (4, 2), knobs)


@needs_amx
def test_amx_backward_variants_varlen_and_flex_match_float64():
    """A window, softcap and ALiBi, dense and varlen, and two flex patterns (a mask_mod; a score_mod with a
    captured table), through autograd (bf16, d32): test_variants, test_varlen and test_flex run these on the
    CPU in float16, which AMX leaves to the plain schedule."""
    import test_flex
    import test_variants
    import test_varlen

    test_variants.gradients_match_float64("cpu", torch.bfloat16, 32, "all")
    for name in ("document", "relative-bias"):
        test_flex.forward_and_gradients_match_float64("cpu", torch.bfloat16, 32, name, test_flex.LENGTHS)
    test_varlen.gradients_match_float64("cpu", torch.bfloat16, 32, "window", test_varlen.LENGTHS, True)
    assert tvmflash.compile_backward(head_dim=32, dtype=torch.bfloat16, target="cpu", varlen=True).info()["schedule"] == "amx"
