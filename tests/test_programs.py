"""hf_tfm's programs (`hf_tfm/programs/`): files run by path in a process of their own, which import nothing of hf_tfm
(and, each where it runs, neither torch nor transformers), and `run_program`, the one way they are run."""

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from hf_tfm.programs import HERE, LAUNCHER, program_path, run_program

PROGRAMS = sorted(path for path in HERE.glob("*.py") if path.name != "__init__.py")
# Program -> the top-level packages it must not import: what a deployment of its runtime does not have (the runtime's
# own Python for llama.cpp, no PyTorch beside ONNX Runtime, one OpenMP runtime beside CTranslate2)
FORBIDDEN = {
    "launch.py": {"hf_tfm", "torch", "transformers", "numpy"},
    "llama_cpp_side.py": {"hf_tfm", "torch", "transformers"},
    "onnxruntime_side.py": {"hf_tfm", "torch", "transformers"},
    "ctranslate2_side.py": {"hf_tfm", "torch", "transformers"},
    "executorch_side.py": {"hf_tfm", "transformers"},
    "executorch_encoder_side.py": {"hf_tfm", "transformers"},
    "transformers_gguf_side.py": {"hf_tfm"},
    "standalone_generate.py": {"hf_tfm"},
    # hf_tfm's own worker: the job it unpickles names hf_tfm's classes, but it imports nothing of hf_tfm itself
    "compile_step.py": {"hf_tfm", "transformers"},
}


def _imports(path: Path) -> set[str]:
    """The top-level packages a file imports, anywhere in it (relative imports as ".")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


def test_every_program_is_listed_with_what_it_must_not_import():
    assert {path.name for path in PROGRAMS} == set(FORBIDDEN)


@pytest.mark.parametrize("path", PROGRAMS, ids=[path.stem for path in PROGRAMS])
def test_programs_import_nothing_of_hf_tfm_and_define_run(path):
    imported = _imports(path)
    assert not imported & (FORBIDDEN[path.name] | {"."}), imported
    names = {node.name for node in ast.parse(path.read_text(encoding="utf-8")).body if hasattr(node, "name")}
    assert ("main" if path == LAUNCHER else "run") in names


def test_program_path_names_only_programs():
    assert program_path("onnxruntime_side") == HERE / "onnxruntime_side.py"
    for name in ("launch", "__init__", "no_such_program"):
        with pytest.raises(ValueError, match="not one of hf_tfm's programs"):
            program_path(name)


def _launch(tmp_path: Path, code: str, *blocked: str) -> subprocess.CompletedProcess:
    program, result = tmp_path / "program.py", tmp_path / "result.pkl"
    program.write_text(code, encoding="utf-8")
    command = [sys.executable, str(LAUNCHER), str(program), str(result), *blocked]
    return subprocess.run(command, input=json.dumps({"x": 2}), capture_output=True, text=True, check=False)


@pytest.mark.slow
def test_the_launcher_blocks_modules_and_hides_its_folder(tmp_path):
    """`launch.py` runs a program's `run(args)` on stdin's JSON, pickles the result, makes each blocked module fail to
    import, and keeps its own folder off sys.path (so `import x` finds the installed x)."""
    code = (
        "import sys\n"
        "def run(args):\n"
        "    try:\n"
        "        import json\n"
        "        blocked = False\n"
        "    except ImportError:\n"
        "        blocked = True\n"
        f"    return {{'twice': 2 * args['x'], 'blocked': blocked, 'path': {str(HERE)!r} in sys.path}}\n"
    )
    assert _launch(tmp_path, code).returncode == 0
    assert pickle.loads((tmp_path / "result.pkl").read_bytes()) == {"twice": 4, "blocked": False, "path": False}
    assert _launch(tmp_path, code, "json").returncode == 0
    assert pickle.loads((tmp_path / "result.pkl").read_bytes())["blocked"] is True


@pytest.mark.slow
def test_a_failing_program_names_the_runtime_and_the_path(tmp_path):
    missing = tmp_path / "no_model"
    with pytest.raises(RuntimeError, match=f"CTranslate2 failed on {missing}: .+"):
        run_program("ctranslate2_side", {"path": str(missing), "encoder": True, "prompts": [[1]]}, "CTranslate2")


@pytest.mark.slow
def test_run_program_runs_a_file_by_path_and_a_module_by_name(tmp_path, monkeypatch):
    """Besides its own programs, `run_program` starts a program file elsewhere by its path (the benchmark's worker)
    and an installed module by its dotted name, its package imported first (`hf_tfm.calibration`), in a process of
    its own or here; a module that is not installed fails naming the runtime and the path."""
    (tmp_path / "worker.py").write_text("def run(args):\n    return {'twice': 2 * args['x']}\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("LOADED = True\n")
    side = "from . import LOADED\n\n\ndef run(args):\n    return {'thrice': 3 * args['x'], 'package': LOADED}\n"
    (tmp_path / "pkg" / "side.py").write_text(side)
    args = {"path": "somewhere", "x": 2}
    assert run_program(tmp_path / "worker.py", args, "a worker") == {"twice": 4}
    assert run_program(tmp_path / "worker.py", args, "a worker", fresh_process=False) == {"twice": 4}
    found = {"thrice": 6, "package": True}
    assert run_program("pkg.side", args, "a module", env={"PYTHONPATH": str(tmp_path)}) == found
    with pytest.raises(RuntimeError, match=r"a module failed on somewhere: (.|\n)*No module named 'pkg'"):
        run_program("pkg.side", args, "a module")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_program("pkg.side", args, "a module", fresh_process=False) == found


def test_onnxruntime_side_pads_as_generate_does():
    side = pytest.importorskip("hf_tfm.programs.onnxruntime_side")
    ids, mask = side.padded([[5, 6, 7], [8]], pad=0, left=True)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = side.padded([[5, 6, 7], [8]], pad=1, left=False)
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.slow
def test_standalone_generate_loads_the_folders_own_code(tmp_path):
    """The fresh-process generation of a just-written folder runs where hf_tfm cannot be imported: the model comes
    from the folder's copied code."""
    import torch

    import hf_tfm
    from hf_tfm.tokenization import train_bpe_tokenizer
    from hf_tfm.training import generate_in_fresh_process

    tokenizer = train_bpe_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300)
    torch.manual_seed(0)
    lm = hf_tfm.TfmForCausalLM(hf_tfm.TfmConfig(vocab_size=300, hidden_size=32, num_attention_heads=4))
    lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    result = generate_in_fresh_process(tmp_path, ["def ", "import "], max_new_tokens=4)
    assert result["class"].startswith("transformers_modules.") and result["class"].endswith(".TfmForCausalLM")
    assert len(result["generations"]) == 2
