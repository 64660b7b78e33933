"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`), from the installed release's sdist.

Every in-tree model's `tests/models/x/test_modeling_x.py` builds on `tests/test_modeling_common.py` and
`tests/test_configuration_common.py`; those ship in transformers' source distribution, not in its wheel. `load()`
fetches the sdist of the installed release with pip (once: it is kept under `~/.cache/hf_tfm`), unpacks its top-level
`tests/*.py` as the package `transformers_common_tests`, and returns that package's two modules. Three modules they
import are not in the sdist; they are written here in their smallest faithful form:

- `generation/test_utils.py`: `GenerationTesterMixin` as an empty class. The generation tests themselves live in the
  repository only; `test_generation_tester_mixin_inheritance` just asks that generative suites inherit it.
- `exporters/test_export.py`: `ExportTesterMixin` as an empty class (the export tests are repository-only too).
- `utils/test_configuration_utils.py`: `config_common_kwargs`, a non-default value for each `PreTrainedConfig`
  attribute, which `ConfigTester.check_config_arguments_init` sets and reads back.
"""

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import transformers

PACKAGE = "transformers_common_tests"
CACHE = Path(os.environ.get("HF_TFM_CACHE", Path.home() / ".cache" / "hf_tfm")) / "transformers-tests"

STUBS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "utils/test_configuration_utils.py": """config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
""",
}


def _unpack(version: str, target: Path) -> None:
    """Download transformers==version's sdist and lay out its `tests/*.py` as a package under `target`."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*command, "-d", tmp, f"transformers=={version}"], check=True, capture_output=True, timeout=300)
        (archive,) = Path(tmp).glob("transformers-*.tar.gz")
        staging = Path(tmp) / PACKAGE
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts  # transformers-X/tests/NAME.py
                if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                    (staging / parts[2]).write_bytes(tar.extractfile(member).read())
        if not (staging / "test_modeling_common.py").is_file():
            raise FileNotFoundError(f"{archive.name} has no tests/test_modeling_common.py")
        (staging / "__init__.py").write_text("")
        for name, text in STUBS.items():
            (staging / name).parent.mkdir(exist_ok=True)
            (staging / name).parent.joinpath("__init__.py").touch()
            (staging / name).write_text(text)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(staging, target)  # whole or not at all: a cut download leaves no half package behind


def load() -> tuple[ModuleType, ModuleType]:
    """`(test_modeling_common, test_configuration_common)` of the installed release; raises `RuntimeError` with a
    one-line reason when they cannot be had (no registry, no sdist for this release)."""
    root = CACHE / transformers.__version__
    if not (root / PACKAGE / "test_modeling_common.py").is_file():
        try:
            _unpack(transformers.__version__, root / PACKAGE)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            detail = getattr(err, "stderr", b"") or b""
            reason = detail.decode(errors="replace").strip().splitlines()[-1:] or [str(err)]
            raise RuntimeError(
                f"transformers {transformers.__version__}'s sdist tests unavailable: {reason[0]}"
            ) from err
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
    )
