"""Bad input raises a ValueError or TypeError that names the argument, what was expected and what was given."""

import pytest
import torch

import tvmflash


@pytest.fixture(scope="module")
def kernel():
    return tvmflash.compile(head_dim=64, dtype="float16", target="cpu")


def qkv(dtype=torch.float16, q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64)):
    return torch.randn(q_shape).to(dtype), torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)


def test_wrong_dtype(kernel):
    q, k, v = qkv(torch.bfloat16)
    with pytest.raises(TypeError, match=r"q: expected dtype torch.float16.*got torch.bfloat16"):
        kernel(q, k, v)


def test_mismatched_dtypes(kernel):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"v: expected dtype torch.float16.*got torch.float32"):
        kernel(q, k, v.float())


def test_mismatched_dtypes_in_attention():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k: expected dtype torch.float16.*got torch.bfloat16"):
        tvmflash.attention(q, k.bfloat16(), v)


def test_mismatched_kv_shapes(kernel):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v: expected the shape of k \(1, 8, 2, 64\), got \(1, 9, 2, 64\)"):
        kernel(q, k, torch.randn(1, 9, 2, 64).half())


def test_mismatched_batch(kernel):
    q, k, v = qkv(kv_shape=(2, 8, 2, 64))
    with pytest.raises(ValueError, match=r"k: expected batch 1 \(from q\), got shape \(2, 8, 2, 64\)"):
        kernel(q, k, v)


def test_wrong_rank(kernel):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q: expected 4 dims .* got shape \(8, 4, 64\)"):
        kernel(q[0], k, v)


def test_head_dim_differs_from_kernel(kernel):
    q, k, v = qkv(q_shape=(1, 8, 4, 128), kv_shape=(1, 8, 2, 128))
    with pytest.raises(ValueError, match=r"q: expected head_dim 64 .* got shape \(1, 8, 4, 128\)"):
        kernel(q, k, v)


def test_unsupported_head_dim():
    """The kernels take the multiples of 8 up to 256; the torch API any head_dim from 1 to 256 (it pads)."""
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 from 8 to 256, got 59 \(tvmflash.attention "
                                         r"and the flash_attn functions take any head_dim from 1 to 256: they pad it\)"):
        tvmflash.compile(head_dim=59, dtype="float16", target="cpu")
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 from 8 to 256, got 264"):
        tvmflash.compile_backward(head_dim=264, dtype="float16", target="cpu")
    q = torch.randn(1, 4, 2, 257).half()
    with pytest.raises(ValueError, match=r"head_dim: expected 1 to 256 \(q's last dim\), got 257"):
        tvmflash.attention(q, q, q)


def test_a_head_dim_a_schedule_does_not_build_is_refused_by_name():
    """A schedule asked for a head_dim it does not declare (``ProgramSchedule.head_dims``) says which it
    serves, before anything is built; so does a target none of whose schedules serves it."""
    with pytest.raises(ValueError, match=r"^schedule 'sm80' \(given\): the sm80 forward serves head_dim "
                                         r"the multiples of 16 up to 256, got 40$"):
        tvmflash.compile(head_dim=40, dtype="float16", target="sm80", schedule="sm80")
    with pytest.raises(ValueError, match=r"the sm90 backward serves head_dim 64, 96, 128, 256, got 160"):
        tvmflash.compile_backward(head_dim=160, dtype="bfloat16", target="sm90", schedule="sm90")
    with pytest.raises(ValueError, match=r"no tvmflash schedule maps the decode on cuda sm_80 for float32 at head_dim 40; "
                                         r"head_dims served there: the multiples of 32 up to 256$"):
        tvmflash.compile_decode(head_dim=40, dtype="float32", target="sm80")


