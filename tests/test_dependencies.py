"""The package's declared dependencies are what it imports: nothing missing, nothing extra."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import names that differ from the distribution's name.
DISTRIBUTION_OF = {"yaml": "pyyaml", "zmq": "pyzmq", "prometheus_client": "prometheus-client"}


def imported_distributions() -> set[str]:
    names = set()
    for path in (ROOT / "kvyard").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    third_party = names - set(sys.stdlib_module_names) - {"kvyard"}
    return {DISTRIBUTION_OF.get(name, name) for name in third_party}


def declared(list_name: str) -> set[str]:
    """The distributions of a TOML list in pyproject.toml (`dependencies = [...]`, `fleet = [...]`), one per
    quoted requirement (tomllib is not in Python 3.10's standard library)."""
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^{list_name} = \[(.*?)\]\s*$", text, re.MULTILINE | re.DOTALL)
    assert body is not None, list_name
    lines = [line.split("#", 1)[0] for line in body.group(1).splitlines()]  # comments aside
    requirements = re.findall(r'"([^"]+)"', "\n".join(lines))
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_kvyard_declares_what_it_imports_and_imports_what_it_declares() -> None:
    required = declared("dependencies")
    fleet, host = declared("fleet"), declared("vllm")  # host: the engine kvyard.integrations.vllm runs inside
    imported = imported_distributions()
    assert sorted(imported - required - fleet - host) == []  # imported, not declared
    assert sorted(required - imported) == []  # declared, never imported
    assert fleet <= imported and host <= imported
