"""tvmflash.flex_attention: score_mod and mask_mod compiled into the programs, against a float64 reference that
applies the same functions in torch to the whole score matrix, under flash-attn's error rule (forward and
gradients); the tracer's refusals, which name the operation and the line; one module per distinct trace.
The CPU cases keep to one dtype, head_dim and head layout (GQA 4/2): each pattern is one forward and one
backward build."""

import math
import shutil

import pytest
import torch
from reference import check_gradient_errors, max_error

import tvmflash
from tvmflash import flex
from tvmflash.flex_trace import FlexTraceError, trace_mods

HEADS = (4, 2)
CPU_DTYPE, CPU_HEAD_DIM = torch.float16, 32
# (seqlen_q, seqlen_k): tails on both sides, and seqlen_q != seqlen_k both ways
LENGTHS = [(77, 130), (130, 77)]
GPU_LENGTHS = LENGTHS + [(1000, 1000), (300, 1000)]


def documents(seqlen: int, device) -> torch.Tensor:
    """Document ids of packed sequences: runs of 23, 40, 7, ... rows (int32, (seqlen,))."""
    sizes = [23, 40, 7, 61, 30]
    ids = torch.cat([torch.full((sizes[n % 5],), n, dtype=torch.int32) for n in range(seqlen // 7 + 1)])
    return ids[:seqlen].to(device)


def patterns(seqlen_q: int, seqlen_k: int, device) -> dict:
    """name -> (score_mod, mask_mod), their captured tensors made for these lengths on ``device``."""
    gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
    slopes = (torch.rand(HEADS[0], generator=gen) * 0.3).to(device)
    table = torch.randn(HEADS[0], 129, generator=gen).to(device)  # relative positions -64 ... 64
    doc_q, doc_k = documents(seqlen_q, device), documents(seqlen_k, device).to(torch.int64)
    prefix = torch.tensor([5, 60], dtype=torch.int32, device=device)  # a prefix length per batch
    window = 19
    return {
        "causal": (None, lambda b, h, q, kv: q >= kv),
        "sliding-window": (None, lambda b, h, q, kv: (q - kv <= window) & (q - kv >= -3)),
        "document": (None, lambda b, h, q, kv: doc_q[q] == doc_k[kv]),
        "prefix-lm": (None, lambda b, h, q, kv: (kv < prefix[b]) | (q >= kv)),
        "alibi": (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), None),
        "softcap": (lambda s, b, h, q, kv: torch.tanh(s / 2.0) * 2.0, None),
        "relative-bias": (lambda s, b, h, q, kv: s + table[h, torch.clamp(q - kv, -64, 64) + 64], None),
        # rows that see no key: by the mask (every third query), and by a score_mod's -inf (every fifth)
        "empty-rows": (lambda s, b, h, q, kv: torch.where(q % 5 == 1, -math.inf, s * 0.5),
                       lambda b, h, q, kv: (q % 3 != 0) & (kv <= q + 7)),
    }


def flex_reference(q, k, v, score_mod, mask_mod, scale=None, dtype=torch.float64):
    """Attention with the mods applied to the whole score matrix in ``dtype``; flex_attention's layout
    (batch, heads, seqlen, head_dim). Returns (out, lse); a query that sees no key (mask_mod, or every
    score -inf) gets out 0 and lse -inf."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    batch, heads, seqlen_q, seqlen_k = s.shape
    device = q.device
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(dtype)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), -math.inf)
    seen = torch.isfinite(s).any(-1, keepdim=True)
    s = s.masked_fill(~seen, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~seen[..., 0], -math.inf)
    p = (torch.softmax(s, dim=-1) * seen).nan_to_num(0.0)
    return p @ vh, lse


def check_forward(out, lse, q, k, v, score_mod, mask_mod, eps=1e-5):
    """flash-attn's rule: our error against float64 at most 2x torch's in the inputs' dtype + eps; lse
    -inf exactly where a query sees no key, else float32-close."""
    ref_out, ref_lse = flex_reference(q, k, v, score_mod, mask_mod)
    same = flex_reference(q, k, v, score_mod, mask_mod, dtype=q.dtype)[0]
    ours, theirs = max_error(out, ref_out), max_error(same, ref_out)
    assert torch.isfinite(out).all(), "out has NaN/inf"
    assert ours <= 2 * theirs + eps, f"out error {ours:.3e} > 2 x torch's {theirs:.3e} + {eps}"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse is -inf exactly where a query sees no key"
    lse_err = max_error(lse[seen], ref_lse[seen])
    assert lse_err <= 1e-4 * (1 + ref_lse[seen].abs().max().item()), f"lse error {lse_err:.3e}"


def random_qkv(batch, seqlen_q, seqlen_k, dtype, device, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS[0], seqlen_q, head_dim, generator=gen)
    k = torch.randn(batch, HEADS[1], seqlen_k, head_dim, generator=gen)
    v = torch.randn(batch, HEADS[1], seqlen_k, head_dim, generator=gen)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def forward_and_gradients_match_float64(device, dtype, head_dim, name, lengths):
    for n, (seqlen_q, seqlen_k) in enumerate(lengths):
        score_mod, mask_mod = patterns(seqlen_q, seqlen_k, device)[name]
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, dtype, device, head_dim, seed=seqlen_q + 7 * seqlen_k)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = tvmflash.flex_attention(*leaves, score_mod=score_mod, block_mask=mask_mod, enable_gqa=True,
                                           return_lse=True)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:3]
        check_forward(out.detach(), lse.detach(), q, k, v, score_mod, mask_mod)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse.detach()), 0.0) if n % 2 else None
        torch.autograd.backward([out, lse] if n % 2 else [out], [dout, dlse] if n % 2 else [dout])
        refs = []
        for ref_dtype in (torch.float64, dtype):
            ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = flex_reference(*ref_leaves, score_mod, mask_mod, dtype=ref_dtype)
            loss = (ref_out * dout.to(ref_dtype)).sum()
            if dlse is not None:
                loss = loss + (ref_lse.masked_fill(ref_lse == -math.inf, 0) * dlse.to(ref_dtype)).sum()
            refs.append(torch.autograd.grad(loss, ref_leaves))
        check_gradient_errors([t.grad for t in leaves], *refs, dtype)


CPU_PATTERNS = list(patterns(8, 8, "cpu"))


@pytest.mark.parametrize("name", CPU_PATTERNS)
def test_forward_and_gradients_match_float64_on_cpu(name):
    forward_and_gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name, LENGTHS)


# The H100's cases: every pattern on the default schedule of bf16 d128 (sm90 on sm_90a), a few on fp16 d64
GPU_CASES = ([(torch.bfloat16, 128, name) for name in CPU_PATTERNS]
             + [(torch.float16, 64, name) for name in ("document", "relative-bias", "empty-rows")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name", GPU_CASES, ids=str)
def test_forward_and_gradients_match_float64_on_the_gpu(dtype, head_dim, name):
    forward_and_gradients_match_float64("cuda", dtype, head_dim, name, GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sm80", "simt"])
def test_a_score_mod_and_a_mask_mod_on_the_other_gpu_schedules(schedule, monkeypatch):
    """A score_mod with a mask_mod (rows that see no key) and a captured table on sm80's mma.sync (on
    sm_90a too: TVMFLASH_SM90=0) and on SIMT (float32), forward and backward."""
    monkeypatch.setenv("TVMFLASH_BACKWARD", schedule)
    if schedule == "sm80":
        monkeypatch.setenv("TVMFLASH_SM90", "0")
    dtype = torch.float32 if schedule == "simt" else torch.float16
    for name in ("empty-rows", "relative-bias"):
        forward_and_gradients_match_float64("cuda", dtype, 64, name, GPU_LENGTHS)


def test_a_block_mask_is_taken_for_its_mask_mod():
    """torch's BlockMask (create_block_mask) as is: its mask_mod is applied (the causal pattern's module)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = random_qkv(2, 129, 129, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=3)
    causal = patterns(129, 129, "cpu")["causal"][1]
    block_mask = create_block_mask(causal, None, None, 129, 129, device="cpu")
    out, lse = tvmflash.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    check_forward(out, lse, q, k, v, None, causal)
    with pytest.raises(ValueError, match="block_mask: made for"):
        tvmflash.flex_attention(q[:, :, :100], k, v, block_mask=block_mask, enable_gqa=True)


