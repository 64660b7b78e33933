"""GGUF export (hf_tfm.export): files written from TfmConfig + state_dict, read back by transformers' own GGUF loader.

The oracle is the in-tree Llama / Qwen2 / GPT-2 model transformers builds from the file alone: f32 files give its
logits within 1e-4 of hf_tfm's and the same greedy tokens. The models are tiny but trained on a repeated token cycle,
so each greedy step has a clear winner (no near-ties that float noise could flip).
"""

import importlib.util
import json
import re
import sys
import unicodedata

import pytest
import tokenizer_shapes
import torch
import transformers
from export_models import GPT2_BLOCK, NEW_TOKENS, PROMPTS, SIZES, VOCAB, config_of, saved, train_tokenizer, trained

import hf_tfm
from hf_tfm.cli import main
from hf_tfm.exporters import export, gguf_vocab, verify
from hf_tfm.exporters import gguf as gguf_export
from hf_tfm.exporters.gguf import gguf_architecture, gguf_blockers

gguf = pytest.importorskip("gguf")

LLAMA = {}
LLAMA_GQA_UNTIED = {"num_key_value_heads": 2, "tie_word_embeddings": False}
LLAMA_GQA_TIED = {"num_key_value_heads": 2}
LLAMA_MHA_UNTIED = {"tie_word_embeddings": False}
QWEN2 = {"num_key_value_heads": 2, "attention_bias": True, "attention_out_bias": False}
QWEN3 = {"num_key_value_heads": 2, "qk_norm": True}
GPT2 = GPT2_BLOCK
# BLOOM's block: ALiBi, a LayerNorm after the embeddings, then GPT-2's block (4 * hidden MLP) without positions
BLOOM = {**GPT2_BLOCK, "position_embedding_type": "alibi", "embedding_norm": True, "intermediate_size": 256}
# Experts on every layer: Mixtral's block (llama), Qwen2-MoE's (biases, unnormalised top-k, a shared expert) and
# Qwen3-MoE's
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
MIXTRAL = {**MOE, "num_key_value_heads": 2, "tie_word_embeddings": False}
QWEN2_MOE = {**QWEN2, **MOE, "norm_topk_prob": False, "shared_expert_intermediate_size": 96}
QWEN3_MOE = {**QWEN3, **MOE}
# The blocks llama.cpp runs that transformers' GGUF loader does not read (verified in llama.cpp:
# tests/test_export_llama_cpp.py): the default block with ALiBi, GPT-NeoX's, MPT's
LAYERNORM_GELU = {"norm_type": "layernorm", "norm_eps": 1e-5, "ffn_type": "mlp", "hidden_act": "gelu_new"}
REFACT = {"position_embedding_type": "alibi", "num_key_value_heads": 2}
GPTNEOX = {**GPT2_BLOCK, "position_embedding_type": "rope", "parallel_residual": True, "tie_word_embeddings": False}
GPTNEOX_SEQUENTIAL = {**GPT2_BLOCK, "position_embedding_type": "rope"}
MPT = {**LAYERNORM_GELU, "position_embedding_type": "alibi", "num_key_value_heads": 2}
MPT_LEARNED = {**LAYERNORM_GELU, "position_embedding_type": "learned", "norm_bias": False}
MPT_SINUSOIDAL = {**GPT2_BLOCK, "position_embedding_type": "sinusoidal", "tie_word_embeddings": False}  # paper scale
# BERT's encoder block with llama.cpp's GELU (tanh): embeddings through llama.cpp's bert graph
BERT_TANH = {**GPT2_BLOCK, "is_causal": False, "norm_position": "post", "embedding_norm": True}
LINEAR_ROPE = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
LLAMA3_ROPE = {
    "rope_parameters": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    }
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize(
    ("overrides", "arch", "in_tree"),
    [
        (LLAMA, "llama", "LlamaForCausalLM"),
        (LLAMA_MHA_UNTIED, "llama", "LlamaForCausalLM"),
        (LLAMA_GQA_TIED, "llama", "LlamaForCausalLM"),
        (LLAMA_GQA_UNTIED, "llama", "LlamaForCausalLM"),
        (QWEN2, "qwen2", "Qwen2ForCausalLM"),
        (QWEN3, "qwen3", "Qwen3ForCausalLM"),
        ({**QWEN3, "head_dim": 24, "tie_word_embeddings": False}, "qwen3", "Qwen3ForCausalLM"),
        (GPT2, "gpt2", "GPT2LMHeadModel"),
        (BLOOM, "bloom", "BloomForCausalLM"),
        ({**BLOOM, "tie_word_embeddings": False}, "bloom", "BloomForCausalLM"),
        # 6 heads: ALiBi's slopes for a head count that is no power of 2 (the paper's interleave, as BLOOM's)
        (
            {**BLOOM, "hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 384},
            "bloom",
            "BloomForCausalLM",
        ),
        ({**LLAMA_GQA_TIED, **LINEAR_ROPE}, "llama", "LlamaForCausalLM"),
        ({**LLAMA_GQA_TIED, **LLAMA3_ROPE}, "llama", "LlamaForCausalLM"),
        (MIXTRAL, "llama", "MixtralForCausalLM"),
        (MOE, "llama", "MixtralForCausalLM"),
        (QWEN2_MOE, "qwen2moe", "Qwen2MoeForCausalLM"),
        ({**QWEN2_MOE, "num_experts_per_tok": 1, "tie_word_embeddings": False}, "qwen2moe", "Qwen2MoeForCausalLM"),
        (QWEN3_MOE, "qwen3moe", "Qwen3MoeForCausalLM"),
    ],
    ids=[
        *("llama-mha-tied", "llama-mha-untied", "llama-gqa-tied", "llama-gqa-untied", "qwen2"),
        *("qwen3", "qwen3-head_dim-untied", "gpt2", "bloom-tied", "bloom-untied", "bloom-6-heads", "linear", "l3"),
        *("mixtral-gqa-untied", "mixtral-mha-tied", "qwen2moe", "qwen2moe-top1-untied", "qwen3moe"),
    ],
)
def test_f32_export_is_exact_through_transformers_loader(overrides, arch, in_tree, tmp_path, tokenizer):
    model = trained(overrides)
    path = export(model, tmp_path / "model.gguf", tokenizer=tokenizer)
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"{arch} {overrides}: {report}")
    assert (report["architecture"], report["class"], report["file_type"]) == (arch, in_tree, "ALL_F32")
    assert report["max_logit_diff"] < 1e-4
    assert report["tokens_equal"]
    reader = gguf.GGUFReader(path)
    untied = not model.config.tie_word_embeddings or arch == "qwen2moe"  # llama.cpp's qwen2moe needs output.weight
    assert any(t.name == "output.weight" for t in reader.tensors) == untied


