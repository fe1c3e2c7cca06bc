"""The code's structure: imports run one way (the torch API and the CLI -> kernel and tuner -> program and
schedules -> lowering), no module reads another's private names, and nothing assigns to TVM's modules
or registries (tvmflash extends TVM through its extension points only: a pipeline of its own, its own
intrinsics and calls). Read from the source with ``ast``; nothing is imported."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*ROOT.glob("tvmflash/**/*.py"), *ROOT.glob("schedules/*.py")])


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


# What each layer may import from tvmflash (a prefix match), besides itself.
LAYERS = {
    "tvmflash.lowering": ("tvmflash.lowering",),
    "tvmflash.program": ("tvmflash.lowering.annotations",),
    "tvmflash.program_backward": ("tvmflash.program",),
    "tvmflash.program_decode": ("tvmflash.program",),
    "tvmflash.schedules": ("tvmflash.schedules", "tvmflash.lowering", "tvmflash.program", "tvmflash.program_backward",
                           "tvmflash.target"),
    "tvmflash.target": (),
    "tvmflash.cache": (),
}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    here = module_name(path)
    layer = next((name for name in LAYERS if here == name or here.startswith(name + ".")), None)
    if layer is None:
        return  # the top: kernel, tune, database, bench, ops, cli may import what is below them
    for module, _ in imports(path):
        assert any(module == ok or module.startswith(ok + ".") for ok in LAYERS[layer]), (
            f"{here} imports {module}: {layer} may import only {LAYERS[layer] or 'nothing of tvmflash'}")


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