def test_no_mods_is_plain_attention():
    q, k, v = random_qkv(1, 33, 40, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=4)
    out, lse = tvmflash.flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    check_forward(out, lse, q, k, v, None, None)


# ----------------------------------------------------------------------------- CUDA, cross-compiled
@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("program", ["forward", "backward"])
def test_sm90_cuda_of_the_mods_compiles_with_nvcc(program):
    """The sm90 schedule (wgmma, TMA) with a score_mod (softcap, a relative-position table) and a
    document mask_mod: built without a GPU, its CUDA reads the captured tensors, and nvcc compiles it."""
    from tvm.support import nvcc

    score_mod, _ = patterns(64, 64, "cpu")["relative-bias"]
    _, mask_mod = patterns(64, 64, "cpu")["document"]
    mods, captures = trace_mods(lambda s, b, h, q, kv: torch.tanh(score_mod(s, b, h, q, kv) / 30.0) * 30.0, mask_mod)
    compile_ = tvmflash.compile_backward if program == "backward" else tvmflash.compile
    kernel = compile_(head_dim=64, dtype="bfloat16", target="sm90", flex=mods)
    source = kernel.source(heads_q=4, heads_kv=2)
    assert all(f"Captured{n}" in source for n in range(len(captures))) and "wgmma" in source
    with kernel.target:
        cubin = nvcc.compile_cuda(source, target_format="cubin", arch="sm_90a", compiler="nvcc")
    assert len(cubin) > 1000


