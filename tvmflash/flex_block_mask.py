"""torch's ``BlockMask`` for the kernels (``tvmflash.flex_attention``'s block sparsity): its lists as the
programs take them (``program_block_sparse.SPARSE_ARGUMENTS``: ``block_sparse_arguments``, kept per mask object by
``block_sparse_lists``), and kernels whose tiles divide its blocks (``compile_flex``, ``fitted_tiles``)."""

from __future__ import annotations

import functools

import math
import weakref

import torch

from tvmflash import kernels
from tvmflash import schedules as schedule_registry
from tvmflash.program_block_sparse import SPARSE_TILE_KNOBS
from tvmflash.program_flex import FlexMods


def compile_flex(head_dim: int, dtype, target, mods: FlexMods, backward: bool = False, sinks: bool = False):
    """``kernels.compile`` (``backward``: ``compile_backward``) of these mods, with a BlockMask
    (``mods.sparse``) in tiles that divide its blocks: the chosen schedule's, or its tile knobs brought down to
    divisors (``fitted_tiles``), or where it takes no such tile the next schedule of ``SCHEDULES`` that serves
    the call and does (sm80 for a BLOCK_SIZE of 32 on sm_90a: sm90's tiles are 64 rows or more); a ValueError
    naming the sizes where none does. ``sinks``: a forward that takes sink logits."""
    compile_ = kernels.compile_backward if backward else functools.partial(kernels.compile, sinks=sinks)
    kernel = compile_(head_dim=head_dim, dtype=dtype, target=target, flex=mods)
    if mods.sparse is None:
        return kernel
    refusals = []
    names = [kernel.schedule.name] + [name for name in schedule_registry.SCHEDULES if name != kernel.schedule.name]
    for name in names:
        try:
            found = kernel if name == kernel.schedule.name else compile_(
                head_dim=head_dim, dtype=dtype, target=target, flex=mods, schedule=name)
        except ValueError:  # a schedule that does not serve this target, dtype or head_dim
            continue
        program = found.schedule.backward if backward else found.schedule.forward
        fitted = fitted_tiles(found.knobs, mods.sparse, program.knobs.knobs, program.knobs.rules)
        if not fitted:
            return found
        try:
            return compile_(head_dim=head_dim, dtype=dtype, target=target, flex=mods, knobs=fitted, schedule=name)
        except ValueError as error:
            refusals.append(f"{name}: tiles {_tiles(found.knobs)}, and {_tiles(fitted)} refused ({error})")
    raise ValueError(f"block_mask: its BLOCK_SIZE {mods.sparse[0]}x{mods.sparse[1]} (Q x KV) is not a multiple of "
                     f"the tiles of any schedule that serves this call: {'; '.join(refusals)}. Make the BlockMask "
                     "with BLOCK_SIZE 128 (or a multiple of the tiles)")


def fitted_tiles(knobs: dict, sparse: tuple, declared=(), rules=None) -> dict:
    """The tile knobs of ``knobs`` that do not divide the BlockMask's (Q, KV) block size ``sparse``, each
    brought down to the largest tile that divides both (a kernel tile then lies in one block, whose list it
    walks: ``program_block_sparse.BlockWalk``), and the derived knobs of the schedule's ``declared`` ones
    (``contract.Knob``: sm90's num_warpgroups follows block_m) that follow; {} where every tile divides.
    Where the schedule's ``rules`` (``contract.KnobSet.rules``) refuse the fitted tiles with another knob's
    value (sm80's dkdv_warps, 16 keys a warp at the least), that knob takes the largest value of its space that
    they take."""
    fitted = {name: math.gcd(knobs[name], sparse[axis]) for name, axis in SPARSE_TILE_KNOBS.items()
              if name in knobs and sparse[axis] % knobs[name]}
    if fitted:
        for knob in declared:
            if callable(knob.space):  # a derived knob: the first value its space gives for the fitted tiles
                values = knob.space({**knobs, **fitted})
                if knobs.get(knob.name) not in values:
                    fitted[knob.name] = values[0]
        for knob in declared:
            complete = {**knobs, **fitted}
            if rules is None or rules(complete) is None:
                break
            if knob.name in SPARSE_TILE_KNOBS or not isinstance(knob.space, tuple):
                continue
            value = next((v for v in sorted(knob.space, reverse=True) if rules({**complete, knob.name: v}) is None),
                         None)
            if value is not None:
                fitted[knob.name] = value
    return fitted


def _tiles(knobs: dict) -> str:
    return ", ".join(f"{name} {knobs[name]}" for name in SPARSE_TILE_KNOBS if name in knobs)


def _ceildiv(a: int, b: int) -> int:
    return -(-a // b)


# id(BlockMask) -> (a weak reference to it, what its lists were made from, the lists): a mask reused from
# call to call (a training step's) is converted once. The entry serves only the same live object holding the
# same tensors (kept here, so that no other tensor takes their place) at the same versions (an in-place
# change makes new lists).
_LISTS: dict[int, tuple] = {}
_LISTS_KEPT = 16
_LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
               "full_q_num_blocks", "full_q_indices")


def _made_from(block_mask, call: tuple) -> tuple:
    tensors = tuple(getattr(block_mask, name, None) for name in _LIST_NAMES)
    return call + (tuple(block_mask.BLOCK_SIZE),), tensors, tuple(getattr(t, "_version", None) for t in tensors)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[2] == b[2] and all(x is y for x, y in zip(a[1], b[1]))


