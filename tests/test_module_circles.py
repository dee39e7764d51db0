"""No module imports one that imports it back, directly or around a circle: an import inside a function
counts, since the module still needs the other to run; one under `if TYPE_CHECKING:` does not, since it
never runs."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"core": "candelabra.core", "backends": "candelabra.backends", "plugins": "candelabra.plugins",
            "conformance": "candelabra.conformance"}


def module_names() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *parts]).removesuffix(".__init__")] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `path` imports anywhere in it; `from package import module` names the module."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules or ({node.module} & modules.keys())
    return found


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not (isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
                pending.append(child)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    order, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in order:
            continue
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in order:
                    order[target] = low[target] = counter[0]
                    counter[0] += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], order[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = module_names()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert circles(graph) == []


def test_an_import_back_inside_a_function_is_a_circle(tmp_path):
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("import candelabra.core.second\n")
    second.write_text("def late():\n    from candelabra.core import first\n")
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import candelabra.core.first\n")
    modules = {"candelabra.core.first": first, "candelabra.core.second": second, "candelabra.core.typed": typed}
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph["candelabra.core.typed"] == set()
    assert circles(graph) == [["candelabra.core.first", "candelabra.core.second"]]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
])
def test_circles_are_found(graph, expected):
    assert sorted(circles(graph)) == expected
