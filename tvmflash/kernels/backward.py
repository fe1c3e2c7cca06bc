"""The backward kernels: FlashAttention's backward (dense and varlen) for one workload and target."""

from __future__ import annotations

import torch
import tvm

from tvmflash import cache, choice, lowering, program, program_backward
from tvmflash import target as targets
from tvmflash.kernels.build import PROGRAMS, Build, describe
from tvmflash.kernels.checks import (
    VARIANT_FIELDS,
    Arguments,
    check_gradient_arguments,
    resolve_softmax_scale,
    sinks_view,
)
from tvmflash.kernels.forward import kernel_build_options
from tvmflash.kernels.varlen import one_batch
from tvmflash.program import AttentionSpec


def row_values(rows: tuple, device) -> tuple:
    """delta and lse2 for the backward's programs: float32 of shape ``rows`` (batch, heads_q,
    seqlen_q), each head's rows ``program_backward.padded_rows`` apart."""
    *outer, seqlen_q = rows
    return tuple(torch.empty((*outer, program_backward.padded_rows(seqlen_q)), dtype=torch.float32,
                             device=device)[..., :seqlen_q] for _ in range(2))


def sinks_gradient(sinks, lse, delta) -> torch.Tensor:
    """The gradient of learnable sinks, float32 (heads_q,): dsink_h = -Σ exp(sink_h - lse) · delta over every
    row of head h, exp(sink_h - lse) the sink's share of the row's softmax and delta = rowsum(dout ∘ out) -
    dlse, the backward's (∂out/∂sink = -share · out, ∂lse/∂sink = share). lse and delta: (batch, heads_q,
    rows) float32; a row of lse -inf (a sink of -inf and no key) adds 0. A reduction over the rows' values:
    the backward's programs are those without sinks (their p = exp(s - lse) holds the sink already)."""
    share = torch.exp(sinks[None, :, None] - lse).nan_to_num_(0.0)  # -inf - -inf: no sink, no key
    return -(share * delta).sum((0, 2))


def cpu_threads() -> int:
    """The threads of TVM's CPU pool, which run a CPU module's parallel tasks (``build`` sizes it)."""
    return tvm.get_global_func("runtime.NumThreads")()


