"""Import arrows point down: every import in the library (function-level ones included) is parsed and checked.

Layers, bottom to top:

- the graph contract: ``zgraph.graph``, ``zgraph.ops``, ``zgraph.errors`` (import only each other);
- ``zgraph.runtime`` and ``zgraph.passes``, side by side: each imports the contract and itself, never the other
  and never the user surface;
- the user surface: every other ``zgraph`` module (step, config, capture, explain, cli, checkpoint, ...).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"zgraph": "zgraph", "passes": "zgraph.passes", "runtime": "zgraph.runtime"}
CONTRACT = {"zgraph.graph", "zgraph.ops", "zgraph.errors"}


def _modules() -> dict[str, str]:
    """``{module name: path}`` of every library module."""
    out = {}
    for folder, package in PACKAGES.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                out[module] = os.path.join(ROOT, folder, name)
    return out


MODULES = _modules()


def layer(module: str) -> str:
    if module in CONTRACT:
        return "contract"
    for package in ("zgraph.runtime", "zgraph.passes"):
        if module == package or module.startswith(package + "."):
            return package.split(".")[1]
    return "surface"


ALLOWED = {
    "contract": {"contract"},
    "runtime": {"contract", "runtime"},
    "passes": {"contract", "passes"},
    "surface": {"contract", "runtime", "passes", "surface"},
}


def imports(path: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every zgraph module ``path`` imports, anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else node.module))
    return [(line, m) for line, m in found if m == "zgraph" or m.startswith("zgraph.")]


def test_layers_are_known():
    assert CONTRACT <= MODULES.keys()
    assert {layer(m) for m in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    path = MODULES[module]
    mine = layer(module)
    upward = [
        f"{os.path.relpath(path, ROOT)}:{line} imports {target} ({layer(target)} layer)"
        for line, target in imports(path)
        if layer(target) not in ALLOWED[mine]
    ]
    assert not upward, f"{module} is in the {mine} layer, which may import only {sorted(ALLOWED[mine])}:\n" + "\n".join(
        upward
    )


def test_the_check_sees_function_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n\n\ndef f():\n    from zgraph.capture.trace import trace as capture\n    from zgraph.inspect.explain import estimate\n"
    )
    assert imports(str(path)) == [(5, "zgraph.capture.trace"), (6, "zgraph.inspect.explain")]