def test_sm80_cuda_of_the_mods_builds():
    score_mod, _ = patterns(64, 64, "cpu")["alibi"]
    _, mask_mod = patterns(64, 64, "cpu")["prefix-lm"]
    mods, _ = trace_mods(score_mod, mask_mod)
    source = tvmflash.compile(head_dim=64, dtype="float16", target="sm80", flex=mods).source(heads_q=4, heads_kv=2)
    assert "mma.sync" in source and "Captured1" in source


# ----------------------------------------------------------------------------- one module per trace
def test_equal_functions_share_a_module_and_different_ones_do_not():
    """Two functions that compute the same (other Python objects, other captured tensors of the same
    dtype and dims) trace to one key and one kernel; a changed constant or operation is another."""
    slopes_a, slopes_b = torch.rand(4), torch.rand(4)

    def first(score, b, h, q, kv):
        return score - slopes_a[h] * (q - kv).abs()

    def second(s, batch, head, i, j):  # other names, another tensor
        return s - slopes_b[head] * (i - j).abs()

    def other_constant(score, b, h, q, kv):
        return score - slopes_a[h] * (q - kv).abs() * 2

    def other_operation(score, b, h, q, kv):
        return score + slopes_a[h] * (q - kv).abs()

    keys = [flex.mods_key(trace_mods(fn, None)[0]) for fn in (first, second, other_constant, other_operation)]
    assert keys[0] == keys[1]
    assert len(set(keys)) == 3
    q, k, v = random_qkv(1, 40, 40, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=5)
    for fn in (first, second):
        tvmflash.flex_attention(q, k, v, score_mod=fn, enable_gqa=True)
    mods = [trace_mods(fn, None)[0] for fn in (first, second, other_constant)]
    kernels = [flex.flex_kernel(q.transpose(1, 2), m) for m in mods]
    assert kernels[0] is kernels[1] and kernels[0] is not kernels[2]
    assert len(kernels[0].build.modules) == 1  # both calls ran on one module
    assert kernels[0].build.key(kernels[0].spec(*HEADS)) != kernels[2].build.key(kernels[2].spec(*HEADS))


WINDOW = 16  # read by a mod as a global (test_a_mod_is_traced_again_only_where_what_it_reads_changed)


def test_a_mod_is_traced_again_only_where_what_it_reads_changed(monkeypatch):
    """``trace_mods`` runs a mod once for as long as its code and the objects it reads (closure, globals,
    defaults, the functions it calls) are the same objects: the same FlexMods and captures come back. A
    new constant in its closure or globals, or another tensor, is traced again; a mod that reads a dict
    (which may change in place) is traced at every call."""
    global WINDOW
    from tvmflash import flex_trace

    runs = []
    trace = flex_trace.trace
    monkeypatch.setattr(flex_trace, "trace", lambda fn, what: runs.append(what) or trace(fn, what))
    bias = torch.rand(4)

    def make(window):
        def mask_mod(b, h, q, kv):
            return (q - kv <= window) & (q >= kv)
        return mask_mod

    def score_mod(score, b, h, q, kv):
        return score + bias[h] * near(q, kv)

    def near(q, kv):  # called by score_mod: its own globals count too
        return (q - kv).abs() < WINDOW

    mask_mod = make(8)
    first = trace_mods(score_mod, mask_mod)
    again = trace_mods(score_mod, mask_mod)
    assert len(runs) == 2 and again[0] is first[0] and again[1] == first[1] and again[1][0] is bias
    assert trace_mods(score_mod, make(9))[0] != first[0] and len(runs) == 4  # another closure: traced again
    assert trace_mods(score_mod, make(8))[0] is first[0] and len(runs) == 4  # a new closure of the same: not
    WINDOW = 17
    try:
        changed = trace_mods(score_mod, mask_mod)[0]
    finally:
        WINDOW = 16
    assert changed != first[0] and len(runs) == 6
    bias = torch.rand(4, dtype=torch.float16)  # the closure's cell now holds another tensor
    assert trace_mods(score_mod, mask_mod)[0].captures[0][0] == "float16" and len(runs) == 8
    settings = {"window": 8}

    def reads_a_dict(b, h, q, kv):
        return q - kv <= settings["window"]

    runs.clear()
    before = trace_mods(None, reads_a_dict)[0]
    assert trace_mods(None, reads_a_dict)[0] == before and len(runs) == 2
    settings["window"] = 9
    assert trace_mods(None, reads_a_dict)[0] != before
    runs.clear()
    for _ in range(3):  # one code object, a new function at each call (an inline lambda): traced once
        trace_mods((lambda s, b, h, q, kv: s * 0.5 + bias[h]), None)
    assert len(runs) == 1


