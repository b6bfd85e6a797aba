"""The package's shape: no import cycle, `import vitkit` stays light, and the README's structure table is true."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vitkit"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the vitkit modules it imports anywhere: at module level, or deferred inside a function (relative
    imports, as the package writes them)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                if node.module:
                    deps.add(f"{base}.{node.module}")
                else:
                    deps.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        for dep in sorted(graph.get(node, ())):
            if cycle := visit(dep, stack + [node]):
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        if cycle := visit(node, []):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "vitkit.checkpoints" in graph["vitkit"] and "vitkit.formats" in graph["vitkit.checkpoints"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_readme_structure_lists_every_module_in_dependency_order():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Structure", 1)[1].split("\n## ", 1)[0]
    listed: list[str] = []
    for cell in re.findall(r"^\| ([^|]+) \|", table, flags=re.M):
        files = re.findall(r"`([\w/]+\.py)`", cell)
        folder = files[0].rpartition("/")[0] + "/" if files and "/" in files[0] else ""
        listed += [f if "/" in f else folder + f for f in files]  # `formats/a.py`, `b.py`: b is in formats/
    modules = {module_name(PACKAGE / f): i for i, f in enumerate(listed)}
    actual = {module_name(p) for p in PACKAGE.rglob("*.py")} - {"vitkit.__main__"}
    extra, missing = sorted(set(modules) - actual), sorted(actual - set(modules))
    assert not extra and not missing, f"README lists {extra}, misses {missing}"
    for module, deps in import_graph().items():
        for dep in deps & set(modules):
            assert modules[dep] < modules.get(module, len(listed)), f"{module} imports {dep}, listed below it"


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_import_vitkit_does_not_load_the_training_or_plotting_stack():
    code = (
        "import sys, vitkit; "
        "print(sorted(m for m in ('torchvision', 'matplotlib', 'vitkit.training', 'vitkit.data') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""},
    )
    assert out.stdout.strip() == "[]"
