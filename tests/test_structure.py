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


def without_type_checking(tree: ast.Module) -> ast.Module:
    """The module without its `if TYPE_CHECKING:` blocks: imports for annotations only, never run."""
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                kept = [
                    n for n in block if not (isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING"))
                ]
                setattr(node, field, kept)
    return tree


def import_graph() -> dict[str, set[str]]:
    """Module -> the vitkit modules it imports anywhere: at module level, or deferred inside a function; relative
    imports (within a folder) and absolute ones (between folders); not those for annotations only."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(without_type_checking(ast.parse(path.read_text()))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "vitkit"):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = node.module if not node.level else f"{base}.{node.module}" if node.module else base
                for alias in node.names:  # `from a import b`: the module a.b where b is one, else a
                    sub = f"{module}.{alias.name}"
                    deps.add(
                        sub
                        if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                        else module
                    )
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
    assert (
        "vitkit.formats.checkpoints" in graph["vitkit.cli.commands"]
        and "vitkit.formats" in graph["vitkit.formats.checkpoints"]
    )
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The folders, each a wing of the house, lowest first: a module imports from its own folder and from folders listed
# before it, never after. `vitkit` (the lazy public API) and `vitkit.__main__` sit above them all.
WINGS = ["errors", "files", "models", "data", "formats", "speed", "training", "analysis", "cli"]


def wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def test_folders_import_only_downwards():
    wings = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__",)}
    assert wings - {"__init__.py", "__main__.py", "__init__", "__main__"} == set(WINGS)
    for module, deps in import_graph().items():
        for dep in deps:
            here, there = wing(module), wing(dep)
            if here and there and here != there:
                assert WINGS.index(there) < WINGS.index(here), f"{module} imports {dep}: {there}/ is above {here}/"


def test_every_folder_says_what_it_holds_in_one_line():
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and doc.split("\n\n")[0].count(".") >= 1, f"{folder.name}/__init__.py needs a docstring"


def test_readme_folder_map_lists_every_folder_in_dependency_order():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Structure", 1)[1].split("\n## ", 1)[0]
    listed = [cell.strip("`/") for cell in re.findall(r"^\| `([\w/.]+)` \|", table, flags=re.M)]
    assert [w.removesuffix(".py") for w in listed if w.removesuffix(".py") in WINGS] == WINGS, listed
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        row = re.search(rf"^\| `{folder.name}/` \|([^\n]*)", table, flags=re.M)
        assert row, folder.name
        for module in folder.glob("*.py"):  # each module of the folder named in its row
            assert module.name == "__init__.py" or f"`{module.stem}`" in row.group(1), f"{folder.name}: {module.stem}"


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_import_vitkit_does_not_load_the_training_or_plotting_stack():
    code = (
        "import sys, vitkit; "
        "print(sorted(m for m in ('torchvision', 'matplotlib', 'vitkit.training.loop', 'vitkit.data.datasets') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""},
    )
    assert out.stdout.strip() == "[]"
