"""The forward kernel: FlashAttention's forward for one workload and target, called on torch tensors."""

from __future__ import annotations

import copy
import math

import torch
import tvm

from tvmflash import cache, choice, database, lowering, program
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets
from tvmflash.kernels import registry
from tvmflash.kernels.build import PROGRAMS, Build, describe
from tvmflash.kernels.checks import VARIANT_FIELDS, Arguments, check_flag, resolve_softmax_scale
from tvmflash.program import AttentionSpec
from tvmflash.schedules.contract import Schedule


def kernel_key(spec_args: dict, target: tvm.target.Target, knobs: dict | None, schedule: str | None = None) -> str:
    """What names a Kernel: its spec, target, given knobs and schedule, and the environment's settings
    (``choice.environment``: they may change the schedule for the same target)."""
    return cache.digest([spec_args, str(target), knobs, *([schedule] if schedule else []),
                         choice.environment("forward")])


def kernel_build_options(schedule: Schedule, variant: dict, program_name: str = "forward") -> dict:
    """What ``lowering.build`` takes for a forward or backward kernel's modules: its schedule's
    options (``Schedule.build_options``), and for varlen the tile tests hoisted on every schedule
    (``HoistBlockIndexConditions``): nvcc unswitches the sm80 schedule's dense K/V step on the causal
    tile test (two bodies in its PTX) but not varlen's (one body), whose test reads the sequence's
    offsets too."""
    options = schedule.build_options(program_name)
    if variant.get("varlen"):
        options["hoist_block_index_conditions"] = True
    return options


def no_keys_lse(lse, sinks, heads_dim: int) -> None:
    """lse of rows that see no key: -inf, or with sinks each head's sink logit (dim ``heads_dim`` of lse
    is the heads')."""
    if sinks is None:
        lse.fill_(-math.inf)
    else:
        shape = [1] * lse.dim()
        shape[heads_dim] = -1
        lse.copy_(sinks.detach().reshape(shape).expand_as(lse))


