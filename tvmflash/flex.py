"""``tvmflash.flex_attention``: PyTorch FlexAttention's API, its ``score_mod`` and ``mask_mod`` compiled into
the one attention program (``program_flex``), forward and backward, on every schedule.

The mods are traced at a call (``flex_trace``), again only where something they read may have changed (a
new closure, a changed global, a mutable value: ``flex_trace._TRACED``); equal traces share one kernel (and
its built modules, keyed by the trace). The custom ops
``tvmflash::flex_forward`` and ``tvmflash::flex_backward`` carry the call through autograd; the trace
reaches them by its key (``MODS``), the captured tensors as a list (and a BlockMask's lists after them:
``flex_block_mask``).
"""

from __future__ import annotations

import dataclasses

import torch

from tvmflash import cache, choice, program_flex_gradient
from tvmflash.flex_block_mask import block_sparse_arguments, block_sparse_lists, check_list_counts, compile_flex
from tvmflash.flex_gradient import CapturedGradients
from tvmflash.flex_trace import check_indices, trace_mods, trace_uncached
from tvmflash.kernels import registry
from tvmflash.kernels.checks import TORCH_DTYPES, check_any_head_dim, check_flag, resolve_softmax_scale
from tvmflash.ops import (gradient_shapes, attention, check_sinks, needed_sinks, padded_head_dim, sinks_argument,
                          target_of, with_sinks_gradient)
from tvmflash.program_flex import FlexMods, Node

# key -> traced mods (``mods_key``), for the custom ops, which take the mods by their key
MODS: dict[str, FlexMods] = {}
# (device, dtype, head_dim, mods, backward, the environment's settings) -> kernel: compile() hashes its
# arguments at every call
FLEX_KERNELS: dict[tuple, object] = {}
registry.on_forget(FLEX_KERNELS.clear)


def mods_key(mods: FlexMods) -> str:
    """The key of traced mods: a digest of the tree (its structure, dtypes and constants), never of
    the Python functions."""
    key = cache.digest(repr(mods))
    MODS.setdefault(key, mods)
    return key


# (id of traced mods, the BlockMask's block size, the learned captures) -> (those mods, them with the block size
# and the learned captures, its key): the same traced mods (``trace_mods`` gives the same object for the same
# functions) take no repr a call
_SPARSE_MODS: dict[tuple, tuple] = {}


def with_sparsity(mods: FlexMods, sparse, learned: tuple = ()) -> tuple[FlexMods, str]:
    """``mods`` with the BlockMask's block size (``FlexMods.sparse``; None: none) and the captures whose
    gradients dkdv makes (``FlexMods.learned``), and their ``mods_key``."""
    found = _SPARSE_MODS.get((id(mods), sparse, learned))
    if found is None or found[0] is not mods:
        replaced = dataclasses.replace(mods, sparse=sparse, learned=learned)
        if len(_SPARSE_MODS) >= 64:
            _SPARSE_MODS.pop(next(iter(_SPARSE_MODS)))
        found = _SPARSE_MODS[(id(mods), sparse, learned)] = (mods, replaced, mods_key(replaced))
    return found[1], found[2]


def compiled_key(score, mask, captures: tuple, sparse, learned: tuple) -> str:
    """``with_sparsity``'s key of traced mods given as plain tuples (``plain``), a constant of a compiled graph:
    Dynamo calls it at trace time (``flex_attention`` traced, the mods run on the tracer's values) and guards
    on what made them. (Tuples, not the FlexMods: Dynamo's constant of a frozen dataclass built with positional
    arguments loses them.)"""
    return with_sparsity(FlexMods(unplain(score), unplain(mask), captures), sparse, learned)[1]


# the mark of torch.compiler.assume_constant_result (``ops.head_dim_to_run``'s reason to set it by hand)
compiled_key._dynamo_marked_constant = True


def plain(node: Node | None):
    """A traced tree as nested tuples (op, dtype, args, value), None for None; ``unplain`` is its inverse."""
    return None if node is None else (node.op, node.dtype, tuple(plain(a) for a in node.args), node.value)


def unplain(value) -> Node | None:
    return None if value is None else Node(value[0], value[1], tuple(unplain(a) for a in value[2]), value[3])


def _forward_mods(mods: FlexMods) -> FlexMods:
    """The mods of the forward kernel: ``mods`` without learned captures (the forward is the same with them)."""
    return with_sparsity(mods, mods.sparse)[0] if mods.learned else mods


