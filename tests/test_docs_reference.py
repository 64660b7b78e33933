"""The reference pages: the configuration reference is generated and current, the Python API page complete.

`scripts/gen_docs.py` reads every field of `TfmConfig` and `TfmSeq2SeqConfig` and its comments; these tests keep every
field documented and the committed page what the script writes (`python scripts/gen_docs.py` regenerates it).
docs/reference/api.md documents `hf_tfm.__all__` and every name a guide imports, each with a parameter table that
matches its signature and an example; the examples run in order.
"""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
from conftest import load_script

from hf_tfm import TfmConfig, TfmSeq2SeqConfig
from hf_tfm.configuration import TfmExpertKnobs

GEN_DOCS = Path(__file__).resolve().parents[1] / "scripts" / "gen_docs.py"

FAKE_SOURCE = '''
class TfmConfig:
    """Not a comment."""

    # --- sizes: a section comment documents no field
    hidden_size: int = 128
    vocab_size: int = 1024  # documented by its trailing comment
    # documented by the comment above it
    num_layers: int = 2
    # a comment that a blank line separates from the field documents nothing

    head_dim: int | None = None
    bias: bool = (
        True  # documented inside a ruff-wrapped default
    )


class Other:
    width: int = 1
'''


def load_gen_docs():
    return load_script(GEN_DOCS, "hf_tfm_gen_docs")


def own_fields(config_class: type) -> list[str]:
    """The fields the class itself declares (`dataclasses.fields` also lists `PreTrainedConfig`'s)."""
    annotations = vars(config_class).get("__annotations__", {})
    return [field.name for field in dataclasses.fields(config_class) if field.name in annotations]


def test_every_field_is_documented():
    gen_docs = load_gen_docs()
    assert gen_docs.undocumented_fields() == []
    # The script reads the same fields the classes declare.
    parsed = [
        f"{field.owner}.{field.name}"
        for section in gen_docs.parse_sections(gen_docs.SOURCE.read_text())
        for field in section.fields
    ]
    classes = (TfmConfig, TfmExpertKnobs, TfmSeq2SeqConfig)
    declared = [f"{cls.__name__}.{name}" for cls in classes for name in own_fields(cls)]
    assert sorted(parsed) == sorted(declared)


def test_undocumented_field_is_detected():
    gen_docs = load_gen_docs()
    assert gen_docs.undocumented_fields(FAKE_SOURCE) == ["TfmConfig.hidden_size", "TfmConfig.head_dim"]
    sections = gen_docs.parse_sections(FAKE_SOURCE)
    assert [(s.name, s.intro, [f.name for f in s.fields]) for s in sections] == [
        (
            "sizes",
            "a section comment documents no field",
            ["hidden_size", "vocab_size", "num_layers", "head_dim", "bias"],
        )
    ]
    docs = {field.name: field.doc for field in sections[0].fields}
    assert docs["bias"] == "documented inside a ruff-wrapped default"
    assert docs["num_layers"] == "documented by the comment above it"


def test_types_and_defaults_come_from_the_source():
    gen_docs = load_gen_docs()
    fields = {
        field.name: field
        for section in gen_docs.parse_sections(gen_docs.SOURCE.read_text(), ("TfmConfig",))
        for field in section.fields
    }
    assert fields["norm_position"].type == '`"pre"`, `"post"`'
    assert fields["norm_position"].default == '"pre"'
    assert fields["classifier_pooling"].type == '`"first"`, `"mean"`, `"last"` or `None`'
    assert fields["first_layer_attn_norm"].default == "True"  # a default ruff wrapped in parentheses


def test_committed_page_is_current():
    gen_docs = load_gen_docs()
    assert gen_docs.is_current(), "docs/reference/configuration.md is out of date: run `python scripts/gen_docs.py`"
    assert gen_docs.main(["--check"]) == 0


def test_page_lists_every_field():
    gen_docs = load_gen_docs()
    page = gen_docs.OUTPUT.read_text()
    assert page.startswith("# Configuration reference\n")
    for name in own_fields(TfmConfig) + own_fields(TfmExpertKnobs):  # the expert knobs: with num_experts
        assert f'<a id="{name}"></a>`{name}`' in page, name
    for name in own_fields(TfmSeq2SeqConfig):
        assert f'<a id="TfmSeq2SeqConfig.{name}"></a>`{name}`' in page, name


