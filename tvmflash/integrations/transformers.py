"""tvmflash as an attention implementation of Hugging Face Transformers (5.x)::

    from tvmflash.integrations import transformers as tvmflash_hf

    tvmflash_hf.register()                                        # once a process
    model = AutoModelForCausalLM.from_config(config, attn_implementation=tvmflash_hf.NAME)
    model.set_attn_implementation(tvmflash_hf.NAME)               # or switch a model you have

Transformers then runs its own flash-attention path (``integrations/flash_attention.py``) on tvmflash's
flash-attn 2 functions, as it would run flash-attn's:
- a batch without padding: ``flash_attn_func``;
- a padded batch (an attention mask: batched generation with left padding): the rows unpadded, then
  ``flash_attn_varlen_func``;
- padding-free packed sequences (``DataCollatorWithFlattening``: position_ids that restart, or its
  ``cu_seq_lens_q/k`` and ``max_length_q/k``): ``flash_attn_varlen_func``, so that no token sees another
  sequence's;
- continuous batching (``generate_batch``): ``flash_attn_varlen_func`` over the keys gathered from the
  paged cache, and on CUDA its decode fast path, ``flash_attn_with_kvcache`` with a ``block_table``.

Why the name has "flash" in it, and how it is served: Transformers sends every implementation whose name
contains "flash" down that path, and loads the path's functions by the name
(``modeling_flash_attention_utils.lazy_import_flash_attention``): flash-attn's own packages for
"flash_attention_2/3/4", else a kernel from the Hugging Face Hub
(``integrations.hub_kernels.load_and_register_attn_kernel``), which fails for a name that is no Hub
repository ("Could not find the currently requested flash attention implementation"). Under a name
without "flash" a plain attention function works, but off that path: packed sequences get a dense block
mask instead of cu_seqlens, and continuous batching refuses the name.
Transformers has no registry for a local module of flash functions, so :func:`register` wraps
``load_and_register_attn_kernel`` to answer for the names it registered with this module, which has what
a Hub flash kernel has (``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``), and
passes every other name to Transformers' function unchanged. The "2" in :data:`NAME` opens continuous
batching's decode fast path, which Transformers opens only to names matching flash…2 or flash…3 (on CUDA).

A model that lists its own flash kernels (``_compatible_flash_implementations``, e.g. Granite SWA) swaps
any other flash name for its first one: such models do not run on tvmflash through this name.
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from tvmflash import flash_attn

NAME = "tvmflash_attention_2"
"""The implementation name :func:`register` registers by default (``attn_implementation=NAME``)."""

# The names register() has registered: the wrapped Hub loader answers for these with this module.
SERVED: set[str] = set()

# Transformers' own flash implementations, and its Hub kernel names (owner/repo[@rev][:name]).
RESERVED = re.compile(r"flash_attention_\d|.*[/:@|].*")

# flash-attn's functions, the ones Transformers' flash path calls (it reads their parameters to see which
# options the implementation takes, so these keep flash-attn's signatures).
flash_attn_func = flash_attn.flash_attn_func
flash_attn_with_kvcache = flash_attn.flash_attn_with_kvcache


@functools.wraps(flash_attn.flash_attn_varlen_func)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs):
    return flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, as_length(max_seqlen_q),
                                             as_length(max_seqlen_k), *args, **kwargs)


flash_attn_varlen_func.__doc__ = """tvmflash's :func:`~tvmflash.flash_attn_varlen_func`, taking max_seqlen_q
and max_seqlen_k also as one-element integer tensors, as flash-attn's does: Transformers passes them so when
it finds packed sequences from position_ids (``cu_seq_lens.diff().max()``)."""


def as_length(value):
    """``value`` as an int where it is a one-element integer tensor (on a GPU this waits for it, as
    flash-attn's conversion of the tensor does); anything else as it is, for tvmflash's checks to judge."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value)
    return value


def register(name: str = NAME) -> str:
    """Make tvmflash a Transformers attention implementation called ``name`` (default :data:`NAME`) and
    return the name, for ``attn_implementation=`` or ``model.set_attn_implementation``.

    ``name`` must contain "flash" (Transformers' flash path, see the module's docstring) and be none of
    Transformers' own ("flash_attention_2", ...) or a Hub kernel's ("owner/repo"). Registering again is
    harmless. Raises ImportError without Transformers 5.
    """
    if not isinstance(name, str) or "flash" not in name or RESERVED.fullmatch(name):
        raise ValueError(f"name: expected a name containing 'flash' (Transformers' flash path), none of "
                         f"Transformers' own flash_attention_N and no Hub kernel's owner/repo; got {name!r}")
    try:
        import transformers
    except ImportError as error:
        raise ImportError("tvmflash.integrations.transformers needs Hugging Face Transformers 5: "
                          "pip install 'tvmflash[transformers]'") from error
    if int(transformers.__version__.split(".")[0]) != 5:
        raise ImportError(f"tvmflash.integrations.transformers serves Transformers 5.x; found "
                          f"{transformers.__version__}")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations import hub_kernels
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # What the Hub loader registers for a flash kernel: Transformers' flash wrapper, and flash's masks
    # (None, or the 2-d padding mask that the wrapper turns into cu_seqlens).
    AttentionInterface.register(name, flash_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    # Continuous batching runs "paged|" + name: Transformers 5.17 looks that up as a name of its own (as it
    # has "paged|flash_attention_2"), later releases derive it from the name.
    paged = "paged|flash_attention_2"
    if paged in AttentionInterface._global_mapping:
        AttentionInterface.register(f"paged|{name}", AttentionInterface._global_mapping[paged])
    if not getattr(hub_kernels.load_and_register_attn_kernel, "serves_tvmflash", False):
        hub_kernels.load_and_register_attn_kernel = serving(hub_kernels.load_and_register_attn_kernel)
    SERVED.add(name)
    return name


def serving(load):
    """Transformers' Hub kernel loader ``load``, answering for the names in :data:`SERVED` (and, as
    Transformers 5.17 asks for continuous batching, for them after "paged|") with this module (its flash
    functions), and for every other name as ``load`` does."""

    @functools.wraps(load)
    def load_and_register_attn_kernel(attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str) and attn_implementation.removeprefix("paged|") in SERVED:
            return sys.modules[__name__]
        return load(attn_implementation, *args, **kwargs)

    load_and_register_attn_kernel.serves_tvmflash = True
    return load_and_register_attn_kernel