class BackwardKernel:
    """FlashAttention backward for one (head_dim, dtype, causal, variant, target): the three programs of
    ``tvmflash.program_backward`` (delta, dkdv, dq) built into one module per pair of head
    counts, scheduled by the target's ``schedule_backward`` and cached like the forward's::

        dq, dk, dv = kernel(q, k, v, out, dout, lse)              # dlse=None: lse unused by the loss
        dq, dk, dv = kernel(q, k, v, out, dout, lse, alibi_slopes=slopes)  # a kernel with ALiBi
        dq, dk, dv = kernel(q, k, v, out, dout, lse, dropout_p=0.1, dropout_seed=seed)  # with dropout: the forward's

    q, out, dout: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv,
    head_dim); lse, dlse: float32 (batch, heads_q, seqlen_q), the forward's. dq, dk, dv have the
    shapes and dtype of q, k and v (dk, dv summed over each GQA group's query heads). The
    gradients are bitwise the same from run to run unless the knob ``dq_atomic`` sums dq by fp32
    atomics (``program_backward``): sm90's default, where that measures faster. ``deterministic``
    (``compile_backward``) turns it off. (The CPU's dq_atomic sums in a fixed order, without atomics, and
    stays: ``Schedule.ordered_dq_accumulation``.) With ``sinks=`` (float32 (heads_q,), those of a forward with sinks,
    whose lse holds them) the call returns (dq, dk, dv, dsinks): the programs are the same, and dsinks, float32
    (heads_q,), is a reduction of lse and the delta program's rows (``sinks_gradient``).
    """

    PASS = "backward"

    def __init__(self, spec_args: dict, target: tvm.target.Target, knobs: dict | None, deterministic: bool = False,
                 schedule: str | None = None):
        self.head_dim, self.dtype, self.causal = spec_args["head_dim"], spec_args["dtype"], spec_args["causal"]
        self.variant = {name: spec_args[name] for name in VARIANT_FIELDS if name in spec_args}
        self.target = target
        chosen = choice.backward(target, spec_args, knobs, deterministic, schedule)
        self._arguments = (spec_args, target, knobs, deterministic, schedule)
        self._dq_pass = None  # the kernel with a dq pass instead of dq_atomic (``_for_tasks``), once needed
        self.schedule, self.schedule_source = chosen.schedule, chosen.schedule_source
        self.knobs, self.knobs_source = chosen.knobs, chosen.knobs_source
        stride_multiple = program.stride_multiple(self.schedule.stride_alignment, self.dtype)
        self.arguments = Arguments(self.head_dim, self.dtype, target, self.variant, stride_multiple)
        options = kernel_build_options(self.schedule, self.variant, "backward")
        self.build = Build(kind=self.PASS, target=target, schedule=self.schedule, knobs=self.knobs,
                           variant=self.variant, spec=self.spec, programs=self._scheduled, entry=self._entry,
                           code=(*PROGRAMS, *self.schedule.sources, *lowering.MODULES),
                           options=options, key_fields={"build": options} if self.variant.get("varlen") else {},
                           outer={"pass": self.PASS, "code": cache.source_digest(program_backward)})
        # as the forward's: a module for some head counts, its CUDA source, its scheduled TensorIR
        self.module, self.source, self.scheduled_tir = self.build.module, self.build.source, self.build.scheduled_tir

    # ----------------------------------------------------------------- building
    def spec(self, heads_q: int, heads_kv: int) -> AttentionSpec:
        return AttentionSpec(self.head_dim, self.dtype, self.causal, heads_q, heads_kv, **self.variant)

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        knobs = self.knobs
        sch = tvm.s_tir.Schedule(program_backward.attention_backward(
            spec, knobs["block_m"], knobs["block_n"], knobs.get("dq_block_m"), knobs.get("dq_block_n"),
            dq_atomic=self.dq_atomic, stride_alignment=self.schedule.stride_alignment,
            dkdv_slices=knobs.get("dkdv_slices", 1), dkdv_slicing=knobs.get("dkdv_slicing", "rows")))
        return self.schedule.backward.apply(sch, **self.knobs)

    @property
    def dq_atomic(self) -> bool:
        """dq summed by fp32 atomics from dkdv (then not bitwise reproducible), or by a program of its own."""
        return bool(self.knobs.get("dq_atomic", False))

    def _for_tasks(self, batch: int, heads_kv: int) -> "BackwardKernel":
        """The kernel to run a call of ``batch`` sequences and ``heads_kv`` K/V heads: this one, or where its
        dq_atomic (not the caller's) sums in order (``Schedule.ordered_dq_accumulation``: the CPU's, one task
        a sequence and K/V head) and those tasks leave threads idle, the same kernel with the dq pass, whose
        tasks are also its blocks. The tasks run in rounds of one a thread; dq's share makes five products
        where the pass makes seven (q kᵀ and dout vᵀ again), so it is the faster while its tasks fill at
        least 5/7 of the rounds' threads, and the pass, which fills them all, below that."""
        if not (self.dq_atomic and self.schedule.ordered_dq_accumulation and "dq_atomic" not in (self._arguments[2] or {})):
            return self
        tasks, threads = batch * heads_kv, cpu_threads()
        if 7 * tasks >= 5 * -(-tasks // threads) * threads:
            return self
        if self._dq_pass is None:  # with the knobs the schedule gives a dq pass (``KnobSet.dq_pass_by_head_dim``)
            spec_args, target, knobs, deterministic, schedule = self._arguments
            dq_pass = self.schedule.backward.knobs.dq_pass_by_head_dim.get(self.head_dim, {})
            self._dq_pass = type(self)(spec_args, target, {**dq_pass, **(knobs or {}), "dq_atomic": False},
                                       deterministic, schedule)
        return self._dq_pass

    def _entry(self, module):
        """The three programs to call, by name (``program_backward.programs``)."""
        return {name: module[name] for name in program_backward.programs(self.dq_atomic)}

    # ----------------------------------------------------------------- using
    def info(self) -> dict:
        """What this kernel is, and where each of its modules came from."""
        return describe(self, after={"pass": self.PASS})

    def __repr__(self) -> str:
        variant = "".join(f"{name}={value!r}, " for name, value in self.variant.items())
        return (f"tvmflash.BackwardKernel(head_dim={self.head_dim}, dtype={self.dtype}, causal={self.causal}, "
                f"{variant}target={targets.describe(self.target)!r})")

    def dq_accumulator(self, q) -> tuple:
        """With ``dq_atomic``: (dq_accum,), zeros of ``program_backward``'s shape for q (batch,
        seqlen_q, heads_q, head_dim); else ()."""
        if not self.dq_atomic:
            return ()
        batch, seqlen_q, heads_q, head_dim = q.shape
        flex = self.variant.get("flex")
        rows = program_backward.dq_accumulator_rows(seqlen_q, self.knobs["block_m"],
                                                    sparse=flex is not None and flex.sparse is not None)
        return (torch.zeros((batch, rows, heads_q, head_dim), dtype=torch.float32, device=q.device),)

    @staticmethod
    def _dq(programs, accumulator, q, k, v, dout, lse2, delta, dq, softmax_scale, *arguments):
        """dq: from dkdv's sum (``accumulator``: convert_dq) or by the dq program."""
        if accumulator:
            programs["convert_dq"](*accumulator, dq, softmax_scale)
        else:
            programs["dq"](q, k, v, dout, lse2, delta, dq, softmax_scale, *arguments)

    def _gradients_and_programs(self, q, k, v, out, dout, dq, dk, dv, heads_q: int, heads_kv: int, work: bool):
        """dq, dk, dv (new where not given, compact) and the programs that fill them
        (``program_backward.programs`` by name); without ``work`` (no query or no key) the gradients
        are 0 and there are no programs."""
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) if g is None else g
                      for t, g in ((q, dq), (k, dk), (v, dv)))
        if not work:
            for grad in grads:
                grad.zero_()
            return grads, None
        # dq, dk, dv, out and dout are compact, of q's, k's and v's sizes; q, k and v may have any strides
        return grads, self.build.module_for(heads_q, heads_kv, q=q, k=k, v=v, out=out, dout=dout).function

    def __call__(self, q, k, v, out, dout, lse, *, dlse=None, softmax_scale=None, dq=None, dk=None, dv=None,
                 alibi_slopes=None, dropout_p=None, dropout_seed=None, captures=None, sinks=None, capture_grads=()):
        """(dq, dk, dv) of attention(q, k, v) = out (with its lse), given dout = ∂L/∂out and
        dlse = ∂L/∂lse (None: 0). Pass dq, dk, dv to have them written in place. See the class
        docstring for the shapes; out and lse are those of the forward of the same variant (and
        ALiBi slopes, or a flex kernel's captured tensors); with ``sinks``, (dq, dk, dv, dsinks).
        ``capture_grads``: with a flex kernel whose mods learn captures (``FlexMods.learned``), float32 compact
        tensors of their shapes, one a learned capture, zeroed by the caller: dkdv adds their gradients in."""
        arguments = self.arguments
        arguments.check(q, k, v, None)
        kernel = self._for_tasks(q.shape[0], k.shape[2])
        if kernel is not self:
            return kernel(q, k, v, out, dout, lse, dlse=dlse, softmax_scale=softmax_scale, dq=dq, dk=dk, dv=dv,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed, captures=captures,
                          sinks=sinks, capture_grads=capture_grads)
        variant_arguments = arguments.variant_arguments(q, alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                                        captures=captures)
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = k.shape[2]
        rows = (batch, heads_q, seqlen_q)
        check_gradient_arguments(q, k, v, out, dout, lse, dlse, dq, dk, dv, rows)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        q, k, v = map(arguments.readable, (q, k, v))
        out, dout, lse = (arguments.readable(t, strided=False) for t in (out, dout, lse))
        sinks = None if sinks is None else sinks_view(sinks, heads_q, q.device)
        (dq, dk, dv), programs = self._gradients_and_programs(q, k, v, out, dout, dq, dk, dv, heads_q, heads_kv,
                                                              work=bool(q.numel() and k.numel()))
        if programs is None:
            return (dq, dk, dv) + self._no_work_sinks(sinks, out, dout, lse, dlse, rows)
        delta, lse2 = row_values(rows, q.device)
        dlse = torch.zeros(rows, dtype=torch.float32, device=q.device) if dlse is None else dlse.contiguous()
        accumulator = self.dq_accumulator(q)
        programs["delta"](out, dout, lse, dlse, delta, lse2)
        programs["dkdv"](q, k, v, dout, lse2, delta, dk, dv, softmax_scale, *accumulator, *variant_arguments,
                         *self._capture_gradients(capture_grads, captures, q.device))
        self._dq(programs, accumulator, q, k, v, dout, lse2, delta, dq, softmax_scale, *variant_arguments)
        return (dq, dk, dv) + (() if sinks is None else (sinks_gradient(sinks, lse, delta),))

    def _capture_gradients(self, grads, captures, device) -> tuple:
        """dkdv's last arguments: the learned captures' gradient buffers (``capture_grads``), checked."""
        flex = self.variant.get("flex")
        learned = () if flex is None else flex.learned
        grads = tuple(grads or ())
        if len(grads) != len(learned):
            raise ValueError(f"capture_grads: expected {len(learned)} tensors (the mods' learned captures "
                             f"{list(learned)}), got {len(grads)}")
        for n, grad in zip(learned, grads):
            shape = tuple(captures[n].shape)
            if grad.dtype != torch.float32 or tuple(grad.shape) != shape or not grad.is_contiguous() \
                    or grad.device != device:
                raise ValueError(f"capture_grads: expected float32 compact {shape} on {device} for capture {n}, got "
                                 f"{grad.dtype} {tuple(grad.shape)} on {grad.device}")
        return grads

    @staticmethod
    def _no_work_sinks(sinks, out, dout, lse, dlse, rows) -> tuple:
        """(dsinks,) of a call with no query or no key (its rows' delta by torch: out is 0 where no key is), or
        () without sinks."""
        if sinks is None:
            return ()
        delta = torch.linalg.vecdot(out.float(), dout.float()).movedim(-1, -2).reshape(rows)
        if dlse is not None:
            delta = delta - dlse
        return (sinks_gradient(sinks, lse.reshape(-1, *rows[-2:]), delta.reshape(-1, *rows[-2:])),)


