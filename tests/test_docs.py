"""The docs against the code: the code map names every module, every command the docs show
still parses (its flags are in its --help, a benchmark's in its script), every `make` target
exists, every link resolves, the lists of the Python API and of data sources are complete, and
imgtrain's docstrings name only modules that exist."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import cli_here

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "imgtrain"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
DOC_PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# The logs (docs/*-history.md) keep commands as they were run: their links must resolve, their
# commands need not parse today.
CURRENT_PAGES = [page for page in DOC_PAGES if not page.name.endswith("-history.md")]

# A code-map entry: a bullet that starts with the module's path, "- `imgtrain/data/format.py`: ..."
MAP_ENTRY = re.compile(r"^\s*[-*] `(imgtrain/[\w/]+\.py)`", re.MULTILINE)
# A Python file named anywhere in the page (the map, "where to add", the prose): `src/imgtrain/x.py`,
# `imgtrain/x.py`, `training/loop.py` (inside the package), `tests/test_docs.py`, or a bare `batcher.py`
ANY_PYTHON_FILE = re.compile(r"`([\w/]+\.py)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SEPARATORS = {"|", ";", "&&", "||"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FLAG = re.compile(r"^\[?(--[a-z0-9][a-z0-9-]*)")
HELP_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def package_modules() -> set[str]:
    """Every module under src/imgtrain as `imgtrain/...py`; a package's __init__.py is named by
    its folder's heading, not as a module of its own."""
    return {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def test_code_map_names_every_module_and_only_modules_that_exist():
    listed = set(MAP_ENTRY.findall(ARCHITECTURE.read_text()))
    modules = package_modules()
    problems = [f"no line for {module}" for module in sorted(modules - listed)]
    problems += [f"a line for {module}, which does not exist" for module in sorted(listed - modules)]
    assert not problems, "docs/ARCHITECTURE.md, the code map: " + "; ".join(problems)


def test_architecture_names_only_files_that_exist():
    """"Where to add" and the prose point at real files, so a move that leaves them stale fails."""
    basenames = {Path(module).name for module in package_modules()}
    named = set(ANY_PYTHON_FILE.findall(ARCHITECTURE.read_text()))
    unknown = sorted(path for path in named
                     if not any((base / path).is_file() for base in (ROOT, ROOT / "src", PACKAGE))
                     and not ("/" not in path and path in basenames))
    assert not unknown, f"docs/ARCHITECTURE.md names files that do not exist: {', '.join(unknown)}"


def test_the_python_api_lists_name_every_function():
    """`imgtrain/__init__.py`'s docstring and the code map list the Python API: every function
    `imgtrain.__all__` exports is in both."""
    init = PACKAGE / "__init__.py"
    tree = ast.parse(init.read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    functions = [name for name in exported if name[0].islower()]  # classes are capitalised
    listed_here = set(re.findall(r"imgtrain\.(\w+)\(", ast.get_docstring(tree)))
    api_sentence = re.search(r"The Python API is `imgtrain/__init__.py`:(.*?)\.\n", ARCHITECTURE.read_text(), re.DOTALL)
    assert api_sentence, "docs/ARCHITECTURE.md: the sentence 'The Python API is `imgtrain/__init__.py`: ...' is gone"
    listed_there = set(re.findall(r"`(\w+)`", api_sentence.group(1)))
    missing = [f"{name} (imgtrain/__init__.py's docstring)" for name in functions if name not in listed_here]
    missing += [f"{name} (docs/ARCHITECTURE.md)" for name in functions if name not in listed_there]
    assert not missing, "functions of the Python API not listed: " + ", ".join(missing)


def test_the_docs_list_every_data_source_in_the_registrys_order():
    """docs/data.md's table of sources is written by hand: it names exactly the registered sources,
    in the order `data prepare --help` lists them."""
    from imgtrain.data.sources import registry

    section = (ROOT / "docs" / "data.md").read_text().split("\n## Sources\n", 1)[1].split("\n## ", 1)[0]
    in_table = re.findall(r"^\| `([\w-]+)` \|", section, re.MULTILINE)
    assert in_table == list(registry.SOURCES), f"docs/data.md's sources {in_table}, registered {list(registry.SOURCES)}"


def shell_lines(page: Path) -> list[tuple[str, str]]:
    """(where, line) for every line of the page's fenced blocks, continuations (`\\`) joined."""
    found = []
    text = page.read_text()
    for block in FENCE.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", first_line
        for number, line in enumerate(block.group(1).splitlines(), first_line):
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            found.append((f"{page.relative_to(ROOT)}:{start}", pending + line))
            pending = ""
    return found


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at `|`, `;`, `&&`, `||`), each without its
    `$ ` prompt and `VAR=value` prefixes; comments dropped. Lines that are not shell (program
    output, Python) may not tokenize: they hold no command."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    found, current = [], []
    for token in [*tokens, ";"]:
        if token in SEPARATORS:
            while current and ENV_ASSIGNMENT.match(current[0]):
                current.pop(0)
            if current:
                found.append(current)
            current = []
        else:
            current.append(token)
    return found


def docs_commands(program: str) -> list[tuple[str, list[str]]]:
    """(where, arguments) of every `program ...` command in the docs' fenced blocks. What follows
    a `--` is a command of the same program (`imgtrain cluster manifest ... -- train ...`)."""
    found = []
    for page in CURRENT_PAGES:
        for where, line in shell_lines(page):
            for command in commands(line):
                if command[0].rsplit("/", 1)[-1] != program:
                    continue
                arguments = command[1:]
                cut = arguments.index("--") if "--" in arguments else len(arguments)
                found += [(where, arguments[:cut])] + ([(where, arguments[cut + 1:])] if cut < len(arguments) else [])
    return found


def command_path(arguments: list[str]):
    """The subcommands these arguments name (`["data", "prepare"]`), the click command they lead
    to, and a problem when a word where a subcommand belongs names none."""
    import typer.main

    from imgtrain.cli import app

    command, path = typer.main.get_command(app), []
    for word in arguments:
        subcommands = getattr(command, "commands", None)
        if not subcommands or word.startswith("-"):
            break
        if word not in subcommands:
            return path, command, f"'imgtrain {' '.join(path)}' has no command '{word}'"
        command, path = subcommands[word], [*path, word]
    return path, command, None


def test_every_imgtrain_command_in_the_docs_parses_with_its_flags(capsys):
    shown = docs_commands("imgtrain")
    assert len(shown) > 40, f"only {len(shown)} imgtrain commands found in the docs: is the parser broken?"
    helps: dict[tuple[str, ...], str] = {}
    problems = []
    for where, arguments in shown:
        path, command, problem = command_path(arguments)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        if tuple(path) not in helps:
            result = cli_here(capsys, *path, "--help")
            if result.returncode != 0:
                problems.append(f"{where}: 'imgtrain {' '.join(path)} --help' exited {result.returncode}")
            helps[tuple(path)] = result.stdout
        # an option of this very command, shown in its help (not merely named in another's text)
        declared = {"--help"} | {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        offered = declared & set(HELP_FLAG.findall(helps[tuple(path)]))
        flags = {m.group(1) for word in arguments if (m := FLAG.match(word))}
        for flag in sorted(flags - offered):
            problems.append(f"{where}: 'imgtrain {' '.join(path)}' has no option {flag}")
    assert not problems, "commands in the docs that imgtrain does not take:\n" + "\n".join(problems)


def test_every_benchmark_command_in_the_docs_names_a_script_and_its_flags():
    """BENCHMARKS.md's figures are reproduced by the commands beside them: each `python
    bench/X.py --flag` names a script that exists and flags it declares."""
    shown = [(where, arguments) for program in ("python", "python3") for where, arguments in docs_commands(program)
             if arguments and arguments[0].startswith("bench/")]
    assert len(shown) > 15, f"only {len(shown)} benchmark commands found in the docs: is the parser broken?"
    problems = []
    for where, (script, *arguments) in shown:
        path = ROOT / script
        if not path.is_file():
            problems.append(f"{where}: no {script}")
            continue
        declared = set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)["']""", path.read_text()))
        # a quoted value with spaces (`--extra "--stem standard"`) holds another program's flags
        given = {m.group(1) for word in arguments if " " not in word and (m := FLAG.match(word))}
        for flag in sorted(given - declared - {"--help"}):
            problems.append(f"{where}: {script} has no option {flag}")
    assert not problems, "benchmark commands in the docs that do not run:\n" + "\n".join(problems)


