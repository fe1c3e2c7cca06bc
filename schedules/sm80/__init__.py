"""The sm80 schedule: the attention programs on tensor cores (mma.sync m16n8k16 and ldmatrix), for
fp16 and bf16 on sm80 and newer GPUs.

One module a role: ``knobs`` (the knob tables of the forward, backward and decode, their checks and
shared-memory models), ``intrinsics`` (mma.sync, ldmatrix, fill), ``fragments`` (the fragment
layouts and the schedule steps on them that all three share), ``forward`` (``schedule``),
``backward`` (``schedule_backward``) and ``decode`` (``schedule_decode``). This package is the
schedule module the registry (``tvmflash.schedules``) hands out: it exposes those names here.
"""

# The schedule's interface, read by the registry, the kernels and the tuner.
from .backward import schedule_backward  # noqa: F401
from .decode import schedule_decode  # noqa: F401
from .forward import schedule  # noqa: F401
from .knobs import (  # noqa: F401
    BACKWARD_HEAD_DIMS, BACKWARD_KNOBS, BACKWARD_KNOBS_FOR_HEAD_DIM, BACKWARD_SPACE, CHOICES, DECODE_KNOBS,
    DECODE_PASS_CONFIG, DECODE_SPACE, DECODE_TENSOR_CORES, DTYPES, KNOBS, KNOBS_FOR_HEAD_DIM, NUM_STAGES,
    PASS_CONFIG, ROW_STATES, SPACE, STRIDE_ALIGNMENT, STRUCTURE_KNOBS, backward_shared_memory_bytes,
    decode_knob_problem, decode_query_tokens, decode_shared_memory_bytes, decode_tasks_per_sm, shared_memory_bytes,
)