def flex_kernel(q: torch.Tensor, mods: FlexMods, backward: bool = False, sinks: bool = False):
    """The forward (``backward``: backward) kernel for q's device, dtype and head_dim and these mods (with
    a BlockMask, tiles that divide its blocks: ``flex_block_mask.compile_flex``; ``sinks``: a forward that
    takes sink logits; the backward is the same with them)."""
    sinks = sinks and not backward
    mods = mods if backward else _forward_mods(mods)
    key = (q.device, q.dtype, q.shape[-1], mods, backward, sinks,
           choice.environment("backward" if backward else "forward"))
    found = FLEX_KERNELS.get(key)
    if found is None:
        found = FLEX_KERNELS[key] = compile_flex(q.shape[-1], q.dtype, target_of(q), mods, backward, sinks)
    return found


# The ops take q, k, v in the kernels' layout (batch, seqlen, heads, head_dim), any strides.
def _flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, captures: list[torch.Tensor], mods: str,
                 softmax_scale: float, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention with the traced mods ``MODS[mods]``; see :func:`flex_attention`. (sinks has no
    default: the dispatcher drops an argument equal to its default, and the backward of an op with a tensor
    list must return a gradient for exactly the arguments it got.)"""
    kernel = flex_kernel(q, MODS[mods], sinks=sinks is not None)
    captures = [t.detach() for t in captures]  # a learned one requires grad (DLPack takes no such tensor)
    return kernel(q, k, v, softmax_scale=softmax_scale, return_lse=True, captures=captures, **sinks_argument(sinks))


def _checked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, captures: list[torch.Tensor], mods: str,
                     softmax_scale: float, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_flex_forward` after the checks that read the captures' values (``check_indices``; a BlockMask's
    counts on the CPU, ``check_list_counts``), which ``flex_attention`` makes before it eagerly and Dynamo cannot
    make at trace time: the custom op's function, what a compiled graph calls."""
    flex = MODS[mods]
    batch, seqlen_q, heads_q, _ = q.shape
    own = len(flex.captures)
    check_indices(flex, captures[:own], batch, heads_q, seqlen_q, k.shape[1])
    if flex.sparse is not None and q.device.type == "cpu":
        check_list_counts(captures[own:])
    return _flex_forward(q, k, v, captures, mods, softmax_scale, sinks)


flex_forward = torch.library.custom_op("tvmflash::flex_forward", mutates_args=())(_checked_forward)


