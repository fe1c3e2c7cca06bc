"""The PyTorch binding: ``tvmflash.attention``, and torch custom ops that torch.compile traces.

Eagerly, without autograd, ``attention`` and ``Kernel.__call__`` call the kernel directly: a custom
op's dispatch costs host time at every call, and its first call imports ``torch._dynamo`` (about
1 s). Eagerly where autograd records the call, an autograd Function runs the custom op's own function
and its autograd (``eager_autograd``), off the dispatch. Under torch.compile they go through the custom
ops (``torch.ops.tvmflash.*``): torch.compile then traces them without a graph break (the fake
implementations give the output shapes), and the autograd registered on the op is the backward's.
The backward pass is ``torch.ops.tvmflash.backward``, a custom op of its own (with a fake
implementation too), so that torch.compile traces the backward graph without a break as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tvmflash import choice, kernels
from tvmflash import target as targets
from tvmflash.kernels import DecodeKernel, compile, compile_backward, compile_decode, registry
from tvmflash.dropout import dropout_arguments, resolve_dropout
from tvmflash.kernels.checks import (TORCH_DTYPES, check_any_head_dim, check_cu_seqlens, check_dropout_p, check_flag,
                                     check_max_seqlen, dtype_name, resolve_softmax_scale, resolve_variant, sinks_view)
from tvmflash.program import MAX_HEAD_DIM

# kernel_for's and backward_kernel_for's answers: compile() resolves a target (a TVM object) and hashes
# its arguments, some 100-250 us a call; attention() runs at every step of a model. Emptied by
# ``kernels.forget_kernels``.
KERNELS_FOR: dict[tuple, kernels.Kernel] = {}
registry.on_forget(KERNELS_FOR.clear)


def kernel_for(q: torch.Tensor, causal: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               alibi: bool = False, varlen: bool = False, dropout: bool = False, sinks: bool = False):
    """The kernel for q's device, dtype and head_dim and the variant (compiled on first use, then cached)."""
    key = (q.device, q.dtype, q.shape[-1], causal, window_left, window_right, softcap, alibi, varlen, dropout, sinks,
           choice.environment("forward"))
    found = KERNELS_FOR.get(key)
    if found is not None:
        return found
    found = KERNELS_FOR[key] = compile(head_dim=q.shape[-1], dtype=q.dtype, causal=causal, target=target_of(q),
                                       window_size=(window_left, window_right), softcap=softcap, alibi=alibi,
                                       varlen=varlen, dropout=dropout, sinks=sinks)
    return found


def target_of(q: torch.Tensor):
    """The target for q's device."""
    return device_target(q.device)


def device_target(device: torch.device):
    """The target for a torch device."""
    if device.type == "cuda":
        target = targets.cuda_device_target(device.index)
    elif device.type == "cpu":
        target = "cpu"
    else:
        raise ValueError(f"q: expected a CPU or CUDA tensor, got one on {device}")
    return target


# ----------------------------------------------------------------------------- decode
# (device, dtype, head_dim, page_size, variant, TVMFLASH_DECODE) -> decode kernel, and (device, dtype,
# TVMFLASH_DECODE) -> the head_dims decode serves there: decode_shaped asks at every generation step, and
# choice.native_head_dims tries every head_dim. Emptied by forget_kernels.
DECODE_KERNELS_FOR: dict[tuple, DecodeKernel] = {}
DECODE_HEAD_DIMS: dict[tuple, tuple[int, ...]] = {}
registry.on_forget(DECODE_KERNELS_FOR.clear)
registry.on_forget(DECODE_HEAD_DIMS.clear)


def decode_kernel_for(q, page_size: int, window_size=(-1, -1), softcap: float = 0.0, alibi: bool = False,
                      leftpad: bool = False, sinks: bool = False, fp8_cache: bool = False) -> DecodeKernel:
    """The decode kernel for q's device, dtype and head_dim, the cache layout and the variant (compiled on
    first use, then kept); fp8_cache: over an e4m3 cache with descales."""
    key = (q.device, q.dtype, q.shape[-1], page_size, window_size, softcap, alibi, leftpad, sinks, fp8_cache,
           choice.environment("decode"))
    kernel = DECODE_KERNELS_FOR.get(key)
    if kernel is None:
        check_decode_head_dim(q)
        kernel = DECODE_KERNELS_FOR[key] = compile_decode(head_dim=q.shape[-1], dtype=q.dtype, page_size=page_size,
                                                          target=target_of(q), window_size=window_size,
                                                          softcap=softcap, alibi=alibi, leftpad=leftpad, sinks=sinks,
                                                          cache_dtype=torch.float8_e4m3fn if fp8_cache else None)
    return kernel


