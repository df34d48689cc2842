"""The layout's rules, read from the source's imports (every import statement, in functions too):
no import cycles; the generator (generator/, shipped as gemmgen.generator) imports nothing of the
runtime but the foundation modules; the runtime reaches the generator only through its public
modules (generator/__init__.py names them); selection and tuning (gemmgen.select) import neither
the operations (gemmgen.ops) nor the command line (gemmgen.cli), which are built on them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# gemmgen.integrations: importing gemmgen registers it with torch's SDPA registry; the package itself
# imports only the standard library (its torch_sdpa module loads when torch does).
FOUNDATION = {"gemmgen", "gemmgen.errors", "gemmgen.arch", "gemmgen.cache", "gemmgen.integrations"}
# What the runtime may import of the generator: the family contract and instance spaces, the
# manifest schema, and the on-demand compile. `gemmgen generate` and `gemmgen package` (the CLI)
# also drive the build and write kernels wheels.
GENERATOR_API = {"gemmgen.generator", "gemmgen.generator.space", "gemmgen.generator.families",
                 "gemmgen.generator.families.base", "gemmgen.generator.manifest", "gemmgen.generator.ondemand"}
CLI_ALSO = {"gemmgen.generator.build", "gemmgen.generator.package"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for the installed layout (generator/ is gemmgen.generator)."""
    found = {}
    for top, package in (("gemmgen", "gemmgen"), ("generator", "gemmgen.generator")):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (`from a import b` counts a.b when b is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & known
            out |= subs or ({node.module} & known)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def is_generator(name: str) -> bool:
    return name == "gemmgen.generator" or name.startswith("gemmgen.generator.")


def test_the_layout_is_read():
    g = graph()
    assert "gemmgen.generator.space" in g and "gemmgen.select.registry" in g and "gemmgen.ops.attention" in g
    assert "gemmgen.generator.space" in g["gemmgen.select.registry"]  # an edge the rules below rely on


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_generator_imports_no_runtime_module():
    bad = {(m, d) for m, deps in graph().items() if is_generator(m)
           for d in deps if not is_generator(d) and d not in FOUNDATION}
    assert bad == set()


def test_the_runtime_reaches_the_generator_through_its_public_modules():
    bad = set()
    for m, deps in graph().items():
        if is_generator(m):
            continue
        allowed = GENERATOR_API | (CLI_ALSO if m.startswith("gemmgen.cli.") else set())
        bad |= {(m, d) for d in deps if is_generator(d) and d not in allowed}
    assert bad == set()


def test_foundation_modules_import_only_each_other():
    g = graph()
    assert {(m, d) for m in FOUNDATION for d in g[m] if d not in FOUNDATION} == set()


def test_selection_imports_no_operation_or_command_module():
    above = ("gemmgen.ops", "gemmgen.cli")
    bad = {(m, d) for m, deps in graph().items() if m == "gemmgen.select" or m.startswith("gemmgen.select.")
           for d in deps if any(d == p or d.startswith(p + ".") for p in above)}
    assert bad == set()


def test_kernel_bindings_import_nothing_above_them():
    """gemmgen.kernels (the C ABI and launching) sits below selection: the problem of a call on
    tensors is gemmgen.select.calls', not the launcher's."""
    above = ("gemmgen.select", "gemmgen.ops", "gemmgen.cli")
    bad = {(m, d) for m, deps in graph().items() if m.startswith("gemmgen.kernels")
           for d in deps if any(d == p or d.startswith(p + ".") for p in above)}
    assert bad == set()