# Max logit difference measured (2 prompts x 32 greedy tokens, logits up to ~14; transformers 5.24 and 5.16.1):
#   llama GQA untied: f16 7.6e-3, bf16 7.6e-2, q8_0 0.21, q4_0 2.4 (llama MHA tied: 3.2e-3, 1.8e-2, 6.9e-2, 0.79;
#   qwen2: 4.2e-3, 3.6e-2, 9.4e-2, 1.5); greedy tokens equal for every type. f32 is bit-identical (difference 0).
TOLERANCES = {"f16": 2e-2, "bf16": 0.2, "q8_0": 0.5, "q4_0": 4.0}


@pytest.mark.parametrize("qtype", list(TOLERANCES))
def test_reduced_types_agree_within_tolerance(qtype, tmp_path, tokenizer):
    model = trained(LLAMA_GQA_UNTIED)
    path = export(model, tmp_path, quantize=qtype, tokenizer=tokenizer)
    assert path.name == f"model-{qtype}.gguf"
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"{qtype}: {report}")
    assert report["file_type"] == gguf_export.TYPES[qtype][1]
    assert report["max_logit_diff"] < TOLERANCES[qtype]
    assert report["forced_agreement"] >= 0.9
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf_export.TYPES[qtype][0]
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"


@pytest.mark.parametrize("case", ["mixtral", "qwen2moe"])
def test_quantized_experts(case, tmp_path, tokenizer):
    """Experts' 3-D weights quantize like the 2-D ones (runs of 32 along a row); the routers stay F32, as llama.cpp's
    converter keeps them. Measured at q8_0: max logit difference 0.07 (mixtral) and 0.32 (qwen2moe), tokens equal."""
    model = trained(MIXTRAL if case == "mixtral" else QWEN2_MOE)
    path = export(model, tmp_path, quantize="q8_0", tokenizer=tokenizer)
    report = verify(path, model, prompts=PROMPTS, max_new_tokens=NEW_TOKENS, fresh_process=False)
    print(f"{case} q8_0: {report}")
    assert report["max_logit_diff"] < TOLERANCES["q8_0"] and report["forced_agreement"] >= 0.9
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert kinds[f"blk.1.{name}.weight"] == "Q8_0", name
    assert kinds["blk.1.ffn_gate_inp.weight"] == "F32"
    if case == "qwen2moe":
        assert kinds["blk.1.ffn_gate_inp_shexp.weight"] == "F32" and kinds["blk.1.ffn_up_shexp.weight"] == "Q8_0"


def _field(reader, key):
    field = reader.fields[key]
    if len(field.data) == 1 and field.types[0] != gguf.GGUFValueType.ARRAY:
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value[0].item()
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode() for i in field.data]
    return [field.parts[i][0].item() for i in field.data]