def test_the_trace_memo_never_serves_a_changed_mod_and_keeps_nothing_alive(monkeypatch):
    """What ``trace_mods``' memo cannot see change is traced at every call: a module's attribute (other than
    torch's and math's functions), a function defined inside the mod, a dict's bound method, a tensor read
    into a Python number and then written in place. The score_mod's and the mask_mod's reads are keyed
    apart, and an entry holds no tensor alive."""
    import gc
    import types
    import weakref

    from tvmflash import flex_trace

    runs = []
    trace = flex_trace.trace
    monkeypatch.setattr(flex_trace, "trace", lambda fn, what: runs.append(what) or trace(fn, what))
    config = types.ModuleType("config")
    config.window = 8
    table = {"window": 8}
    limit = torch.tensor(8)

    def reads_a_module(b, h, q, kv):
        return q - kv <= config.window

    def defines_a_function(b, h, q, kv):
        near = (lambda d: d <= WINDOW)  # noqa: E731
        return near(q - kv)

    get = table.get

    def reads_a_bound_method(b, h, q, kv):
        return q - kv <= get("window")

    def reads_a_number_of_a_tensor(b, h, q, kv):
        return q - kv <= int(limit)

    for mod, change in ((reads_a_module, lambda: setattr(config, "window", 9)),
                        (defines_a_function, lambda: None),
                        (reads_a_bound_method, lambda: table.update(window=9)),
                        (reads_a_number_of_a_tensor, lambda: limit.fill_(9))):
        before = trace_mods(None, mod)[0]
        change()
        after = trace_mods(None, mod)[0]
        assert (after != before) or mod is defines_a_function, mod.__name__
    assert len(runs) == 8  # each traced at each call

    def causal(b, h, q, kv):
        return q >= kv

    trace_mods(None, causal)
    with pytest.raises(TypeError):  # a mask_mod given as the score_mod: traced, never the mask's trace
        trace_mods(causal, None)
    bias = torch.rand(4, requires_grad=True) * 2  # a non-leaf: it keeps its autograd graph

    def score_mod(score, b, h, q, kv):
        return score + bias[h]

    trace_mods(score_mod, None)
    assert trace_mods(score_mod, None)[1][0] is bias  # served from the memo
    alive = weakref.ref(bias)
    del score_mod, bias
    gc.collect()
    assert alive() is None


# ----------------------------------------------------------------------------- refusals
def _error_of(score_mod=None, mask_mod=None):
    with pytest.raises(FlexTraceError) as caught:
        trace_mods(score_mod, mask_mod)
    return str(caught.value)


def test_an_unsupported_operation_is_named_with_its_line():
    def score_mod(score, b, h, q, kv):
        return torch.sin(score)  # the line named

    message = _error_of(score_mod)
    line = score_mod.__code__.co_firstlineno + 1
    assert "torch.sin" in message and f"test_flex.py:{line}" in message, message
    assert ".cos" in _error_of(lambda s, b, h, q, kv: s.cos())


def test_python_control_flow_on_a_traced_value_is_refused_with_its_line():
    def mask_mod(b, h, q, kv):
        if q >= kv:  # the line named
            return True
        return False

    message = _error_of(mask_mod=mask_mod)
    line = mask_mod.__code__.co_firstlineno + 1
    assert "control flow" in message and f"test_flex.py:{line}" in message, message
    assert "and/or" not in message
    assert "Python index" in _error_of(lambda s, b, h, q, kv: s + [0.0, 1.0][h])
    assert "control flow" in _error_of(mask_mod=lambda b, h, q, kv: q >= kv and kv >= 0)
    assert "int()" in _error_of(lambda s, b, h, q, kv: s + int(h))


