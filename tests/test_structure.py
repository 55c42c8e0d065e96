"""The package's shape: the product (``src/engramrt``) never imports the lab distribution
(``engramrt_lab``), the core does not import the CLI or the bench, the core reaches a memory
family only through the registry, imports form no cycle, and no function outside the Triton
kernels runs past 150 lines.

The import graph is read from the source (``ast``), lazy imports inside functions
included and ``if TYPE_CHECKING:`` blocks left out (they never run), so nothing is
imported to check it. Each rule has a control that shows it can fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
BENCH = Path(__file__).resolve().parents[1] / "bench"
LAB_SRC = Path(__file__).resolve().parents[1] / "lab" / "src"

LAB_DISTRIBUTION = "engramrt_lab"
"""The lab's package (``lab/src/engramrt_lab``: models, training, the demo): it uses the
product; no module of the product imports it, lazily or by a string naming it."""

LAB = ("engramrt.cli", "engramrt.bench")
"""The CLI's commands and the bench package: they may use the core; the core (every other
module of engramrt) never imports them."""

FAMILIES = "engramrt.families"
REGISTRY = "engramrt.family"
"""The memory families' packages, and the registry that names them: the core reaches a
family only through :func:`engramrt.family.resolve_family` (the registry holds their names
as strings), so a family is added without editing the core."""

MAX_FUNCTION_LINES = 150


def module_files(root: Path = SRC) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


_MODULE_STRING = re.compile(r"engramrt(\.\w+)+(:\w+)?")


def imports_of(
    module: str, source: str, modules: dict[str, Path], *, strings: bool = True
) -> set[str]:
    """The engramrt modules ``module`` imports at run time (``from pkg import name``
    names ``pkg.name`` when that is a module, else ``pkg``), and those a string names
    whole (``"engramrt.pkg.mod"`` or ``"engramrt.pkg:name"``, what ``importlib`` and
    the package's lazy names take) when ``strings``: a cycle is about import
    statements only, since a name resolved on use runs after every import."""
    is_package = modules.get(module, Path()).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(source)):
        if strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_STRING.fullmatch(node.value):
                name = node.value.partition(":")[0]
                while name not in modules and "." in name:
                    name = name.rpartition(".")[0]
                found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "engramrt")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != "engramrt":
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
    return found


_LAB_STRING = re.compile(rf"{LAB_DISTRIBUTION}(\.\w+)*(:\w+)?")


def lab_imports_of(source: str) -> set[str]:
    """The ``engramrt_lab`` modules ``source`` imports at run time, or names whole in a
    string (``"engramrt_lab.models"``, ``"engramrt_lab.cli:register"``)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _LAB_STRING.fullmatch(node.value):
                found.add(node.value.partition(":")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == LAB_DISTRIBUTION)
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == LAB_DISTRIBUTION
        ):
            found.add(node.module or "")
    return found


def product_imports_of_lab_distribution(sources: dict[str, str]) -> list[str]:
    """``"<module> imports <lab module>"`` for every product module (``{name: source}``)
    that imports the lab distribution."""
    return sorted(
        f"{module} imports {target}"
        for module, source in sources.items()
        for target in lab_imports_of(source)
    )


def import_graph(modules: dict[str, Path], *, strings: bool = True) -> dict[str, set[str]]:
    return {
        m: imports_of(m, p.read_text(), modules, strings=strings) & set(modules) - {m}
        for m, p in modules.items()
    }


def in_lab(module: str) -> bool:
    return any(module == lab or module.startswith(lab + ".") for lab in LAB)


def core_imports_of_lab(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if not in_lab(m)
        for t in targets
        if in_lab(t)
    )


def in_families(module: str) -> bool:
    return module == FAMILIES or module.startswith(FAMILIES + ".")


def core_imports_of_families(graph: dict[str, set[str]]) -> list[str]:
    """Import statements from a core module (not the lab, not a family, not the
    registry) into a family package."""
    return sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if not (in_lab(m) or in_families(m) or m == REGISTRY)
        for t in targets
        if in_families(t)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (
            isinstance(target, ast.Attribute)
            and target.attr in ("jit", "autotune", "heuristics")
            and isinstance(target.value, ast.Name)
            and target.value.id == "triton"
        ):
            return True
    return False


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function longer than ``limit`` lines (``end_lineno -
    lineno + 1``, decorators not counted), ``@triton.jit`` kernels exempt."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(node):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