def test_every_make_target_in_the_docs_exists():
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    shown = docs_commands("make")
    assert shown, "no make command found in the docs: is the parser broken?"
    unknown = [f"{where}: make {word}" for where, arguments in shown for word in arguments
               if not word.startswith("-") and "=" not in word and word not in targets]
    assert not unknown, "make targets in the docs that the Makefile lacks:\n" + "\n".join(unknown)


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_between_the_docs_resolves(page):
    """Relative links (`[text](docs/data.md#anchor)`) point at files that exist and, with an
    anchor, at a heading of that page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {', '.join(broken)}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


# Names in imgtrain's docstrings. A file: `training/loop.py`, `imgtrain/ops/remote.py`, ``batcher.py``,
# tests/test_layers.py. A dotted name in backticks: ``ops.remote``, `loop.run_loop`, ``imgtrain.train``.
# A bare name in double backticks (``lease``), which a package's docstring uses for its own modules.
FILE_IN_TEXT = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w/])")
DOTTED_IN_TEXT = re.compile(r"`{1,2}([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}")
BARE_IN_TEXT = re.compile(r"``([A-Za-z_]\w*)``")
NOT_MODULES = {"json", "jsonl", "csv", "py", "toml", "md", "txt", "log", "err", "out", "png"}  # ``config.json``
FROM_ROOT = ("src/", "bench/", "tests/", "docs/")


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's docstring and of every class's and function's in it."""
    return [(node.body[0].lineno, text) for node in ast.walk(parsed(path))
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (text := ast.get_docstring(node, clean=False))]