def test_tokenizer_metadata_round_trips(tmp_path, tokenizer):
    folder = saved(LLAMA, tmp_path / "lm", tokenizer)
    path = export(folder, tmp_path / "lm.gguf")
    reader = gguf.GGUFReader(path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and len(vocab) < VOCAB
    assert {token: i for i, token in enumerate(tokens) if i < len(vocab)} == vocab
    assert tokens[len(vocab) :] == [f"[PAD{i}]" for i in range(len(vocab), VOCAB)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert _field(reader, "tokenizer.ggml.merges") == merges
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[:5] == [gguf.TokenType.CONTROL] * 5 and types[5] == gguf.TokenType.NORMAL
    assert types[-1] == gguf.TokenType.UNUSED
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    ids = {
        key: _field(reader, f"tokenizer.ggml.{key}") for key in ("bos_token_id", "eos_token_id", "padding_token_id")
    }
    assert ids == {"bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0}
    assert _field(reader, "tokenizer.ggml.unknown_token_id") == 3
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True  # hf_tfm's tokenizer prepends <s>
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.context_length") == SIZES["max_position_embeddings"]


def test_rope_scaling_metadata(tmp_path, tokenizer):
    path = export(trained({**LLAMA_GQA_TIED, **LINEAR_ROPE}), tmp_path / "linear.gguf", tokenizer=tokenizer)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "llama.rope.scaling.type") == "linear"
    assert _field(reader, "llama.rope.scaling.factor") == 2.0
    model = trained({**LLAMA_GQA_TIED, **LLAMA3_ROPE})
    reader = gguf.GGUFReader(export(model, tmp_path / "l3.gguf", tokenizer=tokenizer))
    (freqs,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    head_dim = model.config.head_dim
    default = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(default / torch.from_numpy(freqs.data.copy()), model.model.rotary_emb.inv_freq)


# Each refusal: the knobs (overrides of the llama config) and the words the error must hold. The control is the same
# config without them, which exports.
REFUSALS = [
    ({"position_embedding_type": "alibi", "mlp_bias": True}, ["`mlp_bias`=True", "transformers.exporters"]),
    ({"norm_position": "post"}, ["`norm_position`='post'"]),
    ({"sliding_window": 16}, ["`layer_types`", "sliding window", "to_hf", "mistral"]),
    ({"qk_norm": True, "qk_norm_scope": "projection"}, ["`qk_norm`=True", "`qk_norm_scope`='projection'"]),
    ({"parallel_residual": True}, ["`parallel_residual`=True"]),
    ({"num_experts": 4, "mlp_only_layers": [0]}, ["`mlp_only_layers`=[0]", "experts on every layer"]),
    ({"embedding_scale": 8.0}, ["`embedding_scale`=8.0", "folded into an untied model's token table"]),
    ({"lm_head_bias": True, "tie_word_embeddings": False}, ["`lm_head_bias`=True"]),
    ({"hidden_act": "gelu"}, ["`hidden_act`='gelu'"]),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, ["`rope_parameters`", "rope_type in"]),
    ({"is_causal": False}, ["`is_causal`=False"]),
    ({"qk_norm": True, "parallel_residual": True}, ["`qk_norm`=True", "`parallel_residual`=True"]),
]


@pytest.mark.parametrize(("knobs", "words"), REFUSALS, ids=[",".join(k) for k, _ in REFUSALS])
def test_refusals_name_every_knob(knobs, words):
    assert gguf_architecture(config_of()) == "llama"  # the control: the same config without the knobs
    config = config_of(**knobs)
    with pytest.raises(ValueError, match=r"llama\.cpp") as err:
        gguf_architecture(config)
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert gguf_blockers(config) and not gguf_blockers(config_of())


def test_qwen2_qwen3_and_gpt2_controls():
    assert gguf_architecture(config_of(**QWEN2)) == "qwen2"
    assert gguf_architecture(config_of(**QWEN3)) == "qwen3"
    with pytest.raises(ValueError, match=r"`attention_bias`=True \(llama.cpp qwen3 needs False\)"):
        gguf_architecture(config_of(**QWEN3, attention_bias=True))
    assert gguf_architecture(config_of(**GPT2)) == "gpt2"
    with pytest.raises(ValueError, match=r"`head_dim`=8 \(llama.cpp qwen2 needs hidden/heads\)"):
        gguf_architecture(config_of(**QWEN2, head_dim=8))
    # gpt2 has no GQA: GPT-2's block with it goes to mpt, whose biases are optional and whose q/k/v are GQA-sized
    gpt2_gqa = config_of(**GPT2, num_key_value_heads=2)
    assert "`num_key_value_heads`=2 (llama.cpp gpt2" in gguf_export.gguf_architecture_blockers(gpt2_gqa)["gpt2"][0]
    assert gguf_architecture(gpt2_gqa) == "mpt"


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"embedding_norm": False}, "`embedding_norm`=False (llama.cpp bloom needs True"),
        ({"intermediate_size": 128}, "`intermediate_size`=128 (llama.cpp bloom needs 256 (4 * hidden_size"),
        ({"num_key_value_heads": 2}, "`num_key_value_heads`=2 (llama.cpp bloom needs"),
        ({"hidden_act": "gelu"}, "`hidden_act`='gelu' (llama.cpp bloom needs a tanh GELU"),
        ({"mlp_bias": False}, "`mlp_bias`=False (llama.cpp bloom needs True)"),
    ],
    ids=["no-embedding-norm", "mlp-width", "gqa", "erf-gelu", "no-mlp-bias"],
)
def test_bloom_refusals_with_control(knobs, words):
    """ALiBi goes to llama.cpp's bloom only with its whole block; each knob that leaves it is named (the config may
    still go to mpt, BLOOM's block without the embedding norm)."""
    assert gguf_architecture(config_of(**BLOOM)) == "bloom"  # the control
    config = config_of(**{**BLOOM, **knobs})
    assert any(words in b for b in gguf_export.gguf_architecture_blockers(config)["bloom"])


