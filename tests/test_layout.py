"""The package's imports run one way: every module sits in one layer of `LAYERS` (docs/development.md's map), and
imports only modules of its own layer or of layers below it, without cycles.

The package root (`hf_tfm/__init__.py`, the names users import and the Auto-class registration) is what modules
import to have hf_tfm's classes registered; it is the one module any layer may name. `hf_tfm/programs/*.py` other
than its `__init__` run by path in processes of their own and import nothing of hf_tfm (tests/test_programs.py).
"""

import ast
import re
from pathlib import Path

from conftest import DOCS, ROOT

PACKAGE = ROOT / "hf_tfm"

# bottom to top: a module imports only modules of its own layer and the layers before it
LAYERS = [
    # what a saved folder carries as remote code, and what needs nothing of hf_tfm
    {"configuration", "checkpoint", "distributed", "modeling"},
    {"tokenization", "data", "training.collator", "training.threads", "scale_out", "programs", "exporters.registry"},
    # the inference wing, bottom to top: kernels, layers, the quantize table and attention, the step, the loader
    {"inference.kernels"},
    {"inference.layers", "inference.step_store"},
    {"inference.quantize", "inference.attention", "inference.cache"},
    {"inference.aot"},
    {"inference.load", "inference"},
    # the model's routes out and the helpers built on it
    {"checks", "presets"},
    {"convert.core", "convert.fields", "convert.from_torch", "convert.llama_like", "convert.bart", "convert.bert"},
    {
        "convert",
        "convert.gpt2",
        "convert.marian",
        "convert.mixtral",
        "convert.modernbert",
        "convert.olmoe",
        "convert.qwen2_moe",
    },
    {"exporters._common", "exporters.gguf_vocab"},
    {"exporters.gguf", "exporters.onnx", "exporters.ctranslate2", "exporters.executorch", "exporters"},
    # the steps behind the commands, then the commands, then the entry point
    {
        "training",
        "training.output_dir",
        "training.trainer",
        "training.lora",
        "training.metrics",
        "training.generation",
        "training.plots",
        "training.model_card",
        "training.causal_lm",
        "training.classifier",
        "training.seq2seq",
        "training.job",
        "calibration",
        "info",
    },
    {"commands", "commands.common", "commands.training_options"},
    {
        "commands.calibrate",
        "commands.classify",
        "commands.compile",
        "commands.convert",
        "commands.demo",
        "commands.export",
        "commands.finetune",
        "commands.generate",
        "commands.info",
        "commands.pretrain",
        "commands.push",
        "commands.seq2seq",
        "commands.serve",
    },
    {"cli"},
]
LAYER = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def module_files() -> dict[str, Path]:
    """name relative to the package (`convert.core`) -> its file, for every module but the root and the programs."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[0] == "programs" and parts[-1] != "__init__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path) -> set[str]:
    """The hf_tfm modules `path` imports (`from .x import y` names module x, or x.y where that is a module)."""
    modules = module_files()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".") if package else []
            base = base[: len(base) - (node.level - 1)]
            stem = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{stem}.{a.name}".strip(".") for a in node.names]
            # `from . import kernels` names the module kernels, not its package (which is being imported already)
            targets = names if node.module is None and all(n in modules for n in names) else [stem, *names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hf_tfm":
            stem = node.module.removeprefix("hf_tfm").strip(".")
            targets = [stem, *(f"{stem}.{a.name}".strip(".") for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [
                a.name.removeprefix("hf_tfm").strip(".") for a in node.names if a.name.split(".")[0] == "hf_tfm"
            ]
        found |= {t for t in targets if t in modules and t != name}
    return found


def graph() -> dict[str, set[str]]:
    return {name: imported(name, path) for name, path in module_files().items()}


def test_every_module_has_a_layer():
    missing = set(module_files()) - set(LAYER)
    stale = set(LAYER) - set(module_files())
    assert not missing, f"modules without a layer in LAYERS (place them, and in docs/development.md): {missing}"
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_run_one_way():
    upward = [
        f"{name} (layer {LAYER[name]}) imports {target} (layer {LAYER[target]})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if LAYER[target] > LAYER[name]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    edges = graph()
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges[name]):
            # a package's __init__ re-exporting its modules is not a cycle with them
            if target.startswith(f"{name}."):
                continue
            if state.get(target) == "open":
                raise AssertionError(" -> ".join([*trail, name, target]))
            if target not in state:
                visit(target, [*trail, name])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [])


def test_the_import_finder_sees_imports():
    """The oracle of the tests above: known imports are found (relative, absolute, from a package's __init__)."""
    edges = graph()
    assert {"configuration", "checkpoint", "distributed"} <= edges["modeling"]
    assert "exporters.registry" in edges["exporters.gguf"] and "programs" in edges["exporters.gguf"]
    assert "commands" in edges["cli"] and "checks" in edges["convert.bart"]
    assert edges["configuration"] == set()


# The rooms with a fixed set of modules: a module that leaves its room (back to the top level, or into another) fails
# here. docs/development.md lists every room of hf_tfm/ on a line of its own.
ROOMS = {
    "training": {
        "collator",
        "threads",
        "trainer",
        "causal_lm",
        "classifier",
        "seq2seq",
        "lora",
        "metrics",
        "generation",
        "plots",
        "model_card",
        "output_dir",
        "job",
    },
    "convert": {
        "core",
        "fields",
        "from_torch",
        "llama_like",
        "gpt2",
        "bert",
        "modernbert",
        "mixtral",
        "qwen2_moe",
        "olmoe",
        "bart",
        "marian",
    },
    "inference": {"load", "layers", "quantize", "attention", "aot", "kernels", "cache", "step_store"},
}
MAX_FUNCTION_LINES = 80


def rooms_in_tree() -> set[str]:
    """hf_tfm/'s top-level modules (`name.py`) and folders (`name/`), caches left out."""
    return {
        f"{p.name}/" if p.is_dir() else p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and p.name != "__pycache__") or p.suffix == ".py"
    }