def decode_head_dims(q) -> tuple[int, ...]:
    """The head_dims the decode kernels for q's device and dtype serve as they are
    (``choice.native_head_dims``), kept; q's dtype one of the kernels' (fp16, bf16, fp32)."""
    key = (q.device, q.dtype, choice.environment("decode"))
    found = DECODE_HEAD_DIMS.get(key)
    if found is None:
        target = targets.resolve(target_of(q))
        found = DECODE_HEAD_DIMS[key] = choice.native_head_dims("decode", target, dtype_name(q.dtype))
    return found


def check_decode_head_dim(q) -> None:
    """A ValueError unless a decode kernel for q's device and dtype serves q's head_dim as it is
    (``choice.native_head_dims``): the caches are written in place, so ``flash_attn_with_kvcache`` pads
    no head_dim, as the other functions do; a padded copy of the whole cache at every step would cost
    more than the attention."""
    head_dim = check_any_head_dim(q.shape[-1])
    if q.dtype not in TORCH_DTYPES.values():
        return  # compile_decode names the dtypes it takes
    served = decode_head_dims(q)
    if head_dim not in served:
        raise ValueError(f"head_dim: expected one the decode kernels serve for {dtype_name(q.dtype)} on "
                         f"{targets.describe(targets.resolve(target_of(q)))} ({choice.describe_head_dims(served)}), got "
                         f"{head_dim}: flash_attn_with_kvcache writes k_cache and v_cache in place and pads no "
                         f"head_dim; zero-pad q, the caches, k and v to one of them and pass "
                         f"softmax_scale=1/sqrt({head_dim})")


# Decode-shaped calls, a few query rows over many keys (a generation step through attention() or
# flash_attn_func): the forward's grid, a block a Q block and head, leaves most of a GPU idle and each
# block streams every key, where the split-KV decode kernel splits the keys over blocks (flash-attn's
# forward does the same by its num_splits heuristic). On a GPU, for calls autograd does not record (the
# decode kernel has no backward), with k and v contiguous (the decode kernel's cache layout).
DECODE_SHAPED_QUERIES = 16  # at most this many query rows
DECODE_SHAPED_KEYS = 512  # over at least this many keys


def decode_shaped(q, k, v) -> bool:
    """Does the forward of q over k, v (flash-attn's layout, no autograd) run on the decode kernel?"""
    return (q.device.type == "cuda" and q.shape[1] <= DECODE_SHAPED_QUERIES and k.shape[1] >= DECODE_SHAPED_KEYS
            and k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and q.dtype in TORCH_DTYPES.values()
            and q.shape[-1] in decode_head_dims(q))


def decode_forward(q, k, v, causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                   alibi_slopes, sinks=None) -> tuple:
    """(out, lse) of q over k and v, every batch row's keys all of k's, on the decode kernel."""
    kernel = decode_kernel_for(q, 0, (window_left, window_right), softcap, alibi_slopes is not None,
                               sinks=sinks is not None)
    batch, seqlen_k = q.shape[0], k.shape[1]
    lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
    return kernel(q, k, v, lengths, kernel.batch_rows(batch, q.device), softmax_scale=softmax_scale, causal=causal,
                  alibi_slopes=alibi_slopes, sinks=sinks)


# ----------------------------------------------------------------------------- head_dim
# flash-attn takes any head_dim up to 256 (its interface pads q, k and v to a multiple of 8, its kernels
# round the rest up): so do ``attention`` and ``varlen_attention``, and the flash_attn functions through
# them. A head_dim that the chosen kernels do not serve is zero-padded to one they do (F.pad: autograd
# slices the gradients back), softmax_scale stays that of q's own head_dim, and the output is sliced
# back, as flash-attn's ``out[..., :head_size_og]``.
# (device, dtype, head_dim, with the backward, the environment) -> the head_dim to run; emptied by
# ``kernels.forget_kernels``
HEAD_DIMS_TO_RUN: dict[tuple, int] = {}
registry.on_forget(HEAD_DIMS_TO_RUN.clear)


