"""The measured spaces, ``tvmflash tune --pass backward|decode``, ``--dtype float8_e4m3fn`` and ``--flex NAME``:
the backward's, decode's, the FP8 forward's and a flex workload's forward knobs for this machine, by measuring
their spaces (a flex workload's arguments, its captured tensors and block lists, are no random inputs:
``FlexForward``; the FP8 forward's space is small, and its kernel not ``compile``'s: ``Fp8Forward``; decode
over an FP8 cache is ``Decode``'s with ``cache_dtype``). The FP8 kernels' candidates are checked as their
tests check them (``tvmflash.fp8_reference``).

The backward is three programs run as one call (delta; dkdv; dq by a pass of its own, or by
dkdv's fp32 atomics), and decode two (the splits and their merge, or one that writes the output):
their knobs change which programs run as well as their tiles. MetaSchedule measures one program's
candidates, so these passes are not searched by it: their spaces are small (sm90's backward
``KnobSet.points()`` holds 384 configurations), or, for decode, cheap to build (seconds a
candidate), and a budget of trials covers much of them. The schedule is the one its kernel takes
(``choice.choose_schedule``). The known configurations (the defaults and, unless ``cold``, the best
user and shipped records) come first, then a random draw of the rest of the space, leaving out
before building what ``space.candidate_problem`` rejects (the knob set's validation, shared
memory); each is built in parallel processes (``bench.build_in_parallel``) as
``compile_backward`` / ``compile_decode`` build it on that schedule, checked against float32 with
flash-attn's rule and timed whole on the tuning shape's tensors, one at a time
(``runner.gpu_timing_lock``). The fastest correct one is timed again against the incumbent (the
knobs the pass's kernel takes now), five times each in turns, and stored as a record of the
workload's pass (``choice.workload``), which the pass's kernel then reads, where it beats the
incumbent by more than the noise of those timings (``decision.decide``; else the record keeps the
incumbent's knobs).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch

from tvmflash import bench, choice, database, fp8_reference, kernels
from tvmflash.tune import decision
from tvmflash.kernels import checks
from tvmflash.kernels.fp8 import fp8_schedule
from tvmflash.program import FP8
from tvmflash.program_block_sparse import SPARSE_TILE_KNOBS
from tvmflash.program_decode import DecodeSpec
from tvmflash import target as targets
from tvmflash.tune.builder import usable_cores
from tvmflash.tune.progress import left_out_line
from tvmflash.tune.run import known_configurations, require_gpu, store, tuning_request
from tvmflash.tune.runner import gpu_timing_lock
from tvmflash.tune.space import candidate_problem

# The decode tuning shape: the serving grid of BENCHMARKS.md (GQA 32/8, one query token) on a GPU;
# --heads sets the query heads, a quarter of them the K/V heads.
_DECODE_SHAPE = {"cuda": {"batch": 32, "seqlen": 16384, "heads": 32}, "cpu": {"batch": 2, "seqlen": 1024, "heads": 4}}
GQA_GROUP = 4


def _decode_shape(target, _head_dim: int) -> dict:
    return _DECODE_SHAPE["cuda" if targets.is_cuda(target) else "cpu"]


def space_points(space: dict) -> list[dict]:
    """Every configuration of a space given as an override (a schedule's own is its
    ``KnobSet.points()``): a list of values a knob, or a callable of the knobs resolved before it
    that returns that list (e.g. sm80's dq_warps, from dq_block_m)."""
    points = [{}]
    for name, values in space.items():
        points = [{**point, name: value} for point in points
                  for value in (values(point) if callable(values) else values)]
    return points


class _SquarePass:
    """What the backward's and a flex forward's passes share: (batch, seqlen, heads) queries over as many
    keys and heads, built from ``spec_args``."""

    def _take_shape(self, shape: dict) -> None:
        self.heads = (shape["heads"], shape["heads"])
        self.record_shape = {"batch": shape["batch"], "seqlen_q": shape["seqlen"], "seqlen_k": shape["seqlen"],
                             "heads_q": shape["heads"], "heads_kv": shape["heads"]}

    def build_kwargs(self, knobs: dict, heads: bool = True) -> dict:
        return {**self.spec_args, "target": self.target, "knobs": knobs, "schedule": self.schedule.name,
                **({"heads_q": self.heads[0], "heads_kv": self.heads[1]} if heads else {})}


class Backward(_SquarePass):
    """The backward pass: ``compile_backward``'s kernel, timed on (q, k, v, out, dout, lse) of the
    tuning shape, its gradients checked on two heads."""

    name, builder = "backward", "compile_backward"

    def __init__(self, head_dim: int, dtype: str, causal: bool, target, shape: dict):
        self.spec_args = {"head_dim": head_dim, "dtype": dtype, "causal": causal}
        self.target, self.shape = target, shape
        self.schedule, _, _ = choice.choose_schedule("backward", target, self.spec_args)
        self.knobs = self.schedule.backward.knobs
        self.defaults = self.knobs.defaults(head_dim, dtype=dtype)
        self.workload = choice.workload(self.spec_args, "backward")
        self._take_shape(shape)

    def kernel(self, knobs: dict):
        """The kernel of these knobs (a ValueError where it refuses them; builds nothing)."""
        return kernels.compile_backward(**self.build_kwargs(knobs, heads=False))

    def inputs(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        b, s, h, d = self.shape["batch"], self.shape["seqlen"], self.shape["heads"], self.spec_args["head_dim"]
        self.q, self.k, self.v, self.dout = (torch.randn(b, s, h, d, generator=gen).to(
            device=device, dtype=checks.TORCH_DTYPES[self.spec_args["dtype"]]) for _ in range(4))
        forward = kernels.compile(**self.spec_args, target=self.target)
        self.out, self.lse = forward(self.q, self.k, self.v, return_lse=True)

    def call(self, kern):
        return lambda: kern(self.q, self.k, self.v, self.out, self.dout, self.lse)

    def wrong(self, result) -> list[str]:
        errors = bench.gradient_errors_vs_float32(result, self.q, self.k, self.v, self.dout, self.spec_args["causal"])
        return [f"{name} error {err:.2e} > {allowed:.2e}"
                for name, (err, allowed) in zip(("dq", "dk", "dv"), errors) if not err <= allowed]


class Decode:
    """Decode (Flash-Decoding over a KV cache): ``compile_decode``'s kernel, one query token a
    sequence over full caches of the tuning shape (``page_size``: paged), the split count its
    own (num_splits=0); the output checked on two query heads."""

    name, builder = "decode", "compile_decode"

    def __init__(self, head_dim: int, dtype: str, causal: bool, target, shape: dict, page_size: int = 0,
                 cache_dtype: str | None = None):
        if causal:
            raise ValueError("causal: decode's causal is an argument of each call, not of the kernel: tune without it")
        if cache_dtype not in (None, dtype, FP8):
            raise ValueError(f"cache_dtype: expected {FP8} (an FP8 cache) or none (q's dtype), got {cache_dtype!r}")
        self.spec_args = {"head_dim": head_dim, "dtype": dtype, "causal": False}
        self.head_dim, self.dtype, self.page_size = head_dim, dtype, page_size
        self.cache_dtype = None if cache_dtype in (None, dtype) else cache_dtype
        DecodeSpec(head_dim, dtype, 1, 1, page_size, cache_dtype=self.cache_dtype or "")  # q's dtype with it
        self.target, self.shape = target, shape
        self.schedule, _, _ = choice.choose_schedule("decode", target, self.spec_args)
        # (its knob space is the schedule's decode knobs, an FP8 cache's as a cache in q's dtype's: a candidate
        # that the FP8 cache's build refuses fails as a trial)
        self.knobs = self.schedule.decode.knobs
        self.defaults = choice.decode_defaults(self.schedule, head_dim, dtype, self.cache_dtype)
        self.workload = choice.workload(self.spec_args, "decode", page_size, self.cache_dtype)
        self.heads = (shape["heads"], max(1, shape["heads"] // GQA_GROUP))
        self.record_shape = {"batch": shape["batch"], "seqlen_q": 1, "seqlen_k": shape["seqlen"],
                             "heads_q": self.heads[0], "heads_kv": self.heads[1]}

    def kernel(self, knobs: dict):
        return kernels.compile_decode(**self.build_kwargs(knobs, heads=False))

    def build_kwargs(self, knobs: dict, heads: bool = True) -> dict:
        return {"head_dim": self.head_dim, "dtype": self.dtype, "page_size": self.page_size, "target": self.target,
                "knobs": knobs, "schedule": self.schedule.name,
                **({"cache_dtype": self.cache_dtype} if self.cache_dtype else {}),
                **({"heads_q": self.heads[0], "heads_kv": self.heads[1]} if heads else {})}

    def inputs(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        b, s = self.shape["batch"], self.shape["seqlen"]
        (hq, hkv), d, dtype = self.heads, self.head_dim, checks.TORCH_DTYPES[self.dtype]
        self.q = torch.randn(b, 1, hq, d, generator=gen).to(device=device, dtype=dtype)
        if self.cache_dtype:  # e4m3 of randn * 2 (as tests/test_decode_fp8.py's), with FA3's descales
            self.k, self.v = ((torch.randn(b, s, hkv, d, generator=gen) * 2).to(fp8_reference.F8).to(device)
                              for _ in range(2))
            self.descales = {name: (torch.rand(b, hkv, generator=gen) + 0.5).to(device)
                             for name in ("k_descale", "v_descale")}
        else:
            self.k, self.v = (torch.randn(b, s, hkv, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
            self.descales = {}
        self.lengths = torch.full((b,), s, dtype=torch.int32, device=device)
        if self.page_size:  # the pages in order: page i of sequence j is page j * pages + i
            pages = -(-s // self.page_size)
            cache = [torch.zeros(b * pages * self.page_size, hkv, d, device=device, dtype=self.k.dtype)
                     for _ in range(2)]
            for c, t in zip(cache, (self.k, self.v)):
                c.view(b, pages * self.page_size, hkv, d)[:, :s] = t
            self.k_cache, self.v_cache = (c.view(b * pages, self.page_size, hkv, d) for c in cache)
            self.index = torch.arange(b * pages, dtype=torch.int32, device=device).view(b, pages)
        else:
            self.k_cache, self.v_cache = self.k, self.v
            self.index = torch.arange(b, dtype=torch.int32, device=device)

    def call(self, kern):
        return lambda: kern(self.q, self.k_cache, self.v_cache, self.lengths, self.index, **self.descales)

    def wrong(self, result) -> list[str]:
        if self.cache_dtype:  # as tests/test_decode_fp8.py checks it: two sequences, the first K/V head's group
            group = self.heads[0] // self.heads[1]
            sequences, q_heads, kv_heads = slice(0, 2), (slice(0, 2), slice(None), slice(0, group)), \
                (slice(0, 2), slice(None), slice(0, 1))
            err, allowed = fp8_reference.decode_error(
                result[0][q_heads], self.q[q_heads], self.k[kv_heads], self.v[kv_heads], self.lengths[sequences],
                *(self.descales[name][sequences, :1] for name in ("k_descale", "v_descale")))
        else:
            group = self.heads[0] // self.heads[1]
            k, v = (t.repeat_interleave(group, dim=2) for t in (self.k, self.v))
            err, allowed = bench.error_vs_float32(result[0], self.q, k, v, False)
        return [] if err <= allowed else [f"out error {err:.2e} > {allowed:.2e}"]


class Fp8Forward(_SquarePass):
    """The FP8 (e4m3) forward (``tvmflash tune --dtype float8_e4m3fn``): ``compile_fp8``'s kernel over its knob
    set's space (``Fp8Forward.knobs`` of the schedule, ``kernels.fp8.fp8_schedule``'s), measured whole as the
    backward's is (a small space), timed on e4m3 (q, k, v) of the tuning shape with FA3's descales, and
    checked as tests/test_fp8.py checks it (``fp8_reference.forward_error``: at most twice the error of a
    torch emulation of the same quantisation) on two heads' last rows. Its records are ``choice.fp8_workload``'s,
    which the FP8 forward's kernels alone read. On sm90 GPUs alone (``target_problem``)."""

    name, builder = "fp8", "compile_fp8"
    ROWS = 1024  # the query rows checked (the last: causal is bottom-right, so they keep their mask)

    @staticmethod
    def target_problem(target) -> str | None:
        """Why the FP8 forward is not tuned on ``target``, or None: its kernel is sm90's (the CPU schedule's FP8
        forward runs the same program for the tests alone, and is not what a user's FP8 forward runs)."""
        if not targets.is_cuda(target):
            return (f"the FP8 forward is tuned on an sm90 GPU (H100, H200), where its kernel runs; "
                    f"{targets.describe(target)} has none (its FP8 forward is the tests' reference schedule)")
        return None

    def __init__(self, head_dim: int, dtype: str, causal: bool, target, shape: dict):
        if dtype != FP8:
            raise ValueError(f"dtype: the FP8 forward's inputs are {FP8}, got {dtype!r}")
        problem = self.target_problem(target)
        if problem:
            raise ValueError(f"target: {problem}")
        try:
            self.schedule = fp8_schedule(target)
        except NotImplementedError as err:
            raise ValueError(f"target: {err}") from None
        fp8 = self.schedule.fp8_forward
        if head_dim not in fp8.head_dims:
            raise ValueError(f"head_dim: the {self.schedule.name} FP8 forward takes {fp8.head_dims}, got {head_dim}")
        problem = choice.unchecked_problem(f"the {self.schedule.name} FP8 forward", head_dim, fp8.unchecked_head_dims)
        if problem:
            raise ValueError(problem)
        self.spec_args = {"head_dim": head_dim, "dtype": FP8, "causal": causal}
        self.target, self.shape = target, shape
        self.knobs = fp8.knobs
        self.defaults = self.knobs.defaults(head_dim)
        self.workload = choice.fp8_workload(head_dim, causal)
        self._take_shape(shape)

    def build_kwargs(self, knobs: dict, heads: bool = True) -> dict:
        return {"head_dim": self.spec_args["head_dim"], "causal": self.spec_args["causal"], "target": self.target,
                "knobs": knobs, "schedule": self.schedule.name,
                **({"heads_q": self.heads[0], "heads_kv": self.heads[1]} if heads else {})}

    def kernel(self, knobs: dict):
        return kernels.compile_fp8(**self.build_kwargs(knobs, heads=False))

    def inputs(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        b, s, h, d = self.shape["batch"], self.shape["seqlen"], self.shape["heads"], self.spec_args["head_dim"]
        # e4m3 of randn * 2, descales in [0.5, 1.5) (as tests/test_fp8.py's)
        self.q, self.k, self.v = ((torch.randn(b, s, h, d, generator=gen) * 2).to(fp8_reference.F8).to(device)
                                  for _ in range(3))
        self.descales = [(torch.rand(b, h, generator=gen) + 0.5).to(device) for _ in range(3)]
        self.out = torch.empty(b, s, h, d, dtype=torch.bfloat16, device=device)

    def poison(self) -> None:
        """NaN in the output before a candidate's checked call: one that writes nothing fails."""
        self.out.fill_(float("nan"))

    def call(self, kern):
        return lambda: kern(self.q, self.k, self.v, *self.descales, out=self.out)

    def wrong(self, result) -> list[str]:
        rows = min(self.ROWS, self.shape["seqlen"])
        q_rows, kv = (slice(0, 1), slice(-rows, None), slice(0, 2)), (slice(0, 1), slice(None), slice(0, 2))
        err, allowed = fp8_reference.forward_error(
            result[q_rows], self.q[q_rows], self.k[kv], self.v[kv], *(d[:1, :2] for d in self.descales),
            self.spec_args["head_dim"] ** -0.5, self.spec_args["causal"])
        return [] if err <= allowed else [f"out error {err:.2e} > {allowed:.2e} (2x the emulation's)"]


class FlexForward(_SquarePass):
    """The forward of a flex workload (``tvmflash tune --flex NAME``): ``compile(flex=)``'s kernel over the
    forward knobs' space, measured as the backward's is (a mod's captured tensors and a BlockMask's lists
    are arguments MetaSchedule's random inputs would not fill sensibly: document ids, block indices).
    ``flex(batch, heads, seqlen, device)`` (the API's: ``tvmflash.flex_patterns.TuningCase``) gives the
    traced mods, the tensors each call takes and a reference of the attention, which the output is checked
    against on two heads (flash-attn's rule, against float32). Its records are the mods' workload
    (``choice.workload``: keyed by ``choice.flex_digest``), which every kernel of the same trace reads."""

    name, builder, program = "flex", "compile", "forward"

    def __init__(self, head_dim: int, dtype: str, causal: bool, target, shape: dict, flex=None):
        if flex is None:
            raise ValueError("flex: the flex pass tunes a workload with mods; none given")
        if causal:
            raise ValueError("causal: a flex workload's mask is its mask_mod: tune it without --causal")
        self.flex, self.target, self.shape = flex, target, shape
        self.mods, _, _ = flex(shape["batch"], shape["heads"], shape["seqlen"], "cpu")  # (the trace alone)
        self.spec_args = {"head_dim": head_dim, "dtype": dtype, "causal": False, "flex": self.mods}
        self.schedule, _, _ = choice.choose_schedule(self.program, target, self.spec_args)
        self.knobs = self.schedule.program(self.program).knobs
        self.defaults = self.knobs.defaults(head_dim, dtype=dtype)
        self.workload = choice.workload(self.spec_args, self.program)
        self._take_shape(shape)

    def problem(self, knobs: dict) -> str | None:
        """With a BlockMask, why tiles that do not divide its blocks cannot run (each tile lies in one block)."""
        sparse = self.mods.sparse
        if sparse is None:
            return None
        for name, axis in SPARSE_TILE_KNOBS.items():
            if name in knobs and sparse[axis] % knobs[name]:
                return f"{name} {knobs[name]} does not divide the BlockMask's {sparse[axis]}-row blocks"
        return None

    def kernel(self, knobs: dict):
        return kernels.compile(**self.build_kwargs(knobs, heads=False))

    def inputs(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        b, s, h, d = self.shape["batch"], self.shape["seqlen"], self.shape["heads"], self.spec_args["head_dim"]
        self.q, self.k, self.v = (torch.randn(b, s, h, d, generator=gen).to(
            device=device, dtype=checks.TORCH_DTYPES[self.spec_args["dtype"]]) for _ in range(3))
        mods, self.captures, self.reference = self.flex(b, h, s, device)
        if mods != self.mods:
            raise ValueError(f"flex: {self.flex} traced to other mods on {device} than on the CPU")

    def call(self, kern):
        return lambda: kern(self.q, self.k, self.v, captures=self.captures)

    def wrong(self, result) -> list[str]:
        """flash-attn's rule on batch 0's first two heads: our error against the reference in float32 at
        most 2x the reference's own in the inputs' dtype, plus 1e-5."""
        sl = (slice(0, 1), slice(None), slice(0, 2))
        q, k, v = (t[sl] for t in (self.q, self.k, self.v))
        ref = self.reference(q, k, v, torch.float32)
        ours = (result[sl].float() - ref).abs().max().item()
        theirs = (self.reference(q, k, v, q.dtype).float() - ref).abs().max().item()
        allowed = 2 * theirs + 1e-5
        return [] if ours <= allowed else [f"out error {ours:.2e} > {allowed:.2e}"]


class FlexBackward(FlexForward):
    """The backward of a flex workload (``tvmflash tune --flex NAME --pass backward``): ``compile_backward(flex=)``'s
    kernel over the backward knobs' space, timed on (q, k, v, out, dout, lse) of the tuning shape with the
    mods' captures, its gradients checked against the reference's (torch's autograd) on two heads."""

    name, builder, program = "flex-backward", "compile_backward", "backward"

    def kernel(self, knobs: dict):
        return kernels.compile_backward(**self.build_kwargs(knobs, heads=False))

    def inputs(self, device: torch.device) -> None:
        super().inputs(device)
        self.dout = torch.randn(self.q.shape, generator=torch.Generator().manual_seed(1)).to(self.q)
        forward = kernels.compile(**self.spec_args, target=self.target)
        self.out, self.lse = forward(self.q, self.k, self.v, return_lse=True, captures=self.captures)

    def call(self, kern):
        return lambda: kern(self.q, self.k, self.v, self.out, self.dout, self.lse, captures=self.captures)

    def wrong(self, result) -> list[str]:
        """flash-attn's rule for dq, dk, dv on batch 0's first two heads (as many query as key heads)."""
        sl = (slice(0, 1), slice(None), slice(0, 2))

        def grads(dtype):
            leaves = [t[sl].detach().to(dtype).requires_grad_() for t in (self.q, self.k, self.v)]
            return torch.autograd.grad(self.reference(*leaves, dtype), leaves, self.dout[sl].to(dtype))
        ref, same = grads(torch.float32), grads(self.q.dtype)
        wrong = []
        for name, ours, r, theirs in zip(("dq", "dk", "dv"), result, ref, same):
            err, allowed = (ours[sl].float() - r).abs().max().item(), 2 * (theirs.float() - r).abs().max().item() + 1e-5
            if not err <= allowed:
                wrong.append(f"{name} error {err:.2e} > {allowed:.2e}")
        return wrong


PASSES = {"backward": Backward, "decode": Decode, "fp8": Fp8Forward, "flex": FlexForward,
          "flex-backward": FlexBackward}


def candidates(pass_, known: dict, trials: int, rng: random.Random,
               space: dict | None = None) -> tuple[list[tuple[str, dict]], list[str]]:
    """[(label, knobs)] to measure: the known configurations (label -> knobs), then configurations
    of ``space`` (default the pass's knob set's ``points()``, the combinations its rules accept)
    drawn at random, ``trials`` in all; and why the configurations left out could not run
    (``candidate_problem``: checked before building)."""
    chosen, problems, rest = list(known.items()), [], []
    head_dim, dtype = pass_.spec_args["head_dim"], pass_.spec_args["dtype"]
    for point in space_points(space) if space is not None else pass_.knobs.points():
        knobs = {**pass_.defaults, **point}
        if knobs in known.values():
            continue
        problem = candidate_problem(pass_.knobs, pass_.target, head_dim, dtype, knobs) or (
            pass_.problem(knobs) if hasattr(pass_, "problem") else None)
        if problem is not None:
            problems.append(problem)
            continue
        rest.append(knobs)
    rng.shuffle(rest)
    chosen += [(f"#{n}", knobs) for n, knobs in enumerate(rest[:max(0, trials - len(chosen))], 1)]
    return chosen, problems


def tune_pass(pass_name: str, *, head_dim: int, dtype, causal: bool = False, target=None, trials: int = 64,
              batch: int | None = None, seqlen: int | None = None, heads: int | None = None, page_size: int = 0,
              space: dict | None = None, seed: int | None = None, repeat: int = 10, cold: bool = False,
              jobs: int | None = None, flex=None, cache_dtype: str | None = None, echo=print) -> dict:
    """Tune one pass's knobs ("backward", "decode", "fp8", the FP8 forward (dtype float8_e4m3fn), or "flex", the
    forward of ``flex``'s mods: ``PASSES``; the schedule its kernel picks,
    that schedule's space or ``space``, knob name -> candidates) for one workload on this machine and store the fastest
    correct configuration where it beats the incumbent by more than the noise (``decision.decide``).

    The tuning shape: the backward's is the forward tuner's (batch, seqlen, heads: query and key
    heads alike); decode's is ``_DECODE_SHAPE`` (batch, the KV length, query heads; a quarter as
    many K/V heads; ``page_size``: a paged cache; ``cache_dtype`` float8_e4m3fn: an FP8 cache, q in ``dtype``).
    ``trials`` configurations in all, the known
    ones first. ``cold``: no records are read (the defaults are still timed, as the reference and
    the floor of what is stored). ``jobs``: build processes (default: the usable cores). Returns
    the new record with ``path``.
    """
    if pass_name not in PASSES:
        raise ValueError(f"pass: expected one of {sorted(PASSES)}, got {pass_name!r}")
    dtype, resolved, shape = tuning_request(head_dim, dtype, causal, trials, target, batch, seqlen, heads,
                                            shape_for=_decode_shape if pass_name == "decode" else None)
    if cache_dtype is not None and pass_name != "decode":
        raise ValueError(f"cache_dtype: the KV cache's dtype, of decode alone (pass {pass_name!r})")
    extra = ({"page_size": page_size, "cache_dtype": cache_dtype} if pass_name == "decode" else
             {"flex": flex} if pass_name.startswith("flex") else {})
    pass_ = PASSES[pass_name](head_dim, dtype, causal, resolved, shape, **extra)
    cuda = require_gpu(resolved)
    schedule_name = pass_.schedule.name
    start = time.perf_counter()
    layout = (f", pages of {page_size}" if page_size else "") + (f", {cache_dtype} cache" if cache_dtype else "")
    what = f"--pass {pass_name}" if flex is None else f"({flex}{' backward' if pass_name == 'flex-backward' else ''})"
    echo(f"tvmflash tune {what}: {schedule_name} schedule on {targets.describe(resolved)}, d{head_dim} "
         f"{dtype} {'causal' if causal else 'full'}{layout}, shape {pass_.record_shape}, {trials} trials")

    known = known_configurations(resolved, pass_.knobs, pass_.workload, pass_.defaults, cold=cold,
                                 seqlen_k=shape["seqlen"])
    chosen, problems = candidates(pass_, known, trials, random.Random(seed), space)
    echo(f"  measuring {len(chosen)} configurations ({', '.join(known)} first); {left_out_line(problems)}")

    # ---- build, every core at once (a GPU backward module takes about half a minute, on one core)
    processes = jobs or usable_cores()
    echo(f"  building {len(chosen)} candidates, {processes} at a time")
    errors = bench.build_in_parallel([(pass_.builder, pass_.build_kwargs(knobs)) for _, knobs in chosen], processes,
                                     echo=lambda line: None, keep_going=True)
    echo(f"  built {sum(e is None for e in errors)}/{len(chosen)} ({sum(e is not None for e in errors)} failed), "
         f"{time.perf_counter() - start:.0f} s")

    # ---- check and time each on the same tensors, in this process
    device = torch.device("cuda" if cuda else "cpu")
    pass_.inputs(device)
    times, kernels_, failed = {}, {}, 0
    for n, ((label, knobs), error) in enumerate(zip(chosen, errors), 1):
        changed = {name: knobs[name] for name in knobs if knobs[name] != pass_.defaults.get(name)}
        what = label if label in known else f"{label} {changed}"
        if error is None:
            kern = pass_.kernel(knobs)
            if hasattr(pass_, "poison"):  # its output is reused: NaN first, so a candidate that writes none fails
                pass_.poison()
            wrong = pass_.wrong(pass_.call(kern)())
            error = f"wrong results: {', '.join(wrong)}" if wrong else None
        if error is not None:
            failed += 1
            echo(f"  trial {n}/{len(chosen)} {what}: failed ({error})")
            continue
        with gpu_timing_lock() if cuda else contextlib.nullcontext():
            times[label] = bench.time_ms(pass_.call(kern), device, repeat=repeat)
        kernels_[label] = kern
        echo(f"  trial {n}/{len(chosen)} {what}: {times[label]:.4f} ms (best {min(times.values()):.4f} ms, "
             f"{time.perf_counter() - start:.0f} s)")
    if "default" not in times:
        raise RuntimeError(f"tvmflash tune --pass {pass_name}: the default knobs failed at the tuning shape")
    winner = min(times, key=times.get)
    searched = [label for label in times if label not in known]
    tuned = min(searched, key=times.get) if searched else "default"
    incumbent = decision.incumbent(known)
    rounds = {label: [ms] for label, ms in times.items()}
    if winner != incumbent and incumbent in times:
        # the winner against the incumbent, timed again in turns: their spread is the noise to beat
        echo(f"  timing {winner} against {incumbent} again, {decision.ROUNDS} times each in turns")
        with gpu_timing_lock() if cuda else contextlib.nullcontext():
            rounds.update(decision.timed_rounds({label: pass_.call(kernels_[label]) for label in (incumbent, winner)},
                                                lambda call: bench.time_ms(call, device, repeat=repeat)))
    verdict = decision.decide(rounds, incumbent, winner, None if incumbent in times else "failed at the tuning shape")
    kept_ms = statistics.median(rounds[verdict.kept])
    knobs = dict(chosen)[verdict.kept]
    wall_s = time.perf_counter() - start
    record = database.new_record(
        resolved, schedule_name, pass_.workload, knobs, kept_ms, shape=pass_.record_shape,
        trials=len(chosen), failed_trials=failed, wall_s=round(wall_s, 1), default_ms=times["default"],
        tuned_ms=times[tuned], tuned_knobs=dict(chosen)[tuned], known_ms={label: times.get(label) for label in known},
        start="cold" if cold else "warm", **({"flex_case": str(flex)} if flex is not None else {}),
        **verdict.record_fields())
    echo(f"{pass_name} at {pass_.record_shape}: default {times['default']:.4f} ms, best {times[winner]:.4f} ms "
         f"({times['default'] / times[winner]:.2f}x, {winner}): {dict(chosen)[winner]}")
    path = store(record, verdict, cold, echo, f"{len(chosen)} trials, {failed} failed, {wall_s:.0f} s")
    return {**record, "path": str(path)}