@functools.cache
def packages_of(package: Path) -> tuple[Path, ...]:
    return (package, *(p.parent for p in package.rglob("__init__.py") if p.parent != package))


def file_resolves(named: str, module: Path, package: Path) -> bool:
    """From the repository's root (tests/, bench/, docs/, src/), from imgtrain/, relative to the
    module's package or any package of imgtrain (`ownership.py`, `data/order.py`), or inside an
    installed library (`ray/serve/_private/replica.py`)."""
    if named.startswith("."):
        return True  # elided (`.../torch/nn/parallel/distributed.py` in a traceback shown)
    if named.startswith(FROM_ROOT):
        return (ROOT / named).is_file()
    if named.startswith("imgtrain/"):
        return (package.parent / named).is_file()
    if any((folder / named).is_file() for folder in [module.parent, *packages_of(package)]):
        return True
    top = named.split("/", 1)[0]
    spec = importlib.util.find_spec(top) if "/" in named and top.isidentifier() and top != "imgtrain" else None
    return bool(spec and spec.submodule_search_locations
                and any((Path(place).parent / named).is_file() for place in spec.submodule_search_locations))


def defined_names(body: list) -> dict[str, ast.AST | None]:
    """What a module's (or a class's) body binds: functions and classes (with their node, to look
    inside a class), assignments and imports, also under `if` and `try`."""
    names: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id: None for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0]: None for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= defined_names([*node.body, *node.orelse, *getattr(node, "handlers", [])])
    return names


def dotted_resolves(named: str, module: Path, package: Path) -> bool | None:
    """``ops.remote``, ``loop.run_loop``, ``imgtrain.inference.batcher``: packages and modules down
    to a module, then a name it defines, then a name of that class (deeper is not checked). None
    when the first part is no module of imgtrain (``ray.train.report``, ``config.json``)."""
    parts = named.split(".")
    if parts[-1] in NOT_MODULES:
        return None
    if parts[0] == "imgtrain":
        starts, parts = [package], parts[1:]
    else:
        starts = [folder for folder in [module.parent, *packages_of(package)]
                  if (folder / f"{parts[0]}.py").is_file() or (folder / parts[0] / "__init__.py").is_file()]
        if not starts:
            return None
    return any(names_resolve(start, parts) for start in starts)


def names_resolve(folder: Path, parts: list[str]) -> bool:
    while parts and (folder / parts[0] / "__init__.py").is_file():
        folder, parts = folder / parts[0], parts[1:]
    if not parts:
        return True
    if (folder / f"{parts[0]}.py").is_file():
        source, parts = folder / f"{parts[0]}.py", parts[1:]
    else:
        source = folder / "__init__.py"  # a name the package itself defines: ``imgtrain.train``
    if not parts:
        return True
    names = defined_names(parsed(source).body) if source.is_file() else {}
    if parts[0] not in names:
        return False
    node = names[parts[0]]
    return len(parts) == 1 or not isinstance(node, ast.ClassDef) or parts[1] in defined_names(node.body)


def bare_module_resolves(named: str, init: Path, package: Path) -> bool:
    """A bare name in a package's docstring that is a module of imgtrain is one of this package's
    or a top-level one (``errors``)."""
    def in_folder(folder: Path) -> bool:
        return (folder / f"{named}.py").is_file() or (folder / named / "__init__.py").is_file()

    return not any(in_folder(folder) for folder in packages_of(package)) or in_folder(init.parent) or in_folder(package)


def stale_names_in_docstrings(package: Path = PACKAGE, modules: list[Path] | None = None) -> list[str]:
    """What the docstrings of ``modules`` (every module of ``package`` by default) name that does
    not exist there."""
    problems = []
    for module in modules or sorted(package.rglob("*.py")):
        where = module.relative_to(package.parent).as_posix()
        if module.name == "__init__.py":
            text = ast.get_docstring(parsed(module), clean=False) or ""
            problems += [f"{where}: ``{named}``, a module of another package" for named in BARE_IN_TEXT.findall(text)
                         if not bare_module_resolves(named, module, package)]
        for line, text in docstrings(module):
            problems += [f"{where}:{line}: {named}" for named in FILE_IN_TEXT.findall(text)
                         if not file_resolves(named, module, package)]
            problems += [f"{where}:{line}: {named}" for named in DOTTED_IN_TEXT.findall(text)
                         if dotted_resolves(named, module, package) is False]
    return problems