def test_a_head_dim_not_yet_checked_on_a_gpu_is_refused_unless_asked(monkeypatch):
    """A head_dim built and checked on the CPU alone (``ProgramSchedule.unchecked_head_dims``, here the sm90
    backward's 256 marked so) is refused until its GPU tests pass, and served where TVMFLASH_GPU_UNCHECKED=1
    asks, as a GPU run of those tests does."""
    import dataclasses

    from tvmflash import schedules

    sm90 = schedules.SCHEDULES["sm90"]
    marked = dataclasses.replace(sm90.backward, unchecked_head_dims=(256,))
    monkeypatch.setitem(schedules.SCHEDULES, "sm90", dataclasses.replace(sm90, backward=marked))
    with pytest.raises(ValueError, match=r"the sm90 backward at head_dim 256 has not passed the GPU tests yet "
                                         r"\(TVMFLASH_GPU_UNCHECKED=1 serves it, to run them\)"):
        tvmflash.compile_backward(head_dim=256, dtype="bfloat16", target="sm90", schedule="sm90")
    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")
    assert tvmflash.compile_backward(head_dim=256, dtype="bfloat16", target="sm90", schedule="sm90").info()["schedule"] == "sm90"


def head_dim_calls(head_dim: int) -> dict:
    """Each API entry, called with tensors (or a spec) of this head_dim."""
    q = torch.randn(1, 4, 2, head_dim) if head_dim >= 0 else None
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    as_int = {"compile": lambda: tvmflash.compile(head_dim=head_dim, dtype="float32", target="cpu"),
              "compile_backward": lambda: tvmflash.compile_backward(head_dim=head_dim, dtype="float32", target="cpu"),
              "compile_decode": lambda: tvmflash.compile_decode(head_dim=head_dim, dtype="float32", target="cpu")}
    if q is None:  # no tensor has a negative dim
        return as_int
    return {**as_int,
            "attention": lambda: tvmflash.attention(q, q, q),
            "flash_attn_func": lambda: tvmflash.flash_attn_func(q, q, q),
            "flash_attn_qkvpacked_func": lambda: tvmflash.flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2)),
            "flash_attn_kvpacked_func": lambda: tvmflash.flash_attn_kvpacked_func(q, torch.stack([q, q], dim=2)),
            "varlen_attention": lambda: tvmflash.varlen_attention(q[0], q[0], q[0], offsets, offsets, 4, 4),
            "flash_attn_varlen_func": lambda: tvmflash.flash_attn_varlen_func(q[0], q[0], q[0], offsets, offsets, 4, 4),
            "flash_attn_varlen_qkvpacked_func":
                lambda: tvmflash.flash_attn_varlen_qkvpacked_func(torch.stack([q[0]] * 3, dim=1), offsets, 4),
            "flash_attn_with_kvcache": lambda: tvmflash.flash_attn_with_kvcache(q[:, :1], q, q)}


@pytest.mark.parametrize("head_dim", [0, -8])
def test_a_head_dim_of_zero_or_less_is_a_value_error_at_every_entry(head_dim):
    """head_dim 0 ended in a ZeroDivisionError traceback (1 / sqrt(head_dim), the default scale) in
    attention, flash_attn_func and the varlen functions: each entry now says what it takes, before
    anything is computed or built."""
    for name, call in head_dim_calls(head_dim).items():
        expected = "a multiple of 8 from 8 to 256" if name.startswith("compile") else r"1 to 256 \(q's last dim\)"
        with pytest.raises(ValueError, match=rf"head_dim: expected {expected}, got {head_dim}"):
            call()


def test_a_head_dim_must_be_an_int():
    """64.0 equals 64, and compile took it, to fail deep in TVM when the module was built."""
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 .*, got 64.0"):
        tvmflash.compile(head_dim=64.0, dtype="float32", target="cpu")


def test_unsupported_dtype():
    with pytest.raises(TypeError, match=r"dtype: expected one of .* got torch.int8"):
        tvmflash.compile(head_dim=64, dtype=torch.int8, target="cpu")


def test_heads_not_a_multiple(kernel):
    q, k, v = qkv(q_shape=(1, 8, 3, 64))
    with pytest.raises(ValueError, match=r"q: expected heads_q \(3\) to be a multiple of heads_kv \(2\)"):
        kernel(q, k, v)


def test_last_dim_not_contiguous(kernel):
    q, k, v = qkv()
    k_strided = torch.randn(1, 8, 2, 128).half()[..., ::2]
    with pytest.raises(ValueError, match=r"k: expected a contiguous last dim \(stride 1\), got strides"):
        kernel(q, k_strided, v)


