"""The package's import structure, read from the source: no module imports from a layer above its own, and no
import circle, function-level imports included (docs/architecture.md draws the layers)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "loramux"
# Each layer may import from its own and the ones before it, never from one after it.
LAYERS = [
    {"config", "logs", "logprobs", "sampling_params", "tokenizer"},  # the bottom: no torch model code
    {"ops"},
    {"layers"},
    {"models"},
    {"adapters"},
    {"engine"},
    {"llm", "server"},
    {"cli", "__main__"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["loramux", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its file."""
    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                # `from pkg import sub`: the submodule (a package's own __init__ only for the names it defines)
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= subs | ({node.module} if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
        edges[name] = targets - {name}
    return edges


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "loramux"
    return next((i for i, names in enumerate(LAYERS) if top in names), 0 if top == "loramux" else -1)


def test_every_top_level_name_has_a_layer():
    tops = {m.split(".")[1] for m in _modules() if "." in m}
    assert not {t for t in tops if _layer(f"loramux.{t}") < 0}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [(a, b) for a, targets in _imports(_modules()).items() for b in targets if _layer(b) > _layer(a)]
    assert upward == []


def test_no_import_circles():
    edges = _imports(_modules())
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert circles == []