def head_dim_to_run(device: torch.device, dtype: torch.dtype, head_dim: int, backward: bool) -> int:
    """The head_dim at which the kernels run q's ``head_dim`` on this device (``choice.head_dim_to_run``):
    the forward's, and with ``backward`` (autograd records the call) the backward's too, one head_dim
    for both. torch.compile takes it as a constant of the graph."""
    key = (device, dtype, head_dim, backward, choice.environment("forward"), choice.environment("backward"))
    found = HEAD_DIMS_TO_RUN.get(key)
    if found is None:
        if dtype not in TORCH_DTYPES.values():
            return head_dim  # the kernel's compile() names the dtype it takes
        target = targets.resolve(device_target(device))
        programs = ("forward", "backward") if backward else ("forward",)
        found = HEAD_DIMS_TO_RUN[key] = choice.head_dim_to_run(programs, target, dtype_name(dtype), head_dim)
    return found


# torch.compile takes head_dim_to_run's answer as a constant of the graph (it reads TVM's targets, which
# Dynamo cannot trace): the mark torch.compiler.assume_constant_result sets, set here without it, as that
# would import torch._dynamo with tvmflash (a second), where an eager call never needs it.
# (test_head_dims.py's torch.compile test fails if a torch release reads another mark.)
head_dim_to_run._dynamo_marked_constant = True


def padded_head_dim(q, k, v, head_dim: int) -> tuple:
    """(q, k, v) zero-padded in their last dim from ``head_dim`` (each one's, checked here: a padded
    mismatch would go unnoticed) to the head_dim the kernels run (``head_dim_to_run``), and that head_dim;
    the tensors themselves where it is theirs."""
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if torch.compiler.is_compiling():  # a dynamic shape's SymInt specialised, a guard: one graph a head_dim
        head_dim = next(d for d in range(1, MAX_HEAD_DIM + 1) if head_dim == d)
    run = head_dim_to_run(q.device, q.dtype, head_dim, backward)
    if run == head_dim:
        return q, k, v, run
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != head_dim:
            raise ValueError(f"{name}: expected head_dim {head_dim} in the last dim, got shape {tuple(t.shape)}")
    return (*(F.pad(t, (0, run - head_dim)) for t in (q, k, v)), run)


def _output_shapes(q):
    """out (compact, q's shape) and lse (batch, heads_q, seqlen_q), as the kernel allocates them."""
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


# ----------------------------------------------------------------------------- sinks
# gpt-oss's learnable sinks: a logit per query head in each row's softmax denominator (a key with no value).
def sinks_argument(sinks) -> dict:
    """A kernel call's sinks keyword: none without sinks (a kernel without them runs)."""
    return {} if sinks is None else {"sinks": sinks}


def check_sinks(sinks, q, heads_dim: int):
    """``sinks``, None or float32 (heads_q,) on q's device (``checks.sinks_view``'s errors), as given."""
    if sinks is not None:
        sinks_view(sinks, q.shape[heads_dim], q.device)
    return sinks


def with_sinks_gradient(grads: tuple, q) -> tuple:
    """A backward kernel's (dq, dk, dv) or, called with sinks, (dq, dk, dv, dsinks), as the backward ops'
    four outputs: dsinks empty where there are no sinks (a custom op's outputs are tensors)."""
    return grads if len(grads) == 4 else (*grads, q.new_empty((0,), dtype=torch.float32))


def needed_sinks(ctx, sinks, index: int):
    """The sinks to pass to a backward op: those of the forward where their gradient is needed (its input
    ``index``), else None. (An argument left at its default does not reach needs_input_grad: the
    dispatcher drops it.)"""
    return sinks if sinks is not None and ctx.needs_input_grad[index] else None