# -- the rules -------------------------------------------------------------------


def test_the_product_does_not_import_the_lab_distribution() -> None:
    sources = {m: p.read_text() for m, p in module_files().items()}
    assert product_imports_of_lab_distribution(sources) == []
    assert not (SRC / LAB_DISTRIBUTION).exists(), "the lab's package lies under lab/src"


def test_the_core_does_not_import_the_cli_or_the_bench() -> None:
    assert core_imports_of_lab(import_graph(module_files())) == []


def test_the_core_reaches_families_only_through_the_registry() -> None:
    assert core_imports_of_families(import_graph(module_files(), strings=False)) == []


def test_import_graph_has_no_cycles() -> None:
    assert cycles(import_graph(module_files(), strings=False)) == []


@pytest.mark.parametrize("root", [SRC, LAB_SRC, BENCH], ids=["src", "lab", "bench"])
def test_no_function_runs_past_the_limit(root: Path) -> None:
    too_long = {
        f"{path.relative_to(root.parent)}:{name}": lines
        for path in sorted(root.rglob("*.py"))
        for name, lines in long_functions(path.read_text())
    }
    assert too_long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# -- controls: each rule sees a violation ------------------------------------------


def test_control_catches_an_import_of_the_lab_distribution() -> None:
    """A fake product whose modules import the lab every way the rule must see: at the top,
    lazily, by ``from``, by a string; a ``TYPE_CHECKING`` import and a docstring that
    merely names the lab are not imports."""
    sources = {
        "engramrt.plan": "import engramrt_lab.models\n",
        "engramrt.layer": "def f():\n    from engramrt_lab.models.serve import load_model\n",
        "engramrt.cli": 'import importlib\nimportlib.import_module("engramrt_lab.cli")\n',
        "engramrt.gate": '"""Used by ``engramrt_lab.training`` for its gate."""\n',
        "engramrt.step": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engramrt_lab\n"
        ),
        "engramrt.lookup": "import engramrt_labels\nfrom engramrt import lab\n",
    }
    assert product_imports_of_lab_distribution(sources) == [
        "engramrt.cli imports engramrt_lab.cli",
        "engramrt.layer imports engramrt_lab.models.serve",
        "engramrt.plan imports engramrt_lab.models",
    ]


def test_controls_catch_a_lab_import_a_cycle_and_a_long_function(tmp_path: Path) -> None:
    modules = {
        "engramrt.plan": Path("plan.py"),
        "engramrt.cli": Path("__init__.py"),
        "engramrt.cli.serve": Path("serve.py"),
        "engramrt.a": Path("a.py"),
        "engramrt.b": Path("b.py"),
    }
    lazy_lab = "def f():\n    from engramrt.cli.serve import serve\n"
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engramrt.cli\n"
    assert imports_of("engramrt.plan", lazy_lab, modules) == {"engramrt.cli.serve"}
    assert imports_of("engramrt.plan", typing_only, modules) == set()
    by_name = 'import importlib\nimportlib.import_module("engramrt.cli.serve")\n'
    assert imports_of("engramrt.plan", by_name, modules) == {"engramrt.cli.serve"}
    graph = {
        "engramrt.plan": {"engramrt.cli.serve"},
        "engramrt.cli.serve": {"engramrt.plan"},
        "engramrt.a": {"engramrt.b"},
        "engramrt.b": {"engramrt.a"},
    }
    assert core_imports_of_lab(graph) == ["engramrt.plan imports engramrt.cli.serve"]
    families = {
        "engramrt.plan": {"engramrt.families.qwen4_ple.family"},
        "engramrt.family": {"engramrt.families.qwen4_ple.family"},
        "engramrt.families.qwen4_ple.ops": {"engramrt.families.qwen4_ple.ids"},
        "engramrt.cli.hash_ple": {"engramrt.families.qwen4_ple.ops"},
    }
    assert core_imports_of_families(families) == [
        "engramrt.plan imports engramrt.families.qwen4_ple.family"
    ]
    assert sorted(cycles(graph)) == [
        ["engramrt.a", "engramrt.b"],
        ["engramrt.cli.serve", "engramrt.plan"],
    ]
    assert cycles({"engramrt.a": {"engramrt.b"}, "engramrt.b": set()}) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def long():\n{body}\n") == [("long", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"@triton.jit\ndef _kernel():\n{body}\n") == []
    assert long_functions(f"def short():\n{body[: body.rfind(chr(10))]}\n") == []