@flex_forward.register_fake
def _flex_forward_shapes(q, k, v, captures, mods, softmax_scale, sinks):
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def _flex_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, captures: list[torch.Tensor], mods: str,
                  softmax_scale: float, sinks: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, dsinks, dcaptures) of :func:`flex_forward` given the gradients of its out and lse (dlse
    None: 0); dsinks float32 (heads_q,) with sinks, else empty; dcaptures the gradients of the mods' learned
    captures (``FlexMods.learned``), float32, made by dkdv."""
    flex = MODS[mods]
    kernel = flex_kernel(q, flex, backward=True)
    captures = [t.detach() for t in captures]
    grads = [torch.zeros(captures[n].shape, dtype=torch.float32, device=q.device) for n in flex.learned]
    gradients = with_sinks_gradient(kernel(q, k, v, out, dout, lse, dlse=dlse, softmax_scale=softmax_scale,
                                           captures=captures, capture_grads=grads, **sinks_argument(sinks)), q)
    return (*gradients, grads)


flex_backward = torch.library.custom_op("tvmflash::flex_backward", mutates_args=())(_flex_backward)


@flex_backward.register_fake
def _flex_backward_shapes(dout, dlse, q, k, v, out, lse, captures, mods, softmax_scale, sinks):
    grads = [captures[n].new_empty(captures[n].shape, dtype=torch.float32) for n in MODS[mods].learned]
    return (*gradient_shapes(q, k, v, sinks), grads)


def _setup_context(ctx, inputs, output):
    q, k, v, captures, mods, softmax_scale, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, *captures)
    ctx.mods, ctx.softmax_scale = mods, softmax_scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, sinks, *captures = ctx.saved_tensors
    if grad_out is None:  # only lse reached the loss
        grad_out = torch.zeros_like(out)
    eager = getattr(ctx, "eager", False)  # _FlexFunction's: the op's own function, sinks its input 5
    sinks = needed_sinks(ctx, sinks, 5 if eager else 6)
    dq, dk, dv, dsinks, grads = (_flex_backward if eager else flex_backward)(
        grad_out.contiguous(), grad_lse, q, k, v, out, lse, captures, ctx.mods, ctx.softmax_scale, sinks)
    # the learned captures' from dkdv (the others': none, or flex_gradient's outside the op); none for the mods
    # and the scale
    learned = dict(zip(MODS[ctx.mods].learned, grads))
    dcaptures = [learned[n].to(t.dtype) if n in learned else None for n, t in enumerate(captures)]
    return dq, dk, dv, dcaptures, None, None, None if sinks is None else dsinks


flex_forward.register_autograd(_backward, setup_context=_setup_context)


class _FlexFunction(torch.autograd.Function):
    """``flex_forward`` and its autograd eagerly, off torch.library's dispatch (``ops.eager_autograd``'s
    reason), its captures after its other arguments (autograd sees no tensor inside a list), sinks its input 5."""

    @staticmethod
    def forward(ctx, q, k, v, mods, softmax_scale, sinks, *captures):
        inputs = (q, k, v, list(captures), mods, softmax_scale, sinks)
        output = _flex_forward(*inputs)
        ctx.eager = True
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        dq, dk, dv, dcaptures, _, _, dsinks = _backward(ctx, grad_out, grad_lse)
        return dq, dk, dv, None, None, dsinks, *dcaptures


def _mask_mod_of(block_mask, seqlen_q: int, seqlen_k: int):
    """The mask_mod of ``block_mask``: torch's ``BlockMask`` (its ``mask_mod``, for these lengths), a
    mask_mod itself, or None."""
    if block_mask is None:
        return None
    if callable(block_mask) and not hasattr(block_mask, "mask_mod"):
        return block_mask
    mask_mod = getattr(block_mask, "mask_mod", None)
    if mask_mod is None:
        raise TypeError(f"block_mask: expected torch's BlockMask (create_block_mask), a mask_mod or None, got "
                        f"{type(block_mask).__name__}")
    lengths = tuple(getattr(block_mask, "seq_lengths", (seqlen_q, seqlen_k)))
    if lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask: made for (seqlen_q, seqlen_k) = {lengths}, got query and key lengths "
                         f"{(seqlen_q, seqlen_k)}; make it for these (create_block_mask)")
    return mask_mod


def _is_noop(fn, name: str) -> bool:
    """torch's own no-op mods (``noop_mask``, ``_identity``): no mod at all."""
    return getattr(fn, "__module__", None) == "torch.nn.attention.flex_attention" and getattr(fn, "__name__", "") == name