# The forward and backward ops take the variant as resolve_variant's fields (causal, window_left,
# window_right, softcap; alibi: whether alibi_slopes is given; dropout: whether dropout_p > 0, then with
# the seed that the backward takes too).
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
            window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
            alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, dropout_p: float = 0.0,
            dropout_seed: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) = attention forward; see :func:`attention` (deterministic: its backward's)."""
    kernel = kernel_for(q, causal, window_left, window_right, softcap, alibi_slopes is not None,
                        dropout=dropout_p > 0, sinks=sinks is not None)
    return kernel(q, k, v, softmax_scale=softmax_scale, return_lse=True, alibi_slopes=alibi_slopes,
                  **dropout_arguments(dropout_p, dropout_seed), **sinks_argument(sinks))


forward = torch.library.custom_op("tvmflash::forward", mutates_args=())(_forward)


@forward.register_fake
def _forward_shapes(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                    deterministic=False, dropout_p=0.0, dropout_seed=None, sinks=None):
    return _output_shapes(q)


def backward_kernel_for(q: torch.Tensor, causal: bool, window_left: int = -1, window_right: int = -1,
                        softcap: float = 0.0, alibi: bool = False, varlen: bool = False, deterministic: bool = False,
                        dropout: bool = False):
    """The backward kernel for q's device, dtype and head_dim and the variant (compiled on first use,
    then cached, as ``kernel_for``'s: a training step runs it at every layer)."""
    key = ("backward", q.device, q.dtype, q.shape[-1], causal, window_left, window_right, softcap, alibi, varlen,
           deterministic, dropout, choice.environment("backward"))
    found = KERNELS_FOR.get(key)
    if found is None:
        found = KERNELS_FOR[key] = compile_backward(
            head_dim=q.shape[-1], dtype=q.dtype, causal=causal, target=target_of(q),
            window_size=(window_left, window_right), softcap=softcap, alibi=alibi, varlen=varlen,
            dropout=dropout, deterministic=deterministic)
    return found


def _backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
             window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
             deterministic: bool = False, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
             sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of :func:`forward` given the gradients of its out and lse (dlse None: 0); dsinks
    float32 (heads_q,) with sinks, else empty."""
    kernel = backward_kernel_for(q, causal, window_left, window_right, softcap, alibi_slopes is not None,
                                 deterministic=deterministic, dropout=dropout_p > 0)
    return with_sinks_gradient(kernel(q, k, v, out, dout, lse, dlse=dlse, softmax_scale=softmax_scale,
                                      alibi_slopes=alibi_slopes, **dropout_arguments(dropout_p, dropout_seed),
                                      **sinks_argument(sinks)), q)


backward = torch.library.custom_op("tvmflash::backward", mutates_args=())(_backward_op)


def gradient_shapes(q, k, v, sinks) -> tuple:
    """The backward ops' outputs, as the kernels return them: dq, dk, dv compact, dsinks (heads_q,) or empty."""
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((0,) if sinks is None else sinks.shape, dtype=torch.float32))


@backward.register_fake
def _backward_shapes(dout, dlse, q, k, v, out, lse, causal, softmax_scale, window_left=-1, window_right=-1,
                     softcap=0.0, alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_seed=None,
                     sinks=None):
    return gradient_shapes(q, k, v, sinks)


def _setup_context(ctx, inputs, output):
    (q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p,
     dropout_seed, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed, sinks)
    ctx.variant = (causal, softmax_scale, window_left, window_right, softcap)
    ctx.deterministic, ctx.dropout_p = deterministic, dropout_p


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, alibi_slopes, dropout_seed, sinks = ctx.saved_tensors
    if grad_out is None:  # only lse reached the loss
        grad_out = torch.zeros_like(out)
    sinks = needed_sinks(ctx, sinks, 12)
    op = _backward_op if getattr(ctx, "eager", False) else backward  # eager_autograd's: the op's own function
    dq, dk, dv, dsinks = op(grad_out, grad_lse, q, k, v, out, lse, *ctx.variant, alibi_slopes, ctx.deterministic,
                            ctx.dropout_p, dropout_seed, sinks)
    # no gradient for the options, the ALiBi slopes or the seed
    return (dq, dk, dv) + (None,) * 9 + (None if sinks is None else dsinks,)


forward.register_autograd(_backward, setup_context=_setup_context)


