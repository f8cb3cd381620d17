"""The package's shape: imports run one way, the pipeline stays light, every name is imported from its home."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "heygem"
MOST_LINES = 700


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """Every heygem module ``path`` imports, at the top or inside functions (TYPE_CHECKING-only
    imports left out: they never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            type_checking |= {id(inner) for inner in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("heygem") and name != "heygem":
                found.add(name)
    if path.is_relative_to(REPO):
        found.discard(module_name(path))
    return found


def test_no_module_imports_another_that_imports_it_back_even_through_functions():
    graph = {module: imported_modules(path) for module, path in MODULES.items()}
    cycles = []
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                cycles.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path):
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("from heygem import errors\nif TYPE_CHECKING:\n    from heygem import pipeline\n",
                     encoding="utf-8")
    second.write_text("def later():\n    from heygem.config import option\n    import heygem.media.frames\n",
                      encoding="utf-8")
    assert imported_modules(first) == {"heygem.errors"}
    assert imported_modules(second) == {"heygem.config", "heygem.media.frames"}


def test_importing_the_pipeline_loads_neither_gradio_nor_ray_nor_a_network_library():
    code = ("import sys, heygem.pipeline, heygem.cli, heygem.jobs.store\n"
            "print(sorted(m for m in ('gradio', 'ray', 'torch', 'mediapipe', 'diffusers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_only_the_ui_imports_gradio_and_models_hold_networks_only():
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        if "gradio" in imported:
            assert module.startswith("heygem.ui"), module
        if module.startswith("heygem.models."):
            assert not imported_modules(path) - {"heygem.models", "heygem.errors"}, (module, imported_modules(path))


def test_every_imported_name_comes_from_the_module_that_defines_it():
    """No module re-exports another's names: callers and tests import from where a name is defined."""
    def defined(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        return names

    definitions = {module: defined(path) for module, path in MODULES.items()}
    borrowed = []
    sources = [*PACKAGE.rglob("*.py"), *(REPO / "tests").glob("*.py"), *(REPO / "bench").glob("*.py"),
               REPO / "app.py"]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in definitions:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" not in MODULES and alias.name not in definitions[node.module]:
                        borrowed.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}")
    assert borrowed == []


def test_no_module_is_longer_than_700_lines():
    long = {module: lines for module, path in MODULES.items()
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MOST_LINES}
    assert long == {}


def test_every_subpackage_says_what_it_owns():
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), module
