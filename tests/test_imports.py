"""Import arrows point down: every import in the library (function-level and ``TYPE_CHECKING`` ones included) is
parsed and checked against the house's floors, and the import graph has no circle.

Floors, bottom to top (a module imports its own layer and layers on lower floors, never a layer beside it):

0. the contract: ``zgraph.graph``, ``zgraph.sizes``, ``zgraph.ops``, ``zgraph.sequence_ops``, ``zgraph.host_ops``,
   ``zgraph.errors``,
   ``zgraph.tree``, ``zgraph.version``;
1. ``zgraph.runtime`` and ``zgraph.passes`` (never each other);
2. ``zgraph.deepspeed`` (plain values; never ``Config``) and ``zgraph.checkpoint`` (which imports only the
   runtime and the contract);
3. ``zgraph.config`` (with ``zgraph.config_checks``, ``zgraph.config_docs``, ``zgraph.config_loss_scale`` and
   ``zgraph.config_deprecated``);
4. ``zgraph.capture``;
5. ``zgraph.binding`` and ``zgraph.compile`` (never each other);
6. ``zgraph.inspect`` and ``zgraph.weights`` (never each other);
7. the step: ``zgraph.step`` and ``zgraph.dispatch``;
8. the public face, ``zgraph/__init__.py``;
9. ``zgraph.demos``; 10. ``zgraph.cli``; 11. ``zgraph.integrations`` (inside other libraries' loops: the user
   surface's top floor; it may import the whole library, nothing imports it).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"zgraph": "zgraph", "passes": "zgraph.passes", "runtime": "zgraph.runtime"}
FLOORS = {
    "contract": 0,
    "runtime": 1,
    "passes": 1,
    "deepspeed": 2,
    "checkpoint": 2,
    "config": 3,
    "capture": 4,
    "binding": 5,
    "compile": 5,
    "inspect": 6,
    "weights": 6,
    "step": 7,
    "face": 8,
    "demos": 9,
    "cli": 10,
    "integrations": 11,
}
LAYER_OF = {
    "zgraph.graph": "contract",
    "zgraph.graph_copy": "contract",
    "zgraph.sizes": "contract",
    "zgraph.ops": "contract",
    "zgraph.sequence_ops": "contract",
    "zgraph.host_ops": "contract",
    "zgraph.errors": "contract",
    "zgraph.tree": "contract",
    "zgraph.version": "contract",
    "zgraph.config": "config",
    "zgraph.config_checks": "config",
    "zgraph.config_docs": "config",
    "zgraph.config_loss_scale": "config",
    "zgraph.config_deprecated": "config",
    "zgraph.step": "step",
    "zgraph.dispatch": "step",
    "zgraph.sequence": "step",
    "zgraph.pipeline_data": "step",
    "zgraph": "face",
}
ONLY = {"checkpoint": {"contract", "runtime", "checkpoint"}}  # narrower than its floor allows


def _modules() -> dict[str, str]:
    """``{module name: path}`` of every library module."""
    out = {}
    for folder, package in PACKAGES.items():
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            sub = os.path.relpath(directory, os.path.join(ROOT, folder)).replace(os.sep, ".")
            prefix = package if sub == "." else f"{package}.{sub}"
            for name in sorted(files):
                if name.endswith(".py"):
                    out[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(directory, name)
    return out


MODULES = _modules()


def layer(module: str) -> str:
    if module in LAYER_OF:
        return LAYER_OF[module]
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in FLOORS:
        return parts[1]
    raise AssertionError(f"{module} is in no layer: give it a floor in tests/test_imports.py")


def allowed(importer: str, target: str) -> bool:
    mine, theirs = layer(importer), layer(target)
    if mine in ONLY:
        return theirs in ONLY[mine]
    return theirs == mine or FLOORS[theirs] < FLOORS[mine]


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


def test_every_module_has_a_floor():
    assert {"zgraph.graph", "zgraph.step", "zgraph.capture.trace", "zgraph.binding.setup"} <= MODULES.keys()
    packages = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert packages - set(FLOORS) <= {m.split(".")[1] for m in LAYER_OF if "." in m}
    for module in MODULES:
        layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    path = MODULES[module]
    upward = [
        f"{os.path.relpath(path, ROOT)}:{line} imports {target} ({layer(target)} layer)"
        for line, target in imports(path)
        if not allowed(module, target)
    ]
    assert not upward, f"{module} is in the {layer(module)} layer:\n" + "\n".join(upward)


def test_no_circles():
    graph = {m: {t for _, t in imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_check_sees_function_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch\n\n\ndef f():\n    from zgraph.capture import trace\n    import zgraph.step\n")
    assert imports(str(path)) == [(5, "zgraph.capture.trace"), (6, "zgraph.step")]


def test_the_rules_refuse_an_arrow_up_or_sideways():
    assert not allowed("zgraph.capture.trace", "zgraph.binding.session")
    assert not allowed("zgraph.binding.session", "zgraph.compile.run")
    assert not allowed("zgraph.passes.bucket", "zgraph.runtime.state")
    assert not allowed("zgraph.checkpoint.state", "zgraph.config")
    assert not allowed("zgraph.deepspeed.config", "zgraph.config")
    assert allowed("zgraph.config", "zgraph.deepspeed.config")


def test_importing_zgraph_imports_no_integration():
    """transformers and accelerate are an extra (``hf``): ``import zgraph`` must not import them (nor the
    integrations floor, which does)."""
    import subprocess
    import sys

    names = ("transformers", "accelerate", "zgraph.integrations")
    code = f"import sys, zgraph; print(sorted(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]", out
