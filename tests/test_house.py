"""The rules the layout keeps (docs/ARCHITECTURE.md): no import circles, a web side that loads without
torch, files and functions of a readable size."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# What a web process imports (app.web.processes._serve_web, app.web.server.launch), and its parent's start.
WEB_SIDE = ("app.main", "app.web.server", "app.web.processes", "app.web.proxy", "app.web.uploads", "app.web.guard",
            "app.ui.layout", "app.ui.handlers", "app.ui.cancellable", "app.engine.client", "app.engine.backends")


def app_modules() -> dict[str, Path]:
    modules = {}
    for path in APP.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path, modules: dict) -> set[str]:
    """The app modules `path` imports, at its top or inside its functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in modules:
                found.add(name)
    return found


def test_no_import_circles():
    modules = app_modules()
    graph = {name: imported_modules(path, modules) - {name} for name, path in modules.items()}
    # A package imports nothing of its own; a module importing its package (for a sibling) is no circle.
    for name in graph:
        graph[name] = {other for other in graph[name] if not name.startswith(other + ".")}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(name):] + [name]))
        if name in done:
            return
        on_path.append(name)
        for other in sorted(graph[name]):
            visit(other)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_web_side_loads_without_torch():
    """Everything a web process imports loads with torch (and Triton) made unimportable."""
    script = (
        "import sys, importlib.abc\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton', 'torchvision'):\n"
        "            raise ImportError(f'{name} is not importable here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"for name in {WEB_SIDE!r}:\n"
        "    __import__(name)\n"
        "print('loaded', len(sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]


def test_files_and_functions_are_of_a_readable_size():
    too_long = []
    for name, path in sorted(app_modules().items()):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("environment, cap, default", [
    ({"MINICPMV_MAX_NEW_TOKENS": "2048"}, 8192, 2048),
    ({"MINICPMV_MAX_NEW_TOKENS_LIMIT": "16384", "MINICPMV_MAX_NEW_TOKENS": "4096"}, 16384, 4096),
    ({"MINICPMV_MAX_NEW_TOKENS_LIMIT": "300", "MINICPMV_MAX_NEW_TOKENS": "256"}, 300, 256),
])
def test_the_default_reply_length_and_its_cap_are_two_variables(environment, cap, default):
    """MINICPMV_MAX_NEW_TOKENS once set both the default and the cap: raising the default lowered the cap."""
    script = ("from app import limits; from app.config import parse_config; "
              "print(limits.MAX_NEW_TOKENS, parse_config([]).max_new_tokens)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **environment})
    assert result.stdout.split() == [str(cap), str(default)], result.stderr[-2000:]


def test_a_default_reply_longer_than_the_cap_is_refused_in_one_line():
    result = subprocess.run([sys.executable, "app.py", "--max-new-tokens", "500"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "MINICPMV_MAX_NEW_TOKENS_LIMIT": "300"})
    assert result.returncode == 2 and "--max-new-tokens is 1 to 300" in result.stderr
    assert "Traceback" not in result.stderr
