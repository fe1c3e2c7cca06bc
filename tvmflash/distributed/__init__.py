"""Context parallelism: attention over a sequence sharded across the ranks of a ``torch.distributed``
process group, on tvmflash's own kernels (``docs/context-parallel.md``).

- :func:`ring_attention`: each rank keeps its query shard; K/V shards pass round a ring, partial outputs
  merge by their LSE in float32; the backward passes dK/dV round the ring.
- :func:`ulysses_attention`: all_to_all from sequence shards to head shards, attention over the whole
  sequence, all_to_all back.
- :func:`shard`, :func:`unshard`, :func:`zigzag_shard`, :func:`zigzag_unshard`: a batch's sequence into
  each rank's shard (contiguous, or zigzag: chunks r and 2W-1-r, which balances the causal work) and back.

Shards are flash-attn's layout, (batch, shard_len, heads, head_dim)."""

from tvmflash.distributed.functions import ring_attention, ulysses_attention
from tvmflash.distributed.layout import LAYOUTS, shard, unshard, zigzag_shard, zigzag_unshard

__all__ = ["LAYOUTS", "ring_attention", "shard", "ulysses_attention", "unshard", "zigzag_shard", "zigzag_unshard"]