def test_wrong_values_and_indices_are_refused():
    table = torch.randn(4, 10)
    assert "bool value back" in _error_of(mask_mod=lambda b, h, q, kv: q - kv)
    assert "indices" in _error_of(lambda s, b, h, q, kv: s + table[h])
    assert "float" in _error_of(lambda s, b, h, q, kv: s + table[h, s])
    assert "bool or integer" in _error_of(mask_mod=lambda b, h, q, kv: (q * 0.5) & (kv > 0))
    q, k, v = random_qkv(1, 40, 40, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=6)
    with pytest.raises(ValueError, match=r"captured tensor 0 \(shape \(4, 10\)\): its index in dim 1"):
        tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, i - j], enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s)


def test_the_index_check_reads_the_values_of_index_tensors_alone(monkeypatch):
    """check_indices reads a captured tensor's values (aminmax: on a GPU a synchronisation a call) only where
    they feed an index: a document mask's ids, compared, are not read; ids that index a table are, and bound it."""
    from tvmflash.flex_trace import check_indices

    read = []
    aminmax = torch.Tensor.aminmax
    monkeypatch.setattr(torch.Tensor, "aminmax", lambda t: read.append(t.shape) or aminmax(t))
    doc = documents(40, "cpu")
    mods, captured = trace_mods(None, lambda b, h, q, kv: doc[q] == doc[kv])
    check_indices(mods, captured, 1, 4, 40, 40)
    assert read == []
    table = torch.randn(4, 2)  # (the ids of 40 rows: 0 and 1)
    mods, captured = trace_mods(lambda s, b, h, q, kv: s + table[h, doc[q]], None)
    check_indices(mods, captured, 1, 4, 40, 40)
    assert read == [doc.shape]
    small = torch.randn(4, 1)
    mods, captured = trace_mods(lambda s, b, h, q, kv: s + small[h, doc[q]], None)
    with pytest.raises(ValueError, match="may take values from 0 to 1"):
        check_indices(mods, captured, 1, 4, 40, 40)