def test_page_lists_every_preset():
    from hf_tfm.presets import PRESETS

    page = load_gen_docs().OUTPUT.read_text()
    assert "## Presets" in page
    for name in PRESETS:
        assert f"| `{name}` |" in page, name


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    gen_docs = load_gen_docs()
    stale = tmp_path / "docs" / "reference" / "configuration.md"
    stale.parent.mkdir(parents=True)
    stale.write_text(gen_docs.OUTPUT.read_text().replace("epsilon of every norm", "an old meaning"))
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    monkeypatch.setattr(gen_docs, "OUTPUT", stale)
    assert gen_docs.main(["--check"]) == 1
    assert "docs/reference/configuration.md is out of date" in capsys.readouterr().err
    assert gen_docs.main([]) == 0  # regenerating makes it current
    assert gen_docs.main(["--check"]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# The Python API page (docs/reference/api.md): every public name and every name a guide imports, each with its
# parameters and an example


API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "api.md"
CONFIGS = {"hf_tfm.TfmConfig", "hf_tfm.TfmSeq2SeqConfig", "hf_tfm.TfmEncoderConfig", "hf_tfm.TfmDecoderConfig"}
CONSTANTS = {"hf_tfm.modeling.CACHE_NAME"}  # documented names that take no parameters


def api_entries() -> dict[str, str]:
    """The name each entry is headed with (`::: path`, or its `heading` option where the path is where the object is
    defined) -> the page's text from its `:::` line to the next entry or section."""
    text = API_PAGE.read_text()
    parts = re.split(r"^::: ([\w.]+)\n", text, flags=re.MULTILINE)
    entries = {}
    for path, body in zip(parts[1::2], parts[2::2], strict=True):
        heading = re.match(r'    options:\n(?:      .*\n)*?      heading: "([\w.]+)"', body)
        entries[heading[1] if heading else path] = body.split("\n## ")[0]
    return entries


def resolve(name: str):
    """`name` as a reader writes it: `from <everything before the last dot> import <the last part>`."""
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def guide_imports() -> set[str]:
    """Every `from hf_tfm[.module] import A, B` of the other documentation pages and the README, as dotted names."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    pages = [p for p in docs.rglob("*.md") if p != API_PAGE] + [docs.parent / "README.md"]
    names = set()
    for page in pages:
        for module, imported in re.findall(r"^\s*from (hf_tfm[\w.]*) import ([\w, ]+)$", page.read_text(), re.M):
            names |= {f"{module}.{name.strip()}" for name in imported.split(",")}
    return names


def table_parameters(body: str) -> list[str]:
    """The first column of the entry's parameter table, each cell's names (`a`, `b` in one cell count as two)."""
    if "| parameter |" not in body:
        return []
    rows = re.findall(r"^\| (.+?) \|", body.split("| parameter |", 1)[1], flags=re.M)  # the rows under the header
    return [name for row in rows for name in re.findall(r"`([*\w]+)`", row)]


def signature_parameters(obj) -> list[str]:
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    target = obj.__init__ if inspect.isclass(obj) else obj
    return [marks.get(p.kind, "") + name for name, p in inspect.signature(target).parameters.items() if name != "self"]


def test_api_reference_covers_public_names_and_guide_imports():
    import hf_tfm

    documented = set(api_entries())
    assert {f"hf_tfm.{name}" for name in hf_tfm.__all__} <= documented
    objects = [resolve(name) for name in documented]
    for name in guide_imports() - documented:  # documented under another name it has (`hf_tfm.X` for a module's X)
        assert any(resolve(name) is obj for obj in objects), f"{name}: a guide imports it; the API page lacks it"


def test_api_reference_names_resolve_as_written():
    for name in api_entries():
        assert resolve(name) is not None, name


def test_api_reference_entries_have_parameters_and_an_example():
    for name, body in api_entries().items():
        assert "```python\n" in body, f"{name}: no example"
        if name in CONSTANTS:
            continue
        if name in CONFIGS:  # every knob: the configuration reference, generated from the fields
            assert "configuration.md" in body and table_parameters(body), name
            continue
        assert table_parameters(body) == signature_parameters(resolve(name)), name


def test_api_reference_blocks(tmp_path, monkeypatch):
    """The page's examples run in order as one session; the last, calibration, where llm-compressor's environment
    is made (as in CI)."""
    from conftest import ROOT, doc_blocks, run_doc_block, run_doc_blocks

    blocks = doc_blocks("reference/api")
    assert "calibrate(" in blocks[-1] and all("calibrate(" not in block for block in blocks[:-1])
    namespace = run_doc_blocks("reference/api", len(blocks), tmp_path, monkeypatch, first=len(blocks) - 1)
    assert namespace["continued"].shape == (1, 8) and namespace["translated"].shape[0] == 1
    assert namespace["report"]["max_logit_diff"] == 0.0  # the f32 GGUF: PyTorch's logits
    assert type(namespace["back"]).__name__ == "TfmForCausalLM" and (tmp_path / "out" / "lm-llama").is_dir()
    llmcompressor = ROOT / ".venv-llmcompressor" / "bin" / "python"
    if not llmcompressor.exists():
        pytest.skip("the calibration example needs llm-compressor's environment: make llmcompressor-env")
    monkeypatch.setenv("HF_TFM_LLMCOMPRESSOR_PYTHON", str(llmcompressor))
    run_doc_block("reference/api", len(blocks) - 1, namespace)
    assert (tmp_path / "out" / "lm-gptq" / "config.json").is_file()