def test_docstrings_name_only_modules_that_exist():
    """A docstring that still names a module after it moved (``remote`` in storage/, now
    ops/remote.py) misleads whoever reads it: every file, dotted name and package's module named
    in imgtrain's docstrings exists."""
    problems = stale_names_in_docstrings()
    assert not problems, "docstrings naming modules or names that do not exist:\n" + "\n".join(problems)


def test_the_docstring_check_finds_stale_names(tmp_path):
    import shutil

    package = tmp_path / "imgtrain"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    planted = {
        "storage/__init__.py": ('``lease`` (the driver', '``remote`` (the driver'),
        "training/tracking/__init__.py": ("(``base.py``)", "(``interface.py``)"),
        "training/ingest.py": ('"""', '"""Batches (`data/streaming.py`, ``stream.no_such_name``, '
                                      '``recipe.WeightAverage.no_such_method``). '),
    }
    for name, (old, new) in planted.items():
        path = package / name
        assert old in path.read_text(), f"{name}: the planted text's anchor is gone"
        path.write_text(path.read_text().replace(old, new, 1))
    found = "\n".join(stale_names_in_docstrings(package, [package / name for name in planted]))
    for stale in ("storage/__init__.py: ``remote``", "tracking/__init__.py:1: interface.py",
                  "ingest.py:1: data/streaming.py", "ingest.py:1: stream.no_such_name",
                  "ingest.py:1: recipe.WeightAverage.no_such_method"):
        assert stale in found, f"{stale} not found in:\n{found}"


def test_the_docs_name_only_code_that_exists():
    """The pages outside their fenced blocks (prose, tables, "Code:" lines of NOTES.md) name files
    and dotted names that exist, resolved as in docstrings."""
    problems = []
    for page in CURRENT_PAGES:
        text = FENCE.sub("", page.read_text())
        where = page.relative_to(ROOT)
        problems += [f"{where}: {named}" for named in FILE_IN_TEXT.findall(text)
                     if not file_resolves(named, PACKAGE / "__init__.py", PACKAGE)]
        problems += [f"{where}: {named}" for named in DOTTED_IN_TEXT.findall(text)
                     if dotted_resolves(named, PACKAGE / "__init__.py", PACKAGE) is False]
    assert not problems, "the docs name code that does not exist:\n" + "\n".join(problems)


def make_install_extras() -> set[str]:
    """The extras `make install` (and so `make demo`) installs: `pip install -e '.[a,b]'` in its rule."""
    rule = re.search(r"^\$\(VENV\)/\.installed:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert rule, "the Makefile has no $(VENV)/.installed rule: is the pattern broken?"
    found = re.search(r"pip install[^\n]*-e '?\.(?:\[([\w,-]+)\])?", rule.group(1))
    return set(found.group(1).split(",")) if found and found.group(1) else set()


def extras_needed(arguments: list[str]) -> set[str]:
    """The pyproject extras an imgtrain command needs beyond the base install: a tracker's flag
    (the trackers say which extra is theirs), a timm model or optimizer, ONNX (export's default
    format, --engine onnxruntime)."""
    from imgtrain.inference.export_formats import ENGINES, FORMATS
    from imgtrain.training.tracking import registered

    needed = {t.extra for t in registered() if t.flag in arguments}
    if any(a.startswith("timm:") for a in arguments) or {"lamb", "lars"} & set(arguments):
        needed.add("timm")
    if arguments[:1] == ["export"]:  # the format's extra, onnx's (export) by default
        needed.add(FORMATS[arguments[arguments.index("--format") + 1] if "--format" in arguments else "onnx"].extra)
    engine = arguments[arguments.index("--engine") + 1] if "--engine" in arguments else "torch"
    if ENGINES.get(engine):  # an export's engine: its format's extra
        needed.add(ENGINES[engine].extra)
    return needed - {""}


def test_every_readme_command_that_needs_an_extra_gets_it_from_make_install_or_says_so():
    """The README's commands run after `make install` (`make demo`), or their comment names
    the `pip install 'imgtrain[EXTRA]'` they need."""
    installed, problems, needing = make_install_extras(), [], 0
    for where, line in shell_lines(ROOT / "README.md"):
        for command in commands(line):
            if command[0].rsplit("/", 1)[-1] != "imgtrain":
                continue
            needing += bool(extras_needed(command[1:]))
            for extra in sorted(extras_needed(command[1:]) - installed):
                if f"imgtrain[{extra}]" not in line:
                    problems.append(f"{where}: {' '.join(command)} needs 'imgtrain[{extra}]'")
    assert needing, "no README command needs an extra: is extras_needed broken?"
    assert not problems, ("README commands that `make install` leaves unable to run, their comment silent:\n"
                          + "\n".join(problems))
