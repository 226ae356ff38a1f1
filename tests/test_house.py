"""The house's size rules, checked on every Python file of the library (``zgraph/``, ``passes/``, ``runtime/``),
the benchmarks and the tests: no file over 500 lines and no function over 80, so that a change that grows one
past them is cut along a seam when it is made, not in a later clean-up. The library's core is held tighter: no
file over 400 lines in ``zgraph/`` and ``passes/``, no function over 60 lines in the library. (The import rules
are ``test_imports.py``.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [p for d in ("zgraph", "passes", "runtime") for p in sorted((ROOT / d).rglob("*.py"))]
HOUSE = LIBRARY + [p for d in ("benchmarks", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
CORE = [p for d in ("zgraph", "passes") for p in sorted((ROOT / d).rglob("*.py"))]
MAX_CORE_FILE_LINES = 400
MAX_LIBRARY_FUNCTION_LINES = 60


def test_library_files_are_found():
    assert len(LIBRARY) > 50


def test_no_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in HOUSE if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_core_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in CORE if (n := len(p.read_text().splitlines())) > MAX_CORE_FILE_LINES}
    assert not long, f"files over {MAX_CORE_FILE_LINES} lines: {long}"


def _long_functions(paths: list[Path], limit: int) -> dict[str, int]:
    long = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    return long


def test_no_library_function_over_60_lines():
    long = _long_functions(LIBRARY, MAX_LIBRARY_FUNCTION_LINES)
    assert not long, f"functions over {MAX_LIBRARY_FUNCTION_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = _long_functions(HOUSE, MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_every_package_init_maps_its_files():
    """A package's ``__init__`` opens with a map of its files: each module and sub-package is named there."""
    unmapped = {}
    for init in (p for p in LIBRARY if p.name == "__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        files = [p for p in init.parent.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
        files += [p for p in init.parent.iterdir() if (p / "__init__.py").exists()]
        missing = [p.name for p in files if p.name not in doc]
        if missing:
            unmapped[str(init.relative_to(ROOT))] = missing
    assert not unmapped, f"package maps that leave files out: {unmapped}"