def block_sparse_lists(block_mask, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device):
    """``block_sparse_arguments``, kept for the same BlockMask object unchanged (``_LISTS``)."""
    if block_mask is None or not hasattr(block_mask, "kv_num_blocks"):
        return None, []
    made_from = _made_from(block_mask, (batch, heads_q, seqlen_q, seqlen_k, device))
    found = _LISTS.get(id(block_mask))
    if found is not None and found[0]() is block_mask and _same(found[1], made_from):
        return found[2]
    result = block_sparse_arguments(block_mask, batch, heads_q, seqlen_q, seqlen_k, device)
    try:
        reference = weakref.ref(block_mask)
    except TypeError:  # not weakly referable: not kept
        return result
    _LISTS.pop(id(block_mask), None)
    if len(_LISTS) >= _LISTS_KEPT:
        _LISTS.pop(next(iter(_LISTS)))
    _LISTS[id(block_mask)] = (reference, made_from, result)
    return result


def check_list_counts(lists) -> None:
    """A ValueError unless each count pair of ``block_sparse_arguments``' lists (kv counts, kv list, q counts,
    q list) is 0 <= partial <= partial + full <= its list's width: the check of the counts that
    ``block_sparse_arguments`` makes on the CPU, on its result (under torch.compile, at run time)."""
    for what, counts, indices in (("kv", lists[0], lists[1]), ("q", lists[2], lists[3])):
        if bool((counts[..., 0] < 0).any() or (counts[..., 0] > counts[..., 1]).any()
                or (counts[..., 1] > indices.shape[-1]).any()):
            raise ValueError(f"block_mask.{what}_num_blocks: counts out of range (0 to the width of its indices)")


def block_sparse_arguments(block_mask, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device,
                           check_counts: bool = True):
    """torch's ``BlockMask`` as the programs take it (``program_block_sparse.SPARSE_ARGUMENTS``): its (Q, KV)
    BLOCK_SIZE and four int32 tensors, each list's partial blocks first and its full ones after them
    (``counts[..., 0]`` partial, ``[..., 1]`` partial + full), or (None, []) for anything else. A mask
    whose shapes are not those of this call (stale, or made for other lengths, batch or heads)
    raises a ValueError, and on the CPU counts out of range (``check_counts``; the kernels there read the lists
    unclamped)."""
    if block_mask is None or not hasattr(block_mask, "kv_num_blocks"):
        return None, []
    sizes = tuple(int(n) for n in block_mask.BLOCK_SIZE)
    block_q, block_kv = sizes
    rows, cols = _ceildiv(seqlen_q, block_q), _ceildiv(seqlen_k, block_kv)
    q_num, q_indices = block_mask.q_num_blocks, block_mask.q_indices
    full_q_num, full_q_indices = block_mask.full_q_num_blocks, block_mask.full_q_indices
    if q_num is None:  # BlockMask.from_kv_blocks(compute_q_blocks=False): the backward's lists from the forward's
        from torch.nn.attention.flex_attention import _transpose_ordered
        q_num, q_indices = _transpose_ordered(block_mask.kv_num_blocks, block_mask.kv_indices)
        if block_mask.full_kv_num_blocks is not None:
            full_q_num, full_q_indices = _transpose_ordered(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    lists = []
    for what, (num, indices, full_num, full_indices), length in (
            ("kv", (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                    block_mask.full_kv_indices), rows),
            ("q", (q_num, q_indices, full_q_num, full_q_indices), cols)):
        for name, t, dims in ((f"{what}_num_blocks", num, 3), (f"{what}_indices", indices, 4),
                              (f"full_{what}_num_blocks", full_num, 3), (f"full_{what}_indices", full_indices, 4)):
            if t is None and name.startswith("full_"):
                continue
            if (not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] not in (1, batch)
                    or t.shape[1] not in (1, heads_q) or t.shape[2] != length or (dims == 4 and not t.shape[3])):
                raise ValueError(
                    f"block_mask.{name}: expected (batch 1 or {batch}, heads 1 or {heads_q}, {length} blocks"
                    f"{', ...' if dims == 4 else ''}) for these lengths ({seqlen_q}, {seqlen_k}) and BLOCK_SIZE {sizes}, "
                    f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}; make the mask for this call "
                    "(create_block_mask)")
            if t.device != device:
                raise ValueError(f"block_mask.{name}: expected query's device {device}, got {t.device}")
        shape = (max(num.shape[0], indices.shape[0]), max(num.shape[1], indices.shape[1]))
        if full_num is None:
            full_num = torch.zeros_like(num)
            full_indices = indices[..., :1]
        shape = tuple(max(n) for n in zip(shape, full_num.shape[:2], full_indices.shape[:2]))
        num, full_num = (t.to(torch.int32).expand(*shape, length) for t in (num, full_num))
        indices, full_indices = (t.to(torch.int32).expand(*shape, length, t.shape[3]) for t in (indices, full_indices))
        width = indices.shape[3]
        # (on a GPU the values are not read back: the kernels clamp them into the tensors)
        if check_counts and device.type == "cpu":
            if bool((num < 0).any() or (num > width).any() or (full_num < 0).any()
                    or (full_num > full_indices.shape[3]).any()):
                raise ValueError(f"block_mask.{what}_num_blocks: counts out of range (0 to the width of its indices)")
        # one list a row: its partial blocks, then its full ones
        both = torch.cat([indices, full_indices], dim=-1)
        at = torch.arange(both.shape[-1], device=device, dtype=torch.int32)
        source = torch.where(at < num[..., None], at, width + at - num[..., None]).clamp(0, both.shape[-1] - 1)
        lists += [torch.stack([num, num + full_num], dim=-1).contiguous(),
                  torch.gather(both, -1, source.long()).contiguous()]
    return sizes, lists
