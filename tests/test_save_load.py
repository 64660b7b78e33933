"""save_pretrained / from_pretrained: bit-identical heads, tying, computed buffers, auto_map and remote code."""

import json

import pytest
import torch
from conftest import build, random_ids, run_without_hf_tfm, tiny_config
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from hf_tfm import (
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
)
from hf_tfm.modeling import AUTO_MAP

HEADS = [
    (TfmForCausalLM, AutoModelForCausalLM, {}),
    (TfmForSequenceClassification, AutoModelForSequenceClassification, {"is_causal": False, "num_labels": 3}),
    (TfmForTokenClassification, AutoModelForTokenClassification, {"is_causal": False, "num_labels": 4}),
    (TfmForMaskedLM, AutoModelForMaskedLM, {"is_causal": False, "position_embedding_type": "learned"}),
    (TfmForQuestionAnswering, AutoModelForQuestionAnswering, {"is_causal": False}),
    (TfmModel, AutoModel, {"position_embedding_type": "alibi"}),
]


def stored_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def outputs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    if hasattr(out, "start_logits"):
        return torch.stack((out.start_logits, out.end_logits))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize(("model_class", "auto_class", "overrides"), HEADS, ids=lambda v: getattr(v, "__name__", ""))
def test_round_trip_is_bit_identical(tmp_path, model_class, auto_class, overrides):
    model = build(model_class, tiny_config(**overrides))
    model.save_pretrained(tmp_path)
    loaded = auto_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is model_class
    ids = random_ids(2, 7)
    assert torch.equal(outputs(loaded, ids), outputs(model, ids))
    volatile = {"_name_or_path", "dtype"}
    saved = {k: v for k, v in loaded.config.to_dict().items() if k not in volatile}
    assert saved == {k: v for k, v in model.config.to_dict().items() if k not in volatile}


def test_tied_model_stores_one_copy_and_stays_tied(tmp_path):
    model = build(TfmForCausalLM, tiny_config())
    model.save_pretrained(tmp_path)
    keys = stored_keys(tmp_path)
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)

    mlm = build(TfmForMaskedLM, tiny_config(is_causal=False))
    mlm.save_pretrained(tmp_path / "mlm")
    assert "lm_head.weight" not in stored_keys(tmp_path / "mlm") and "lm_head.bias" in stored_keys(tmp_path / "mlm")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("device_map", ["auto", "cpu"])