def eager_autograd(impl, setup_context, backward_fn):
    """The ``apply`` of an autograd Function that runs a custom op's own function ``impl`` and its autograd
    (``setup_context``, ``backward_fn``, as ``register_autograd`` takes them; ``ctx.eager`` set, so that the
    backward calls its op's own function too): an eager call that autograd records, off torch.library's
    dispatch, which costs tens of microseconds of host time an op a call (its schema's defaults filled, its
    arguments flattened and unflattened by pytree, Dynamo's disable wrapper), a launch's time on a GPU. Under
    torch.compile the calls take the custom ops, which Dynamo traces. Differentiable once, as the ops are."""

    def forward_(ctx, *inputs):
        output = impl(*inputs)
        ctx.eager = True
        setup_context(ctx, inputs, output)
        return output

    @torch.autograd.function.once_differentiable
    def backward_(ctx, *grads):
        return backward_fn(ctx, *grads)

    name = "".join(word.title() for word in impl.__name__.split("_")) + "Function"  # grad_fn: ForwardFunctionBackward
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward_),
                                                   "backward": staticmethod(backward_)}).apply


forward_eager = eager_autograd(_forward, _setup_context, _backward)


# A kept Kernel (``tvmflash.compile``) under torch.compile: the op names it by ``Kernel.key``.
@torch.library.custom_op("tvmflash::kernel_forward", mutates_args=())
def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, softmax_scale: float,
                   alibi_slopes: torch.Tensor | None = None, dropout_p: float | None = None,
                   dropout_seed: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the Kernel ``kernel`` names; see ``Kernel.__call__``."""
    return kernels.by_key(kernel)(q, k, v, softmax_scale=softmax_scale, return_lse=True, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)


@kernel_forward.register_fake
def _kernel_forward_shapes(q, k, v, kernel, softmax_scale, alibi_slopes=None, dropout_p=None, dropout_seed=None,
                           sinks=None):
    kernels.by_key(kernel).arguments.check(q, k, v, None)
    return _output_shapes(q)


@torch.library.custom_op("tvmflash::kernel_forward_out", mutates_args=("out",))
def kernel_forward_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, kernel: str,
                       softmax_scale: float, alibi_slopes: torch.Tensor | None = None, dropout_p: float | None = None,
                       dropout_seed: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """lse of the Kernel ``kernel`` names, its output written into ``out``."""
    return kernels.by_key(kernel)(q, k, v, softmax_scale=softmax_scale, out=out, return_lse=True,
                                  alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                  sinks=sinks)[1]


@kernel_forward_out.register_fake
def _kernel_forward_out_shapes(q, k, v, out, kernel, softmax_scale, alibi_slopes=None, dropout_p=None,
                               dropout_seed=None, sinks=None):
    kernels.by_key(kernel).arguments.check(q, k, v, out)
    return _output_shapes(q)[1]


def kernel_call(kernel, q, k, v, softmax_scale: float, out, return_lse: bool, alibi_slopes=None, dropout_p=None,
                dropout_seed=None, sinks=None):
    """``kernel(q, k, v, ...)`` through the custom ops (what torch.compile traces)."""
    if out is None:
        out, lse = kernel_forward(q, k, v, kernel.key, softmax_scale, alibi_slopes, dropout_p, dropout_seed, sinks)
    else:
        lse = kernel_forward_out(q, k, v, out, kernel.key, softmax_scale, alibi_slopes, dropout_p, dropout_seed,
                                 sinks)
    return (out, lse) if return_lse else out


# Kernel.__call__ under torch.compile takes this route from kernels.registry: the kernels never import ops
registry.add_route("forward", kernel_call)


def _options(q, k, v, dims: int, layout: str, causal, window_size, softcap, alibi_slopes) -> tuple:
    """The forward and backward ops' variant arguments, causal and the variant fields in order
    (``resolve_variant``; the kernel checks the slopes), after checking that q, k and v are tensors,
    q of ``dims`` dims (``layout``) with a head_dim of 1 to 256 (``padded_head_dim`` pads it)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != dims:
        raise ValueError(f"q: expected {dims} dims {layout}, got shape {tuple(q.shape)}")
    check_any_head_dim(q.shape[-1])
    variant = resolve_variant(causal, window_size, softcap, alibi_slopes is not None)
    return (variant["causal"], variant.get("window_left", -1), variant.get("window_right", -1),
            variant.get("softcap", 0.0))