def learnable_bias_case(device, dtype, head_dim, seqlen_q, seqlen_k, seed):
    """A relative-position bias table and per-head slopes that require grad (a float32 table, float16
    slopes), read by a score_mod beside a mask_mod that hides every key from some rows: the gradients of q,
    k, v and both captured tensors, through out and lse, against float64 autograd (flash-attn's rule; the
    same-dtype reference holds the captures in q's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(HEADS[0], 129, generator=gen).to(device).requires_grad_()
    slopes = (torch.rand(HEADS[0], generator=gen) * 0.3).to(device=device, dtype=torch.float16).requires_grad_()

    def mods(table, slopes):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + table[h, torch.clamp(q_idx - kv_idx, -64, 64) + 64] - slopes[h] * (q_idx - kv_idx).abs()

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + 3) & (q_idx % 4 != 1)
        return score_mod, mask_mod

    q, k, v = random_qkv(2, seqlen_q, seqlen_k, dtype, device, head_dim, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    score_mod, mask_mod = mods(table, slopes)
    out, lse = tvmflash.flex_attention(*leaves, score_mod=score_mod, block_mask=mask_mod, enable_gqa=True,
                                       return_lse=True)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse.detach()), 0.0)
    torch.autograd.backward([out, lse], [dout, dlse])
    refs = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v, table, slopes)]
        ref_out, ref_lse = flex_reference(*ref_leaves[:3], *mods(*ref_leaves[3:]), dtype=ref_dtype)
        loss = (ref_out * dout.to(ref_dtype)).sum()
        loss = loss + (ref_lse.masked_fill(ref_lse == -math.inf, 0) * dlse.to(ref_dtype)).sum()
        refs.append(torch.autograd.grad(loss, ref_leaves))
    check_gradient_errors([t.grad for t in leaves], refs[0][:3], refs[1][:3], dtype)
    for name, ours, ref, same in (("table", table.grad, refs[0][3], refs[1][3]),
                                  ("slopes", slopes.grad, refs[0][4], refs[1][4])):
        assert ours is not None and ours.shape == ref.shape and torch.isfinite(ours).all(), name
        err, their_err = max_error(ours, ref), max_error(same, ref)
        floor = 1e-5 * (1 + ref.abs().max().item())
        assert err <= 2 * their_err + floor, f"{name} error {err:.3e} > 2 x torch's {their_err:.3e} + {floor:.1e}"


def test_a_learnable_bias_table_gets_its_gradient():
    learnable_bias_case("cpu", CPU_DTYPE, CPU_HEAD_DIM, 77, 130, seed=7)


@pytest.mark.gpu
def test_a_learnable_bias_table_gets_its_gradient_on_the_gpu():
    learnable_bias_case("cuda", torch.bfloat16, 128, 1000, 1000, seed=8)


def test_positions_are_clamped_only_where_a_value_past_the_sequence_could_differ():
    """The programs evaluate the mods on padding rows and keys too (the mask hides them). A position is
    clamped into its sequence where it indexes a load (which must stay inside the tensor), divides (0 past
    the sequence: a trap on the CPU) or enters exp, log or sqrt (inf or NaN, which an added -inf would not
    hide); elsewhere it is left as it is, so that a causal mask_mod is one comparison, as the built-in's."""
    from tvmflash.program_flex import _clamped

    table, ids = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    cases = {  # mod: (q_idx clamped, kv_idx clamped)
        "causal": (lambda b, h, q, kv: q >= kv, (False, False)),
        "window": (lambda b, h, q, kv: (q - kv).abs() <= 3, (False, False)),
        "document": (lambda b, h, q, kv: ids[q] == ids[kv], (True, True)),
        "divisor": (lambda b, h, q, kv: kv // (q + 1) < 2, (True, False)),
        "dividend": (lambda b, h, q, kv: q // 64 >= kv // 64, (False, False)),
        "log": (lambda s, b, h, q, kv: s + torch.log(kv + 1.0), (False, True)),
        "head table": (lambda s, b, h, q, kv: s - table[h] * (q - kv).abs(), (False, False)),
        "bias": (lambda s, b, h, q, kv: s + table[(q - kv).abs() % 8], (True, True)),
    }
    for name, (mod, expected) in cases.items():
        score = mod.__code__.co_argcount == 5
        mods, _ = trace_mods(mod if score else None, None if score else mod)
        tree = mods.score if score else mods.mask
        assert (_clamped(tree, "q_idx"), _clamped(tree, "kv_idx")) == expected, name


def test_a_softcap_score_mod_is_the_built_in_softcap():
    """flash-attn's softcap is a tree of the score_mod mechanism (``program_flex.builtin_score``), written by
    the code that writes a user's score_mod: so softcap * tanh(score / softcap) as a score_mod gives the
    built-in softcap's sm90 forward, and its dkdv kernel (the constant divisor folded into the scale, the
    derivative's constant factors cancelled: 1 - tanh²); the forward is the pinned built-in softcap's."""
    import json
    import re

    from test_generated_cuda import HASHES, digest

    mods, _ = trace_mods(lambda s, b, h, q, kv: torch.tanh(s / 30.0) * 30.0, None)
    for compile_ in (tvmflash.compile, tvmflash.compile_backward):
        builtin, mod = (compile_(head_dim=128, dtype="bfloat16", target="sm90", **variant).source(heads_q=4, heads_kv=2)
                        for variant in ({"softcap": 30.0}, {"flex": mods}))
        if compile_ is tvmflash.compile:
            assert mod == builtin and digest(mod) == json.loads(HASHES.read_text())["sm90-d128-softcap"]
        else:  # (the delta kernel differs: a flex row that sees no key takes lse2 = +inf)
            # (its definition, the longest match, not its declaration)
            dkdv = [max(re.findall(r'extern "C" __global__ void [^\n]* dkdv_kernel\(.*?(?=\nextern "C"|\Z)', source,
                                   re.S), key=len) for source in (builtin, mod)]
            assert dkdv[0] == dkdv[1] and "tanhf" in dkdv[0]


def test_an_alibi_score_mod_takes_the_float_absolute_value_as_the_built_in_does():
    """|q_idx - kv_idx| times a float slope: the integer's absolute value is written as the float's (the same
    number; a free operand modifier in SASS, where max(d, -d) is an integer op a score more), as the built-in
    ALiBi writes it."""
    slopes = torch.rand(HEADS[0])
    mods, _ = trace_mods(lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), None)
    source = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", flex=mods).source(heads_q=4, heads_kv=2)
    assert source.count("fabsf(((float)") >= 32 and "(float)max(" not in source


def test_the_derivative_of_a_score_mod():
    """d score_mod / d score from the tree, against autograd at a few scores."""
    from tvmflash.program_flex import derivative

    def score_mod(s, b, h, q, kv):
        return torch.where(s > 0.5, torch.tanh(s) * 3.0, torch.sqrt(s.abs() + 1.0) - torch.exp(s) / (s * s + 2.0))

    node = trace_mods(score_mod, None)[0].score
    d = derivative(node)
    for value in (-2.0, -0.3, 0.0, 0.4, 0.9, 3.0):
        s = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        (expected,) = torch.autograd.grad(score_mod(s, 0, 0, 0, 0), s)
        assert abs(_evaluate(d, value) - expected.item()) < 1e-9


def _evaluate(node, score: float) -> float:
    """A float tree's value at ``score`` (no loads, no positions), in Python."""
    f = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
         "neg": lambda a: -a, "tanh": math.tanh, "exp": math.exp, "sqrt": math.sqrt, "abs": abs,
         "lt": lambda a, b: a < b, "gt": lambda a, b: a > b, "le": lambda a, b: a <= b, "ge": lambda a, b: a >= b,
         "where": lambda c, a, b: a if c else b, "cast": lambda a: a}
    if node.op == "score":
        return score
    if node.op == "const":
        return node.value
    return f[node.op](*(_evaluate(a, score) for a in node.args))