class Kernel:
    """FlashAttention forward for one (head_dim, dtype, causal, variant, target).

    Call it on torch tensors in flash-attn's layout::

        out = kernel(q, k, v)                   # q: (batch, seqlen_q, heads_q, head_dim)
        out, lse = kernel(q, k, v, return_lse=True)  # k, v: (batch, seqlen_k, heads_kv, head_dim)

    out has q's shape and dtype; lse is float32 of shape (batch, heads_q, seqlen_q). The tensors
    are read (and out written) in place through their strides, which may be any with a contiguous
    last dim: (b, s, h, d) tensors and (b, h, s, d) ones seen through ``transpose(1, 2)`` alike. On
    CUDA a tensor whose batch, sequence or head stride is no multiple of 16 bytes, or 0 (a
    broadcast), is copied first (out: written to a compact tensor, then copied); no transpose or
    slice of a compact tensor at a supported head_dim needs that. A new out is compact. batch and
    the sequence lengths may change from call to call without rebuilding; each new pair of head
    counts builds (or loads) one more module.

    The variant (``compile``'s window_size, softcap, alibi, dropout) is the kernel's; with ALiBi each
    call takes ``alibi_slopes``, float32 (heads_q,) or (batch, heads_q), and with dropout
    ``dropout_p`` (0 <= p < 1) and ``dropout_seed`` (int64 (seed, offset) on q's device, flash-attn's rng_state: the entries
    dropped are a function of it, ``program_dropout``; the backward takes the same seed). ``module``, ``source`` and
    ``scheduled_tir`` are those of the kernel's ``build`` (``build.Build``): a module for some head
    counts, its CUDA source, its scheduled TensorIR.
    """

    def __init__(self, spec_args: dict, target: tvm.target.Target, knobs: dict | None, schedule: str | None = None):
        self.head_dim, self.dtype, self.causal = spec_args["head_dim"], spec_args["dtype"], spec_args["causal"]
        self.variant = {name: spec_args[name] for name in VARIANT_FIELDS if name in spec_args}
        self.target = target
        self.key = kernel_key(spec_args, target, knobs, schedule)
        chosen = choice.forward(target, spec_args, knobs, schedule)
        self.schedule, self.schedule_source = chosen.schedule, chosen.schedule_source
        self.knobs, self.knobs_source = chosen.knobs, chosen.knobs_source
        stride_multiple = program.stride_multiple(self.schedule.stride_alignment, self.dtype)
        self.arguments = Arguments(self.head_dim, self.dtype, target, self.variant, stride_multiple)
        self._own_build()
        # seqlen bucket -> a copy with that bucket's tuned knobs, in modules of its own; ``__call__`` runs
        # the copy for key lengths in its bucket (varlen: the dense kernels' records are no varlen's)
        self.by_bucket = {} if self.variant.get("varlen") or chosen.record is None else self._bucket_kernels(
            target, spec_args, chosen)
        registry.remember(self)

    def _own_build(self) -> None:
        """A Build of this kernel's knobs (``build.Build``), whose ``module``, ``source`` and
        ``scheduled_tir`` are this kernel's."""
        options = kernel_build_options(self.schedule, self.variant)
        build = Build(kind="forward", target=self.target, schedule=self.schedule, knobs=self.knobs,
                      variant=self.variant, spec=self.spec, programs=self._scheduled,
                      entry=lambda module: module["main"],
                      code=(*PROGRAMS, *self.schedule.sources, *lowering.MODULES), options=options,
                      key_fields={"build": options} if self.variant.get("varlen") else {})  # (dense keys unchanged)
        self.build, self.module, self.source, self.scheduled_tir = build, build.module, build.source, build.scheduled_tir

    def _bucket_kernels(self, target, spec_args: dict, chosen: choice.Choice) -> dict:
        """By seqlen_k bucket (``database.SEQLEN_BUCKETS``) other than that of the record these knobs
        came from: a copy of this kernel with that bucket's tuned knobs, where they differ
        (``choice.forward_for_bucket``)."""
        children = {}
        for index in range(len(database.bucket_seqlens())):
            if index == database.bucket(chosen.record):
                continue
            found = choice.forward_for_bucket(target, chosen, spec_args, index)
            if found is not None:
                child = copy.copy(self)
                child.knobs, child.knobs_source, child.by_bucket = found.knobs, found.knobs_source, {}
                child._own_build()
                children[index] = child
        return children

    # ----------------------------------------------------------------- building
    def spec(self, heads_q: int, heads_kv: int) -> AttentionSpec:
        return AttentionSpec(self.head_dim, self.dtype, self.causal, heads_q, heads_kv, **self.variant)

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        sch = tvm.s_tir.Schedule(schedule_registry.program_for(spec, self.schedule, self.knobs))
        return self.schedule.forward.apply(sch, **self.knobs)

    # ----------------------------------------------------------------- using
    def info(self) -> dict:
        """What this kernel is, and where each of its modules came from."""
        return describe(self, {"seqlen_buckets": {database.bucket_label(index): {"knobs": dict(child.knobs),
                                                                                 "knobs_source": child.knobs_source}
                                                  for index, child in self.by_bucket.items()}} if self.by_bucket else {})

    def __repr__(self) -> str:
        variant = "".join(f"{name}={value!r}, " for name, value in self.variant.items())
        return (f"tvmflash.Kernel(head_dim={self.head_dim}, dtype={self.dtype}, causal={self.causal}, {variant}"
                f"target={targets.describe(self.target)!r})")

    def __call__(self, q, k, v, *, softmax_scale=None, out=None, return_lse=False, alibi_slopes=None, dropout_p=None,
                 dropout_seed=None, captures=None, sinks=None):
        """Attention of q over k, v. See the class docstring for the shapes. captures: a flex kernel's
        captured tensors (``compile(..., flex=)``), in the order its mods read them. sinks: a kernel with
        sinks' logits, float32 (heads_q,)."""
        return_lse = check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        if torch.compiler.is_compiling() and self.variant.get("flex") is not None:
            raise NotImplementedError("a flex kernel (score_mod, mask_mod) under torch.compile: not yet")
        if torch.compiler.is_compiling():  # torch.compile traces a custom op, which calls back here at run time
            return registry.route("forward")(self, q, k, v, softmax_scale, out, return_lse, alibi_slopes, dropout_p,
                                             dropout_seed, sinks)
        arguments = self.arguments
        arguments.check(q, k, v, out)
        if self.by_bucket:  # another seqlen bucket's tuned knobs (``_bucket_kernels``)
            other = self.by_bucket.get(database.seqlen_bucket(k.shape[1]))
            if other is not None:
                return other(q, k, v, softmax_scale=softmax_scale, out=out, return_lse=return_lse,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             captures=captures, sinks=sinks)
        variant_arguments = arguments.variant_arguments(q, alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                                        captures=captures, sinks=sinks)
        # The module reads and writes through the tensors' own strides: none is copied, but where a
        # CUDA kernel's 16-byte vectors do not fit the strides (``Arguments.usable``).
        q, k, v = arguments.usable(q, "q"), arguments.usable(k, "k"), arguments.usable(v, "v")
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = k.shape[2]
        given = out
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif not arguments.fits(out):  # written to a compact tensor, then copied into out
            arguments.usable(out, "out", copy=False)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        module = self.build.module_for(heads_q, heads_kv, q=q, k=k, v=v, out=out)
        if out.numel() and not k.shape[1]:
            # No key at all: every row sees none (0, and an LSE of -inf, or the sink's). Answered here,
            # as the TMA builds' tensor maps cannot describe an empty K or V.
            out.zero_()
            no_keys_lse(lse, sinks, heads_dim=1)
        elif out.numel():
            module.function(q, k, v, out, lse, softmax_scale, *variant_arguments)
        if given is not None and given is not out:
            out = given.copy_(out)
        return (out, lse) if return_lse else out