@pytest.mark.parametrize(
    ("base", "knobs", "words"),
    [
        (MIXTRAL, {"norm_topk_prob": False}, "`norm_topk_prob`=False (llama.cpp llama needs True"),
        (MIXTRAL, {"shared_expert_intermediate_size": 64}, "llama.cpp llama needs None (no shared expert)"),
        (MIXTRAL, {"decoder_sparse_step": 2}, "`decoder_sparse_step`=2 (llama.cpp llama needs 1"),
        (QWEN2_MOE, {"shared_expert_intermediate_size": None}, "llama.cpp qwen2moe needs a width"),
        (QWEN2_MOE, {"norm_topk_prob": True}, "`norm_topk_prob`=True (llama.cpp qwen2moe needs False"),
        (QWEN3_MOE, {"qk_norm_scope": "projection"}, "`qk_norm_scope`='projection' (llama.cpp qwen3moe needs 'head'"),
    ],
    ids=[
        "mixtral-unnormalised",
        "mixtral-shared",
        "mixtral-dense-layers",
        "qwen2moe-no-shared",
        "qwen2moe-norm",
        "qwen3moe-proj",
    ],
)
def test_moe_refusals_with_control(base, knobs, words):
    """Experts go to the architecture whose graph routes them as hf_tfm does; each knob that leaves it is named."""
    expected = {id(MIXTRAL): "llama", id(QWEN2_MOE): "qwen2moe", id(QWEN3_MOE): "qwen3moe"}[id(base)]
    assert gguf_architecture(config_of(**base)) == expected  # the control
    with pytest.raises(ValueError, match=r"No llama\.cpp") as err:
        gguf_architecture(config_of(**{**base, **knobs}))
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("overrides", "arch"),
    [
        (REFACT, "refact"),
        (GPTNEOX, "gptneox"),
        (GPTNEOX_SEQUENTIAL, "gptneox"),
        (MPT, "mpt"),
        (MPT_LEARNED, "mpt"),
        (MPT_SINUSOIDAL, "mpt"),
        ({"embedding_scale": 8.0, "tie_word_embeddings": False}, "llama"),
    ],
    ids=["refact", "gptneox", "gptneox-sequential", "mpt-alibi", "mpt-learned-no-bias", "mpt-sinusoidal", "scaled"],
)
def test_llama_cpp_only_architectures_write_their_graph_keys(overrides, arch, tmp_path, tokenizer):
    """What each llama.cpp graph reads besides the llama set: ALiBi without RoPE keys, GPT-NeoX's residual layout,
    MPT's ALiBi bias (0: none) and position table (hf_tfm's sinusoidal table, row by row), a folded embedding scale.
    Their numbers are checked in llama.cpp itself (tests/test_export_llama_cpp.py)."""
    model = trained(overrides)
    config = model.config
    assert gguf_architecture(config) == arch
    reader = gguf.GGUFReader(export(model, tmp_path / "model.gguf", tokenizer=tokenizer))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert _field(reader, "general.architecture") == arch
    assert (f"{arch}.rope.freq_base" in reader.fields) == (config.position_embedding_type == "rope")
    if arch == "gptneox":
        assert _field(reader, "gptneox.use_parallel_residual") is config.parallel_residual
        assert "output.weight" in tensors  # its graph has no tied fallback
    if arch == "mpt":  # ALiBi's bias; 0 (no key) turns it off
        bias = _field(reader, "mpt.attention.max_alibi_bias") if "mpt.attention.max_alibi_bias" in reader.fields else 0
        assert bias == (8.0 if config.position_embedding_type == "alibi" else 0)
        assert ("blk.0.attn_qkv.bias" in tensors) is config.attention_bias
        assert ("output_norm.bias" in tensors) is config.norm_bias
    positions = torch.arange(config.max_position_embeddings)[None]
    if config.position_embedding_type in ("learned", "sinusoidal"):
        with torch.no_grad():
            table = model.model._absolute_positions(positions, torch.float32)[0]
        assert torch.equal(tensors["position_embd.weight"], table)
    scale = config.embedding_scale
    assert torch.equal(tensors["token_embd.weight"], model.model.embed_tokens.weight.detach() * scale)


@pytest.mark.parametrize(
    ("base", "knobs", "words"),
    [
        (REFACT, {"attention_bias": True}, "`attention_bias`=True (llama.cpp refact needs False"),
        (GPTNEOX, {"mlp_bias": False}, "`mlp_bias`=False (llama.cpp gptneox needs True"),
        (GPTNEOX, {"hidden_act": "gelu"}, "`hidden_act`='gelu' (llama.cpp gptneox needs a tanh GELU"),
        (GPTNEOX, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "RoPE on every dim"),
        (MPT, {"position_offset": 2, "position_embedding_type": "learned"}, "`position_offset`=2 (llama.cpp mpt"),
        (MPT, {"qk_norm": True}, "`qk_norm`=True (llama.cpp mpt needs False"),
        (MPT_SINUSOIDAL, {"tie_word_embeddings": True}, "1.0 with tied embeddings"),
    ],
    ids=["refact-bias", "gptneox-mlp-bias", "gptneox-erf", "gptneox-partial", "mpt-offset", "mpt-qk-norm", "mpt-tied"],
)
def test_llama_cpp_only_refusals_with_control(base, knobs, words):
    expected = gguf_architecture(config_of(**base))  # the control
    assert expected in ("refact", "gptneox", "mpt")
    with pytest.raises(ValueError, match=r"No llama\.cpp") as err:
        gguf_architecture(config_of(**{**base, **knobs}))
    assert words in str(err.value), str(err.value)