def test_device_map_loading_keeps_ties_and_logits(tmp_path, device_map):
    """Big-model loading (`device_map`, accelerate dispatch) gives the same logits and keeps the tie."""
    model = build(TfmForCausalLM, tiny_config())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, attn_implementation="eager").eval()
    ids = random_ids(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_untied_model_stores_both(tmp_path):
    model = build(TfmForCausalLM, tiny_config(tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= stored_keys(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "overrides",
    [
        {"position_embedding_type": "rope"},
        {"position_embedding_type": "rope", "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        {"position_embedding_type": "sinusoidal"},
        {"position_embedding_type": "alibi", "num_attention_heads": 8, "hidden_size": 64},  # and 6 heads below
        {"position_embedding_type": "alibi", "num_attention_heads": 6, "hidden_size": 48},
    ],
    ids=["rope", "rope-linear", "sinusoidal", "alibi8", "alibi6"],
)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_computed_buffers_after_loading(tmp_path, overrides, dtype):
    """Non-persistent buffers are rebuilt after the meta-device load; they stay fp32 even with dtype=bfloat16
    (transformers casts parameters and persistent buffers only), so positions keep full precision."""
    config = tiny_config(**overrides)
    model = build(TfmForCausalLM, config)
    model.save_pretrained(tmp_path)
    assert all("inv_freq" not in k and "slopes" not in k for k in stored_keys(tmp_path))  # computed, not stored
    fresh = dict(build(TfmForCausalLM, tiny_config(**overrides)).named_buffers())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager")
    buffers = dict(loaded.named_buffers())
    assert buffers.keys() == fresh.keys() and buffers
    for name, buffer in buffers.items():
        assert buffer.dtype == torch.float32, name
        assert torch.equal(buffer, fresh[name]), name
    if dtype is None:
        ids = random_ids(1, 6)
        assert torch.equal(outputs(loaded, ids), outputs(model, ids))
    else:
        assert loaded.lm_head.weight.dtype == torch.bfloat16
        assert torch.isfinite(outputs(loaded, random_ids(1, 6))).all()


def test_alibi_slopes_match_the_paper():
    from hf_tfm.modeling import TfmAlibi

    torch.testing.assert_close(TfmAlibi.compute_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 6 heads: the 4-head slopes, then every other one of the 8-head slopes (arXiv:2108.12409, appendix)
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(TfmAlibi.compute_slopes(6), torch.tensor(expected))


def test_config_json_lists_every_head(tmp_path):
    build(TfmForSequenceClassification, tiny_config(is_causal=False)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP
    assert set(AUTO_MAP) == {
        "AutoConfig",
        "AutoModel",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForMaskedLM",
        "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering",
    }
    assert saved["model_type"] == "hf_tfm"
    assert {p.name for p in tmp_path.iterdir()} >= {"configuration.py", "modeling.py", "config.json"}
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "TfmConfig"


@pytest.mark.slow
def test_remote_code_round_trip_without_hf_tfm(tmp_path):
    """In a process where hf_tfm cannot be imported: both checkpoints load from their own code with
    trust_remote_code, give bit-identical logits and generate; without trust_remote_code loading fails."""
    lm = build(TfmForCausalLM, tiny_config(num_key_value_heads=2))
    clf = build(TfmForSequenceClassification, tiny_config(is_causal=False, num_labels=3))
    lm.save_pretrained(tmp_path / "lm")
    clf.save_pretrained(tmp_path / "clf")
    ids = random_ids(2, 5)
    torch.save(ids, tmp_path / "ids.pt")
    code = """
    import json, torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    try:
        import hf_tfm
        raise SystemExit("hf_tfm must not be importable here")
    except ImportError:
        pass
    ids = torch.load("ids.pt")
    kwargs = {"trust_remote_code": True, "attn_implementation": "eager"}
    lm = AutoModelForCausalLM.from_pretrained("lm", **kwargs).eval()
    clf = AutoModelForSequenceClassification.from_pretrained("clf", **kwargs).eval()
    with torch.no_grad():
        torch.save({"lm": lm(input_ids=ids).logits, "clf": clf(input_ids=ids).logits}, "logits.pt")
    gen = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                      do_sample=False)
    refused = False
    try:
        AutoModelForCausalLM.from_pretrained("lm")
    except ValueError as err:
        refused = "trust_remote_code" in str(err)
    print("RESULT:" + json.dumps({
        "modules": [type(lm).__module__, type(clf).__module__],
        "tied": lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr(),
        "generated": gen.tolist(),
        "refused": refused,
    }))
    """
    stdout = run_without_hf_tfm(code, tmp_path)
    result = json.loads(stdout.split("RESULT:")[-1])  # the refused load's prompt also writes to stdout
    assert all(m.startswith("transformers_modules.") for m in result["modules"]), result["modules"]
    assert result["tied"] and result["refused"]
    logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        assert torch.equal(logits["lm"], lm(input_ids=ids).logits)
        assert torch.equal(logits["clf"], clf(input_ids=ids).logits)
    expected = lm.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    assert result["generated"] == expected.tolist()


def test_run_without_hf_tfm_blocks_the_package(tmp_path):
    """The helper itself: hf_tfm really is unimportable there, and failures surface with the child's stderr."""
    assert run_without_hf_tfm("import json; print(json.dumps(1 + 1))", tmp_path).strip() == "2"
    with pytest.raises(RuntimeError, match=r"ModuleNotFoundError|ImportError"):
        run_without_hf_tfm("import hf_tfm", tmp_path)
