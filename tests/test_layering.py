"""The package's import graph, read from the source: dependencies point one way (docs/design.md, "Layout").

Every `import` counts, including those inside functions: a lazy import hides a cycle from the
interpreter, not from a reader or from the next refactor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moeserve

PACKAGE = Path(moeserve.__file__).parent
PARTS = ("training", "export", "serve", "bench")  # each may import runtime; runtime imports none of them


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: moeserve modules it imports}; `from moeserve.x import name` counts as importing moeserve.x."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "moeserve.runtime.model" in graph["moeserve.runtime.engine"]
    assert "moeserve.checkpoint" in graph["moeserve.runtime.loading"]
    assert "moeserve.runtime.backends.onnx" in graph["moeserve.runtime.engine"]  # a lazy import counts


def test_no_import_cycles() -> None:
    assert _cycle(import_graph()) is None


def test_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_runtime_imports_none_of_the_parts_that_use_it() -> None:
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("moeserve.runtime"):
            bad = sorted(e for e in edges if e.split(".")[1] in (*PARTS, "cli", "scoring"))
            assert not bad, f"{name} imports {bad}"


def test_checkpoint_format_knows_no_model() -> None:
    graph = import_graph()
    for name in ("moeserve.checkpoint", "moeserve.hf_mixtral", "moeserve.config", "moeserve.tokenizer"):
        assert not [e for e in graph[name] if e.startswith("moeserve.runtime")], name


def test_serve_does_not_train() -> None:
    """The default model is resolved by the CLI; a server is handed a path."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("moeserve.serve"):
            assert not [e for e in edges if e.startswith("moeserve.training")], name


# ---- one execution backend per model: the model's modules are math, the backends choose how it runs ----------
BACKENDS = "moeserve.runtime.backends"
KERNEL = {f"{BACKENDS}.{m}" for m in ("cpu_kernel", "kernel_decode", "kernel_abi", "kernel_checks")}
# what a module would hold or ask to pick an execution path at call time (the forms before backends/ existed)
PATH_FLAGS = {"kernel", "use_kernel", "kernel_decode", "decode_kernel", "step_kernel", "head_kernel", "head_packed",
              "head_kernel_max_rows", "kernel_router", "inference", "table", "packed", "fused", "compiled"}
PATH_CALLS = {"is_grad_enabled", "is_compiling"}


def _outside_backends() -> dict[str, Path]:
    """runtime/'s modules that are not backends: the model's math, the engine, the scheduler."""
    root = PACKAGE / "runtime"
    return {_module(p): p for p in root.rglob("*.py") if (root / "backends") not in p.parents}


def path_choices(source: str) -> list[str]:
    """Where `source` picks an execution path at call time: a call to torch.is_grad_enabled() or
    torch.compiler.is_compiling(), or an attribute of PATH_FLAGS set on an object (self.kernel = ...)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in PATH_CALLS:
                found.append((node.lineno, f"line {node.lineno}: {name}()"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and e.attr in PATH_FLAGS:
                        found.append((node.lineno, f"line {node.lineno}: .{e.attr} ="))
    return [text for _, text in sorted(found)]


def test_path_choices_are_found() -> None:
    src = "def f(self, x):\n    if torch.is_grad_enabled():\n        pass\n    self.step_kernel = None\n    self.w = 1\n"
    assert path_choices(src) == ["line 2: is_grad_enabled()", "line 4: .step_kernel ="]


def test_runtime_modules_outside_backends_hold_no_execution_path_flags() -> None:
    """Which way a model runs is its backend's (backends/), decided once when it is laid out: the modules under
    runtime/ neither hold a flag for it nor ask at call time."""
    for name, path in _outside_backends().items():
        assert not path_choices(path.read_text(encoding="utf-8")), f"{name}: {path_choices(path.read_text())}"


def test_only_backends_import_the_kernel_and_onnxruntime() -> None:
    """The C kernel's bindings and ONNX Runtime are backends' business; benchmarks (which time the kernel) and the
    exporter (which checks its graph on ONNX Runtime) are the only other readers."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith(BACKENDS) or name.startswith("moeserve.bench"):
            continue
        assert not edges & KERNEL, f"{name} imports {sorted(edges & KERNEL)}"
    for name, path in _outside_backends().items():
        imported = {a.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                    if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(n, ast.ImportFrom) and n.module}
        assert "onnxruntime" not in imported, name