def rooms_in_docs() -> set[str]:
    """The rooms docs/development.md lists: its `- `name`: ...` lines under "The rooms of `hf_tfm/`"."""
    text = (DOCS / "development.md").read_text()
    section = text.split("The rooms of `hf_tfm/`", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"^- `([\w./]+)`:", section, flags=re.MULTILINE))


def test_every_room_has_its_line_in_the_docs():
    tree = rooms_in_tree()
    documented = rooms_in_docs()
    assert tree - documented == set(), "rooms without a line in docs/development.md's room list"
    assert documented - tree == set(), "docs/development.md lists rooms that do not exist"


def test_rooms_hold_their_modules():
    for room, expected in ROOMS.items():
        assert (PACKAGE / room).is_dir(), f"hf_tfm/{room}/ is missing"
        found = {p.stem for p in (PACKAGE / room).glob("*.py") if p.name != "__init__.py"}
        assert found == expected, f"hf_tfm/{room}/: {sorted(found ^ expected)} differ from ROOMS"


def function_lengths(source: str) -> list[tuple[int, int, str]]:
    """(lines, first line, name) of every function and method in `source`, nested ones too: from `def` to its end."""
    return [
        (node.end_lineno - node.lineno + 1, node.lineno, node.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_no_function_over_80_lines():
    """A function that needs a scroll bar is two functions: none over 80 lines in hf_tfm/ and scripts/."""
    files = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
    long = [
        f"{path.relative_to(ROOT)}:{line} {name}: {lines} lines"
        for path in files
        for lines, line, name in function_lengths(path.read_text(encoding="utf-8"))
        if lines > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def test_the_function_length_check_counts_from_def_to_the_end():
    """The oracle of the check above: decorators left out, a nested function counted on its own and in its parent."""
    source = "@decorator\ndef outer(\n    x,\n):\n    def inner():\n        return 1\n\n    return inner\n"
    assert sorted(function_lengths(source)) == [(2, 5, "inner"), (7, 2, "outer")]