def test_llama_cpp_is_needed_for_k_quants_and_its_own_architectures(tmp_path, tokenizer, monkeypatch, capsys):
    """Without llama.cpp: Q4_K_M (its quantizer) and verifying a refact file (transformers' loader does not read it)
    are one line naming what to install; the F32 refact file itself is written from Python alone."""
    monkeypatch.delenv("HF_TFM_LLAMA_CPP_PYTHON", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec raises ValueError on a None entry: hide it
    monkeypatch.setattr(gguf_export.importlib.util, "find_spec", lambda name: None)
    assert gguf_export.llama_cpp_python() is None
    model = trained(LLAMA)
    with pytest.raises(ImportError, match="pip install llama-cpp-python, or set HF_TFM_LLAMA_CPP_PYTHON"):
        export(model, tmp_path / "q.gguf", quantize="q4_k_m", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []
    path = export(trained(REFACT), tmp_path / "refact.gguf", tokenizer=tokenizer)
    with pytest.raises(ImportError, match=r"Verifying a GGUF refact file needs llama\.cpp"):
        verify(path, trained(REFACT), prompts=PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match="does not read 'refact' files"):
        gguf_export.verify_gguf(path, trained(REFACT), prompts=PROMPTS, max_new_tokens=4, runtime="transformers")
    folder = saved(LLAMA, tmp_path / "lm", tokenizer)
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "lm.gguf"), "--quantize", "q4_k_m"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install llama-cpp-python" in err


def bert_encoder(overrides: dict):
    """A BERT-block encoder (TfmModel) whose weights have a trained model's scale (initializer_range's give ~0)."""
    torch.manual_seed(0)
    model = hf_tfm.TfmModel(config_of(**{**BERT_TANH, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model


def test_encoder_exports_as_bert_for_embeddings(tmp_path, tokenizer):
    """A TfmModel with BERT's block (or its folder) becomes llama.cpp's bert: token types, the embedding norm and the
    post-norm layers under llama.cpp's names, mean pooling by default; its numbers are checked in llama.cpp
    (tests/test_export_llama_cpp.py), since transformers' GGUF loader reads no BERT."""
    model = bert_encoder({"type_vocab_size": 2, "add_pooling_layer": True})
    assert gguf_architecture(model.config) == "bert"
    model.save_pretrained(tmp_path / "enc")
    tokenizer.save_pretrained(tmp_path / "enc")
    reader = gguf.GGUFReader(export(tmp_path / "enc", tmp_path / "enc.gguf"))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert _field(reader, "general.architecture") == "bert"
    assert _field(reader, "bert.pooling_type") == gguf.PoolingType.MEAN
    assert _field(reader, "bert.attention.causal") is False and _field(reader, "tokenizer.ggml.token_type_count") == 2
    assert torch.equal(tensors["token_types.weight"], model.token_type_embeddings.weight.detach())
    assert torch.equal(tensors["blk.1.attn_output_norm.weight"], model.layers[1].attn_norm.weight.detach())
    assert torch.equal(tensors["blk.1.layer_output_norm.bias"], model.layers[1].mlp_norm.bias.detach())
    assert not any(name.startswith(("output", "pooler")) for name in tensors)  # no head, no pooler: embeddings


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"hidden_act": "gelu"}, "`hidden_act`='gelu' (llama.cpp bert needs a tanh GELU"),
        ({"norm_position": "pre"}, "`norm_position`='pre' (llama.cpp bert needs 'post')"),
        ({"embedding_norm": False}, "`embedding_norm`=False (llama.cpp bert needs True"),
        ({"position_embedding_type": "rope"}, "`position_embedding_type`='rope' (llama.cpp bert needs 'learned')"),
    ],
    ids=["erf-gelu", "pre-norm", "no-embedding-norm", "rope"],
)
def test_bert_refusals_with_control(knobs, words):
    assert gguf_architecture(config_of(**BERT_TANH)) == "bert"  # the control
    with pytest.raises(ValueError, match=r"No llama\.cpp") as err:
        gguf_architecture(config_of(**{**BERT_TANH, **knobs}))
    assert words in str(err.value), str(err.value)


