"""Imports point down: a module imports only modules of its own layer or below, and no cycle exists.

The layer order, bottom first (docs/layout.md states the same):

 0. ``yolofast.kernels._constants``, ``yolofast.kernels._bbox_loss_grad``: numbers and the autograd formula
    shared by the references and every kernel (torch at most)
 1. ``yolofast.kernels``: the Triton kernels (kernels/ in the checkout), leaves: they import only each other,
    by relative imports, never ``yolofast.*``
 2. ``yolofast.boxes``, ``yolofast.cfg``: leaves of the package
 3. ``yolofast.ops``, itself in order: ``reference`` (the spec) < ``_schemas`` (op schemas, fakes, autograd)
    < ``_toolchain`` (compiler, flags, CUDA toolkit) < ``_build_cache`` (cache key, folder, lock, the
    locked build) < ``_compile_ext`` (the cpp_extension calls) < ``_build`` (find the sources, build and
    load the extensions) < ``_library`` (the compiled callables) < ``_composed``
    (forms composed of torch ops) < ``_backend`` (which implementation runs) < the public wrappers
    (``tal_assign``, ``bbox_loss``, ``head_decode``, ``ema_update``) < the package ``yolofast.ops``
 4. ``yolofast.data``, ``yolofast.nn``, ``yolofast.loss`` (the model's ``loss()`` builds its criterion),
    ``yolofast.optim`` (MuSGD: the optimizers over ops), ``yolofast.predict.results`` (Results/Boxes, a leaf)
 5. ``yolofast.io``, ``yolofast.export``
 6. ``yolofast.val``     7. ``yolofast.predict``
 8. ``yolofast.doctor``: the checks over a Session the engine builds (engine/doctor_setup.py)
 9. ``yolofast.engine``
10. ``yolofast.model``, ``yolofast.bench``     11. ``yolofast`` (the package), ``yolofast.cli``,
    ``yolofast.__main__``

Every ``import`` counts, at module level or inside a function (a lazy import still ties the two modules
together). ``from package import submodule`` is an arrow to the submodule; reading ``__version__`` off
the package is not an arrow (it is a constant of ``yolofast/__init__.py``, which imports nothing at the top).
``KNOWN_BAD`` lists the arrows that point up or close a cycle today, outside the ops and kernels: each is a
lazy import (inside a function) that a restructuring of its package is to remove; nothing may be added to it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [  # module-name prefixes, bottom first; a module takes the layer of its longest matching prefix
    ("yolofast.kernels._constants", "yolofast.kernels._bbox_loss_grad"),
    ("yolofast.kernels",),
    ("yolofast.boxes", "yolofast.cfg"),
    ("yolofast.ops.reference",),
    ("yolofast.ops._schemas",),
    ("yolofast.ops._toolchain",),
    ("yolofast.ops._build_cache",),
    ("yolofast.ops._compile_ext",),
    ("yolofast.ops._build",),
    ("yolofast.ops._library",),
    ("yolofast.ops._composed",),
    ("yolofast.ops._backend",),
    ("yolofast.ops.tal_assign", "yolofast.ops.bbox_loss", "yolofast.ops.head_decode",
     "yolofast.ops.ema_update"),
    ("yolofast.ops",),
    ("yolofast.data", "yolofast.nn", "yolofast.loss", "yolofast.optim", "yolofast.predict.results"),
    ("yolofast.io", "yolofast.export"),
    ("yolofast.val",),
    ("yolofast.predict",),
    ("yolofast.doctor",),
    ("yolofast.engine",),
    ("yolofast.model", "yolofast.bench"),
    ("yolofast", "yolofast.cli", "yolofast.__main__"),
]

KNOWN_BAD: set[tuple[str, str]] = set()  # (importer, imported) lazy imports that point up: none left


def _modules() -> dict[str, Path]:
    mods = {}
    for base, pkg in ((ROOT / "yolofast", "yolofast"), (ROOT / "kernels", "yolofast.kernels")):
        for path in base.rglob("*.py"):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path) -> dict[str, int]:
    """{imported module of the package: line} for every import statement of module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for a in node.names:
                if module == "yolofast" and a.name == "__version__":
                    continue
                sub = f"{module}.{a.name}"
                targets.append(sub if sub in MODULES else module)
        for target in targets:
            owner = _owner(target) if target.startswith("yolofast") else None
            if owner and owner != name:
                found.setdefault(owner, node.lineno)
    return found


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS in tests/test_layers.py"
    return rank


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_arrow_points_down():
    upward = []
    for name, targets in sorted(GRAPH.items()):
        for target, line in sorted(targets.items()):
            if _layer(target) > _layer(name) and (name, target) not in KNOWN_BAD:
                upward.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} (layer "
                              f"{_layer(target)} above its own {_layer(name)})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_cycle():
    graph = {n: {t for t in ts if (n, t) not in KNOWN_BAD} for n, ts in GRAPH.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_kernels_are_leaves():
    """kernels/ imports nothing of yolofast but itself, and itself by relative imports (so the folder works
    as yolofast.kernels in a wheel and in a checkout alike)."""
    bad = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            bad += [f"{where} imports {n}" for n in names if n.startswith("yolofast")]
    assert not bad, "kernels/ must import only itself, relatively:\n" + "\n".join(bad)


def test_csrc_includes_stay_in_csrc():
    """csrc/ includes its own headers (by a path from the including file's folder or csrc/common) or
    torch's, CUDA's and the system's: nothing of the Python package."""
    csrc = ROOT / "csrc"
    bad = []
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith('#include "'):
                inc = line.split('"')[1]
                if not any((d / inc).is_file() for d in (path.parent, csrc / "common", csrc)):
                    bad.append(f"{path.relative_to(ROOT)}:{i} includes {inc}, not a file of csrc/")
    assert not bad, "\n".join(bad)


def test_no_test_module_imports_another():
    """Shared inputs and helpers live in helper modules (tests/ops/op_inputs.py, ...), never in a test_*.py
    that another test module imports (which would run its tests' module code twice and tie the two)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[-1].startswith("test_")]
    assert not bad, "test modules importing test modules:\n" + "\n".join(bad)