# ----------------------------------------------------------------------------- torch.compile
def _compiled_and_eager(fn, inputs, backend="aot_eager", **options):
    """(out, lse, dq, dk, dv) of ``fn(q, k, v)`` (returning out and lse) compiled with fullgraph=True and run
    eagerly, one backward of a loss of both each."""
    results = []
    for run in (torch.compile(fn, fullgraph=True, backend=backend, **options), fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, lse = run(*leaves)
        gen = torch.Generator().manual_seed(3)
        dout = torch.randn(out.shape, generator=gen).to(out)
        dlse = torch.randn(lse.shape, generator=gen).to(lse).masked_fill(~torch.isfinite(lse.detach()), 0.0)
        torch.autograd.backward([out, lse], [dout, dlse])
        results.append((out.detach(), lse.detach(), *(t.grad for t in leaves), dout, dlse))
    return results


@pytest.mark.parametrize("case", ["score_mod", "block_mask", "both"])
def test_torch_compile_fullgraph_forward_and_backward_match_eager_and_float64(case):
    """torch.compile(fullgraph=True) of a function calling flex_attention: Dynamo runs the tracer on the mods (a
    score_mod defined inside the compiled function, closing over its argument; a BlockMask's mask_mod), the
    captured tensors and the BlockMask's lists are graph inputs, the custom ops' autograd the backward. The same
    kernels as eagerly (bitwise the same out, lse and gradients; on a GPU dq within rounding, as its fp32 atomics add in
    any order), under flash-attn's rule against float64."""
    compiled_matches_eager_and_float64(case, "cpu", CPU_DTYPE, CPU_HEAD_DIM, 77, 130, "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["both"])  # (the CPU test runs each alone)
def test_torch_compile_fullgraph_with_inductor_on_the_gpu(case):
    compiled_matches_eager_and_float64(case, "cuda", torch.bfloat16, 128, 1000, 1300, "inductor")


def compiled_matches_eager_and_float64(case, device, dtype, head_dim, seqlen_q, seqlen_k, backend):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = random_qkv(1, seqlen_q, seqlen_k, dtype, device, head_dim, seed=8)
    table = torch.randn(HEADS[0], 2 * seqlen_k + 1, generator=torch.Generator().manual_seed(1)).to(device)
    window = seqlen_q // 2

    def window_mask(b, h, i, j):
        return (i - j <= window) & (j <= i + 60)

    block_mask = create_block_mask(window_mask, 1, None, seqlen_q, seqlen_k, device=device,
                                   BLOCK_SIZE=64 if device == "cpu" else 128)
    with_mask, with_score = case != "score_mod", case != "block_mask"

    def fn(q, k, v, table=table):
        score_mod = (lambda s, b, h, i, j: s * 0.5 + table[h, i - j + seqlen_k]) if with_score else None
        return tvmflash.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask if with_mask else None,
                                       enable_gqa=True, return_lse=True)

    counter = CompileCounterWithBackend(backend)
    compiled, eager = _compiled_and_eager(fn, (q, k, v), backend=counter)
    assert counter.frame_count == 1
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dout", "dlse"), compiled, eager):
        if name == "dq" and device == "cuda":  # summed by fp32 atomics, in whichever order the blocks run
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-5)
        else:
            assert torch.equal(a, b), name
    score_mod = (lambda s, b, h, i, j: s * 0.5 + table[h, i - j + seqlen_k]) if with_score else None
    mask_mod = window_mask if with_mask else None
    out, lse, dq, dk, dv, dout, dlse = compiled
    check_forward(out, lse, q, k, v, score_mod, mask_mod)
    refs = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = flex_reference(*ref_leaves, score_mod, mask_mod, dtype=ref_dtype)
        loss = (ref_out * dout.to(ref_dtype)).sum() + (ref_lse.masked_fill(ref_lse == -math.inf, 0)
                                                       * dlse.to(ref_dtype)).sum()
        refs.append(torch.autograd.grad(loss, ref_leaves))
    check_gradient_errors([dq, dk, dv], *refs, dtype)


