"""The contract between a schedule and the floors above it.

A schedule declares once, as data, what the kernels, the tuner and the tuning database need to know:
each knob with its default, the values it takes, its tuning space, its per-head_dim defaults and what
it constrains (``Knob``), the rules between knobs and the build's limits (``KnobSet``), and for each
program it maps (forward, backward, decode) the function that schedules it (``ProgramSchedule``). The
knob tables, the tuning space and the one knob validation (``KnobSet.problem``) are derived from that
declaration; nothing above reads a schedule module's attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# What a knob constrains, which is how the tuner treats it (``tvmflash.tune.space``):
TILE = "tile"  # a tile size of the program (its buffers and loops): one MetaSchedule task per value
PROGRAM = "program"  # a function attribute of the program (__launch_bounds__): one task per value
STRUCTURE = "structure"  # a plain value that changes which schedule steps run: one design space per value
SCHEDULE = "schedule"  # a value the schedule reads; with several candidates, sampled inside the trace
DERIVED = "derived"  # follows from the knobs before it (its ``space`` is a function of them)
ROLES = (TILE, PROGRAM, STRUCTURE, SCHEDULE, DERIVED)


@dataclass(frozen=True)
class Knob:
    """One knob of one program's schedule.

    default: its value where nothing else decides. choices: the values it may take; None: any
    positive int (an int default) or True/False (a bool default). space: the candidates the tuner
    tries (None: the default alone), or for a ``DERIVED`` knob a function of the knobs before it
    returning them (and a ``DERIVED`` knob). by_head_dim: its default at some head_dims; by_dtype: at some dtypes
    (a head_dim's first). varlen: the value varlen's packed sequences require (None: any). role: what it
    constrains (``ROLES``)."""

    name: str
    default: Any
    choices: tuple | None = None
    space: tuple | Callable[[dict], list] | None = None
    by_head_dim: Mapping[int, Any] = field(default_factory=dict)
    varlen: Any = None
    role: str = SCHEDULE
    by_dtype: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"knob {self.name}: role must be one of {ROLES}, got {self.role!r}")
        if callable(self.space) and self.role != DERIVED:
            raise ValueError(f"knob {self.name}: a knob whose space is a function of other knobs is derived")
        for value in (self.default, *self.by_head_dim.values(), *self.by_dtype.values(),
                      *((self.varlen,) if self.varlen is not None else ()),
                      *(() if self.space is None or callable(self.space) else self.space)):
            problem = self.value_problem(value)
            if problem:
                raise ValueError(f"knob {self.name}'s declaration: {problem}")

    def value_problem(self, value, schedule: str = "") -> str | None:
        """None if ``value`` is a value of this knob, else why not (``schedule``: whose knob it is)."""
        if self.choices is not None:
            if value in self.choices and type(value) is type(self.default):
                return None
            return f"the {schedule} schedule takes one of {list(self.choices)}, got {value!r}"
        if isinstance(self.default, bool):
            return None if isinstance(value, bool) else f"expected True or False, got {value!r}"
        if isinstance(self.default, int) and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return f"expected a positive int, got {value!r}"
        return None

    def candidates(self, knobs: dict | None = None) -> list:
        """The tuning space's values (a derived knob's from ``knobs``)."""
        if callable(self.space):
            return list(self.space(knobs or {}))
        return [self.default] if self.space is None else list(self.space)


@dataclass(frozen=True)
class KnobSet:
    """The knobs of one program's schedule, and what limits them.

    rules: ``rules(knobs) -> str | None``, why complete knobs do not go together (any head_dim).
    build_problem: ``build_problem(head_dim, dtype, knobs) -> str | None``, why a build with complete
    knobs would fail on the GPU (registers, alignment). shared_memory: ``shared_memory(head_dim, dtype,
    knobs) -> bytes`` a build needs. precheck: ``precheck(head_dim, dtype, knobs) -> str | None``, what
    the tuner also leaves out before building: configurations that a cheap model says would fail at
    build time (a caller's own knobs are left to the build, which says so too). shared_memory_limit: a cap below the target's (static shared
    memory). varlen_by_head_dim: knobs varlen takes at some head_dims (over the defaults, below the
    caller's). dq_pass_by_head_dim: knobs a backward takes at some head_dims where its dq is a pass of its
    own (deterministic; over the defaults or a record's, below the caller's). The tuner's design space is
    ``space()``."""

    schedule: str
    program: str
    knobs: tuple[Knob, ...]
    rules: Callable[[dict], str | None] | None = None
    build_problem: Callable[[int, str, dict], str | None] | None = None
    shared_memory: Callable[[int, str, dict], int] | None = None
    precheck: Callable[[int, str, dict], str | None] | None = None
    shared_memory_limit: int | None = None
    varlen_by_head_dim: Mapping[int, dict] = field(default_factory=dict)
    dq_pass_by_head_dim: Mapping[int, dict] = field(default_factory=dict)

    def __post_init__(self):
        names = [knob.name for knob in self.knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.schedule} {self.program} knobs: a name is declared twice in {names}")

    @property
    def by_name(self) -> dict[str, Knob]:
        return {knob.name: knob for knob in self.knobs}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(knob.name for knob in self.knobs)

    def defaults(self, head_dim: int | None = None, varlen: bool = False, dtype: str | None = None) -> dict:
        """The default knobs, at ``head_dim`` and ``dtype`` where given; with varlen, what varlen requires or
        prefers."""
        knobs = {knob.name: knob.by_head_dim.get(head_dim, knob.by_dtype.get(dtype, knob.default)) for knob in self.knobs}
        if varlen:
            knobs.update(self.varlen_by_head_dim.get(head_dim, {}))
            knobs.update(self.varlen_required())
        return knobs

    def varlen_required(self) -> dict:
        """The knob values varlen's packed sequences require."""
        return {knob.name: knob.varlen for knob in self.knobs if knob.varlen is not None}

    def names_of(self, *roles: str) -> tuple[str, ...]:
        """The knobs of these roles, in declaration order."""
        return tuple(knob.name for knob in self.knobs if knob.role in roles)

    def space(self) -> dict:
        """The tuning space: name -> candidates, or for a derived knob the function that gives them."""
        return {knob.name: knob.space if callable(knob.space) else knob.candidates() for knob in self.knobs}

    def points(self) -> list[dict]:
        """Every configuration of the space that goes together (``rules``): each knob's candidates,
        a derived knob's from the knobs before it."""
        points = [{}]
        for knob in self.knobs:
            points = [{**point, knob.name: value} for point in points for value in knob.candidates(point)]
        return [point for point in points if self.rules is None or self.rules(point) is None]

    def accepts(self, knobs: dict) -> bool:
        """Whether ``knobs`` (a tuning record's) name every knob of this set with values it takes: a record
        made before a knob existed, or after one was dropped, is not this schedule's any more."""
        return set(knobs) == set(self.names) and self.problem(knobs) is None

    def problem(self, knobs: dict, head_dim: int | None = None, dtype: str | None = None,
                tuning: bool = False) -> str | None:
        """The one knob validation: None if ``knobs`` (some or all of this set's, the defaults filling
        in the rest) are valid, else why not. Names first, then each value, then the rules between
        knobs, then, given a head_dim and dtype, the build's own limits (``build_problem``, and for the
        tuner, ``tuning``, its ``precheck``)."""
        unknown = sorted(set(knobs) - set(self.names))
        if unknown:
            which = "" if self.program == "forward" else f"{self.program} "
            return f"knobs: {unknown} are not {which}knobs of the {self.schedule} schedule; it has {sorted(self.names)}"
        by_name = self.by_name
        for name, value in knobs.items():
            problem = by_name[name].value_problem(value, self.schedule)
            if problem:
                return f"knobs: {name}: {problem}"
        complete = {**self.defaults(head_dim), **knobs}
        problem = self.rules(complete) if self.rules is not None else None
        for check in ((self.build_problem, self.precheck if tuning else None) if head_dim and dtype else ()):
            if problem is None and check is not None:
                problem = check(head_dim, dtype, complete)
        return None if problem is None else f"knobs: {problem}"


@dataclass(frozen=True)
class DecodeTasks:
    """What decode's kernel needs of a schedule besides its knobs. tensor_cores: the program variant it
    maps (operands in q's dtype on tensor cores, else float32). query_tokens(group, knobs): the query
    tokens a task holds for a GQA group of ``group`` query heads. per_processor(head_dim, dtype, knobs,
    group): the tasks one SM (one core on the CPU) runs at once, which the split count fills. fp8_cache:
    it maps the program over an FP8 (e4m3) cache (``program_decode``: the blocks dequant_k and dequant_v);
    fp8_unchecked_head_dims: the head_dims where that has not passed the GPU tests yet, served only where
    TVMFLASH_GPU_UNCHECKED=1 asks (as ``ProgramSchedule.unchecked_head_dims``). fp8_byte_tiles(head_dim,
    knobs, converts): the program's byte_tiles form it maps ("", "prefetched" or "staged": the cache's bytes
    in tiles of their own, ``program_decode.decode_split``); converts: the target converts e4m3 itself.
    fp8_cache_defaults: knobs whose default over an FP8 cache differs from the knob set's."""

    tensor_cores: bool = False
    fp8_cache: bool = False
    fp8_unchecked_head_dims: tuple[int, ...] = ()
    fp8_cache_defaults: Mapping[str, Any] = field(default_factory=dict)
    fp8_byte_tiles: Callable[[int, dict, bool], str] = lambda head_dim, knobs, converts: ""
    query_tokens: Callable[[int, dict], int] = lambda group, knobs: knobs["query_tokens"]
    per_processor: Callable[[int, str, dict, int], int] = lambda head_dim, dtype, knobs, group: 1


# The head_dims at which the CUDA schedules' kernels have passed the gpu tests on a GPU. A CUDA schedule
# builds at more (cross-compiled and through nvcc: each one's ``..._HEAD_DIMS``), but serves only these
# until a GPU run of tests/test_head_dims.py checks the others: until then the torch API pads a head_dim
# to one of these there, and ``tvmflash.compile`` names them.
GPU_CHECKED_HEAD_DIMS = tuple(range(16, 257, 16))


def gpu_checked(head_dims: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Of ``head_dims`` (None: every head_dim the programs take), those checked on a GPU."""
    return tuple(d for d in (head_dims or GPU_CHECKED_HEAD_DIMS) if d in GPU_CHECKED_HEAD_DIMS)


@dataclass(frozen=True)
class ProgramSchedule:
    """How a schedule maps one program (forward, backward or decode).

    knobs: its ``KnobSet``. apply: ``apply(sch, **knobs) -> sch``. head_dims: the head_dims it can
    serve (None: every one the program takes); preferred_head_dims: those where it is the default
    choice over the schedules after it (None: all it serves). unchecked_head_dims: those of head_dims
    whose kernels have not passed the GPU tests yet, served only where TVMFLASH_GPU_UNCHECKED=1 asks
    (``choice.serve_problem``; a GPU run of their tests sets it): a kernel checked on the CPU alone (its
    program against float64, nvcc's registers) is never a silent default. pass_config: the PassContext
    config of its builds (None: the schedule's). tasks: decode's ``DecodeTasks``."""

    knobs: KnobSet
    apply: Callable
    head_dims: tuple[int, ...] | None = None
    preferred_head_dims: tuple[int, ...] | None = None
    unchecked_head_dims: tuple[int, ...] = ()
    pass_config: Mapping[str, Any] | None = None
    tasks: DecodeTasks | None = None

    def serves(self, head_dim: int) -> bool:
        return self.head_dims is None or head_dim in self.head_dims

    def prefers(self, head_dim: int) -> bool:
        return self.serves(head_dim) and (self.preferred_head_dims is None or head_dim in self.preferred_head_dims)


@dataclass(frozen=True)
class Fp8Forward:
    """A schedule's FP8 (e4m3) forward (``program_forward`` with ``AttentionSpec.fp8``): its ``KnobSet``
    (the defaults at a head_dim, the space ``tvmflash tune --dtype float8_e4m3fn`` measures; its records'
    workload has the dtype float8_e4m3fn, ``choice.fp8_forward``), ``apply(sch, **knobs)``, and the
    head_dims it serves; unchecked_head_dims: those whose kernels have not passed the GPU tests yet, served
    only where TVMFLASH_GPU_UNCHECKED=1 asks (as ``ProgramSchedule.unchecked_head_dims``)."""

    knobs: KnobSet
    apply: Callable
    head_dims: tuple[int, ...]
    unchecked_head_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """One architecture's schedule: its name (in tuning records and cache keys), the target kind and
    compute capabilities it runs on (``compute_capabilities``: those alone; ``min_compute_capability``:
    that one or newer; None: any), its dtypes, and a ``ProgramSchedule`` for each program it maps.

    stride_alignment: bytes that the strides of q, k, v and out must be a multiple of (16: the CUDA
    schedules move 16-byte vectors). pass_config, async_proxy_operands, hoist_block_index_conditions:
    what it asks of ``lowering.build``. kernel_attrs(knobs): function attributes the program carries
    for these knobs (a trace cannot set one). min_kv_tiles(knobs): K/V tiles a Q block visits at the
    least. cpu_features: the LLVM CPU features an llvm target must have for it to serve (of its ``mcpu``
    and ``mattr``). prepare(): what a process does before it runs one of its modules (AMX: Linux's
    permission for the tile state), True if the host allows it. sources: the modules whose code shapes
    its builds (the cache key's). fallback: it serves what the schedules before it do not, slower (SIMT
    on a GPU, with no tensor cores): the torch API pads a head_dim to one that a schedule before it serves
    rather than run it (``choice.head_dim_to_run``). fp8_forward: its FP8 forward (``Fp8Forward``), or None.
    ordered_dq_accumulation: its backward's knob ``dq_atomic`` sums dq in a fixed order, not by atomics."""

    name: str
    target_kind: str
    dtypes: tuple[str, ...]
    forward: ProgramSchedule
    backward: ProgramSchedule | None = None
    decode: ProgramSchedule | None = None
    compute_capabilities: tuple[int, ...] | None = None
    min_compute_capability: int | None = None
    stride_alignment: int = 1
    pass_config: Mapping[str, Any] = field(default_factory=dict)
    async_proxy_operands: bool = False
    hoist_block_index_conditions: bool = False
    kernel_attrs: Callable[[dict], dict] = lambda knobs: {}
    min_kv_tiles: Callable[[dict], int] = lambda knobs: 1
    cpu_features: tuple[str, ...] = ()
    prepare: Callable[[], bool] = lambda: True
    sources: tuple = ()
    fallback: bool = False
    fp8_forward: Fp8Forward | None = None  # the FP8 forward, where the schedule maps it (sm90)
    # its backward's dq_atomic adds dq's shares in a fixed order (one task owns each row of dq: the CPU's),
    # so bitwise reproducible: deterministic=True keeps it
    ordered_dq_accumulation: bool = False

    def program(self, name: str) -> ProgramSchedule | None:
        """The ``ProgramSchedule`` of "forward", "backward" or "decode" (None: not mapped)."""
        if name not in PROGRAMS:
            raise ValueError(f"program: expected one of {PROGRAMS}, got {name!r}")
        return getattr(self, name)

    def build_options(self, program: str = "forward") -> dict:
        """What ``lowering.build`` takes for this program's modules (plain values: the tuner's builder
        workers receive them pickled)."""
        own = self.program(program).pass_config
        return {"pass_config": dict(self.pass_config if own is None else own),
                "async_proxy_operands": self.async_proxy_operands,
                "hoist_block_index_conditions": self.hoist_block_index_conditions}


PROGRAMS = ("forward", "backward", "decode")