class VarlenBackwardKernel(BackwardKernel):
    """The backward of a :class:`VarlenKernel` (flash-attn's varlen: sequences packed without
    padding)::

        dq, dk, dv = kernel(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    q, out, dout, dq: (total_q, heads_q, head_dim); k, v, dk, dv: (total_k, heads_kv, head_dim);
    lse, dlse: float32 (heads_q, total_q), the forward's; cu_seqlens and max_seqlen_q as the
    forward's, and max_seqlen_k, an int at least every sequence's key count (it sizes dkdv's grid).
    It is the BackwardKernel (its spec's ``varlen`` field set) with the packed call.
    """

    def __call__(self, q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 dlse=None, softmax_scale=None, dq=None, dk=None, dv=None, alibi_slopes=None, dropout_p=None,
                 dropout_seed=None, sinks=None):
        """(dq, dk, dv) of the varlen attention(q, k, v) = out (with its lse), with ``sinks`` (dq, dk, dv,
        dsinks); see ``BackwardKernel.__call__`` and the class docstring."""
        arguments = self.arguments
        arguments.check_varlen(q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        batch = cu_seqlens_q.shape[0] - 1
        kernel = self._for_tasks(batch, k.shape[1])
        if kernel is not self:
            return kernel(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse=dlse,
                          softmax_scale=softmax_scale, dq=dq, dk=dk, dv=dv, alibi_slopes=alibi_slopes,
                          dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
        variant_arguments = arguments.variant_arguments(q, alibi_slopes, batch, dropout_p, dropout_seed)
        total_q, heads_q, _ = q.shape
        heads_kv = k.shape[1]
        rows = (heads_q, total_q)
        check_gradient_arguments(q, k, v, out, dout, lse, dlse, dq, dk, dv, rows)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        q, k, v = (arguments.readable(one_batch(t))[0] for t in (q, k, v))
        out, dout, lse = (arguments.readable(t, strided=False) for t in (out, dout, lse))
        sinks = None if sinks is None else sinks_view(sinks, heads_q, q.device)
        (dq, dk, dv), programs = self._gradients_and_programs(q, k, v, out, dout, dq, dk, dv, heads_q, heads_kv,
                                                              work=bool(q.numel() and k.numel() and batch))
        if programs is None:
            return (dq, dk, dv) + self._no_work_sinks(sinks, out, dout, lse, dlse, rows)
        delta, lse2 = row_values((1, *rows), q.device)
        dlse = torch.zeros((1, *rows), dtype=torch.float32, device=q.device) if dlse is None else dlse.contiguous()[None]
        # the packed rows as the programs' one batch
        q, k, v, out, dout, lse, dq4, dk4, dv4 = map(one_batch, (q, k, v, out, dout, lse, dq, dk, dv))
        sequences = (cu_seqlens_q, cu_seqlens_k)
        accumulator = self.dq_accumulator(q)
        programs["delta"](out, dout, lse, dlse, delta, lse2)
        programs["dkdv"](q, k, v, dout, lse2, delta, dk4, dv4, softmax_scale, *accumulator, *sequences, max_seqlen_k,
                         *variant_arguments)
        self._dq(programs, accumulator, q, k, v, dout, lse2, delta, dq4, softmax_scale, *sequences, max_seqlen_q,
                 *variant_arguments)
        return (dq, dk, dv) + (() if sinks is None else (sinks_gradient(sinks, lse, delta),))