def test_failed_export_leaves_no_file(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    folder = saved({"parallel_residual": True}, tmp_path / "parallel", tokenizer)
    with pytest.raises(ValueError, match="parallel_residual"):
        export(folder, out / "model.gguf")

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export(trained(LLAMA), out / "model.gguf", tokenizer=tokenizer)
    assert list(out.iterdir()) == []


def test_missing_gguf_is_one_line(tmp_path, tokenizer, monkeypatch, capsys):
    folder = saved(LLAMA, tmp_path / "lm", tokenizer)
    capsys.readouterr()  # the save's progress bars
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r'pip install gguf \(or pip install "hf-tfm\[export\]"\)'):
        export(folder, tmp_path / "lm.gguf")
    assert main(["export", str(folder), str(tmp_path / "lm.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install gguf" in err
    assert not (tmp_path / "lm.gguf").exists()


def test_cli_export_verify_in_fresh_process(tmp_path, tokenizer, capsys):
    folder = saved(LLAMA_GQA_UNTIED, tmp_path / "lm", tokenizer)
    dst = tmp_path / "lm.gguf"
    argv = ["export", str(folder), str(dst), "--verify", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal: yes" in out and "largest logit difference" in out and "LlamaForCausalLM" in out
    assert main(argv) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*argv[:3], "--quantize", "q8_0", "--overwrite"]) == 0 and dst.is_file()


def test_hf_tfm_export_is_the_function(tmp_path, tokenizer):
    path = hf_tfm.export(trained(LLAMA), tmp_path / "a.gguf", tokenizer=tokenizer)
    assert path.is_file() and hf_tfm.export is export


def test_info_reports_gguf(tmp_path):
    from hf_tfm.info import describe

    parallel = {"parallel_residual": True}
    for overrides, ok in (
        (LLAMA, True),
        (QWEN2, True),
        (BLOOM, True),
        (MPT, True),
        (MIXTRAL, True),
        (parallel, False),
    ):
        config_of(**overrides).save_pretrained(tmp_path)
        ok_, why = describe(str(tmp_path))["integrations"]["export to runtimes"]["GGUF (llama.cpp)"]
        assert ok_ is ok, why
        assert ("architecture" in why) if ok else ("parallel_residual" in why)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers: each shape llama.cpp has a vocabulary for (tests/tokenizer_shapes.py, trained on standard-library
# files), the metadata written checked against what llama.cpp's loader reads, and the file's tokenizer read back by
# transformers' GGUF loader. llama.cpp's own tokenization of the same files: tests/test_export_llama_cpp.py.

TOKENIZER_VOCAB = 1024  # the shapes' 600 tokens, padded with unused ones
LLAMA3_PRE = ("llama-bpe", "smaug-bpe")
SPACE_PREFIX = {"spm-legacy": True, "spm-metaspace": True, "spm-never": False, "spm-gemma": False}


def tokenizer_model(tokenizer, shape: str):
    """A tiny model for `tokenizer`'s vocabulary, its bos/eos the tokenizer's (as a model trained with it): an encoder
    with BERT's block for WordPiece, Qwen2's block for the Qwen shapes (transformers' loader picks its tokenizer by
    architecture in some releases), else Llama's. Untrained: only the vocabulary is checked here."""
    ids = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    torch.manual_seed(0)
    if shape.startswith("bert"):
        return hf_tfm.TfmModel(config_of(**BERT_TANH, vocab_size=TOKENIZER_VOCAB, **ids)).eval()
    block = QWEN2 if "qwen" in shape else LLAMA
    return hf_tfm.TfmForCausalLM(config_of(**block, vocab_size=TOKENIZER_VOCAB, **ids)).eval()


def export_with_tokenizer(shape: str, tokenizer, folder):
    """The model for `tokenizer` and the tokenizer saved in `folder`, exported from the folder to a folder of its own
    (where transformers' loader finds no tokenizer files to prefer to the GGUF's keys); returns (the folder's tokenizer
    as transformers loads it, the GGUF path)."""
    from transformers import AutoTokenizer

    tokenizer_model(tokenizer, shape).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return AutoTokenizer.from_pretrained(folder / "model"), export(folder / "model", folder / "gguf" / "model.gguf")


@pytest.fixture(scope="module", params=list(tokenizer_shapes.SHAPES))
def exported_shape(request, tmp_path_factory):
    shape = request.param
    tokenizer, path = export_with_tokenizer(shape, tokenizer_shapes.build(shape), tmp_path_factory.mktemp(shape))
    return shape, tokenizer, path


def _special_ids(reader) -> dict:
    keys = {
        "bos": "bos_token_id",
        "eos": "eos_token_id",
        "unk": "unknown_token_id",
        "pad": "padding_token_id",
        "sep": "seperator_token_id",  # llama.cpp's spelling
        "cls": "cls_token_id",
        "mask": "mask_token_id",
    }
    return {
        name: _field(reader, f"tokenizer.ggml.{key}")
        for name, key in keys.items()
        if f"tokenizer.ggml.{key}" in reader.fields
    }


def _types_as_added(types: list[int], vocab: dict, special: set[int]) -> bool:
    """Added special tokens CONTROL, the rest of the tokenizer's NORMAL."""
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    return all(types[i] == (control if i in special else normal) for i in vocab.values())


def _check_gpt2(shape, tokenizer, reader, spec, special) -> None:
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    assert _field(reader, "tokenizer.ggml.pre") == shape.removeprefix("bpe-")
    assert {token: i for i, token in enumerate(tokens) if i < len(vocab)} == vocab
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert _field(reader, "tokenizer.ggml.merges") == merges and "tokenizer.ggml.scores" not in reader.fields
    assert _types_as_added(types, vocab, special)
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos  # Qwen2 names no BOS
    ids = _special_ids(reader)
    assert (ids["bos"], ids["eos"]) == (bos, eos)  # gpt2's defaults would be 11 and 11
    flags = (_field(reader, "tokenizer.ggml.add_bos_token"), _field(reader, "tokenizer.ggml.add_eos_token"))
    assert flags == (shape.removeprefix("bpe-") in LLAMA3_PRE, False)  # Llama 3 adds its BOS


def _check_llama(shape, tokenizer, reader, spec) -> None:
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    assert _field(reader, "tokenizer.ggml.pre") == "default"
    assert {token: i for i, token in enumerate(tokens) if i < len(vocab)} == vocab
    byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256)]
    assert byte_ids == list(range(3, 259)) and all(types[i] == gguf.TokenType.BYTE for i in byte_ids)
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]  # <unk> <s> </s>
    scores = _field(reader, "tokenizer.ggml.scores")
    made = {}  # token -> rank of the first merge that makes it
    for rank, merge in enumerate(spec["model"]["merges"]):
        made.setdefault("".join(merge.split(" ") if isinstance(merge, str) else merge), rank)
    assert made and all(scores[vocab[token]] == -rank for token, rank in made.items())  # not a flat -1000
    assert all(scores[i] == gguf_vocab.UNMERGED_SCORE for i in range(len(vocab)) if tokens[i] not in made)
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is SPACE_PREFIX[shape]
    assert _special_ids(reader) == {"bos": 1, "eos": 2, "unk": 0}
    flags = (_field(reader, "tokenizer.ggml.add_bos_token"), _field(reader, "tokenizer.ggml.add_eos_token"))
    assert flags == (True, False)


