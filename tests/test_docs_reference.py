"""The configuration reference (docs/reference/configuration.md) is generated from `TfmConfig`'s source and current.

`scripts/gen_docs.py` reads every field of `TfmConfig` and `TfmSeq2SeqConfig` and its comments; these tests keep every
field documented and the committed page what the script writes (`python scripts/gen_docs.py` regenerates it).
"""

import dataclasses
from pathlib import Path

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
