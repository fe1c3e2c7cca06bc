"""The generated CUDA of a set of configurations, pinned by hash.

The CUDA that tvmflash generates is what its speed rests on, so any change to it is a reviewed diff:
a change to the program, a schedule or the lowering that alters one of these sources fails here
until the hashes are updated, in the same commit, with

    python tests/test_generated_cuda.py --update

and the commit message says what changed in the CUDA and why. The configurations are the forward's
defaults at head_dim 64/128/256, causal or not, on sm80 and sm90, plus the main knob variants, and
the tensor-core backward's defaults measured on the H200 (``BACKWARD_CONFIGS``), flash-attn's score
variants, softcap and ALiBi (``VARIANT_CONFIGS``), the FP8 forward's (``FP8_CONFIGS``), and the decode's over
a bf16 and an FP8 cache (``DECODE_CONFIGS``); heads 4/2 as the other cross-compile tests build them, decode's
32/8 as tests/test_decode_fp8.py's (so most modules are shared with those tests in one run).
"""

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

HASHES = Path(__file__).with_name("generated_cuda.json")

_WARPGROUP = {"producer": "warpgroup", "min_blocks_per_sm": 1, "block_n": 128}
_THREE_STAGES = {"min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3, "q_layout": "swizzled"}

# name: (target, head_dim, dtype, causal, knobs, TVMFLASH_SM90)
CONFIGS = {
    **{f"{arch}-d{d}-{'causal' if c else 'full'}": (arch, d, "bfloat16", c, None, None)
       for arch in ("sm80", "sm90") for d in (64, 128, 256) for c in (False, True)},
    "sm90-d128-full-float16": ("sm90", 128, "float16", False, None, None),
    "sm90-schedule-sm80-d64-float16": ("sm90", 64, "float16", False, None, "0"),
    "sm80-d64-causal-3stages": ("sm80", 64, "bfloat16", True, {"num_stages": 3}, None),
    "simt-d64-float32": ("sm90", 64, "float32", False, None, None),
    "sm90-d128-cp.async": ("sm90", 128, "bfloat16", False, {"kv_copy": "cp.async", "kv_layout": "core_matrices"}, "1"),
    "sm90-d128-one-stage": ("sm90", 128, "bfloat16", False, {"num_stages": 1, "kv_copy": "cp.async"}, "1"),
    "sm90-d128-producer": ("sm90", 128, "bfloat16", False, _WARPGROUP, "1"),
    "sm90-d128-causal-producer": ("sm90", 128, "bfloat16", True, _WARPGROUP, "1"),
    "sm90-d128-q-swizzled": ("sm90", 128, "bfloat16", False, {"q_layout": "swizzled"}, "1"),
    "sm90-d128-o-direct": ("sm90", 128, "bfloat16", False, {"o_store": "direct"}, "1"),
    "sm90-d128-three-stages-producer": ("sm90", 128, "bfloat16", False, {**_THREE_STAGES, "producer": "warpgroup"}, "1"),
    "sm90-d128-q-tma": ("sm90", 128, "bfloat16", False, {**_THREE_STAGES, "producer": "warpgroup", "q_copy": "tma"}, "1"),
    "sm90-d128-overlap": ("sm90", 128, "bfloat16", False, {**_THREE_STAGES, "producer": "warpgroup", "overlap": 1}, "1"),
    "sm90-d128-overlap-thread": ("sm90", 128, "bfloat16", False, {**_THREE_STAGES, "overlap": 1}, "1"),
    "sm90-d64-causal-block-m-64": ("sm90", 64, "bfloat16", True, {"block_m": 64, "num_warpgroups": 1}, "1"),
    "sm90-d128-row-state-shared": ("sm90", 128, "bfloat16", False, {"row_state": "shared"}, "1"),
}
# name: (target, head_dim, dtype, causal) of a backward module (delta, dkdv and dq) with its defaults
BACKWARD_CONFIGS = {
    "backward-sm80-d64-full": ("sm80", 64, "bfloat16", False),
    "backward-sm80-d128-causal": ("sm80", 128, "bfloat16", True),
    "backward-sm90-d128-full": ("sm90", 128, "bfloat16", False),
    "backward-sm90-d256-causal": ("sm90", 256, "bfloat16", True),  # dkdv in two slices of the columns
}
# name: (program, target, head_dim, dtype, variant keywords) of a module with flash-attn's score variants, whose
# expressions the programs write as trees (``program_flex.builtin_score``), as a user's score_mod is written
VARIANT_CONFIGS = {
    "sm90-d128-softcap": ("forward", "sm90", 128, "bfloat16", {"softcap": 30.0}),
    "sm90-d128-causal-alibi": ("forward", "sm90", 128, "bfloat16", {"causal": True, "alibi": True}),
    "sm90-d128-softcap-alibi-window": ("forward", "sm90", 128, "bfloat16",
                                       {"softcap": 50.0, "alibi": True, "window_size": (256, 0)}),
    "sm80-d64-softcap-alibi": ("forward", "sm80", 64, "float16", {"softcap": 30.0, "alibi": True}),
    "simt-d64-float32-softcap-alibi": ("forward", "sm90", 64, "float32", {"softcap": 30.0, "alibi": True}),
    "backward-sm90-d128-causal-softcap-alibi": ("backward", "sm90", 128, "bfloat16",
                                                {"causal": True, "softcap": 30.0, "alibi": True}),
    "backward-sm80-d64-softcap": ("backward", "sm80", 64, "float16", {"softcap": 30.0}),
}
CONFIGS.update({name: None for name in BACKWARD_CONFIGS})
CONFIGS.update({name: None for name in VARIANT_CONFIGS})
# name: (target, head_dim, causal) of the FP8 forward (``kernels.fp8.Fp8Kernel``) with its defaults
FP8_CONFIGS = {
    "fp8-sm90-d128-full": ("sm90", 128, False),
    "fp8-sm90-d128-causal": ("sm90", 128, True),
}
CONFIGS.update({name: None for name in FP8_CONFIGS})
# name: (target, head_dim, dtype, page_size, cache_dtype) of a decode module (``compile_decode``) with its defaults;
# an FP8 cache at d128 prefetches its bytes into registers, at d256 converts them as it reads them
DECODE_CONFIGS = {
    "decode-sm90-d128": ("sm90", 128, "bfloat16", 0, None),
    "decode-sm90-d128-paged256": ("sm90", 128, "bfloat16", 256, None),
    "decode-sm90-d128-fp8-cache": ("sm90", 128, "bfloat16", 0, "float8_e4m3fn"),
    "decode-sm90-d128-fp8-cache-paged256": ("sm90", 128, "bfloat16", 256, "float8_e4m3fn"),
    "decode-sm90-d256-fp8-cache": ("sm90", 256, "bfloat16", 0, "float8_e4m3fn"),
}
CONFIGS.update({name: None for name in DECODE_CONFIGS})


@contextlib.contextmanager
def environment(name: str, value: str | None):
    """``os.environ[name]`` set to ``value`` (None: unset) inside the block, the environment as it was after."""
    with mock.patch.dict(os.environ):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
        yield


def source(name: str) -> str:
    import tvmflash

    if name in VARIANT_CONFIGS:
        program, target, head_dim, dtype, variant = VARIANT_CONFIGS[name]
        compile_ = tvmflash.compile_backward if program == "backward" else tvmflash.compile
        return compile_(head_dim=head_dim, dtype=dtype, target=target, **variant).source(heads_q=4, heads_kv=2)
    if name in FP8_CONFIGS:
        from tvmflash.kernels.fp8 import Fp8Kernel

        target, head_dim, causal = FP8_CONFIGS[name]
        with environment("TVMFLASH_GPU_UNCHECKED", "1"):  # pinned while awaiting its GPU check too
            return Fp8Kernel(head_dim, causal, target).source(heads_q=4, heads_kv=2)
    if name in DECODE_CONFIGS:
        target, head_dim, dtype, page_size, cache_dtype = DECODE_CONFIGS[name]
        with environment("TVMFLASH_GPU_UNCHECKED", "1"):  # (an FP8 cache's awaits its GPU check)
            return tvmflash.compile_decode(head_dim=head_dim, dtype=dtype, page_size=page_size, target=target,
                                           cache_dtype=cache_dtype).source(32, 8)
    if name in BACKWARD_CONFIGS:
        target, head_dim, dtype, causal = BACKWARD_CONFIGS[name]
        # the pins cover kernels awaiting their GPU check too (``ProgramSchedule.unchecked_head_dims``)
        with environment("TVMFLASH_GPU_UNCHECKED", "1"):
            return tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=causal,
                                             target=target).source(heads_q=4, heads_kv=2)
    target, head_dim, dtype, causal, knobs, sm90 = CONFIGS[name]
    with environment("TVMFLASH_SM90", sm90):
        kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, target=target, knobs=knobs)
        return kernel.source(heads_q=4, heads_kv=2)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generated_cuda_is_pinned(name):
    pinned = json.loads(HASHES.read_text())
    assert name in pinned, f"{name}: no pinned hash; run python tests/test_generated_cuda.py --update"
    assert digest(source(name)) == pinned[name], (
        f"{name}: the generated CUDA changed. If that is intended, run python tests/test_generated_cuda.py "
        "--update and say in the commit what changed and why")


def test_every_pinned_hash_has_a_configuration():
    assert set(json.loads(HASHES.read_text())) == set(CONFIGS)


if __name__ == "__main__":  # python tests/test_generated_cuda.py --update [NAME ...]
    if "--update" not in sys.argv:
        sys.exit(__doc__)
    names = [a for a in sys.argv[1:] if a != "--update"] or sorted(CONFIGS)
    pinned = json.loads(HASHES.read_text()) if HASHES.exists() else {}
    for name in names:
        pinned[name] = digest(source(name))
        print(name, pinned[name], flush=True)
    HASHES.write_text(json.dumps({k: pinned[k] for k in sorted(pinned) if k in CONFIGS}, indent=1) + "\n")
