"""``tvmflash bench``: tvmflash against PyTorch SDPA on the same inputs, device and run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tvmflash.kernels import compile
from tvmflash.kernels.checks import TORCH_DTYPES
from tvmflash.version import __version__

# The grid: batch * seqlen = 16k tokens, heads * head_dim = 2048.
GPU_GRID = {"tokens": 16384, "hidden": 2048, "seqlens": [512, 1024, 2048, 4096, 8192, 16384]}
# Small enough for a laptop-class CPU to finish in a minute or two.
CPU_GRID = {"tokens": 2048, "hidden": 512, "seqlens": [256, 512, 1024, 2048]}


@dataclass
class Result:
    config: str
    times_ms: dict  # backend -> median milliseconds (None where the backend refused the input)
    flops: float
    error: float  # max |tvmflash - float32 reference| on a slice of the output
    tolerance: float  # 2x torch's same-dtype error on that slice + eps (flash-attn's rule)
    host_us: dict | None = None  # backend -> host microseconds a call (``host_us``), where measured
    shape: dict | None = None  # batch, seqlen, heads, head_dim, causal: what a plot's axes and panels are


@dataclass
class Ceilings:
    """What the device reaches outside attention, measured in the same run as the attention figures (the
    same clocks, the same timing method), so that those read as a share of what is possible."""
    matmul_tflops: float  # a square torch.matmul in the benchmark's dtype
    matmul_size: int  # its n: (n, n) @ (n, n)
    copy_gbps: float  # a tensor copy: bytes read plus bytes written, a second
    copy_bytes: int  # the tensor copied


# A square matmul large enough to run at the device's peak, and a copy far larger than its caches
# (an H100's or H200's L2: 50/60 MiB; a CPU's last level: up to a few hundred MiB).
CEILING_SIZES = {"cuda": (8192, 1 << 30), "cpu": (1024, 256 << 20)}

# Bumped when a field of the report changes meaning, so that an old file is refused rather than misdrawn.
REPORT_FORMAT = "tvmflash bench report 1"


@dataclass
class Report:
    """What one ``run`` measured and where: printed as a table, written by ``tvmflash bench --json``,
    drawn by ``tvmflash.plot.plot``."""
    device: str  # the GPU's name, or the CPU's model and threads
    dtype: str
    date: str
    version: str  # tvmflash's, and the commit where it runs from a git checkout
    ceilings: Ceilings
    results: list  # of Result, in the order measured

    def to_json(self) -> dict:
        return {"format": REPORT_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data) -> Report:
        """The report ``to_json`` wrote; ValueError, saying what is wrong, for anything else."""
        if not isinstance(data, dict) or data.get("format") != REPORT_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"expected a report of `tvmflash bench --json` ({REPORT_FORMAT!r}), got {found!r}")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            fields["ceilings"] = Ceilings(**fields["ceilings"])
            fields["results"] = [Result(**r) for r in fields["results"]]
            return cls(**fields)
        except (KeyError, TypeError) as err:  # a field missing or unknown: a damaged or hand-made file
            raise ValueError(f"a damaged bench report: {type(err).__name__}: {err}") from None


def save_report(report: Report, path) -> None:
    try:
        Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    except OSError as err:
        raise ValueError(f"{path}: cannot write the report: {err.strerror}") from None


def load_report(path) -> Report:
    """The report in ``path`` (``tvmflash bench --json``); ValueError, naming the file, where it is not one."""
    try:
        return Report.from_json(json.loads(Path(path).read_text()))
    except OSError as err:
        raise ValueError(f"{path}: cannot read it: {err.strerror}") from None
    except ValueError as err:  # json's JSONDecodeError is one
        raise ValueError(f"{path}: {err}") from None


def device_name(device) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses: what a figure was measured on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # Linux names the model here; platform.processor() often gives "x86_64"
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"CPU: {model}, {torch.get_num_threads()} threads"


def version() -> str:
    """tvmflash's version, and the commit (with -dirty for local changes) where it runs from a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        git = ["git", "-C", str(here)]
        top, commit = subprocess.run([*git, "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=10, check=True).stdout.split()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):  # no git, or an installed copy: the version alone
        return __version__
    if Path(top).resolve() != here.parent:  # installed inside some other repository: its commit is not ours
        return __version__
    return f"{__version__} ({commit}{'-dirty' if dirty else ''})"


def build_in_parallel(builds: list[tuple[str, dict]], processes: int, echo=print,
                      keep_going: bool = False) -> list[str | None]:
    """Build kernels into the module cache, ``processes`` at a time (a module takes tens of seconds
    to build, on one core): each build is (the name of a tvmflash function, its keyword arguments),
    e.g. ("compile_backward", {"head_dim": 128, ..., "heads_q": 16}), and optionally environment
    variables to set for it (e.g. {"TVMFLASH_BACKWARD": "sm90"}). The benchmark's own calls then load
    them from the cache. Spawned processes: CUDA, initialised here, forbids fork.

    Returns each build's error (None where it built). The first error is raised unless
    ``keep_going`` (the tuner's: a candidate that fails to build is a failed trial)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    errors = []
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for build, error in zip(builds, pool.map(_build, builds)):
            call = f"{build[0]}({', '.join(f'{k}={v}' for k, v in build[1].items())})"
            if error and not keep_going:
                raise RuntimeError(f"{call}: {error}")
            echo(f"failed to build {call}: {error}" if error else f"built {call}")
            errors.append(error)
    return errors


def _build(build: tuple) -> str | None:
    from tvmflash import kernels

    name, kwargs, env = (*build, {})[:3]
    try:
        with environment(env):
            getattr(kernels, name)(**kwargs)
    except Exception as err:  # noqa: BLE001 - reported as this build's error
        lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        return f"{type(err).__name__}: {lines[-1].strip()}"
    return None


@contextlib.contextmanager
def environment(variables: dict):
    """Set these environment variables (e.g. TVMFLASH_BACKWARD, which picks a schedule) within."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    """Forward FLOPs as flash-attn counts them: 2 GEMMs, halved when causal."""
    flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


# Under sustained load the GPU's clocks drop after some tens of milliseconds of back-to-back attention
# kernels, whatever the backend (BENCHMARKS.md, "Method"); a backend timed late in a long burst then
# loses to the one timed first. ``time_backends`` therefore keeps
# each burst short and pauses before it, and rotates the backends' order over rounds.
BURST_MS = 20.0
PAUSE_S = 0.3
ROUNDS = 3


def time_ms(fn, device, *, warmup=3, repeat=20, max_burst_ms=None):
    """Median milliseconds of ``fn()``: CUDA events on a GPU, the wall clock on the CPU.

    On a GPU the calls are queued back to back, each between two events, and synchronized once at the
    end (as ``triton.testing.do_bench``): a call's host work (argument checks, the launch) overlaps
    the previous call's kernel, as in a model's forward pass, so a sample is the GPU's time unless
    the host cannot keep up. Synchronizing after every sample would add each backend's host time
    to its kernel's (``host_us`` measures that time apart). ``max_burst_ms``: on a GPU, fewer samples
    (at least 5) where ``repeat`` of them would run longer than that, as timed on the warmup's last."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        if max_burst_ms:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            repeat = max(5, min(repeat, int(max_burst_ms / max(start.elapsed_time(end), 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def host_us(fn, *, calls=50):
    """Microseconds of host time a call of ``fn`` takes to queue its GPU work (CUDA only): the calls are
    made while the GPU is kept busy, so that none waits for a kernel."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time: the queue never drains meanwhile
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def sdpa_backends(device):
    """(name, context manager factory) for each SDPA backend worth timing on this device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type == "cuda":
        return [("sdpa-flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
                ("sdpa-cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))]
    return [("sdpa", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]))]


def time_backends(calls: dict, device, repeat: int) -> dict:
    """Each backend's best ``time_ms`` over ``ROUNDS`` rounds (one on the CPU). A round times every
    backend once, in an order rotated each round, each burst at most ``BURST_MS`` of GPU time after a
    pause of ``PAUSE_S``: so that every backend meets the GPU at the same clocks (see ``BURST_MS``)."""
    names = list(calls)
    best = dict.fromkeys(names, math.inf)
    for round_ in range(ROUNDS if device.type == "cuda" else 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            if device.type == "cuda":
                time.sleep(PAUSE_S)
            best[name] = min(best[name], time_ms(calls[name], device, repeat=repeat, max_burst_ms=BURST_MS))
    return best


def measure_ceilings(device, dtype: str, repeat: int) -> Ceilings:
    """A square matmul's TFLOP/s and a large copy's GB/s on ``device``, timed as the backends are
    (``time_backends``: the same rounds, bursts and pauses, so the same clocks)."""
    n, copy_bytes = CEILING_SIZES[device.type]
    gen = torch.Generator(device=device).manual_seed(0)
    # random operands, not zeros: a GPU's power, and so its clocks, depend on the bits that toggle
    a, b = (torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype], generator=gen) for _ in range(2))
    product = torch.empty_like(a)
    # a copy is bound by memory, not by the bits: a constant fill (0b01011010) is a second faster than random bytes
    source = torch.full((copy_bytes,), 0x5A, dtype=torch.uint8, device=device)
    copied = torch.empty_like(source)
    times = time_backends({"matmul": lambda: torch.matmul(a, b, out=product), "copy": lambda: copied.copy_(source)},
                          device, repeat)
    return Ceilings(matmul_tflops=2 * n**3 / times["matmul"] / 1e9, matmul_size=n,
                    copy_gbps=2 * copy_bytes / times["copy"] / 1e6, copy_bytes=copy_bytes)


def run_one(kernel, batch, seqlen, heads, head_dim, dtype, causal, device, repeat, measure_host=False,
            layout="bshd"):
    """Check and time one configuration. measure_host (CUDA): also each backend's ``host_us``, SDPA's
    inside its backend's context (entered once, as a model would). layout "bhsd": the inputs are
    (batch, heads, seqlen, head_dim) tensors, SDPA's layout, which SDPA reads as they are and
    tvmflash through transpose(1, 2) views ("tvmflash-bhsd", out such a view too); "tvmflash" runs on
    (b, s, h, d) copies of them, so that the two compare strided and contiguous inputs in one run."""
    torch_dtype = TORCH_DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(seqlen)
    shape = (batch, seqlen, heads, head_dim) if layout == "bshd" else (batch, heads, seqlen, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch_dtype, generator=gen) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (b, h, s, d) views, or (b, s, h, d) ones
    if layout == "bhsd":
        (q, k, v), (qt, kt, vt) = (t.contiguous() for t in (qt, kt, vt)), (q, k, v)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernel(q, k, v, out=out)
    error, tolerance = error_vs_float32(out, q, k, v, causal)
    calls = {"tvmflash": lambda: kernel(q, k, v, out=out)}
    if layout == "bhsd":  # tvmflash on views of SDPA's tensors: strided, not copied
        qs, ks, vs, outs = (t.transpose(1, 2) for t in (qt, kt, vt, torch.full_like(qt, float("nan"))))
        kernel(qs, ks, vs, out=outs)
        error = max(error, error_vs_float32(outs, q, k, v, causal)[0])
        calls["tvmflash-bhsd"] = lambda: kernel(qs, ks, vs, out=outs)

    def attend():  # SDPA, under whichever backend's context is current
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    for name, backend in sdpa_backends(device):
        def sdpa(backend=backend):
            with backend():
                return attend()
        try:
            sdpa()
            calls[name] = sdpa
        except RuntimeError:  # this backend does not take this input
            calls[name] = None
    times = time_backends({name: call for name, call in calls.items() if call}, device, repeat)
    times = {name: times.get(name) for name in calls}  # the backends' order, None where refused
    host = None
    if measure_host and device.type == "cuda":
        host = {"tvmflash": host_us(calls["tvmflash"])}
        for name, backend in sdpa_backends(device):
            if calls[name]:
                with backend():
                    host[name] = host_us(attend)
    config = f"{dtype} d{head_dim} {'causal' if causal else 'full'} b{batch} h{heads} s{seqlen}"
    shape = {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim, "causal": causal}
    return Result(config, times, attention_flops(batch, heads, seqlen, seqlen, head_dim, causal), error, tolerance,
                  host, shape)


def attention_in(dtype, q, k, v, causal):
    """Plain attention on (batch, seqlen, heads, head_dim) inputs with every product in ``dtype``: the
    scores and the output rounded to it, the softmax over the rounded scores in float32 and then rounded
    (flash-attn's ``attention_ref`` with ``upcast=False``), bottom-right causal. Differentiable. This is
    "PyTorch's same-dtype attention" of flash-attn's rule: not SDPA's math backend, which since torch 2.5
    computes half and bfloat16 in float32 (``allow_fp16_bf16_reduction_math_sdp``) and so sets a baseline
    far tighter than flash-attn's own tests do."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k.to(dtype)) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + lk - lq, -math.inf)
    softmax = torch.softmax(s.to(torch.promote_types(dtype, torch.float32)), -1)  # (float64 stays float64)
    return torch.einsum("bhqk,bkhd->bqhd", softmax.to(dtype), v.to(dtype))


def error_vs_float32(out, q, k, v, causal, heads=2, rows=1024):
    """Error of the first ``heads`` heads' last ``rows`` queries against float32 (``attention_in``), and
    what flash-attn's rule allows: 2x the error of the same attention in q's dtype, plus 1e-5."""
    # The last rows keep the bottom-right causal alignment of the whole problem.
    sl = (slice(0, 1), slice(-rows, None), slice(0, heads))
    q_, out_ = q[sl], out[sl]
    k_, v_ = k[:1, :, :heads], v[:1, :, :heads]
    ref = attention_in(torch.float32, q_, k_, v_, causal)
    ours = (out_.float() - ref).abs().max().item()
    theirs = (attention_in(q.dtype, q_, k_, v_, causal).float() - ref).abs().max().item()
    return ours, 2 * theirs + 1e-5


def gradient_errors_vs_float32(grads, q, k, v, dout, causal, heads=2) -> list[tuple[float, float]]:
    """(error, allowed) of each of dq, dk, dv on the first ``heads`` heads (query heads; as many key
    heads) against float32 (``attention_in``): flash-attn's rule allows 2x the error of the same attention
    in q's dtype, plus 1e-5. q, k, v, dout: (batch, seqlen, heads, head_dim), as many query as key heads."""
    sl = (slice(None), slice(None), slice(0, heads))

    def grads_in(dtype):
        leaves = [t[sl].detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention_in(dtype, *leaves, causal), leaves, dout[sl].to(dtype))

    ref, same = grads_in(torch.float32), grads_in(q.dtype)
    return [((got[sl].float() - r).abs().max().item(), 2 * (s.float() - r).abs().max().item() + 1e-5)
            for got, r, s in zip(grads, ref, same)]


def run(*, device=None, dtype="bfloat16", head_dims=(64, 128), causal=(False, True), seqlens=None,
        tokens=None, hidden=None, repeat=20, target=None, knobs=None, layout="bshd", echo=print) -> Report:
    """Measure the device's ceilings (``measure_ceilings``), then run the grid and print a table.
    Returns the report: the results, the ceilings and where they were measured. layout: see ``run_one``."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"device: expected cpu or cuda, got {device!r}")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} needs a CUDA GPU visible to torch, and none is")
    device = torch.device(device)
    grid = GPU_GRID if device.type == "cuda" else CPU_GRID
    seqlens = grid["seqlens"] if seqlens is None else seqlens
    tokens = grid["tokens"] if tokens is None else tokens
    hidden = grid["hidden"] if hidden is None else hidden
    for name, values in (("seqlens", seqlens), ("head_dims", head_dims), ("tokens", [tokens]), ("hidden", [hidden]),
                         ("repeat", [repeat])):
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1] or (
            [] if values else ["none"])
        if bad:
            raise ValueError(f"{name}: expected positive ints, got {bad if len(values) > 1 else bad[0]!r}")
    if hidden < max(head_dims):
        raise ValueError(f"hidden: heads * head_dim must hold at least one head of head_dim {max(head_dims)}, "
                         f"got {hidden}")
    target = target or ("cpu" if device.type == "cpu" else None)
    name, date = device_name(device), time.strftime("%Y-%m-%d")
    echo(f"tvmflash bench on {name}, {date}: batch*seqlen={tokens}, heads*head_dim={hidden}")
    ceilings = measure_ceilings(device, dtype, repeat)
    echo(_ceilings_line(ceilings, dtype))
    results, kernels = [], []
    header = None
    for head_dim in head_dims:
        heads = hidden // head_dim
        for is_causal in causal:
            kernel = compile(head_dim=head_dim, dtype=dtype, causal=is_causal, target=target, knobs=knobs)
            kernels.append(kernel)
            for seqlen in seqlens:
                batch = max(1, tokens // seqlen)
                result = run_one(kernel, batch, seqlen, heads, head_dim, dtype, is_causal, device, repeat,
                                 measure_host=not results, layout=layout)
                results.append(result)
                if header is None:
                    header = _header(result)
                    echo(header)
                    echo("-" * len(header))
                echo(_row(result))
    if layout == "bhsd" and results:
        ratios = [r.times_ms["tvmflash-bhsd"] / r.times_ms["tvmflash"] for r in results]
        echo(f"strided (b, h, s, d) views over contiguous (b, s, h, d) tensors, time ratio: {min(ratios):.3f}x to "
             f"{max(ratios):.3f}x (geometric mean {statistics.geometric_mean(ratios):.3f}x)")
    if results and results[0].host_us:
        echo(f"host time a call, the GPU kept busy ({results[0].config}): " +
             ", ".join(f"{name} {us:.0f} us" for name, us in results[0].host_us.items()))
    for kernel in kernels:  # what ran: schedule and knobs (tuned, defaults or given)
        info = kernel.info()
        source = info["knobs_source"].split(" (")[0]
        echo(f"kernel d{info['head_dim']} {'causal' if info['causal'] else 'full'}: {info['schedule']} schedule, "
             f"{'default' if source == 'defaults' else source} knobs {info['knobs']}")
    return Report(name, dtype, date, version(), ceilings, results)


def print_report(report: Report, echo=print) -> None:
    """The table ``run`` printed, from a saved report (``tvmflash bench --from-json``)."""
    echo(f"tvmflash bench on {report.device}, {report.date}, tvmflash {report.version} (from a saved report)")
    echo(_ceilings_line(report.ceilings, report.dtype))
    if report.results:
        header = _header(report.results[0])
        echo(header)
        echo("-" * len(header))
    for result in report.results:
        echo(_row(result))


def _ceilings_line(ceilings: Ceilings, dtype: str) -> str:
    n = ceilings.matmul_size
    return (f"ceilings in this run: {n}x{n} {dtype} matmul {ceilings.matmul_tflops:.2f} TFLOP/s, "
            f"copy of {ceilings.copy_bytes >> 20} MiB {ceilings.copy_gbps:.1f} GB/s (read + write)")


def _header(result):
    cols = [f"{'config':<36}"]
    for backend in result.times_ms:
        cols.append(f"{backend + ' ms':>14} {'TFLOP/s':>8}")
    cols += [f"{'vs ' + b:>16}" for b in result.times_ms if b != "tvmflash"]
    cols.append(f"{'max err':>9} {'ok':>3}")
    return " ".join(cols)


def _row(result):
    cols = [f"{result.config:<36}"]
    for ms in result.times_ms.values():
        cols.append(f"{ms:>14.3f} {result.flops / ms / 1e9:>8.2f}" if ms else f"{'n/a':>14} {'':>8}")
    ours = result.times_ms["tvmflash"]
    for backend, ms in result.times_ms.items():
        if backend != "tvmflash":
            cols.append(f"{ms / ours:>15.2f}x" if ms else f"{'n/a':>16}")
    cols.append(f"{result.error:>9.2e} {'yes' if result.error <= result.tolerance else 'NO':>3}")
    return " ".join(cols)
