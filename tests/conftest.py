import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

# Every test run builds into its own cache, so stale modules never hide a broken build. pytest-xdist's
# workers share their run's (one id a run), so a module that two workers need is built once
# (``cache.build_lock``) instead of once by each.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("TVMFLASH_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"tvmflash-test-cache-{_RUN}")
                      if _RUN else tempfile.mkdtemp(prefix="tvmflash-test-cache-"))

HAS_GPU = torch.cuda.is_available()

# benchmarks/gpu_tests.py's record of where the time goes: with TVMFLASH_TEST_TIMES naming a file, each
# test appends a line as it ends (a run stopped at its time limit keeps what finished): its seconds, and
# how many modules it built in how many of them. A failing test's report goes to the file of that name
# with the suffix ".failures" as it fails: pytest prints its reports only at the end, which a run
# stopped at its limit never reaches.
_TIMES = os.environ.get("TVMFLASH_TEST_TIMES")
if _TIMES:
    import logging

    class _Builds(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.seconds = []

        def emit(self, record):
            if getattr(record, "build_seconds", 0.0):
                self.seconds.append(record.build_seconds)

    _BUILDS = _Builds()
    _TEST_SECONDS = {}
    logging.getLogger("tvmflash").addHandler(_BUILDS)
    if logging.getLogger("tvmflash").getEffectiveLevel() > logging.INFO:
        logging.getLogger("tvmflash").setLevel(logging.INFO)

    def pytest_runtest_logreport(report):
        if getattr(report, "node", None) is not None:
            return  # on pytest-xdist's controller, a worker's report (``node``: the worker); it wrote it down
        if report.when == "setup":
            _BUILDS.seconds.clear()
        _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            with open(os.path.splitext(_TIMES)[0] + ".failures", "a") as out:
                out.write(f"{'_' * 30} {report.nodeid} ({report.when})\n{report.longreprtext}\n"
                          + "".join(f"{'-' * 10} {name}\n{text}\n" for name, text in report.sections)[-20000:])
        if report.when == "teardown":
            with open(_TIMES, "a") as out:
                out.write(f"{_TEST_SECONDS.pop(report.nodeid):8.1f} s {len(_BUILDS.seconds):3d} builds "
                          f"{sum(_BUILDS.seconds):7.1f} s  {report.nodeid}\n")
# CUDA errors after which the process's CUDA context is unusable: every later CUDA call of the process fails
# with them. Under pytest-xdist (benchmarks/gpu_tests.py) a worker that met one ends after that test, and a fresh
# worker runs the tests it had queued, instead of each failing with the first test's error.
STICKY_CUDA_ERRORS = ("misaligned address", "an illegal memory access", "illegal instruction",
                      "unspecified launch failure", "device-side assert triggered")
# The same errors as TVM reports them: its launch of a kernel by their driver names ("CUDALaunch Error:
# CUDA_ERROR_MISALIGNED_ADDRESS"), its runtime calls as "CUDA Runtime Error: misaligned address". The first call
# to see an earlier kernel's fault may be TVM's, not torch's.
STICKY_CUDA_DRIVER_ERRORS = ("CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_ILLEGAL_ADDRESS",
                             "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ASSERT")
_STICKY = []


def is_sticky_cuda_error(text: str) -> bool:
    return ((("CUDA error" in text or "CUDA Runtime Error" in text)
             and any(error in text for error in STICKY_CUDA_ERRORS))
            or any(error in text for error in STICKY_CUDA_DRIVER_ERRORS))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and HAS_GPU and is_sticky_cuda_error(report.longreprtext):
        _STICKY.append(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _STICKY and os.environ.get("PYTEST_XDIST_WORKER"):  # its reports are out: the controller replaces it
        sys.stdout.flush()
        os._exit(3)


# The forward tests' edge shapes, (seqlen_q, seqlen_k, heads_q, heads_kv): tails on both sides, Lq != Lk
# both ways, and three head layouts (MHA 2/2, GQA 4/2, MQA 4/1): each layout is one build per kernel.
SHAPES = [
    (1, 1, 2, 2),
    (17, 17, 4, 2),
    (127, 127, 2, 2),
    (128, 128, 4, 1),
    (129, 129, 2, 2),
    (1000, 1000, 2, 2),
    (1, 129, 4, 1),
    (17, 1000, 2, 2),
    (129, 17, 4, 2),
    (1000, 128, 4, 1),
    (320, 191, 2, 2),  # whole K/V tiles and a ragged last one; causal diagonal crosses tiles
    (64, 257, 4, 2),  # seqlen_k one past a multiple of every block_n
]
# SHAPES in one head layout, GQA 4/2 (its head mapping covers MHA's and MQA's): one build per kernel
# instead of three, for the GPU tests of a schedule's structures beside its defaults, whose head mapping
# is the defaults' (tested in the three layouts).
ONE_LAYOUT_SHAPES = [(seqlen_q, seqlen_k, 4, 2) for seqlen_q, seqlen_k, _, _ in SHAPES]


# The GPU tests' seconds in a run on a fresh GPU machine (benchmarks/gpu_tests.py --save-times writes it, in
# the .times format). The GPU suite starts the longest first (tests it does not list, new ones, before
# all): pytest-xdist's workers take the tests in this order, and a long test taken last would end the
# run on its own, the other workers idle.
GPU_TEST_TIMES = os.path.join(os.path.dirname(__file__), "gpu_test_times.txt")


def recorded_seconds(path: str) -> dict:
    """test id -> seconds, from a .times file (none: {})."""
    if not os.path.exists(path):
        return {}
    with open(path) as lines:
        return {line.split(None, 6)[6].rstrip("\n"): float(line.split(None, 1)[0]) for line in lines if line.strip()}


def longest_first(items: list, seconds: dict) -> None:
    """The GPU tests in ``items`` sorted by their recorded ``seconds``, the longest first and unlisted ones
    before all, ahead of the others (in their order)."""
    items.sort(key=lambda item: -seconds.get(item.nodeid, math.inf) if in_gpu_suite(item) else 0.0)


def in_gpu_suite(item) -> bool:
    """Might the GPU suite run this test (``benchmarks/gpu_tests.py``: ``-m gpu``; with ``--nvcc`` also the nvcc
    tests, which are ordered by their recorded seconds too)?"""
    return "gpu" in item.keywords or "nvcc" in item.keywords


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        longest_first(items, recorded_seconds(GPU_TEST_TIMES))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch")
    # nvcc's compile of a whole kernel takes the CPU suite's 2 cores 5-20 s a kernel; run where asked
    skip_nvcc = pytest.mark.skip(reason="nvcc's whole compile of a kernel: TVMFLASH_NVCC_TESTS=1 runs it here "
                                        "(benchmarks/gpu_tests.py --nvcc on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        elif "nvcc" in item.keywords and os.environ.get("TVMFLASH_NVCC_TESTS") != "1":  # 1: run them here too
            item.add_marker(skip_nvcc)


def devices():
    """The devices a numerics test runs on: the CPU always, CUDA as a `gpu`-marked case."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, scale=1.0, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen) * scale
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen) * scale
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    return (t.to(dtype=dtype, device=device) for t in (q, k, v))


def captured_in_a_cuda_graph(step):
    """(graph, step's outputs): ``step`` run once on a side stream (builds and warms up outside the
    capture), then captured in a CUDA graph; replaying it writes the outputs again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, outputs


def poisoned_out(q):
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full_like(q, float("nan"))


def kv_loop_body(src: str) -> str:
    """The body of the K/V-tile loop (``for (int kb = 0; ...) { ... }``) in generated CUDA, by
    brace matching."""
    start = src.index("{", src.index("for (int kb"))
    depth = 0
    for end in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[end], 0)
        if depth == 0:
            return src[start + 1:end]
    raise AssertionError("unbalanced K/V loop")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache dir (modules and tuning records) and no in-memory kernels."""
    from tvmflash import kernels

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    kernels.forget_kernels()
    yield tmp_path
    kernels.forget_kernels()


@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    """``cache_dir`` for tests of tuning: a fresh cache dir (tuning records, work dirs; no in-memory
    kernels) whose modules/ is the run's. Its modules are keyed by all they are built from, so sharing
    them hides no build; a tuning run's kernels (the defaults, the candidates it times again through
    compile) are then built once in the run, not once a test (1-2 s each, several a test)."""
    from tvmflash import cache, kernels

    shared = cache.module_dir()
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "modules").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    kernels.forget_kernels()
    yield tmp_path
    kernels.forget_kernels()


def tune_on_one_core(patch) -> None:
    """Tuning's build processes (MetaSchedule's builder workers, a measured pass's spawned builds) one at a
    time, as under ``taskset -c 0`` (``tune.builder.usable_cores``), by ``patch`` (a pytest MonkeyPatch): each
    process imports TVM and tvmflash first (some 3 s of CPU), and a test's two or three candidates need no
    second one. The tests of building on every core (tune/test_builder.py's, test_measured's backward run)
    keep them."""
    from tvmflash.tune import measured, run, task

    for module in (run, task, measured):
        patch.setattr(module, "usable_cores", lambda: 1)


@pytest.fixture
def one_core(monkeypatch):
    """``tune_on_one_core`` for a test."""
    tune_on_one_core(monkeypatch)


def cli(*args, env_dir):
    """``tvmflash ARGS`` in a process of its own, with ``env_dir`` its cache dir."""
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(env_dir))
    return subprocess.run([sys.executable, "-m", "tvmflash.cli", *args], capture_output=True, text=True, env=env)


def ptxas_report(src: str, arch: str) -> dict:
    """ptxas -v's lines for each kernel of a CUDA source (compiled with nvcc here)."""
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cu"
        path.write_text(src)
        done = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-o", str(path.with_suffix(".cubin")), str(path),
                               "-Xptxas", "-v"], capture_output=True, text=True, check=True)
    report, kernel = {}, None
    for line in done.stderr.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
            report[kernel] = ""
        elif kernel:
            report[kernel] += line + "\n"
    return report
