"""The tree shows the architecture (design §1, style habit 13): commands → engines → shared helpers and
contracts, one way, no import circles, small files.

The import graph is read with ``ast`` from the source (no imports, no subprocess): every ``import`` and
``from … import`` of a ``ckptrun.cli`` or ``ckptrun.runtime`` module is an edge, at module level or inside a
function alike — a lazy import is still a dependency. Only ``if TYPE_CHECKING:`` blocks are left out: they
never run. Importing ``a.b.c`` runs the packages ``a.b`` and ``a`` first, so those are edges too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ckptrun.cli": ROOT / "cli", "ckptrun.runtime": ROOT / "runtime",
            "ckptrun.integrations": ROOT / "runtime" / "integrations"}  # installed as its own package (pyproject)
INTEGRATIONS = "ckptrun.integrations"
MAX_LINES = 400  # a module of more lines is two concepts
MAX_TOP_LEVEL_RUNTIME = 12  # besides __init__.py: the torch-free contracts and the primitives every room uses
ALLOWED_CYCLES: list[set[str]] = []  # none; a circle needs a reason written here, never a silent entry
RUNTIME_ROOMS = ("storage", "checkpoint", "worker", "step")
ROOM_DEPS = {"storage": set(), "checkpoint": {"storage"}, "worker": set(), "step": {"storage", "checkpoint", "worker"}}
COMMANDS, SUPERVISION, BUDGET = "ckptrun.cli.commands", "ckptrun.cli.supervision", "ckptrun.cli.recovery_budget"
HELPERS = ("ckptrun.cli.errors", "ckptrun.cli.durations", "ckptrun.cli.progress", "ckptrun.cli.humanize")


MISNAMED_INTEGRATIONS = "ckptrun.runtime.integrations"


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if package != INTEGRATIONS and PACKAGES[INTEGRATIONS] in path.parents:
                continue  # ckptrun.integrations, never ckptrun.runtime.integrations
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _runs(node: ast.AST) -> list[ast.AST]:
    """The statements under ``node`` that can run: ``if TYPE_CHECKING:`` bodies are skipped."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            out.extend(child.orelse)
            continue
        out.append(child)
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ckptrun modules ``name`` imports anywhere in its code, with the packages each import runs."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    todo = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        for child in _runs(node):
            todo.append(child)
            if isinstance(child, ast.Import):
                targets.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = ".".join(package[:len(package) - child.level + 1] + [child.module or ""]).strip(".") \
                    if child.level else (child.module or "")
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in child.names)
    edges = set()
    for target in targets:
        parts = target.split(".")
        edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    # ckptrun.runtime.integrations is the folder's name, not a module (it installs as ckptrun.integrations):
    # kept, so that an import by that name is seen and refused
    return {edge for edge in edges if (edge in known or edge.startswith(MISNAMED_INTEGRATIONS)) and edge != name
            and not name.startswith(edge + ".")}


GRAPH = {name: imported(name, path, modules()) for name, path in modules().items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a readable circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def edges_into(prefix_from: str | tuple[str, ...], prefix_to: str) -> list[str]:
    return [f"{a} → {b}" for a, targets in sorted(GRAPH.items()) if a.startswith(prefix_from)
            for b in sorted(targets) if b == prefix_to or b.startswith(prefix_to + ".")]


def test_the_graph_is_read() -> None:
    assert "ckptrun.cli.supervision.supervisor" in GRAPH["ckptrun.cli.supervision.runner"]
    assert "ckptrun.cli.recovery_budget.rto_measure" in GRAPH["ckptrun.cli.recovery_budget.estimate"]


def test_no_import_circles() -> None:
    found = [c for c in cycles(GRAPH) if set(c) not in ALLOWED_CYCLES]
    assert not found, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in found)


def test_the_runtime_never_imports_the_cli() -> None:
    assert not edges_into("ckptrun.runtime", "ckptrun.cli")


@pytest.mark.parametrize("engine", [SUPERVISION, BUDGET])
def test_the_engines_never_import_the_commands(engine: str) -> None:
    assert not edges_into(engine, COMMANDS)


def test_supervision_never_imports_the_recovery_budget() -> None:
    """One way: the budget measures attempts with the supervision's primitives; the launch hands the
    supervisor its estimator (``world.Estimator``)."""
    assert not edges_into(SUPERVISION, BUDGET)


@pytest.mark.parametrize("helper", HELPERS)
def test_shared_helpers_sit_below_both_engines(helper: str) -> None:
    assert not [e for layer in (COMMANDS, SUPERVISION, BUDGET) for e in edges_into(helper, layer)]


def test_files_stay_small() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_runtime_top_level_keeps_only_the_contracts_and_shared_primitives() -> None:
    top = sorted(p.name for p in (ROOT / "runtime").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_RUNTIME, top
    rooms = sorted(p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()
                   and p != PACKAGES[INTEGRATIONS])
    assert rooms == sorted(RUNTIME_ROOMS), rooms


def room_of(module: str) -> str:
    """``ckptrun.runtime.<room>.x`` → room; a top-level runtime module → ``contracts``."""
    parts = module.split(".")
    if len(parts) > 3 or (len(parts) == 3 and parts[2] in RUNTIME_ROOMS):
        return parts[2]
    return "contracts"


@pytest.mark.parametrize("room", RUNTIME_ROOMS)
def test_runtime_rooms_import_one_way(room: str) -> None:
    """storage ← checkpoint ← step → worker: a lower room never imports a higher one, not even in a function."""
    allowed = ROOM_DEPS[room] | {room, "contracts"}
    wrong = [f"{a} → {b}" for a, targets in sorted(GRAPH.items()) if a.startswith(f"ckptrun.runtime.{room}")
             for b in sorted(targets) if b.startswith("ckptrun.runtime") and b != "ckptrun.runtime"
             and room_of(b) not in allowed]
    assert not wrong, wrong


def test_the_contracts_import_no_room() -> None:
    wrong = [f"{a} → {b}" for a, targets in sorted(GRAPH.items())
             if a.startswith("ckptrun.runtime.") and room_of(a) == "contracts"
             for b in sorted(targets) if room_of(b) in RUNTIME_ROOMS and b.startswith("ckptrun.runtime.")]
    assert not wrong, wrong


def test_every_room_says_what_lives_there_and_what_it_may_import() -> None:
    for room in RUNTIME_ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "runtime" / room / "__init__.py").read_text())) or ""
        assert "Import" in doc and len(doc.splitlines()) >= 3, room


def test_the_commands_table_points_at_command_modules() -> None:
    from ckptrun.cli.main import Commands

    modules_named = {command.module for command in Commands.table.values()}
    assert modules_named and all(m.startswith(COMMANDS + ".") and m in GRAPH for m in modules_named), modules_named


def test_the_integrations_use_the_runtime_and_nothing_uses_them() -> None:
    """ckptrun.integrations (Lightning, HF Trainer) may import the runtime's contracts and rooms, never the
    CLI; nothing in ckptrun imports them (they are optional extras)."""
    assert any(a.startswith(INTEGRATIONS) for a in GRAPH)
    assert not edges_into(INTEGRATIONS, "ckptrun.cli")
    assert not [e for e in edges_into(("ckptrun.cli", "ckptrun.runtime"), INTEGRATIONS)]
    wrong = [f"{a} → {b}" for a, targets in GRAPH.items() for b in targets if b.startswith(MISNAMED_INTEGRATIONS)]
    assert not wrong, wrong