def _check_bert(shape, tokenizer, reader, special) -> None:
    """llama.cpp puts ▁ before each word and matches pieces greedily; [CLS] is its BOS."""
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    vocab = tokenizer.get_vocab()
    assert _field(reader, "tokenizer.ggml.pre") == "default"
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    phantom = [t if i in special else t[2:] if t.startswith("##") else "\u2581" + t for t, i in by_id]
    assert tokens[: len(vocab)] == phantom and _types_as_added(types, vocab, special)
    names = ("cls", "sep", "unk", "pad", "mask")
    expected = {"bos": tokenizer.cls_token_id, **{name: getattr(tokenizer, f"{name}_token_id") for name in names}}
    assert _special_ids(reader) == expected
    flags = [_field(reader, f"tokenizer.ggml.add_{name}_token") for name in ("bos", "eos", "sep")]
    assert flags == [True, False, True] and _field(reader, "tokenizer.ggml.token_type_count") == 1
    lowercase = shape == "bert-uncased"
    assert _field(reader, "tokenizer.ggml.normalizer.lowercase") is lowercase  # llama.cpp lowercases by default
    assert _field(reader, "tokenizer.ggml.normalizer.strip_accents") is lowercase


def test_tokenizer_metadata_per_shape(exported_shape):
    """What llama.cpp's loader reads, per vocabulary (/work/shared/tokenizer_notes.md §1-4): the tokens by id (bert's
    in phantom-space spelling), their types, gpt2's merges and pre-tokenizer, llama's merge-rank scores and all 256
    byte tokens, the special ids and add_* flags the tokenizer has (never llama.cpp's defaults), the chat template."""
    shape, tokenizer, path = exported_shape
    reader = gguf.GGUFReader(path)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == TOKENIZER_VOCAB and len(set(tokens)) == TOKENIZER_VOCAB
    assert types[len(tokenizer) :] == [gguf.TokenType.UNUSED] * (TOKENIZER_VOCAB - len(tokenizer))
    special = {token["id"] for token in spec["added_tokens"] if token["special"]}
    kind = shape.split("-")[0]
    assert _field(reader, "tokenizer.ggml.model") == {"bpe": "gpt2", "spm": "llama", "bert": "bert"}[kind]
    if kind == "bpe":
        _check_gpt2(shape, tokenizer, reader, spec, special)
    elif kind == "spm":
        _check_llama(shape, tokenizer, reader, spec)
    else:
        _check_bert(shape, tokenizer, reader, special)
    template = "tokenizer.chat_template"
    assert (_field(reader, template) if template in reader.fields else None) == tokenizer.chat_template
    assert ("qwen" in shape) == (tokenizer.chat_template is not None)  # the Qwen shapes carry ChatML


# What transformers' GGUF loader makes of each vocabulary (it rebuilds a tokenizer from the file by its own rules), for
# the new loader and the old: why it does not read the shape, or which texts it must tokenize as the folder's
# tokenizer does (plain text, no special tokens; `all`: every one). Releases with `integrations/gguf` (5.19, 5.25)
# read tokenizer.ggml.pre's regex and build a Metaspace ("first") SentencePiece tokenizer; older ones (5.16.1) use
# GPT-2's regex for every byte-level vocabulary, Qwen2's for a qwen2 architecture, and Llama 2's normalizer.
NEW_LOADER = importlib.util.find_spec("transformers.integrations.gguf") is not None


def _not_leading_space(text: str) -> bool:  # Metaspace and llama.cpp's space prefix differ only before such text
    return not text.startswith(" ")


def _nfc(text: str) -> bool:  # the Qwen2 shapes' NFC normalizer: neither llama.cpp nor the new loader applies it
    return unicodedata.normalize("NFC", text) == text


def _no_space_before_digit(text: str) -> bool:  # StarCoder splits digits apart; the loaders read its vocabulary
    return re.search(r"\s\d", text) is None  # with GPT-2's regex, which keeps a space before digits with them


LOADER_READS = {
    "bpe-gpt-2": (all, all),
    "bpe-starcoder": (_no_space_before_digit, _no_space_before_digit),
    **dict.fromkeys(
        ("bpe-llama-bpe", "bpe-smaug-bpe", "bpe-gpt-4o", "bpe-tekken"), (all, "reads GPT-2's regex whatever the pre")
    ),
    **dict.fromkeys(("bpe-qwen2", "bpe-qwen35"), (_nfc, all)),
    "spm-legacy": (_not_leading_space, all),
    "spm-metaspace": (all, _not_leading_space),
    **dict.fromkeys(("spm-never", "spm-gemma"), ("prepends a space whatever add_space_prefix says", all)),
    **dict.fromkeys(("bert-uncased", "bert-cased"), ("reads no bert vocabulary",) * 2),
}


def test_transformers_gguf_loader_tokenizes_as_the_folder(exported_shape):
    """transformers' GGUF loader, an independent reader of the file, rebuilds the tokenizer from its keys alone: on the
    varied texts and held-out standard-library code its ids are the folder tokenizer's, where it reads the shape."""
    from transformers import AutoTokenizer

    shape, tokenizer, path = exported_shape
    expected = LOADER_READS[shape][0 if NEW_LOADER else 1]
    if isinstance(expected, str):
        pytest.skip(f"transformers {transformers.__version__}'s GGUF loader {expected}")
    loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [*gguf_vocab.TEXTS, *tokenizer_shapes.held_out_texts()]
    differ = [
        t
        for t in texts
        if loaded(t, add_special_tokens=False)["input_ids"] != tokenizer(t, add_special_tokens=False)["input_ids"]
    ]
    print(f"{shape}: transformers' loader agrees on {len(texts) - len(differ)}/{len(texts)} texts")
    assert [t for t in differ if expected is all or expected(t)] == []
    assert len(differ) < len(texts) / 4  # the known gap is a few texts, not the vocabulary


