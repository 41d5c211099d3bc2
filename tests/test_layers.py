"""imgtrain's import layers, read from the source (no import is run): a module imports its own
layer and those below, never one above, and no top-level module or package imports another
that imports it back, directly or round a loop. Imports inside functions count (deferred, they
are still dependencies), and so do those under ``TYPE_CHECKING``."""

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
    ["errors", "console", "ops"],  # utilities: ops/ imports nothing of imgtrain but errors
    ["config", "checkpoint_policy"],  # every setting; how checkpoints are named, ranked and kept
    ["data"],  # sources, the prepared data set, the streamed epoch, batch augmentation
    ["models"],  # model families by name, held to the data set's bounds
    ["checkpoint", "storage", "runs", "configfile"],  # the run store: checkpoints, bucket, run files
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


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: Path):
    """(imgtrain module, line) of every import in the file, wherever it stands."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from imgtrain import runs` imports the module imgtrain.runs
                yield (f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base), node.lineno
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


def test_no_import_cycle_between_top_level_modules_and_packages():
    after = defaultdict(set)
    for source, target in dependencies():
        after[source].add(target)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in after[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {unit: reachable(unit) for unit in units()}
    cycles = [f"{where} ({source} -> {target}, and {target} leads back to {source})"
              for (source, target), places in sorted(dependencies().items())
              if source in reach[target]
              for where in places]
    assert not cycles, "import cycles between top-level modules/packages:\n" + "\n".join(cycles)