def test_torch_compile_guards_what_the_mods_read():
    """The compiled graph is guarded on what the mods read: a closure's or a global's new number recompiles (with
    dynamic=False: Dynamo makes a changed number symbolic otherwise, which the tracer refuses with an error, never
    a stale trace), a captured tensor's new values are read by the same graph; each result is the eager one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    global _GUARDED
    q, k, v = random_qkv(1, 40, 70, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=3)

    def windowed(w):
        return lambda b, h, i, j: (i - j <= w) & (i >= j)

    def fn(q, k, v, mask_mod, slopes):
        return tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * _GUARDED - slopes[h] * (i - j),
                                       block_mask=mask_mod, enable_gqa=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=False)
    slopes = torch.rand(HEADS[0]) * 0.3
    outs = []
    for w, factor, scale in ((1, 1.0, 1), (22, 1.0, 1), (22, 1.5, 1), (22, 1.5, 2), (1, 1.0, 1)):
        _GUARDED = factor
        got, want = compiled(q, k, v, windowed(w), slopes * scale), fn(q, k, v, windowed(w), slopes * scale)
        assert torch.equal(got, want)
        outs.append(got)
    assert counter.frame_count == 3  # (1, 1.0), (22, 1.0), (22, 1.5); new slopes' values and (1, 1.0) again: none
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2]) and not torch.equal(outs[2], outs[3])
    assert torch.equal(outs[0], outs[4])
    # dynamic by default (Dynamo remembers the numbers that changed above): an error, never another number's result
    dynamic = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for w, factor in ((1, 1.0), (22, 1.0), (5, 1.5)):
        _GUARDED = factor
        try:
            got = dynamic(q, k, v, windowed(w), slopes)
        except Exception:  # noqa: BLE001 - Dynamo's, at the tracer's use of a symbolic number
            continue
        assert torch.equal(got, fn(q, k, v, windowed(w), slopes))


_GUARDED = 1.0


def test_torch_compile_checks_values_at_run_time_and_names_a_refusal():
    """Under torch.compile the checks that read tensors' values run in the op: an index out of its captured
    tensor is the eager ValueError; the tracer's refusal still names the operation."""
    q, k, v = random_qkv(1, 40, 70, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=3)
    small = torch.zeros(HEADS[0], 50)

    def out_of_range(q, k, v):
        return tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + small[h, i - j + 25],
                                       enable_gqa=True)

    with pytest.raises(ValueError, match="its index in dim 1 may take values"):
        torch.compile(out_of_range, fullgraph=True, backend="aot_eager")(q, k, v)

    def unsupported(q, k, v):
        return tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.sin(s), enable_gqa=True)

    with pytest.raises(Exception, match="torch.sin is not supported"):
        torch.compile(unsupported, fullgraph=True, backend="aot_eager")(q, k, v)


def test_torch_compile_of_a_learnable_bias_takes_dkdvs_gradient():
    """A captured table that requires grad, compiled: its gradient from dkdv's additions (torch's way,
    the CPU's eager default, is no graph), equal to the eager call's with TVMFLASH_FLEX_GRADIENT=kernel."""
    q, k, v = random_qkv(1, 40, 70, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=4)
    table = torch.randn(HEADS[0], 129, generator=torch.Generator().manual_seed(2)).requires_grad_()

    def fn(q, k, v):
        return tvmflash.flex_attention(q, k, v, enable_gqa=True, return_lse=True,
                                       score_mod=lambda s, b, h, i, j: s + table[h, torch.clamp(i - j, -64, 64) + 64])

    grads = []
    for run in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
        table.grad = None
        with pytest.MonkeyPatch.context() as patch:
            if run is fn:
                patch.setenv("TVMFLASH_FLEX_GRADIENT", "kernel")
            _, (out, lse) = None, run(q, k, v)
            out.float().square().sum().backward()
        grads.append(table.grad.clone())
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])