def _through_ops(q, k, v, sinks=None) -> bool:
    """Must a call go through the custom ops (under torch.compile) or their autograd (``eager_autograd``, where
    autograd records it), rather than call the kernel directly?"""
    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)))


def attention(q, k, v, *, causal: bool = False, softmax_scale=None, return_lse: bool = False, window_size=(-1, -1),
              softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False, dropout_p: float = 0.0,
              dropout_seed=None, sinks=None):
    """Exact attention softmax(q kᵀ · scale) v in flash-attn's layout.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (GQA/MQA), head_dim any from 1 to 256. Returns out with q's shape and
    dtype, or (out, lse) with lse float32 of shape (batch, heads_q, seqlen_q). softmax_scale (positive,
    at most 1e8) defaults to 1/sqrt(head_dim). A head_dim that the kernels for q's device and dtype do
    not serve is zero-padded to one they do (``head_dim_to_run``: a multiple of 8, and on a GPU one that
    a tensor-core schedule serves where there is one) and the output sliced back, a view of the padded
    output as flash-attn's; gradients come back at q's head_dim. With causal and seqlen_q != seqlen_k the mask is aligned bottom-right; a
    query that sees no key gets 0 (and lse -inf). The kernel for the tensors' device, dtype and
    head_dim is compiled on first use and cached. On a GPU a call that autograd does not record, of at
    most 16 query rows over at least 512 contiguous keys (a generation step), runs on the split-KV
    decode kernel of :func:`tvmflash.flash_attn_with_kvcache` (``decode_shaped``). Differentiable in q, k and v through out and lse
    (``torch.ops.tvmflash.backward``). Where it measures faster (the sm90 backward) dq is summed by
    fp32 atomics, in an order that changes from run to run; ``deterministic=True`` gives gradients
    bitwise the same from run to run (dq by a pass of its own), as they always are elsewhere.

    flash-attn's variants (one kernel per window and softcap): ``window_size=(left, right)``, query i
    sees keys i + seqlen_k - seqlen_q - left ... i + seqlen_k - seqlen_q + right (-1: no bound on
    that side; causal is right = 0), and only the K/V tiles a window reaches are visited; ``softcap``
    > 0 turns the scaled score s into softcap · tanh(s / softcap); ``alibi_slopes``, float32
    (heads_q,) or (batch, heads_q), adds -slope · |i + seqlen_k - seqlen_q - j| to it (after the
    cap). A query whose window holds no key gets 0 (and lse -inf). The slopes get no gradient.

    ``dropout_p`` (flash-attn's; 0 <= p < 1): each entry of the softmax is dropped with probability p
    and the kept ones scaled by 1 / (1 - p), after the softmax's sum (lse is that of the whole softmax).
    Which entries drop is Philox4x32-10 of ``dropout_seed`` (flash-attn's rng_state: int64 (seed,
    offset) on q's device; None: drawn from torch's generator for q's device, ``philox_state``) and each
    entry's batch, head, query and key (``dropout_kept`` says which), so the backward drops the same ones.

    ``sinks`` (gpt-oss's learnable attention sinks): float32 (heads_q,) on q's device, a logit per query
    head that joins each row's softmax denominator as a key with no value: p_ij = exp(s_ij - m) /
    (exp(sink_h - m) + Σ_j exp(s_ij - m)), s the scaled (capped, biased) scores; the sink itself is not
    scaled. lse includes it; a query that sees no key gets 0 and lse = sink_h. Differentiable in sinks
    too (sinks.grad float32 (heads_q,)).
    """
    options = _options(q, k, v, 4, "(batch, seqlen, heads, head_dim)", causal, window_size, softcap, alibi_slopes)
    sinks = check_sinks(sinks, q, heads_dim=2)
    return_lse, deterministic = check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
    dropout_p, dropout_seed = resolve_dropout(dropout_p, dropout_seed, q.device, q.shape[0] * q.shape[2])
    head_dim = q.shape[-1]
    softmax_scale = resolve_softmax_scale(softmax_scale, head_dim)  # q's own head_dim's, before any padding
    q, k, v, run = padded_head_dim(q, k, v, head_dim)
    if _through_ops(q, k, v, sinks):  # the custom op under torch.compile, else its autograd Function
        op = forward if torch.compiler.is_compiling() else forward_eager
        out, lse = op(q, k, v, options[0], softmax_scale, *options[1:], alibi_slopes, deterministic, dropout_p,
                      dropout_seed, sinks)
    elif not dropout_p and decode_shaped(q, k, v):  # a generation step: split the keys over the GPU
        out, lse = decode_forward(q, k, v, *options[:1], softmax_scale, *options[1:], alibi_slopes, sinks)
    else:  # eager, nothing for autograd to record: no custom op's dispatch
        out, lse = kernel_for(q, *options, alibi_slopes is not None, dropout=dropout_p > 0, sinks=sinks is not None)(
            q, k, v, softmax_scale=softmax_scale, return_lse=True, alibi_slopes=alibi_slopes,
            **dropout_arguments(dropout_p, dropout_seed), **sinks_argument(sinks))
    if run != head_dim:
        out = out[..., :head_dim]
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- varlen
# flash-attn's packed sequences: q (total_q, heads_q, d), k and v (total_k, heads_kv, d), each
# sequence's rows from cu_seqlens (int32, batch + 1) on the device; lse (heads_q, total_q).
def _varlen_output_shapes(q):
    """out (compact, q's shape) and lse (heads_q, total_q), as the varlen kernel allocates them."""
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                   softmax_scale: float, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, dropout_p: float = 0.0,
                   dropout_seed: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the varlen forward; see :func:`varlen_attention` (deterministic: its backward's)."""
    kernel = kernel_for(q, causal, window_left, window_right, softcap, alibi_slopes is not None, varlen=True,
                        dropout=dropout_p > 0, sinks=sinks is not None)
    return kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale=softmax_scale, return_lse=True,
                  alibi_slopes=alibi_slopes, **dropout_arguments(dropout_p, dropout_seed), **sinks_argument(sinks))


