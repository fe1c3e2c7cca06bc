"""The code's structure: every module is on one floor (``FLOORS``), imports run one way down the floors
with no exemption and no cycle, no module reads another's private names, and nothing assigns to TVM's modules
or registries (tvmflash extends TVM through its extension points only: a pipeline of its own, its own
intrinsics and calls). Read from the source with ``ast``; nothing is imported."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*ROOT.glob("tvmflash/**/*.py"), *ROOT.glob("schedules/**/*.py")])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("tvmflash", "schedules", *parts[1:]) if parts[0] == "schedules" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether ``name`` (dotted) is a tvmflash module or package."""
    parts = name.split(".")
    base, tail = (ROOT / "schedules", parts[2:]) if parts[1:2] == ["schedules"] else (ROOT / "tvmflash", parts[1:])
    path = base.joinpath(*tail)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path):
    """(tvmflash module, the names taken from it) for each import of a tvmflash module in ``path``; a
    submodule taken by name (``from tvmflash import program``) counts as that module."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names if alias.name.startswith("tvmflash"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("tvmflash"):
                continue
            names = []
            for alias in node.names:
                if is_module(f"{base}.{alias.name}"):
                    yield f"{base}.{alias.name}", []
                else:
                    names.append(alias.name)
            if names:
                yield base, names


# The floors, top to bottom: a module may import from its own floor and the floors below it, never
# from one above. Every module of tvmflash is on one (``test_every_module_is_on_a_floor``).
FLOORS = (
    ("integrations: tvmflash in other libraries", ("tvmflash.integrations",)),
    ("the API: torch functions and ops, the command line", ("tvmflash", "tvmflash.ops", "tvmflash.dropout", "tvmflash.flash_attn",
                                                            "tvmflash.flash_attn_checks",
                                                            "tvmflash.flex", "tvmflash.flex_block_mask", "tvmflash.flex_trace",
                                                            "tvmflash.flex_gradient", "tvmflash.flex_patterns", "tvmflash.cli",
                                                            "tvmflash.distributed")),
    ("tuning", ("tvmflash.tune",)),
    ("measuring", ("tvmflash.bench", "tvmflash.plot", "tvmflash.fp8_reference")),
    ("kernels: compile, build, cache, call", ("tvmflash.kernels",)),
    ("the choice of schedule and knobs", ("tvmflash.choice",)),
    ("tuning records", ("tvmflash.database",)),
    ("schedules", ("tvmflash.schedules",)),
    ("the programs", ("tvmflash.program", "tvmflash.program_forward", "tvmflash.program_backward",
                      "tvmflash.program_backward_tiles", "tvmflash.program_decode", "tvmflash.program_dropout",
                      "tvmflash.program_e4m3", "tvmflash.program_flex", "tvmflash.program_flex_gradient",
                      "tvmflash.program_block_sparse", "tvmflash.tvmscript")),
    ("the lowering", ("tvmflash.lowering",)),
    ("targets, the disk cache, the version", ("tvmflash.target", "tvmflash.cache", "tvmflash.version")),
)


def floor_of(module: str) -> int:
    """The index in ``FLOORS`` of the floor that holds ``module`` (its longest matching prefix)."""
    best = max(((len(prefix), index) for index, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is on no floor of tests/test_layering.py's FLOORS"
    return best[1]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_on_a_floor(path):
    floor_of(module_name(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    """No module imports from a floor above its own, at module level or inside a function."""
    here = module_name(path)
    for module, _ in imports(path):
        assert floor_of(module) >= floor_of(here), (
            f"{here} ({FLOORS[floor_of(here)][0]}) imports {module}, a floor above ({FLOORS[floor_of(module)][0]})")


def test_no_import_cycle():
    """Within a floor too, imports run one way: the graph of tvmflash's imports (a package's import of its
    own submodules left out, as a package's ``__init__`` naming its parts is no cycle) has no cycle."""
    graph = {module_name(path): {m for m, _ in imports(path)} for path in SOURCES}
    for here, targets in graph.items():
        targets.discard(here)
        graph[here] = {t for t in targets if not t.startswith(here + ".")}
    state: dict = {}

    def visit(node, trail):
        state[node] = "open"
        for after in sorted(graph.get(node, ())):
            if state.get(after) == "open":
                cycle = trail[trail.index(after):] + [after] if after in trail else [node, after]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if after not in state:
                visit(after, trail + [after])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reads_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    aliases = {}  # local name -> tvmflash module it stands for
    for module, names in imports(path):
        for name in names:
            assert not (name.startswith("_") and not name.startswith("__")), (
                f"{module_name(path)} imports the private {module}.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tvmflash")):
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names if alias.name.startswith("tvmflash")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            assert not (node.attr.startswith("_") and not node.attr.startswith("__")), (
                f"{module_name(path)}:{node.lineno} reads the private {node.value.id}.{node.attr}")


def _rooted_at(node, names) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_assigns_to_tvm(path):
    tree = ast.parse(path.read_text())
    tvm_names = {"tvm", "tvm_ffi"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tvm_names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ("tvm", "tvm_ffi")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("tvm", "tvm_ffi"):
            tvm_names |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            assert not (isinstance(target, (ast.Attribute, ast.Subscript)) and _rooted_at(target, tvm_names)), (
                f"{module_name(path)}:{node.lineno} assigns into TVM ({ast.unparse(target)})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            assert not _rooted_at(node.args[0], tvm_names), f"{module_name(path)}:{node.lineno} sets an attribute of TVM"
    assert "CODEGEN_REGISTRY" not in path.read_text(), f"{module_name(path)} reaches into TVM's codegen registry"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_tvms_intrinsic_library(path):
    """The schedules register their own tensor-core intrinsics: importing TVM's library
    (``tvm.s_tir.tensor_intrin``, which parses some 500 TVMScript functions) costs a process's first
    build about a minute."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(n.startswith("tvm.s_tir.tensor_intrin") for n in names), (
            f"{module_name(path)}:{node.lineno} imports TVM's intrinsic library")


def test_every_package_is_installed():
    """pyproject.toml lists the packages to install one by one: a package of the tree that it leaves out
    (a new folder of tvmflash/ or schedules/) would be missing from a non-editable install."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(path) for path in SOURCES if path.name == "__init__.py"}
    assert packages <= listed, f"pyproject.toml's packages leave out {sorted(packages - listed)}"