def test_device_the_kernel_was_not_built_for():
    kernel = tvmflash.compile(head_dim=64, dtype="float16", target="sm80")
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q: the kernel was built for cuda sm_80, got a tensor on cpu"):
        kernel(q, k, v)


def test_device_mismatch(kernel):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k: expected device cpu \(q's\), got meta"):
        kernel(q, k.to("meta"), v)


def test_not_a_tensor(kernel):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q: expected a torch.Tensor, got ndarray"):
        kernel(q.numpy(), k, v)


def test_bad_out(kernel):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"out: expected a tensor of q's shape"):
        kernel(q, k, v, out=torch.empty(1, 8, 4, 32).half())


def test_bad_softmax_scale(kernel):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"softmax_scale: expected a finite float, got nan"):
        kernel(q, k, v, softmax_scale=float("nan"))
    for bad in (0.0, -0.125, 1e9):
        with pytest.raises(ValueError, match=r"softmax_scale: expected a positive float"):
            kernel(q, k, v, softmax_scale=bad)


def test_bad_target():
    with pytest.raises(ValueError, match=r"target: expected None, 'cpu'.* got 'tpu'"):
        tvmflash.compile(head_dim=64, dtype="float16", target="tpu")


def test_unknown_knob():
    with pytest.raises(ValueError, match=r"knobs: \['blockm'\] are not knobs of the cpu schedule"):
        tvmflash.compile(head_dim=64, dtype="float16", target="cpu", knobs={"blockm": 16})


@pytest.mark.parametrize("flag", ["no", "", [True], object()], ids=["str", "empty-str", "list", "object"])
def test_boolean_options_refuse_what_flash_attn_refuses(kernel, flag):
    """``causal="no"`` would run causal (bool("no") is True): a string, as flash-attn's binding does,
    or any object that is no number, bool, None or one-element tensor is a TypeError."""
    q, k, v = qkv(kv_shape=(1, 8, 4, 64))
    with pytest.raises(TypeError, match=r"causal: expected True or False"):
        tvmflash.compile(head_dim=64, dtype="float16", target="cpu", causal=flag)
    with pytest.raises(TypeError, match=r"causal: expected True or False"):
        tvmflash.attention(q, k, v, causal=flag)
    with pytest.raises(TypeError, match=r"return_lse: expected True or False"):
        tvmflash.attention(q, k, v, return_lse=flag)
    with pytest.raises(TypeError, match=r"return_lse: expected True or False"):
        kernel(q, k, v, return_lse=flag)
    with pytest.raises(TypeError, match=r"deterministic: expected True or False"):
        tvmflash.attention(q, k, v, deterministic=flag)
    with pytest.raises(TypeError, match=r"deterministic: expected True or False"):
        tvmflash.flash_attn_func(q, k, v, deterministic=flag)


def test_flags_and_windows_in_flash_attn_forms():
    """What flash-attn 2 takes (its binding reads flags by their truth and window_size[0], [1] as
    ints): ``deterministic=1``, ``causal=None``, one-element tensors, a window as a list, a tensor or a
    numpy array; each gives what the plain form gives, and the kernels' keys see plain values."""
    import numpy as np

    from tvmflash.kernels.checks import check_flag, resolve_variant, window_pair
    assert [check_flag("x", f) for f in (1, 0, None, 2.5, torch.tensor(True), torch.tensor([0]), np.int64(1))] == [
        True, False, False, True, True, False, True]
    for window in ([5, 3], torch.tensor([5, 3]), np.array([5, 3]), (np.int32(5), torch.tensor(3))):
        assert window_pair(window) == (5, 3) and type(window_pair(window)[0]) is int
        assert resolve_variant(1, window) == {"causal": True, "window_left": 5}
    for bad in ((5,), (1, 2, 3), (5.0, 3), (True, -1), "ab", 5, None):
        with pytest.raises(TypeError, match="window_size: expected two ints"):
            window_pair(bad)
    q, k, v = qkv(kv_shape=(1, 8, 4, 64))
    plain = tvmflash.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), deterministic=False)
    forms = tvmflash.flash_attn_func(q, k, v, causal=1, window_size=torch.tensor([3, -1]), deterministic=None)
    assert torch.equal(plain, forms)
    out, lse = tvmflash.attention(q, k, v, causal=torch.tensor(True), return_lse=1)
    assert out.shape == q.shape and lse.dtype == torch.float32


