"""The package's layers: a module imports only from its own layer or a lower one, and validating a config
imports neither ``datasets`` nor ``torch``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qlora_train"
# lowest first; packages on one layer (diagnostics, train) are siblings and do not import each other
LAYERS = [
    {"qlora_train", "qlora_train.errors", "qlora_train.files", "qlora_train.locations", "qlora_train.chat_templates",
     "qlora_train.terminal"},
    {"qlora_train.masking"},  # the mask engine: a conversation and a tokenizer in, text, masks and labels out
    {"qlora_train.config"},
    {"qlora_train.output_dir"},  # whose folder train.output_dir is, and which run writes into it now
    {"qlora_train.rl"},  # online RL apart from the Trainer: sampling, rewards, tools (agent prompts' schemas), loss
    {"qlora_train.data"},
    {"qlora_train.vision"},  # which bases read images, their image processor (the tokenizer carries its rule)
    {"qlora_train.tokenizer"},
    {"qlora_train.diagnostics", "qlora_train.train"},
    {"qlora_train.export"},  # loads the base as training did, reads the run's outputs
    {"qlora_train.tiny_agent"},  # the agent demo's model taught the call shape (qlora_train.tiny --agent saves it)
    {"qlora_train.cli", "qlora_train.tiny"},
]


def unit(module: str) -> str:
    """``qlora_train.masking.render`` -> ``qlora_train.data``: the package or top-level module that owns it."""
    return ".".join(module.split(".")[:2])


def layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if unit(module) in names)


def imports_of(path: Path) -> set[str]:
    """Every ``qlora_train`` module a file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qlora_train"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("qlora_train")}
    return out


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def test_every_module_has_a_layer():
    assert [m for m, _ in modules() if not any(unit(m) in names for names in LAYERS)] == []


def test_no_module_imports_a_higher_layer_or_a_sibling():
    wrong = []
    for name, path in modules():
        for imported in imports_of(path):
            if layer(imported) > layer(name) or (layer(imported) == layer(name) and unit(imported) != unit(name)
                                                 and layer(name) != 0):
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_the_mask_engine_is_called_through_its_package():
    """Outside ``qlora_train.masking``, the package imports only its public names (``masking.__all__``), never a
    module of it: its boundary is its ``__init__``."""
    import qlora_train.masking as masking

    wrong = []
    for name, path in modules():
        if unit(name) == "qlora_train.masking":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qlora_train.masking"):
                names = {a.name for a in node.names}
                if node.module != "qlora_train.masking" or names - set(masking.__all__):
                    wrong.append(f"{name}: from {node.module} import {sorted(names)}")
    assert wrong == []


def strings_naming_other_packages(name: str, path: Path, known: set[str]) -> list[str]:
    """The string constants of a module that name a ``qlora_train`` module of another package: a lazy re-export
    (``{"render_conversation": "qlora_train.masking.render"}`` and ``importlib``), which the layer check cannot see."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value
            and node.value in known and unit(node.value) != unit(name)]


def test_no_module_reexports_another_package_by_string():
    known = {m for m, _ in modules()}
    found = [f"{name}: {s!r}" for name, path in modules() for s in strings_naming_other_packages(name, path, known)]
    assert found == []


def test_the_string_check_can_fail(tmp_path):
    side_door = tmp_path / "side_door.py"
    side_door.write_text('_EXPORTS = {"build": "qlora_train.masking.render", "own": "qlora_train.data.parse"}\n')
    known = {"qlora_train.masking.render", "qlora_train.data.parse"}
    assert strings_naming_other_packages("qlora_train.data", side_door, known) == ["qlora_train.masking.render"]


def test_the_layer_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from qlora_train.train.run import train\n")
    assert imports_of(bad) == {"qlora_train.train.run"}
    assert layer("qlora_train.train.run") > layer("qlora_train.config")


def package_names(path: Path) -> dict[str, str]:
    """What a package's ``__init__`` imports by name from ``qlora_train`` modules: name -> that module."""
    return {a.asname or a.name: node.module for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qlora_train") for a in node.names}


def import_graph() -> dict[str, set[str]]:
    """Every ``qlora_train`` module -> the modules it imports, at the top or inside a function (as ``imports_of``
    reads them). A name imported from a package is the module it is (``from qlora_train.masking import budget``)
    or the one the package's ``__init__`` takes it from (``from qlora_train.masking import render_conversation``:
    ``qlora_train.masking.render``): a package's ``__init__`` imports its modules, not they it."""
    paths = dict(modules())
    inits = {name: package_names(path) for name, path in paths.items() if path.name == "__init__.py"}

    def resolve(module: str, name: str) -> str:
        if f"{module}.{name}" in paths:
            return f"{module}.{name}"
        source = inits.get(module, {}).get(name)
        return module if source is None else resolve(source, name) if source in inits else source

    graph = {}
    for name, path in paths.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qlora_train"):
                out |= {resolve(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("qlora_train")}
        graph[name] = out - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in ``graph`` (``[a, b, a]``: a imports b, b imports a), or ``[]``."""
    done, path = set(), []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return []

    return next((c for c in map(visit, sorted(graph)) if c), [])


def test_no_import_circle():
    """No module imports one that imports it back, directly or through others, not even inside a function (an
    import inside a function that breaks a circle at import time still ties the two modules into one)."""
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_the_circle_check_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph()  # a name the engine's package imports is the engine module that defines it
    assert "qlora_train.masking.messages" in graph["qlora_train.data.parse"]
    assert "qlora_train.masking" not in graph["qlora_train.data.parse"]


@pytest.mark.parametrize("code", [
    # a missing local model (no tiny model built yet) is a ConfigError after the whole validation ran
    "from qlora_train.config import ConfigError, load_config\n"
    "for p in sorted(pathlib.Path('configs').glob('*.yaml')):\n"
    "    try: load_config(p)\n"
    "    except ConfigError: pass",
    "import qlora_train.masking, qlora_train.tokenizer, qlora_train.chat_templates",
])
def test_validating_a_config_imports_neither_datasets_nor_torch(code):
    probe = f"import pathlib, sys\n{code}\nprint(sorted(m for m in ('datasets', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
