"""Check that blockspec's imports only go down its layers and never form a cycle.

Every import of a blockspec module counts, at the top of a file or inside a function. The layers,
from the bottom:

    errors, io, clock, sampling,    plain helpers, tokenizer conventions, the bundled prompt files,
    tokens, data, machine           what a timing depends on
    hub                             known models: install, verify, convert, cache
    models                          networks, checkpoint formats, target loading
    drafters                        the drafter protocol's implementations and the registry
    decoding                        the step, verifier, caches, trees, width policy, and their drivers
    training, dllm, bench, serve,   what is built on decoding
    demo
    cli                             the command line

A module may import its own layer or any layer below; modules of one layer may import each
other as long as no cycle forms. Run: ``python scripts/check_imports.py`` (exit 1 on a problem).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = [
    ("blockspec.errors", "blockspec.io", "blockspec.clock", "blockspec.sampling", "blockspec.tokens", "blockspec.data",
     "blockspec.machine"),
    ("blockspec.hub",),
    ("blockspec.models",),
    ("blockspec.drafters",),
    ("blockspec.decoding",),
    ("blockspec.training", "blockspec.dllm", "blockspec.bench", "blockspec.serve", "blockspec.demo"),
    ("blockspec.cli",),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The blockspec modules ``path`` imports (a ``from package import module`` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return {module for module in found if module in known and module != name}


def layer_of(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return rank
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def problems(root: Path) -> list[str]:
    """Every upward import, unplaced module and import cycle under ``root`` (the folder holding blockspec/)."""
    paths = {module_name(path, root): path for path in sorted((root / "blockspec").rglob("*.py"))}
    known = set(paths)
    graph = {name: imports_of(path, name, known) for name, path in paths.items()}
    found = []
    for name, imported in sorted(graph.items()):
        rank = layer_of(name)
        if rank is None and name != "blockspec":
            found.append(f"{name} belongs to no layer: add it to LAYERS in {Path(__file__).name}")
            continue
        for other in sorted(imported):
            other_rank = layer_of(other)
            if rank is not None and other_rank is not None and other_rank > rank:
                found.append(f"upward import: {name} imports {other}")
    found += [f"import cycle: {' -> '.join(component)}" for component in cycles(graph)]
    return found


def main() -> int:
    found = problems(Path(__file__).resolve().parent.parent)
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