def _check_tensors(query, key, value, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in TORCH_DTYPES.values():
            raise TypeError(f"{name}: expected one of {list(TORCH_DTYPES.values())}, got {t.dtype}")
    if key.shape != value.shape:
        raise ValueError(f"value: expected key's shape {tuple(key.shape)} (batch, heads_kv, seqlen_k, head_dim), got "
                         f"{tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"key, value: expected query's dtype {query.dtype}, got {key.dtype} and {value.dtype}")
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise ValueError(f"key: expected query's batch and head_dim ({query.shape[0]}, {query.shape[3]}), got shape "
                         f"{tuple(key.shape)}")
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_kv == 0 or heads_q % heads_kv or (heads_q != heads_kv and not enable_gqa):
        raise ValueError(f"key: expected heads_kv = heads_q ({heads_q}), or with enable_gqa=True a divisor of it, got "
                         f"{heads_kv}")
    check_any_head_dim(query.shape[-1])


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa: bool = False,
                   return_lse: bool = False, *, sinks=None):
    """PyTorch's ``torch.nn.attention.flex_attention.flex_attention``, its mods compiled into tvmflash's kernels.

    query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k, head_dim), heads_kv
    = heads_q, or with ``enable_gqa`` a divisor of it; float16, bfloat16 or float32, on the CPU or a CUDA GPU;
    head_dim 1 to 256 (padded as :func:`tvmflash.attention` pads it). Returns out (batch, heads_q, seqlen_q,
    head_dim) in query's dtype, or (out, lse) with ``return_lse``: lse float32 (batch, heads_q, seqlen_q),
    natural log.

    The score of query i and key j is ``s = q_i · k_j * scale`` (scale: 1/sqrt(head_dim) by default; positive
    without a score_mod), then ``score_mod(s, b, h, i, j)`` if given; the keys that ``mask_mod(b, h, i, j)``
    refuses are left out. b is the batch, h the query head, i and j positions from 0. ``block_mask``: torch's
    ``BlockMask`` (``create_block_mask``, ``BlockMask.from_kv_blocks``) made for these lengths, or a mask_mod
    itself (every K/V tile is then visited and masked). A query that sees no key gets 0 and an lse of -inf
    (flash-attn's rule), never NaN.

    A ``BlockMask`` is block-sparse, as torch's kernel takes it: with its BLOCK_SIZE (Q, KV) (default 128 x
    128), q_blocks = ceil(seqlen_q / Q) and kv_blocks = ceil(seqlen_k / KV),
        kv_num_blocks (B, H, q_blocks), kv_indices (B, H, q_blocks, w): each Q block's partial K/V blocks,
        full_kv_num_blocks, full_kv_indices (same shapes, or None): its full ones,
        q_num_blocks, q_indices, full_q_* (B, H, kv_blocks[, w']): each K/V block's Q blocks (the backward's;
            made from the kv lists where None),
    int32, B 1 or batch and H 1 or heads_q (1: shared). The forward and dq visit only the K/V tiles of
    a Q block's lists, and dk, dv only the Q tiles of a K/V block's: a block in no list is never loaded.
    Full blocks skip mask_mod, partial ones apply it, as torch's compiled kernel does (for a BlockMask whose
    lists agree with its mask_mod, as create_block_mask's do, that is the mask_mod's result). The kernels' tiles must divide the blocks: where the
    schedule's default tiles do not, the kernels are built with tiles that do (64-row tiles on sm90 for
    a BLOCK_SIZE of 64, say), and where the schedule takes no such tile, on the next schedule that does
    (sm80 for a BLOCK_SIZE of 32 on sm_90a: ``flex_block_mask.compile_flex``); where none does, a ValueError names the sizes.
    A mask made for other lengths, batch or heads is a ValueError.

    ``sinks`` (not torch's; gpt-oss's learnable sinks, as :func:`tvmflash.attention` takes them): float32
    (heads_q,), a logit per query head that joins each row's softmax denominator after the score_mod, with
    no value; lse includes it, a query that sees no key gets 0 and lse = the sink; sinks.grad where it
    requires grad.

    The mods are traced (``tvmflash.flex_trace``: what they may use, and the error that names the line of
    anything else) and become expressions inside the one attention program: no second kernel, no bias
    tensor. Each distinct trace builds its modules once (a trace differs by its operations and constants,
    not by the values of the tensors it captures, which each call passes). Differentiable in query, key and
    value, through the score_mod's derivative, and in the captured float tensors that require grad (a learnable
    bias table): on a GPU by the backward's dkdv (``program_flex_gradient``: atomic additions, so not bitwise
    reproducible) where TVMFLASH_GPU_UNCHECKED=1 asks, until its GPU tests pass; otherwise, on the CPU and under
    ``torch.use_deterministic_algorithms`` by torch operations after the kernels' backward (``flex_gradient``:
    exact, but with O(seqlen_q · seqlen_k) work outside the kernels); TVMFLASH_FLEX_GRADIENT=kernel or torch
    chooses, ``choice.capture_gradients_in_kernel`` says which.

    Under torch.compile (fullgraph=True too), forward and backward: Dynamo runs the tracer on the mods, so the
    compiled graph is guarded on everything they read (closures, globals) and a change recompiles it; the key
    of the trace is a constant of the graph and the captured tensors and the BlockMask's lists are its inputs
    (the custom ops ``tvmflash::flex_forward``, ``flex_backward``); the checks that read tensors' values (the
    captured tensors' index ranges, a BlockMask's counts on the CPU) run in the op. A Python number a mod reads
    that changes from call to call is guarded too, but at the second value Dynamo recompiles it as a dynamic
    (symbolic) number, which the tracer cannot take as a constant (Dynamo's error at a comparison): compile
    with ``dynamic=False`` there (each value then compiles its own graph), or keep the number fixed. A
    captured tensor that requires grad gets its gradient from dkdv's additions under compile, never torch's way
    (a NotImplementedError where torch's is asked: deterministic algorithms, or TVMFLASH_FLEX_GRADIENT=torch on
    a GPU).
    """
    _check_tensors(query, key, value, check_flag("enable_gqa", enable_gqa))
    return_lse = check_flag("return_lse", return_lse)
    batch, heads_q, seqlen_q, head_dim = query.shape
    seqlen_k = key.shape[2]
    mask_mod = _mask_mod_of(block_mask, seqlen_q, seqlen_k)
    score_mod = None if _is_noop(score_mod, "_identity") else score_mod
    mask_mod = None if _is_noop(mask_mod, "noop_mask") else mask_mod
    if score_mod is not None and scale is not None and isinstance(scale, (int, float)) and scale <= 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    softmax_scale = resolve_softmax_scale(scale, head_dim)  # query's own head_dim's, before any padding
    sinks = check_sinks(sinks, query, heads_dim=1)
    compiling = torch.compiler.is_compiling()
    if compiling:
        # Dynamo traces the tracer itself (no cache of ours: Dynamo's guards on what the mods read, closures and
        # globals, stand for ``trace_mods``' checks), and the BlockMask's conversion into the graph; what reads
        # the tensors' values, the checks of the indices and counts, the op does at run time (``_checked_forward``)
        mods, captured = trace_uncached(score_mod, mask_mod)
        sparse, lists = block_sparse_arguments(block_mask, batch, heads_q, seqlen_q, seqlen_k, query.device,
                                               check_counts=False)
    else:
        mods, captured = trace_mods(score_mod, mask_mod)
        sparse, lists = block_sparse_lists(block_mask, batch, heads_q, seqlen_q, seqlen_k, query.device)
    for n, t in enumerate(captured):
        if t.device != query.device:
            raise ValueError(f"captured tensor {n}: expected query's device {query.device}, got {t.device}")
    if not compiling:
        check_indices(mods, captured, batch, heads_q, seqlen_q, seqlen_k)
    # a learnable bias: a captured float tensor that requires grad, read by the score_mod; its gradient made by
    # dkdv (``program_flex_gradient``) or by torch after the kernels' backward (``flex_gradient``)
    learned = program_flex_gradient.learnable(mods.score, captured) if torch.is_grad_enabled() else ()
    deterministic = torch.are_deterministic_algorithms_enabled()
    in_kernel = bool(learned) and choice.capture_gradients_in_kernel(query.device.type, deterministic)
    if learned and not in_kernel and compiling:
        # torch's way (flex_gradient: torch.autograd.grad inside an autograd Function's backward) is no graph
        # Dynamo makes; the CPU's dkdv adds them exactly, its tiles in turn (slower than torch's way eagerly)
        if query.device.type != "cpu" or deterministic:
            raise NotImplementedError(
                "tvmflash.flex_attention under torch.compile(fullgraph=True) with a captured tensor that requires "
                "grad: its gradient by torch's operations (flex_gradient, asked by deterministic algorithms or "
                "TVMFLASH_FLEX_GRADIENT=torch) is not traced; outside deterministic mode TVMFLASH_FLEX_GRADIENT=kernel "
                "makes it in the backward kernel (atomic additions), or run the call eagerly")
        in_kernel = True
    # the block lists after the mods' tensors; those whose gradient dkdv makes reach the custom op's autograd
    captures = [t if in_kernel and n in learned else t.detach() for n, t in enumerate(captured)] + lists
    # flex_gradient evaluates the mods alone
    if compiling:  # the key a constant of the graph (``compiled_key``)
        gradient_mods, digest = mods, compiled_key(plain(mods.score), plain(mods.mask), mods.captures, sparse,
                                                   learned if in_kernel else ())
    else:
        gradient_mods, (mods, digest) = mods, with_sparsity(mods, sparse, learned if in_kernel else ())
    # the kernels' layout, (batch, seqlen, heads, head_dim): views, read through their strides
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if mods.score is None and mods.mask is None and sparse is None:  # no mod, no sparsity: the built-in kernels
        out, lse = attention(q, k, v, softmax_scale=softmax_scale, return_lse=True, sinks=sinks)
    else:
        q, k, v, run = padded_head_dim(q, k, v, head_dim)
        if compiling:
            out, lse = flex_forward(q, k, v, captures, digest, softmax_scale, sinks)
        elif torch.is_grad_enabled() and (in_kernel or any(t is not None and t.requires_grad
                                                             for t in (q, k, v, sinks))):
            out, lse = _FlexFunction.apply(q, k, v, digest, softmax_scale, sinks, *captures)
        else:  # eager, nothing for autograd to record: no custom op's dispatch
            out, lse = flex_kernel(q, mods, sinks=sinks is not None)(
                q, k, v, softmax_scale=softmax_scale, return_lse=True, captures=captures, **sinks_argument(sinks))
        if run != head_dim:
            out = out[..., :head_dim]
    out = out.transpose(1, 2)
    if learned and not in_kernel:  # its gradient by torch operations after the kernels' backward (flex_gradient)
        out, lse = CapturedGradients.apply(out, lse, query, key, value, gradient_mods, softmax_scale, *captured)
    return (out, lse) if return_lse else out