varlen_forward = torch.library.custom_op("tvmflash::varlen_forward", mutates_args=())(_varlen_forward)


@varlen_forward.register_fake
def _varlen_forward_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                           dropout_p=0.0, dropout_seed=None, sinks=None):
    return _varlen_output_shapes(q)


def _varlen_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                    softmax_scale: float, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, dropout_p: float = 0.0,
                    dropout_seed: torch.Tensor | None = None, sinks: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of :func:`varlen_forward` given the gradients of its out and lse (dlse None: 0);
    dsinks float32 (heads_q,) with sinks, else empty."""
    kernel = backward_kernel_for(q, causal, window_left, window_right, softcap, alibi_slopes is not None, varlen=True,
                                 deterministic=deterministic, dropout=dropout_p > 0)
    return with_sinks_gradient(kernel(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dlse=dlse, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                                      **dropout_arguments(dropout_p, dropout_seed), **sinks_argument(sinks)), q)


varlen_backward = torch.library.custom_op("tvmflash::varlen_backward", mutates_args=())(_varlen_backward_op)


@varlen_backward.register_fake
def _varlen_backward_shapes(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                            deterministic=False, dropout_p=0.0, dropout_seed=None, sinks=None):
    return gradient_shapes(q, k, v, sinks)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
     window_right, softcap, alibi_slopes, deterministic, dropout_p, dropout_seed, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, sinks)
    ctx.lengths = (max_seqlen_q, max_seqlen_k)
    ctx.variant = (causal, softmax_scale, window_left, window_right, softcap)
    ctx.deterministic, ctx.dropout_p = deterministic, dropout_p


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, sinks = ctx.saved_tensors
    if grad_out is None:  # only lse reached the loss
        grad_out = torch.zeros_like(out)
    sinks = needed_sinks(ctx, sinks, 16)
    op = _varlen_backward_op if getattr(ctx, "eager", False) else varlen_backward
    dq, dk, dv, dsinks = op(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths,
                            *ctx.variant, alibi_slopes, ctx.deterministic, ctx.dropout_p, dropout_seed, sinks)
    # none for the offsets, lengths, options, ALiBi slopes or seed
    return (dq, dk, dv) + (None,) * 13 + (None if sinks is None else dsinks,)


varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
varlen_forward_eager = eager_autograd(_varlen_forward, _varlen_setup_context, _varlen_backward)


# A kept VarlenKernel (``tvmflash.compile(..., varlen=True)``) under torch.compile, named by its key.
@torch.library.custom_op("tvmflash::varlen_kernel_forward", mutates_args=())
def varlen_kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, kernel: str, softmax_scale: float,
                          alibi_slopes: torch.Tensor | None = None, dropout_p: float | None = None,
                          dropout_seed: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the VarlenKernel ``kernel`` names; see ``VarlenKernel.__call__``."""
    return kernels.by_key(kernel)(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale=softmax_scale,
                                  return_lse=True, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  dropout_seed=dropout_seed, sinks=sinks)


