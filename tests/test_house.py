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
            "app.web.openai_api", "app.ui.layout", "app.ui.handlers", "app.ui.cancellable", "app.ui.mcp_tools",
            "app.engine.client",
            "app.engine.backends")


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


def loads_without_torch(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Import `modules` in a fresh interpreter where torch (and Triton) cannot be imported."""
    script = (
        "import sys, importlib.abc\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton', 'torchvision'):\n"
        "            raise ImportError(f'{name} is not importable here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
        "print('loaded', len(sys.modules))\n"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_web_side_loads_without_torch():
    """Everything a web process imports loads with torch (and Triton) made unimportable."""
    result = loads_without_torch(WEB_SIDE)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_engine_side_loads_without_torch_and_the_scheduler_never_touches_the_gpu():
    """app/engine is the request's life: every module of it loads without torch (the GPU side, app/model,
    comes with a model's load). The scheduler decides and the runner it is handed does the GPU's work
    (nano-vllm's split): it imports nothing of app.model at all."""
    modules = app_modules()
    engine = tuple(sorted(name for name in modules if name.startswith("app.engine.")))
    result = loads_without_torch(engine)
    assert result.returncode == 0, result.stderr[-3000:]
    path = APP / "engine" / "scheduler.py"
    assert not {name for name in imported_modules(path, modules) if name.startswith("app.model")}


def test_the_runner_decides_its_backends_once():
    """Fused or transformers, graphs or launches, side streams or one: each is an object chosen when the
    runner is made (app.model.backends, cuda_graphs, streams), never a None checked on the way."""
    tree = ast.parse((APP / "model" / "runner.py").read_text())
    checks = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
              and isinstance(node.left, ast.Attribute) and isinstance(node.left.value, ast.Name)
              and node.left.value.id == "self" and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)]
    assert not checks, f"app/model/runner.py checks an attribute for None at lines {checks}"


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
    script = ("from app import limits; from app.config import apply_environment, parse_config; apply_environment(); "
              "print(limits.MAX_NEW_TOKENS_LIMIT, parse_config([]).max_new_tokens)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **environment})
    assert result.stdout.split() == [str(cap), str(default)], result.stderr[-2000:]


def test_a_default_reply_longer_than_the_cap_is_refused_in_one_line():
    result = subprocess.run([sys.executable, "app.py", "--max-new-tokens", "500"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "MINICPMV_MAX_NEW_TOKENS_LIMIT": "300"})
    assert result.returncode == 2 and "--max-new-tokens is 1 to 300" in result.stderr
    assert "Traceback" not in result.stderr


# The main function of each kind of process the app starts (app.startup's docstring lists them).
PROCESS_MAINS = (("app/main.py", "main"), ("app/engine/process.py", "serve"), ("app/web/processes.py", "_serve_web"),
                 ("app/web/processes.py", "_serve_front"), ("app/engine/preparers.py", "_load_processor"))


def test_every_kind_of_process_starts_through_one_routine():
    """Signals, logging, the environment's knobs, the GIL interval, torch's threads and malloc's thresholds are set in
    app.startup.start_process, which every process's main calls first; nowhere else."""
    for where, name in PROCESS_MAINS:
        tree = ast.parse((ROOT / where).read_text())
        function = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name)
        calls = {node.func.id for node in ast.walk(function) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "start_process" in calls, f"{where}: {name} does not call start_process"
    setters = ("setswitchinterval", "basicConfig", "freeze", "set_num_threads")
    for name, path in app_modules().items():
        if name == "app.startup":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in setters:
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} calls {node.func.attr} outside app.startup")
            if isinstance(node, ast.Attribute) and node.attr == "mallopt":  # reached through ctypes, called later
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} takes mallopt outside app.startup")


def test_nothing_reads_the_environment_at_import():
    """Importing every module of app/ reads no environment variable from app/'s own code (the limits and
    knobs are read by app.config.apply_environment, when a process starts)."""
    script = (
        "import collections.abc, os, sys, traceback\n"
        "reads = []\n"
        "class Watched(collections.abc.MutableMapping):\n"
        "    def __init__(self, real): self.real = real\n"
        "    def _note(self, key):\n"
        "        for frame, _ in traceback.walk_stack(sys._getframe(2)):\n"  # the reader: past os.getenv and Mapping.get
        "            if frame.f_code.co_filename.endswith(('os.py', '_collections_abc.py')): continue\n"
        f"            if frame.f_code.co_filename.startswith({str(APP)!r}):\n"
        "                reads.append((frame.f_code.co_filename, frame.f_lineno, key))\n"
        "            return\n"
        "    def __getitem__(self, key): self._note(key); return self.real[key]\n"
        "    def __setitem__(self, key, value): self.real[key] = value\n"
        "    def __delitem__(self, key): del self.real[key]\n"
        "    def __iter__(self): return iter(self.real)\n"
        "    def __len__(self): return len(self.real)\n"
        "    def get(self, key, default=None): self._note(key); return self.real.get(key, default)\n"
        "    def copy(self): return dict(self.real)\n"
        "os.environ = Watched(os.environ)\n"
        f"for name in sorted({sorted(app_modules())!r}):\n"
        "    __import__(name)\n"
        "print(reads)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-3000:]
