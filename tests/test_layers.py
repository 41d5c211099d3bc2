"""imgtrain's import layers, read from the source (no import is run): a module imports its own
layer and those below, never one above, and no module imports another that imports it back,
directly or round a loop: neither between top-level modules and packages nor between the modules
inside one package. Imports inside functions count (deferred, they are still dependencies), and
so do those under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "imgtrain"

# Lowest first. Each entry: the units (top-level modules and packages of imgtrain) of one layer;
# "__init__" is imgtrain/__init__.py itself. A new unit goes in the lowest layer at or above
# every unit it imports (the test says which unit is missing).
LAYERS = [
    ["errors", "console", "ops"],  # utilities: ops/ (files, processes, an object store's files) imports only errors
    ["settings", "config", "checkpoint_policy"],  # how options are declared; every setting; checkpoints' names and ranks
    ["data"],  # sources, the prepared data set, the streamed epoch, batch augmentation
    ["models"],  # model families by name, held to the data set's bounds
    ["storage", "configfile"],  # the run store (a run's folder, lock, files, checkpoints, bucket mirror); --config files
    ["cluster", "finetune", "kuberay"],  # starting or joining Ray; --init-from's weights; KubeRay manifests
    ["training", "inference"],
    ["sweep"],  # a trial is a training run
    ["commands"],  # clean, doctor: above the run store and the cluster
    ["__init__"],  # the public API: imgtrain.train, imgtrain.Predictor, ...
    ["cli"],
]


def unit_of(module: str) -> str:
    """``imgtrain.data.format`` -> ``data``; ``imgtrain`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, package: Path = PACKAGE) -> bool:
    path = package.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: Path, package_root: Path = PACKAGE):
    """(module, line) of every import in the file, wherever it stands."""
    module = module_of(path, package_root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from imgtrain.storage import runs` imports the module imgtrain.storage.runs
                yield (f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}", package_root) else base), node.lineno
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno  # importlib.import_module("imgtrain.x"): a registry's lazy import


@functools.cache
def dependencies() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where: ``src/imgtrain/x.py:LINE imports imgtrain.y``."""
    edges = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(module_of(path))
        for name, line in imported(path):
            if (name == "imgtrain" or name.startswith("imgtrain.")) and unit_of(name) != source:
                edges[source, unit_of(name)].append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return {edge: list(dict.fromkeys(places)) for edge, places in edges.items()}  # `import a, b`: one line, once


def units() -> set[str]:
    found = {unit_of(module_of(path)) for path in PACKAGE.rglob("*.py")}
    return found | {unit for unit, _ in dependencies()}


def test_every_unit_has_one_layer():
    declared = [unit for layer in LAYERS for unit in layer]
    assert len(declared) == len(set(declared)), f"declared twice: {sorted({u for u in declared if declared.count(u) > 1})}"
    missing, stale = units() - set(declared), set(declared) - units()
    assert not missing, f"add to LAYERS in {Path(__file__).name}, in the lowest layer at or above all they import: {sorted(missing)}"
    assert not stale, f"LAYERS names units that are not in src/imgtrain: {sorted(stale)}"


def test_no_import_goes_up_a_layer():
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = [f"{where} ({source}, layer {level[source]} -> {target}, layer {level[target]})"
              for (source, target), places in sorted(dependencies().items())
              if level.get(target, -1) > level.get(source, len(LAYERS))
              for where in places]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def reachable(after: dict[str, set[str]], start: str) -> set[str]:
    """Every node ``start`` leads to through the edges ``after`` (node -> the nodes it imports)."""
    seen, todo = set(), [start]
    while todo:
        for nxt in after[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycle_between_top_level_modules_and_packages():
    after = defaultdict(set)
    for source, target in dependencies():
        after[source].add(target)

    reach = {unit: reachable(after, unit) for unit in units()}
    cycles = [f"{where} ({source} -> {target}, and {target} leads back to {source})"
              for (source, target), places in sorted(dependencies().items())
              if source in reach[target]
              for where in places]
    assert not cycles, "import cycles between top-level modules/packages:\n" + "\n".join(cycles)


def module_loops(package: Path) -> list[str]:
    """The import loops between the modules of the package at ``package`` (a package's
    ``__init__`` is the module of its name), one entry per loop: its modules, then every import
    that joins two of them, as ``path:LINE imports module``. A loop is a set of modules each of
    which reaches all the others through imports; cutting any one listed import may not be enough,
    but each one listed is part of the loop."""
    top = package.name
    edges = defaultdict(list)  # (importer, imported) -> where
    for path in sorted(package.rglob("*.py")):
        source = module_of(path, package)
        for name, line in imported(path, package):
            if (name == top or name.startswith(top + ".")) and name != source:
                edges[source, name].append(f"{path.relative_to(package.parent)}:{line} imports {name}")
    after = defaultdict(set)
    for source, target in edges:
        after[source].add(target)

    reach = {module: reachable(after, module) for module in list(after)}
    loops = []
    for module in sorted(reach):
        if module not in reach[module] or any(module in loop for loop, _ in loops):
            continue  # not on a loop, or on one already told
        loop = sorted({module} | {other for other in reach[module] if module in reach.get(other, ())})
        joins = [where for (source, target), places in sorted(edges.items())
                 if source in loop and target in loop for where in dict.fromkeys(places)]
        loops.append((loop, joins))
    return [" <-> ".join(loop) + ":\n    " + "\n    ".join(joins) for loop, joins in loops]


def test_no_import_loop_between_modules():
    loops = module_loops(PACKAGE)
    assert not loops, (f"{len(loops)} import loop(s) between modules (move the names they share to the module "
                       "where they belong, or to a small module of their own):\n" + "\n".join(loops))


def test_the_loop_check_finds_a_planted_loop(tmp_path):
    """A loop inside one package, through a deferred import and one under TYPE_CHECKING, and a
    longer one through a relative import; a package ``__init__`` importing its members is no loop."""
    package = tmp_path / "fake"
    (package / "inner").mkdir(parents=True)
    files = {
        "__init__.py": "from fake import a\n",
        "a.py": "import fake.b\n",
        "b.py": "def late():\n    from fake.a import name\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.b import x\n",
        "inner/__init__.py": "import importlib\nimportlib.import_module('fake.inner.p')\n",
        "inner/p.py": "from .q import y\n",
        "inner/q.py": "from fake.inner import r\n",
        "inner/r.py": "from fake.inner.p import z\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    assert module_loops(package) == [
        "fake.a <-> fake.b:\n    fake/a.py:1 imports fake.b\n    fake/b.py:2 imports fake.a",
        "fake.inner.p <-> fake.inner.q <-> fake.inner.r:\n    fake/inner/p.py:1 imports fake.inner.q\n"
        "    fake/inner/q.py:1 imports fake.inner.r\n    fake/inner/r.py:1 imports fake.inner.p",
    ]
    (package / "b.py").write_text("")
    (package / "inner" / "r.py").write_text("")
    assert module_loops(package) == []
