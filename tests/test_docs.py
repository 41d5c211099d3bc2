"""The docs against the code: the code map names every module, every command the docs show
still parses (its flags are in its --help), every `make` target exists, every link resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import cli_here

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "imgtrain"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

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
    for page in DOC_PAGES:
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
    from imgtrain.training.tracking import TRACKERS

    needed = {t.extra for t in TRACKERS if t.flag in arguments}
    if any(a.startswith("timm:") for a in arguments) or {"lamb", "lars"} & set(arguments):
        needed.add("timm")
    exporting = arguments[:1] == ["export"]
    fmt = arguments[arguments.index("--format") + 1] if "--format" in arguments else "onnx"
    if (exporting and fmt == "onnx") or "onnxruntime" in arguments:
        needed.add("export")
    return needed


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
