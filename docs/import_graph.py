"""Draw refkv's import graph: which module imports which, in floors.

Usage::

    python docs/import_graph.py [PACKAGE_DIR] [--png OUT.png] [--rooms | --only refkv.oracle]

Every ``import`` and ``from ... import`` of a refkv module is an edge, at module level or
inside a function (a lazy import is still a dependency; only ``if TYPE_CHECKING:`` blocks are
left out). ``--rooms`` merges modules into rooms: a sub-package (``refkv.oracle``) or a
top-level module (``refkv.engine``); ``--only PREFIX`` keeps the modules of one room and the
imports among them. The printout lists the strongly connected components
with more than one member (the circles; none is the goal), then the floors: floor 0 imports
no other refkv module, floor k imports something on floor k-1 and nothing higher. The PNG draws
the floors bottom-up, one row each, with the edges between them.

This is maintainers' tooling (issue 25 asked for a picture of the house before and after); it
needs matplotlib only for ``--png``. ``tests/test_layering.py`` uses its :func:`import_graph`
and :func:`find_cycle` to fail on any circle.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import sys

from refkv.files import atomic_write


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:`` (imports there never run)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every Import/ImportFrom node of ``tree`` that can run: at module level, in a class or in a
    function body, but not in the body of an ``if TYPE_CHECKING:`` block (its ``else`` counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def absolute_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module ``from ... import`` reads from, in a module of ``package``
    (``from ..files import x`` in ``refkv.oracle`` reads ``refkv.files``)."""
    base = package
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    target = node.module or ""
    if node.level:
        target = f"{base}.{target}" if target else base
    return target


def import_graph(sources: dict[str, str], packages=frozenset()) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports, anywhere in its code (``TYPE_CHECKING`` aside).

    ``sources`` maps each module's name to its code, a package's ``__init__`` under the
    package's own name (``refkv.oracle``); ``packages`` names those. ``from X import name``
    imports the module ``X.name`` when that is one of ``sources``, else ``X`` itself. Only
    edges between modules of ``sources`` are kept. The implicit import of a module's parent
    package is no edge: Python runs ``refkv/oracle/__init__.py`` before
    ``refkv/oracle/vectors.py``, but a package importing its own submodules is no circle.
    """
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        package = module if module in packages else module.rpartition(".")[0]
        targets = set()
        for node in _runtime_imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            target = absolute_target(node, package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                targets.add(sub if sub in sources else target)
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def module_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """:func:`import_graph` of every module under ``package_dir`` (``pkg.__init__`` is ``pkg``)."""
    root = package_dir.parent
    sources, packages = {}, set()
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if parts[-1] == "__init__":
            packages.add(name)
        sources[name] = path.read_text(encoding="utf-8")
    return import_graph(sources, packages)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path of the depth-first search, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def room_of(module: str, top: str) -> str:
    """``refkv.oracle.walk`` -> ``refkv.oracle``; ``refkv.engine`` -> ``refkv.engine``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module if module != top else top


def rooms(graph: dict[str, set[str]], top: str) -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = room_of(module, top)
        merged.setdefault(src, set()).update(room_of(t, top) for t in targets)
    # The top package's __init__ re-exports its rooms; it is the roof, not a room.
    merged.pop(top, None)
    return {src: {t for t in targets if t != src and t != top} for src, targets in merged.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Longest import chain below each node; nodes of one circle share the circle's floor."""
    component_of = {}
    for members in circles(graph):
        for m in members:
            component_of[m] = tuple(members)
    floor: dict[str, int] = {}

    def height(node, seen=()):
        if node in floor:
            return floor[node]
        group = component_of.get(node, (node,))
        below = [t for m in group for t in graph.get(m, ()) if t not in group and t not in seen]
        value = 1 + max((height(t, seen + group) for t in below), default=-1)
        for m in group:
            floor[m] = value
        return value

    for node in sorted(graph):
        height(node)
    return floor


def draw(graph: dict[str, set[str]], levels: dict[str, int], out: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_floor: dict[int, list[str]] = {}
    for node, level in levels.items():
        by_floor.setdefault(level, []).append(node)
    width = max(len(v) for v in by_floor.values())
    fig, ax = plt.subplots(figsize=(max(8, 2.0 * width), 1.3 * (len(by_floor) + 1)))
    where = {}
    for level, nodes in by_floor.items():
        for i, node in enumerate(sorted(nodes)):
            where[node] = ((i + 0.5) * width / len(nodes), level)
    for src, targets in graph.items():
        for t in targets:
            (x0, y0), (x1, y1) = where[src], where[t]
            ax.annotate("", xy=(x1, y1 + 0.12), xytext=(x0, y0 - 0.12),
                        arrowprops={"arrowstyle": "->", "color": "0.6", "lw": 0.6,
                                    "connectionstyle": "arc3,rad=0.05"})
    for node, (x, y) in where.items():
        ax.text(x, y, node.split(".", 1)[-1], ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.3"})
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.7, max(by_floor) + 0.7)
    ax.set_yticks(sorted(by_floor))
    ax.set_yticklabels([f"floor {k}" for k in sorted(by_floor)])
    ax.set_xticks([])
    ax.set_title(title)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    data = io.BytesIO()
    fig.savefig(data, dpi=110, format="png")
    plt.close(fig)
    atomic_write(out, data.getvalue())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(pathlib.Path(__file__).resolve().parents[1] / "refkv"))
    parser.add_argument("--png", type=pathlib.Path)
    parser.add_argument("--rooms", action="store_true", help="merge modules into sub-packages and top-level modules")
    parser.add_argument("--only", metavar="PREFIX", help="keep only the modules under PREFIX (e.g. refkv.oracle)")
    args = parser.parse_args(argv)
    package = pathlib.Path(args.package).resolve()
    if not (package / "__init__.py").is_file():
        parser.error(f"package must be a folder holding __init__.py, got {args.package}")
    graph = module_graph(package)
    modules = len(graph)
    if args.rooms:
        graph = rooms(graph, package.name)
    elif args.only:
        keep = {m for m in graph if m == args.only or m.startswith(args.only + ".")}
        graph = {m: graph[m] & keep for m in keep}
        if not graph:
            parser.error(f"--only must name a module or package of {package.name}, got {args.only}")
    edges = sum(len(t) for t in graph.values())
    found = circles(graph)
    levels = floors(graph)
    print(f"{package}: {modules} modules, {len(graph)} nodes, {edges} import edges, "
          f"{len(found)} circle(s), {1 + max(levels.values())} floors")
    for members in found:
        print("  circle:", " <-> ".join(members))
    for level in range(max(levels.values()), -1, -1):
        print(f"  floor {level}:", ", ".join(sorted(n.split('.', 1)[-1] for n, v in levels.items() if v == level)))
    if args.png:
        draw(graph, levels, args.png, f"{args.only or package.name}: {'rooms' if args.rooms else 'modules'}, "
             f"{edges} imports, {len(found)} circle(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