CPU_BLOCK_M = r"the cpu schedule takes one of \[8, 16, 32, 64, 128\]"
CPU_BLOCK_N = r"the cpu schedule takes one of \[16, 32, 64, 128, 256\]"


@pytest.mark.parametrize("target,knobs,message", [
    ("cpu", {"block_m": 0}, rf"knobs: block_m: {CPU_BLOCK_M}, got 0"),
    ("cpu", {"block_m": 7}, rf"knobs: block_m: {CPU_BLOCK_M}, got 7"),
    ("cpu", {"block_n": 4096}, rf"knobs: block_n: {CPU_BLOCK_N}, got 4096"),
    ("cpu", {"block_n": "big"}, rf"knobs: block_n: {CPU_BLOCK_N}, got 'big'"),
    ("cpu", {"block_m": 64.0}, rf"knobs: block_m: {CPU_BLOCK_M}, got 64.0"),
    ("sm80", {"vec": True}, r"knobs: vec: expected a positive int, got True"),
    ("cpu", {"vector": 3}, r"knobs: vector: the cpu schedule takes one of \[4, 8, 16, 32\], got 3"),
    ("sm80", {"num_stages": 4}, r"knobs: num_stages: the sm80 schedule takes one of \[1, 2, 3\], got 4"),
    ("sm80", {"row_state": "fast"}, r"knobs: row_state: the sm80 schedule takes one of \['registers', 'shared'\], got 'fast'"),
], ids=["zero", "block_m-7", "block_n-4096", "str", "float", "bool", "vector", "choice", "str-choice"])
def test_bad_knob_values(target, knobs, message):
    """block_m 0 failed in TVM (DiagnosticError: divide by zero), "big" with a type mismatch, and the
    CPU's block_m 7 and block_n 4096 were taken silently: knob values are checked against the
    schedule's, the error naming the knob and the values it takes, before anything is built."""
    with pytest.raises(ValueError, match=message):
        tvmflash.compile(head_dim=64, dtype="float16", target=target, knobs=knobs)


@pytest.mark.parametrize("compile_,knobs,message", [
    ("compile_backward", {"block_m": 7}, rf"knobs: block_m: {CPU_BLOCK_M}, got 7"),
    ("compile_backward", {"block_n": 4096}, rf"knobs: block_n: {CPU_BLOCK_N}, got 4096"),
    ("compile_backward", {"vector": 3}, r"knobs: vector: the cpu schedule takes one of \[4, 8, 16, 32\], got 3"),
    ("compile_decode", {"block_n": 4096}, rf"knobs: block_n: {CPU_BLOCK_N}, got 4096"),
    ("compile_decode", {"vector": 3}, r"knobs: vector: the cpu schedule takes one of \[4, 8, 16, 32\], got 3"),
])
def test_bad_cpu_knob_values_of_the_backward_and_decode(compile_, knobs, message):
    """The backward's and decode's CPU knobs are checked as the forward's (nothing is built)."""
    with pytest.raises(ValueError, match=message):
        getattr(tvmflash, compile_)(head_dim=64, dtype="float16", target="cpu", knobs=knobs)


def test_tuned_knobs_of_bad_values_are_passed_over(tmp_path, monkeypatch):
    from tvmflash import database
    from tvmflash import target as targets
    from tvmflash.schedules import cpu

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    workload = {"head_dim": 64, "dtype": "float16", "causal": False}
    database.add(database.new_record(targets.cpu_target(), "cpu", workload, {**cpu.FORWARD.defaults(), "block_m": 0},
                                     1.0))
    assert database.lookup(targets.cpu_target(), "cpu", workload, usable=cpu.FORWARD.accepts) is None