@varlen_kernel_forward.register_fake
def _varlen_kernel_forward_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, kernel, softmax_scale,
                                  alibi_slopes=None, dropout_p=None, dropout_seed=None, sinks=None):
    return _varlen_output_shapes(q)


def varlen_kernel_call(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale: float, out,
                       return_lse: bool, alibi_slopes=None, dropout_p=None, dropout_seed=None, sinks=None):
    """``kernel(q, k, v, cu_seqlens_q, ...)`` of a VarlenKernel through its custom op (what
    torch.compile traces); a given out is written by a copy."""
    result, lse = varlen_kernel_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, kernel.key, softmax_scale,
                                        alibi_slopes, dropout_p, dropout_seed, sinks)
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result


registry.add_route("varlen", varlen_kernel_call)  # as "forward", for VarlenKernel.__call__


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale=None, return_lse: bool = False, window_size=(-1, -1),
                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False, dropout_p: float = 0.0,
                     dropout_seed=None, sinks=None):
    """:func:`attention` of sequences packed without padding (flash-attn's varlen layout).

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); cu_seqlens_q,
    cu_seqlens_k: int32 (batch + 1,) on q's device, the offsets of each sequence's first row
    (non-decreasing from 0 to total_q, total_k); max_seqlen_q, max_seqlen_k: ints, at least every
    sequence's length (they size the grids). head_dim: any from 1 to 256, padded as :func:`attention`'s.
    Returns out with q's shape, or (out, lse) with lse float32 (heads_q, total_q). Each sequence attends to its own keys only, with the causal mask,
    window and ALiBi distances of its own lengths (bottom-right aligned). The kernel reads the
    offsets on the device: no padding, no loop over sequences, no rebuild for new lengths.
    Differentiable in q, k and v (``torch.ops.tvmflash.varlen_backward``), under torch.compile too;
    ``deterministic`` and ``dropout_p`` as :func:`attention`'s (with dropout, b in ``dropout_kept`` is the
    sequence, and the query and key are positions in it); ``sinks``, float32 (heads_q,), as :func:`attention`'s.
    """
    options = _options(q, k, v, 3, "(total_q, heads, head_dim)", causal, window_size, softcap, alibi_slopes)
    sinks = check_sinks(sinks, q, heads_dim=1)
    return_lse, deterministic = check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
    dropout_p = check_dropout_p(dropout_p)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)  # max_seqlen_k: the backward's
    streams = (cu_seqlens_q.shape[0] - 1) * q.shape[1]  # sequences · heads_q
    dropout_p, dropout_seed = resolve_dropout(dropout_p, dropout_seed, q.device, streams)
    head_dim = q.shape[-1]
    softmax_scale = resolve_softmax_scale(softmax_scale, head_dim)  # q's own head_dim's, before any padding
    q, k, v, run = padded_head_dim(q, k, v, head_dim)
    if _through_ops(q, k, v, sinks):  # the custom op under torch.compile, else its autograd Function
        op = varlen_forward if torch.compiler.is_compiling() else varlen_forward_eager
        out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options[0], softmax_scale,
                      *options[1:], alibi_slopes, deterministic, dropout_p, dropout_seed, sinks)
    else:  # eager, nothing for autograd to record: no custom op's dispatch
        out, lse = kernel_for(q, *options, alibi_slopes is not None, varlen=True, dropout=dropout_p > 0,
                              sinks=sinks is not None)(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale=softmax_scale, return_lse=True,
            alibi_slopes=alibi_slopes, **dropout_arguments(dropout_p, dropout_seed), **sinks_argument(sinks))
    if run != head_dim:
        out = out[..., :head_dim]
    return (out, lse) if return_lse else out