def _variant(tokenizer, edit):
    """`tokenizer` with its tokenizer.json edited by `edit(spec)` (special tokens as they were)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    edit(spec)
    names = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **names)


def _set(path: str, value):
    """An edit setting `spec[a][b]...` (path "a.b...") to `value`."""

    def edit(spec):
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return edit


def _bert_duplicate():
    """WordPiece with a special token spelled like a continuation piece without its ## (both become that string)."""
    tokenizer = tokenizer_shapes.wordpiece()
    piece = next(t for t in tokenizer.get_vocab() if t.startswith("##") and len(t) > 4)
    tokenizer = _variant(tokenizer, lambda spec: None)
    tokenizer.add_special_tokens({"additional_special_tokens": [piece[2:] + "\u2581"]})  # not in the vocab yet
    tokenizer.add_special_tokens({"additional_special_tokens": [piece[2:]]}, replace_extra_special_tokens=False)
    return tokenizer


TOKENIZER_REFUSALS = {
    "unigram": (tokenizer_shapes.unigram, ["a Unigram tokenizer", "t5", "not written"]),
    "unknown-regex": (
        lambda: _variant(
            tokenizer_shapes.byte_level("llama-bpe"),
            _set("pre_tokenizer.pretokenizers.0.pattern.Regex", gguf_vocab.SPLITS["llama3"].replace("{1,3}", "{1,4}")),
        ),
        ["is not one of the regexes llama.cpp implements", r"\p{N}{1,4}"],
    ),
    "ignore-merges": (
        lambda: _variant(tokenizer_shapes.byte_level("qwen2"), _set("model.ignore_merges", True)),
        ["ignore_merges=True", "'qwen2' pre-tokenizer has ignore_merges=False"],
    ),
    "prefix-space": (
        lambda: _variant(tokenizer_shapes.byte_level("gpt-2"), _set("pre_tokenizer.add_prefix_space", True)),
        ["ByteLevel(add_prefix_space=True)"],
    ),
    "bpe-normalizer": (
        lambda: _variant(tokenizer_shapes.byte_level("gpt-2"), _set("normalizer", {"type": "Lowercase"})),
        ["normalizer Lowercase", "applies no normalizer to a BPE vocabulary"],
    ),
    "no-byte-fallback": (
        lambda: _variant(tokenizer_shapes.sentencepiece(), _set("model.byte_fallback", False)),
        ["without byte_fallback", "<0xXX>", "terminates"],
    ),
    "missing-bytes": (
        lambda: tokenizer_shapes.sentencepiece(byte_tokens=200),
        ["<0xC8>, <0xC9>", "56 of 256 missing", "terminates the process"],
    ),
    "metaspace-split": (
        lambda: _variant(tokenizer_shapes.sentencepiece("metaspace"), _set("pre_tokenizer.split", True)),
        ["Metaspace(split=True)"],
    ),
    "spm-normalizer": (
        lambda: _variant(
            tokenizer_shapes.sentencepiece(), _set("normalizer.normalizers", [{"type": "NFKC"}, {"type": "Lowercase"}])
        ),
        ["neither byte-level nor SentencePiece-shaped", "NFKC + Lowercase"],
    ),
    "bert-template": (
        lambda: _variant(tokenizer_shapes.wordpiece(), _set("post_processor", None)),
        ["always adds [CLS] ... [SEP]"],
    ),
    "bert-pre-tokenizer": (
        lambda: _variant(tokenizer_shapes.wordpiece(), _set("pre_tokenizer", {"type": "Whitespace"})),
        ["pre-tokenizer Whitespace", "BertPreTokenizer"],
    ),
    "bert-duplicate": (_bert_duplicate, ["occur twice", "aborts on duplicates"]),
}


@pytest.mark.parametrize("case", list(TOKENIZER_REFUSALS))
def test_tokenizer_refusals_name_the_reason(case, tmp_path):
    """Shapes llama.cpp would tokenize differently (or crash on) are refused before anything is written, with the
    reason; the control of each is its shape as built, which exports (tests above)."""
    build, words = TOKENIZER_REFUSALS[case]
    tokenizer = build()
    shape = "bert-uncased" if "bert" in case else "spm-legacy" if "spm" in case or "byte" in case else "bpe-gpt-2"
    with pytest.raises(ValueError) as err:
        export(tokenizer_model(tokenizer, shape), tmp_path / "model.gguf", tokenizer=tokenizer)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_missing_eos_is_refused_and_config_ids_fill_in(tmp_path):
    """A tokenizer that names no BOS/EOS takes the model config's; with neither, the export is refused (llama.cpp's
    gpt2 default, token 11, would end generation)."""
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer_shapes.byte_level("gpt-2").backend_tokenizer)
    model = hf_tfm.TfmForCausalLM(config_of(vocab_size=TOKENIZER_VOCAB, bos_token_id=None, eos_token_id=None))
    with pytest.raises(ValueError, match="no end-of-sequence token in the tokenizer or the config"):
        export(model, tmp_path / "model.gguf", tokenizer=bare)
    model.config.bos_token_id, model.config.eos_token_id = 0, 0
    reader = gguf.GGUFReader(export(model, tmp_path / "model.gguf", tokenizer=bare))
    assert (_field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")) == (0, 0)
