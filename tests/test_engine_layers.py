"""Import arrows inside engine/ flow one way (docs/architecture.md, "Module map").

Each unit (a sub-package or a top-level module of engine/) may import only itself and
the units listed before it, and no two engine modules import each other in a cycle.
The imports are read from the source (every `import` statement, at any depth), so a
lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"

# Lowest first: a unit may import the ones above it in this list, never those below.
LAYERS = [
    "cpu_host", "facts", "config", "kv", "sampling", "text", "guided", "model", "vision", "lora",
    "request", "speculative", "outputs", "prompt", "proto_convert",
    "tiers", "residency", "cache", "tracing", "steady_decodes", "step_pacing", "scheduler", "runner", "metrics", "output_processor", "step_sampling", "verify_step", "engine_stats", "state_listing",
    "responses_store",
    "builder", "offline", "inbox", "core", "call_status", "adapter_calls", "session", "server", "session_socket", "__main__",
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ENGINE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def engine_imports() -> dict[str, set[str]]:
    """module -> the engine modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        module = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("engine.")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine."):
                found.add(node.module)
        graph[module] = found
    return graph


def test_every_engine_unit_is_placed_in_a_layer() -> None:
    units = {_unit(m) for m in engine_imports()} - {"__init__"}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"


def test_imports_flow_down_the_layers() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in engine_imports().items() if _unit(module) in rank
        for target in targets if rank[_unit(target)] > rank[_unit(module)]
    )
    assert upward == []


def test_no_import_cycles_between_engine_modules() -> None:
    graph = engine_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target in graph and state.get(target) is None:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module, [module])

