"""The package layout is the architecture: each package imports only the layers below it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvyard"

# What each top-level part of kvyard may import ("" is the package root: `kvyard.__version__`).
ALLOWED: dict[str, set[str]] = {
    "paths": set(),
    "settings": set(),
    "kvcache": {"paths", "settings"},
    "api": {"kvcache", "settings"},
    "net": {"api", "settings"},
    "kernels": {"paths"},
    "models": {"kernels"},
    "engine": {"api", "kernels", "kvcache", "models", "settings"},
    "sim": {"engine", "api", "kvcache", "net", "settings"},
    "server": {"engine", "api", "kvcache", "net", "settings", ""},
    "router": {"api", "kvcache", "net", "settings", ""},
    "bench": {"api", "net", "settings", ""},
    "deploy": {"api", "paths"},  # runs `kvyard serve` / `kvyard route` as processes and talks to them over HTTP
    "integrations": {"kvcache", "models", "paths", "settings"},  # kvyard's tier inside vLLM (a KV connector)
    "testing": {"server", "sim", "engine", "api", "kvcache", "models", "net", "paths", "settings"},
}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return (
        relative.parts[0].removesuffix(".py")
        if len(relative.parts) > 1 or relative.stem not in ("__init__", "__main__")
        else ""
    )


def imported_parts(path: Path) -> set[str]:
    """The parts of kvyard a module imports, at any depth (function-level imports included)."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name == "kvyard" or name.startswith("kvyard."):
                parts.add(name.split(".")[1] if "." in name else "")
    return parts


def test_no_layer_imports_one_above_it() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        if part in ("", "cli"):  # the entry points compose everything
            continue
        assert part in ALLOWED, f"{path}: new top-level part {part!r}: place it in ALLOWED"
        for imported in imported_parts(path) - {part} - ALLOWED[part]:
            violations.append(f"{path.relative_to(PACKAGE.parent)} ({part}) imports kvyard.{imported}")
    assert not violations, "\n".join(violations)


def test_router_sim_and_bench_never_import_the_server() -> None:
    for part in ("router", "sim", "bench"):
        for path in (PACKAGE / part).rglob("*.py"):
            assert "server" not in imported_parts(path), path


def test_the_check_sees_imports_at_any_depth(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from kvyard.server.app import ReplicaApp\n    import kvyard.sim.engine\n")
    assert imported_parts(module) == {"server", "sim"}


# The engine's rooms (kvyard/engine/*/) and the rooms each may import; a room never imports the engine's own
# modules above them (core, llm_engine, llm, config, ...), except the fast-start engine, which is an engine.
ENGINE = PACKAGE / "engine"
ENGINE_ROOMS: dict[str, set[str]] = {
    "sampling": set(),
    "pooling": set(),
    "blend": set(),
    "scheduling": {"sampling", "pooling", "blend"},
    "kv_links": {"scheduling", "sampling", "pooling"},
    "runners": {"scheduling", "sampling", "pooling", "blend"},
    "speculative": {"runners", "scheduling", "sampling", "pooling"},
    "fast_start": {"kv_links", "scheduling", "sampling", "pooling", "config", "core", "model_setup"},
}


def engine_parts_imported(path: Path) -> set[str]:
    """The engine rooms and top-level engine modules a module imports (`kvyard.engine.core` -> "core")."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvyard.engine."):
            parts.add(node.module.split(".")[2])
    return parts


def test_engine_rooms_import_only_the_rooms_below_them() -> None:
    rooms = {path.name for path in ENGINE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert rooms == set(ENGINE_ROOMS), "a room was added or removed: place it in ENGINE_ROOMS"
    violations = []
    for room, allowed in ENGINE_ROOMS.items():
        for path in sorted((ENGINE / room).rglob("*.py")):
            for imported in engine_parts_imported(path) - {room} - allowed:
                violations.append(f"{path.relative_to(PACKAGE.parent)} ({room}) imports kvyard.engine.{imported}")
    assert not violations, "\n".join(violations)
