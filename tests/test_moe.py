"""Mixture-of-experts layers (`num_experts`): config, routing, experts kernels, aux loss, heads, training, PEFT.

Oracles: transformers' own `load_balancing_loss_func` (from its in-tree Mixtral), the dense `TfmMLP` with the same
weights, each row run alone, a full forward for cached decoding, plain PyTorch steps for Trainer and gradient
accumulation. Parity with in-tree Mixtral / Qwen2-MoE / OLMoE is in test_convert_moe.py; the 2-process runs (DDP,
tensor and expert parallelism) are marked slow.
"""

import copy
import json
from unittest import mock

import pytest
import torch
from conftest import (
    build,
    enable_activation_checkpointing,
    random_ids,
    run_doc_blocks,
    run_without_hf_tfm,
    tiny_config,
)
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from test_training import lm_examples, max_param_diff, training_args
from transformers import Trainer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as in_tree_load_balancing_loss

from hf_tfm import (
    TfmConfig,
    TfmForCausalLM,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
)
from hf_tfm.modeling import TfmMLP, TfmSparseMoeBlock, load_balancing_loss_func
from hf_tfm.training import PadCollator

# PEFT calls a property transformers 5.2x deprecates (`is_gradient_checkpointing`): not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ATOL = 1e-5
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def moe_config(**overrides) -> TfmConfig:
    """The tiny config with 4 experts of width 16, top-2, in every layer; keyword arguments override any field."""
    return tiny_config(**{**MOE, **overrides})


def moe_model(model_class=TfmForCausalLM, seed: int = 0, experts: str = "eager", **overrides):
    model = build(model_class, moe_config(**overrides), seed=seed)
    model.set_experts_implementation(experts)
    return model


def left_padded(batch: int = 3, length: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 6))[: batch - 1]:
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over labels that are not -100 (the causal LM's loss before normalising)."""
    shift_logits, shift_labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------------------------------------------------------------
# Config


def test_dense_by_default_and_old_configs_load_dense():
    config = tiny_config()
    assert config.num_experts is None and not any(config.is_sparse_layer(i) for i in range(2))
    model = TfmForCausalLM(config)
    assert all(type(layer.mlp) is TfmMLP for layer in model.model.layers)
    assert not any("experts" in key or "mlp.gate." in key for key in model.state_dict())
    saved = config.to_dict()  # a config.json written before the MoE knobs existed
    saved.pop("num_experts")
    assert TfmConfig.from_dict(saved).num_experts is None


# Every mixture-of-experts attribute generic tools probe: TRL's trainers take `output_router_logits` (with
# `router_aux_loss_coef`) as "this model returns router logits" and its FLOPs count `num_experts_per_tok` as "this
# model routes"; in-tree dense configs (Llama, BERT, BART) have none of them, in-tree MoE configs have them.
TOOL_PROBES = ("output_router_logits", "router_aux_loss_coef", "num_experts_per_tok", "num_local_experts")
# What today's main wrote into every dense config.json before the expert knobs left dense configs: their defaults.
SAVED_BEFORE = {
    "num_experts": None,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,
    "shared_expert_intermediate_size": None,
    "norm_topk_prob": True,
    "router_weights_fp32": False,
    "router_jitter_noise": 0.0,
    "mlp_only_layers": None,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}


def test_a_dense_config_has_no_expert_attributes_as_in_tree_dense_configs(caplog):
    from transformers import LlamaConfig, MixtralConfig

    from hf_tfm.configuration import EXPERT_KNOBS

    dense, moe = tiny_config(), moe_config()
    assert [probe for probe in TOOL_PROBES if hasattr(LlamaConfig(), probe)] == []  # the in-tree controls
    assert [probe for probe in TOOL_PROBES if hasattr(MixtralConfig(), probe)] == list(TOOL_PROBES)
    assert [name for name in (*EXPERT_KNOBS, *TOOL_PROBES) if hasattr(dense, name)] == []
    assert not set(EXPERT_KNOBS) & set(dense.to_dict()), "a dense config.json must not bring them back"
    assert all(hasattr(moe, name) for name in EXPERT_KNOBS)  # the control: a config with experts has every one
    assert moe.output_router_logits is False and moe.router_aux_loss_coef == 0.001
    # an old dense config.json with every knob at its default loads without them, and without a word
    with caplog.at_level("WARNING"):
        old = TfmConfig.from_dict({**dense.to_dict(), **SAVED_BEFORE})
    assert [name for name in EXPERT_KNOBS if hasattr(old, name)] == [] and old.to_dict() == dense.to_dict()
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]
    # one set to something else is dropped too, and said
    with caplog.at_level("WARNING"):
        odd = TfmConfig(**{**tiny_config().to_dict(), "output_router_logits": True, "num_experts_per_tok": 4})
    assert not hasattr(odd, "output_router_logits") and not hasattr(odd, "num_experts_per_tok")
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "`output_router_logits`=True has no effect" in warned and "`num_experts_per_tok`=4" in warned


def test_expert_knobs_are_typed_defaulted_and_compared():
    from hf_tfm.configuration import EXPERT_KNOBS

    config = moe_config(num_experts_per_tok=3)
    assert {name: getattr(config, name) for name in EXPERT_KNOBS} == {
        **EXPERT_KNOBS,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 16,
    }
    assert config == moe_config(num_experts_per_tok=3) and config != moe_config()
    assert TfmConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_config(num_experts_per_tok="2")


def test_a_checkpoint_saved_before_the_split_loads_the_same(tmp_path):
    """A dense and an MoE folder as today's main wrote them (every expert knob in config.json, the expert layer's
    conversion registered for every hf_tfm model): each loads with its weights, and the dense one without the knobs."""
    from transformers import AutoModelForCausalLM

    for overrides in ({}, MOE):
        model = build(TfmForCausalLM, tiny_config(**overrides))
        model.save_pretrained(tmp_path / "ckpt")
        saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**SAVED_BEFORE, **saved}))
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        assert hasattr(loaded.config, "output_router_logits") == bool(overrides)
        ids = random_ids(2, 7)
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": 4, "moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"num_experts": 4, "shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
        ({"num_experts": 4, "mlp_only_layers": [0, 2]}, "mlp_only_layers"),
        ({"num_experts": 4, "mlp_only_layers": [-1]}, "mlp_only_layers"),
        ({"num_experts": 4, "decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"num_experts": 4, "router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
        ({"num_experts": 4, "router_jitter_noise": 1.0}, "router_jitter_noise"),
        ({"num_experts": 4, "ffn_type": "mlp"}, "ffn_type"),
        ({"num_experts": 4, "mlp_bias": True}, "mlp_bias"),
    ],
)
def test_invalid_moe_configs_name_the_knob(overrides, knob):
    with pytest.raises(ValueError, match=f"`{knob}"):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    ("overrides", "sparse"),
    [
        ({}, [0, 1, 2, 3]),
        ({"mlp_only_layers": [0, 3]}, [1, 2]),
        ({"decoder_sparse_step": 2}, [1, 3]),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1]),
    ],
)
def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step(overrides, sparse):
    model = moe_model(num_hidden_layers=4, output_router_logits=True, **overrides)
    assert [i for i in range(4) if model.config.is_sparse_layer(i)] == sparse
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, TfmSparseMoeBlock)] == sparse
    ids = random_ids(2, 5)
    router_logits = model(input_ids=ids).router_logits
    assert len(router_logits) == len(sparse) and all(r.shape == (10, 4) for r in router_logits)


# ---------------------------------------------------------------------------------------------------------------------
# Experts implementations


def test_default_experts_implementation_is_grouped_mm_and_every_class_can_switch(tmp_path):
    """transformers allows the fused kernels only if the model classes' file holds `@use_experts_implementation`."""
    for cls in (TfmModel, TfmForCausalLM, TfmForSequenceClassification, TfmForMaskedLM):
        assert cls._can_set_experts_implementation(), cls
    model = TfmForCausalLM(moe_config())
    assert model.config._experts_implementation == "grouped_mm"  # the fastest on CPU too (README, bench.py)
    experts = model.model.layers[0].mlp.experts
    assert experts.config is model.config  # the model's own config: set_experts_implementation reaches it
    model.set_experts_implementation("batched_mm")
    assert experts.config._experts_implementation == "batched_mm"
    assert TfmConfig(**MOE, experts_implementation="eager")._experts_implementation == "eager"
    model.save_pretrained(tmp_path)
    loaded = TfmForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert loaded.config._experts_implementation == "eager"
    assert TfmForCausalLM.from_pretrained(tmp_path).config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_experts_implementations_agree_with_eager(implementation, monkeypatch):
    model = moe_model(shared_expert_intermediate_size=24)
    ids, mask = left_padded()

    def run():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_logits, eager_grads = run()
    kernel = mock.Mock(wraps=ALL_EXPERTS_FUNCTIONS[implementation])
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, implementation, kernel)
    model.set_experts_implementation(implementation)
    logits, grads = run()
    assert kernel.call_count == model.config.num_hidden_layers  # the kernel really ran, once per sparse layer
    assert (logits - eager_logits)[mask.bool()].abs().max() <= ATOL
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_one_expert_top1_equals_the_dense_ffn(norm_topk_prob):
    dense = build(TfmForCausalLM, tiny_config())
    sparse = moe_model(num_experts=1, num_experts_per_tok=1, moe_intermediate_size=48, norm_topk_prob=norm_topk_prob)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, layer in enumerate(dense.model.layers):
        mlp = layer.mlp
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[
            None
        ]
        state[f"model.layers.{i}.mlp.experts.down_proj"] = mlp.down_proj.weight[None]
        state[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(1, 32)  # softmax over one expert: weight 1
    sparse.load_state_dict(state, strict=True)
    ids, mask = left_padded()
    with torch.no_grad():
        expected = dense(input_ids=ids, attention_mask=mask).logits
        for implementation in IMPLEMENTATIONS:
            sparse.set_experts_implementation(implementation)
            got = sparse(input_ids=ids, attention_mask=mask).logits
            # fp32 rounding only: the kernels sum in other orders (batched_mm 1.5e-6 on an AMD EPYC, |logits| ~3)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=implementation)


# ---------------------------------------------------------------------------------------------------------------------
# Router logits and the load-balancing loss


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_aux_loss_equals_transformers_load_balancing_loss(masked):
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 7, 6, generator=generator) for _ in range(3))
    mask = (torch.rand(3, 7, generator=generator) > 0.3).long() if masked else None
    expected = in_tree_load_balancing_loss(logits, 6, 2, mask)
    torch.testing.assert_close(load_balancing_loss_func(logits, 6, 2, mask), expected, atol=1e-7, rtol=0)

    model = moe_model(output_router_logits=True, router_aux_loss_coef=0.5)
    ids, mask = left_padded()
    mask = mask if masked else None
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert isinstance(out, MoeCausalLMOutputWithPast) and len(out.router_logits) == 2
    torch.testing.assert_close(
        out.aux_loss, in_tree_load_balancing_loss(out.router_logits, 4, 2, mask), atol=1e-7, rtol=0
    )
    plain = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=False)
    assert plain.aux_loss is None and plain.router_logits is None  # an explicit False beats the config
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * out.aux_loss, atol=1e-6, rtol=0)


def test_no_sparse_layer_does_not_crash_when_router_logits_are_requested():
    """transformers' `load_balancing_loss_func` raises on an empty tuple (Qwen2-MoE with every layer in
    `mlp_only_layers`): here the logits are an empty tuple, there is no aux loss, and the loss is the plain one. A
    dense model asked for router logits answers as in-tree Llama does: its dense output, without them."""
    ids = random_ids(2, 6)
    model = moe_model(mlp_only_layers=[0, 1], output_router_logits=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.router_logits == () and out.aux_loss is None
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids, output_router_logits=False).loss)
    dense = build(TfmForCausalLM, tiny_config())
    out = dense(input_ids=ids, labels=ids, output_router_logits=True)
    assert type(out) is CausalLMOutputWithPast and "router_logits" not in out
    torch.testing.assert_close(out.loss, dense(input_ids=ids, labels=ids).loss)


def test_router_logits_and_aux_loss_come_from_the_config():
    model = moe_model()
    ids = random_ids(2, 6)
    out = model(input_ids=ids)
    assert isinstance(out, MoeCausalLMOutputWithPast) and out.router_logits is None and out.aux_loss is None
    out = model(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.aux_loss is not None
    base = moe_model(TfmModel, output_router_logits=True)(input_ids=ids)
    assert isinstance(base, MoeModelOutputWithPast) and len(base.router_logits) == 2


@pytest.mark.parametrize("fp32", [True, False])
def test_routing_weights_dtype_under_bf16(fp32):
    """Mixtral scales the expert outputs by fp32 routing weights, Qwen2-MoE and OLMoE in the hidden dtype."""
    model = moe_model(router_weights_fp32=fp32).to(torch.bfloat16)
    seen = []
    block = model.model.layers[0].mlp
    hook = block.gate.register_forward_hook(lambda module, args, out: seen.append((out[0].dtype, out[1].dtype)))
    with torch.no_grad():
        logits = model(input_ids=random_ids(2, 5)).logits
    hook.remove()
    assert seen == [(torch.bfloat16, torch.float32 if fp32 else torch.bfloat16)]
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------------------------------
# Invariants: cache, padding, encoders, heads


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_cached_decoding_equals_a_full_forward(implementation):
    model = moe_model(experts=implementation, shared_expert_intermediate_size=24, mlp_only_layers=[0])
    ids, mask = left_padded()
    with torch.no_grad():
        generated = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
        )
        full_mask = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], dim=1)
        full = model(input_ids=generated, attention_mask=full_mask, use_cache=False).logits
        step = model(input_ids=ids, attention_mask=mask, use_cache=True)  # prefill, then one token at a time
        cache, logits = getattr(step, "cache", None) or step.past_key_values, [step.logits[:, -1]]
        for t in range(7):
            token = generated[:, 10 + t : 11 + t]
            step = model(input_ids=token, attention_mask=full_mask[:, : 11 + t], cache=cache, use_cache=True)
            logits.append(step.logits[:, -1])
    assert torch.equal(full[:, 9:-1].argmax(-1), generated[:, 10:])  # greedy tokens are the full forward's argmax
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 9:-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("is_causal", [True, False], ids=["decoder-left-pad", "encoder-right-pad"])
def test_padded_batch_equals_each_row_alone(is_causal):
    model_class = TfmForCausalLM if is_causal else TfmForMaskedLM
    model = moe_model(model_class, is_causal=is_causal, output_router_logits=True, shared_expert_intermediate_size=24)
    ids, mask = left_padded()
    if not is_causal:  # right padding for the encoder
        mask = mask.flip(1)
        ids = random_ids(3, 10).masked_fill(mask == 0, 0)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask)
        rows = [model(input_ids=ids[i : i + 1, mask[i].bool()]) for i in range(3)]
    for i, row in enumerate(rows):
        torch.testing.assert_close(batch.logits[i, mask[i].bool()], row.logits[0], atol=ATOL, rtol=0)
    # The masked aux loss counts real tokens only: it equals the loss over the rows' router logits, concatenated.
    alone = tuple(torch.cat([row.router_logits[layer] for row in rows]) for layer in range(2))
    torch.testing.assert_close(batch.aux_loss, in_tree_load_balancing_loss(alone, 4, 2), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("model_class", "labels"),
    [
        (TfmForSequenceClassification, lambda ids: torch.tensor([0, 2, 1])),
        (TfmForTokenClassification, lambda ids: ids % 3),
        (TfmForMaskedLM, lambda ids: ids),
        (TfmForQuestionAnswering, None),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_encoder_heads_add_the_aux_loss(model_class, labels):
    model = moe_model(model_class, is_causal=False, num_labels=3, output_router_logits=True, router_aux_loss_coef=0.3)
    ids, mask = left_padded()
    if labels is None:
        targets = {"start_positions": torch.tensor([1, 4, 7]), "end_positions": torch.tensor([2, 5, 9])}
    else:
        targets = {"labels": labels(ids)}
    out = model(input_ids=ids, attention_mask=mask, **targets)
    plain = model(input_ids=ids, attention_mask=mask, output_router_logits=False, **targets)
    dense_class = next(c for c in type(out).__mro__[1:] if c.__name__ in type(out).__name__)
    assert isinstance(out, dense_class) and len(out.router_logits) == 2
    torch.testing.assert_close(
        out.aux_loss, in_tree_load_balancing_loss(out.router_logits, 4, 2, mask), atol=1e-7, rtol=0
    )
    torch.testing.assert_close(out.loss, plain.loss + 0.3 * out.aux_loss, atol=1e-6, rtol=0)
    (out.loss).backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_generate_with_router_logits_in_the_config():
    """Decoding steps see one token but the whole attention mask: the aux loss uses the new tokens' columns (in-tree
    Mixtral fails there with a size mismatch)."""
    model = moe_model(output_router_logits=True)
    ids, mask = left_padded()
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, output_router_logits=False, **kwargs)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)


@pytest.mark.parametrize("attn", ["paged|sdpa", "paged|eager"])
def test_continuous_batching_equals_generate(attn):
    """All requests packed in one row of a paged cache: routing is per token, so the tokens are generate()'s."""
    from test_serving import PROMPTS, generate_batch, generate_each

    model = moe_model(experts="grouped_mm", shared_expert_intermediate_size=24, mlp_only_layers=[0])
    expected = generate_each(model)
    model.set_attn_implementation(attn)
    got = generate_batch(model)
    assert [out.error for out in got] == [None] * len(PROMPTS)
    assert [out.generated_tokens for out in got] == expected


@pytest.mark.slow  # inductor compiles on CPU: ~30 s
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_fullgraph_compile_and_compiled_static_generate(implementation):
    """The fused kernels compile with fullgraph=True (transformers' grouped_mm falls back to its own custom op when
    compiling outside bf16); eager's loop over the experts hit is data-dependent, as in-tree."""
    from transformers import CompileConfig

    model = moe_model(experts=implementation, shared_expert_intermediate_size=24)
    model.config._attn_implementation = "sdpa"
    ids, mask = left_padded(2, 8)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled[mask.bool()], eager[mask.bool()], atol=ATOL, rtol=0)
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True  # generate() compiles only on accelerators unless told (private flag)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs, cache_implementation="static", compile_config=config), reference)


# ---------------------------------------------------------------------------------------------------------------------
# Saving and loading


def test_checkpoint_stores_experts_one_by_one_and_loads_back(tmp_path):
    model = moe_model(shared_expert_intermediate_size=24, mlp_only_layers=[0])
    model.save_pretrained(tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight").shape == (16, 32)
    for expert in range(4):
        assert {f"model.layers.1.mlp.experts.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= keys
    assert (
        "model.layers.1.mlp.shared_expert.gate_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    )
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)  # no fused tensors on disk

    loaded = TfmForCausalLM.from_pretrained(tmp_path / "ckpt", experts_implementation="eager").eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    loaded.save_pretrained(tmp_path / "again")  # a loaded model saves the same layout again
    with safe_open(str(tmp_path / "again" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == keys
    model.save_pretrained(tmp_path / "fused", save_original_format=False)  # the fused layout loads too
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    fused = TfmForCausalLM.from_pretrained(tmp_path / "fused")
    assert torch.equal(fused.model.layers[1].mlp.experts.gate_up_proj, model.model.layers[1].mlp.experts.gate_up_proj)


@pytest.mark.slow
def test_remote_code_checkpoint_switches_experts_implementation(tmp_path):
    """Where hf_tfm is not installed, the copied modeling.py still passes transformers' source check for the
    decorator: grouped_mm by default, switchable, the same logits as here."""
    model = moe_model(shared_expert_intermediate_size=24)
    model.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(2, 7)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        result = {{"can_set": type(model)._can_set_experts_implementation(),
                   "default": model.config._experts_implementation, "logits": {{}}}}
        for implementation in ("grouped_mm", "eager", "batched_mm"):
            model.set_experts_implementation(implementation)
            with torch.no_grad():
                result["logits"][implementation] = model(input_ids=torch.tensor({ids.tolist()})).logits.tolist()
        print(json.dumps(result))
    """
    result = json.loads(run_without_hf_tfm(code, tmp_path).strip().splitlines()[-1])
    assert result["can_set"] and result["default"] == "grouped_mm"
    for implementation, logits in result["logits"].items():
        torch.testing.assert_close(torch.tensor(logits), expected, atol=ATOL, rtol=0, msg=implementation)


@pytest.mark.slow
def test_moe_checkpoint_loads_under_another_release(tmp_path):
    """As test_cross_release.py, for an MoE checkpoint: per-expert layout, converted by the remote code's mapping."""
    from test_cross_release import LOAD, OTHERS

    if not OTHERS:
        pytest.skip("no other release's environment: `make test-matrix` creates them")
    model = moe_model(shared_expert_intermediate_size=24, mlp_only_layers=[0])
    model.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(2, 7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for python in OTHERS:
        code = f"import sys; sys.argv = ['x', {str(tmp_path / 'ckpt')!r}, {json.dumps(ids.tolist())!r}]\n" + LOAD
        result = json.loads(run_without_hf_tfm(code, tmp_path, python=str(python)).strip().splitlines()[-1])
        torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=ATOL, rtol=0, msg=str(python))
        assert result["tokens"] == tokens.tolist()


# ---------------------------------------------------------------------------------------------------------------------
# Training


def test_activation_checkpointing_gives_the_same_gradients_and_router_logits():
    model = moe_model(output_router_logits=True, shared_expert_intermediate_size=24).train()
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    ids, mask = left_padded()
    outs = []
    for m in (model, checkpointed):
        out = m(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        outs.append(out)
    assert len(outs[1].router_logits) == 2  # recorded once per layer, not again by the recomputation
    torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=1e-6, rtol=0)
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0, msg=name)


SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "max_steps": 1}


def aux_oracle_step(model, batches: list[dict], coef: float, by_share: bool = True) -> None:
    """One SGD step (lr 1) on sum_i CE_i / N + coef * w_i * aux_i, computed by hand: each micro-batch's
    cross-entropy sum over the step's N label tokens, and its aux loss weighted by its share n_i / N of them
    (`by_share`) or by 1 (a plain sum over the micro-batches)."""
    num_items = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches)
    total = 0.0
    for batch in batches:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        weight = batch["labels"][:, 1:].ne(-100).sum() / num_items if by_share else 1.0
        aux = in_tree_load_balancing_loss(out.router_logits, 4, 2, batch["attention_mask"])
        total = total + cross_entropy_sum(out.logits, batch["labels"]) / num_items + coef * weight * aux
    total.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad


def test_trainer_step_adds_the_aux_loss(tmp_path):
    base = moe_model(output_router_logits=True, router_aux_loss_coef=0.5).train()
    data = lm_examples([5, 9, 7, 12])
    trained = copy.deepcopy(base)
    args = training_args(tmp_path, per_device_train_batch_size=4, **SGD)
    Trainer(model=trained, args=args, train_dataset=data, data_collator=PadCollator()).train()
    oracle = copy.deepcopy(base)
    aux_oracle_step(oracle, [PadCollator()(data)], coef=0.5)
    assert max_param_diff(trained, oracle) < 1e-6
    without = copy.deepcopy(base)
    aux_oracle_step(without, [PadCollator()(data)], coef=0.0)
    assert max_param_diff(oracle, without) > 1e-4  # the aux loss did move the weights (the router's, at least)


def test_gradient_accumulation_is_exact_with_the_aux_loss(tmp_path):
    """Batch 1 x 4 accumulation steps == the hand-computed step where each micro-batch's aux loss counts with its
    share of the label tokens; a plain sum (what in-tree MoE models give Trainer) weighs it 4 times as much."""
    coef = 2.0  # large, so the two weightings differ clearly
    base = moe_model(output_router_logits=True, router_aux_loss_coef=coef).train()
    data = lm_examples([3, 11, 6, 15])
    accumulated = copy.deepcopy(base)
    args = training_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=4, **SGD)
    Trainer(model=accumulated, args=args, train_dataset=data, data_collator=PadCollator()).train()

    micro_batches = [PadCollator()([example]) for example in data]
    oracle, plain_sum = copy.deepcopy(base), copy.deepcopy(base)
    aux_oracle_step(oracle, micro_batches, coef)
    aux_oracle_step(plain_sum, micro_batches, coef, by_share=False)
    assert max_param_diff(accumulated, oracle) < 1e-6
    assert max_param_diff(accumulated, plain_sum) > 1e-4  # the data tell the two weightings apart


# ---------------------------------------------------------------------------------------------------------------------
# PEFT


def perturb_lora_b(model, seed: int = 1) -> None:
    """LoRA starts as a no-op (B = 0): random B values make the adapters change the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


EXPERT_LORA = {
    "r": 4,
    "target_modules": ["q_proj", "v_proj"],
    # fused 3-D experts and the (non-Linear) router are parameters to PEFT; this order is part of the adapter format
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
}


def test_lora_on_attention_and_experts_trains_saves_loads_and_merges(tmp_path):
    base = moe_model()
    ids, mask = left_padded()
    with torch.no_grad():
        before = base(input_ids=ids, attention_mask=mask).logits
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**EXPERT_LORA))
    perturb_lora_b(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".mlp.experts." in n for n in trainable) and any(".mlp.gate." in n for n in trainable)
    assert all("lora_" in n for n in trainable)

    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.eval()
    with torch.no_grad():
        adapted = {}
        for implementation in IMPLEMENTATIONS:  # the same LoRA delta whichever kernel runs the experts
            model.base_model.model.set_experts_implementation(implementation)
            adapted[implementation] = model(input_ids=ids, attention_mask=mask).logits
    assert (adapted["eager"] - before).abs().max() > 1e-2
    for implementation, logits in adapted.items():
        torch.testing.assert_close(logits, adapted["eager"], atol=ATOL, rtol=0, msg=implementation)

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    merged = model.merge_and_unload()
    assert type(merged) is TfmForCausalLM and not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    again = TfmForCausalLM.from_pretrained(tmp_path / "merged", experts_implementation="eager").eval()
    real = mask.bool()  # padded positions are don't-care (their attention rows are empty)
    with torch.no_grad():
        reloaded.base_model.model.set_experts_implementation("grouped_mm")  # the kernel `adapted` ran last
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits, adapted["grouped_mm"])
        for result in (merged, again):
            logits = result(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits[real], adapted["eager"][real], atol=ATOL, rtol=0)


def test_all_linear_lora_leaves_experts_and_router_alone():
    """PEFT expands "all-linear" to fused experts only for in-tree model types: on hf_tfm it reaches the attention,
    the dense layers' and shared expert's projections, not the experts or the router (README: target_parameters)."""
    model = get_peft_model(moe_model(shared_expert_intermediate_size=24), LoraConfig(r=4, target_modules="all-linear"))
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert not any(".experts" in n or n.endswith(".mlp.gate") for n in adapted)
    assert any(".shared_expert.down_proj" in n for n in adapted) and any(".q_proj" in n for n in adapted)


# ---------------------------------------------------------------------------------------------------------------------
# Tensor and expert parallel plans


def _plan_targets(model) -> set[str]:
    """Every module and parameter name of `model`, with layer indices as `*` (as transformers matches plans)."""
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return {replace_layer_number_by_wildcard(n) for n in names}


def _parallel_styles() -> set[str]:
    import importlib.util

    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    if importlib.util.find_spec("transformers.distributed.expert_parallel"):  # newer releases register EP styles here
        import transformers.distributed.expert_parallel  # noqa: F401
    return set(ALL_PARALLEL_STYLES.keys())


@pytest.mark.parametrize("qk_norm_scope", [None, "projection"])
def test_tp_and_ep_plans_match_the_model_and_cover_the_experts(qk_norm_scope):
    qk = {"qk_norm": True, "qk_norm_scope": qk_norm_scope} if qk_norm_scope else {}
    config = moe_config(mlp_only_layers=[0], shared_expert_intermediate_size=24, **qk)  # dense and sparse layers
    model = TfmModel(config)
    targets = _plan_targets(model)
    tp_plan, ep_plan = config.base_model_tp_plan, config.base_model_ep_plan
    assert set(tp_plan) <= targets, set(tp_plan) - targets  # every pattern names something real
    assert set(ep_plan) <= targets, set(ep_plan) - targets
    assert set(tp_plan.values()) | set(ep_plan.values()) <= _parallel_styles()  # styles this release has
    for param in ("gate_up_proj", "down_proj"):  # the experts are sharded by both plans
        assert f"layers.*.mlp.experts.{param}" in tp_plan and f"layers.*.mlp.experts.{param}" in ep_plan
    assert tp_plan["layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"  # [gate; up] split per half
    gathered = tp_plan["layers.*.self_attn.q_proj"] == "colwise_gather_output"
    assert gathered is (qk_norm_scope == "projection")  # a norm over all heads needs them gathered (as OLMoE)
    assert moe_config().base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"  # per-head norm or none


# ---------------------------------------------------------------------------------------------------------------------
# hf-tfm


def test_info_reports_total_and_active_parameters(capsys):
    from hf_tfm.cli import main
    from hf_tfm.presets import load_config

    assert main(["info", "small-moe", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = load_config("small-moe")
    experts, top_k, hidden = config.num_experts, config.num_experts_per_tok, config.hidden_size
    with torch.device("meta"):
        total = sum(p.numel() for p in TfmForCausalLM(config).parameters())
        top_k_only = TfmForCausalLM(load_config("small-moe", num_experts=top_k))  # k experts per layer, all active
        active = sum(p.numel() for p in top_k_only.parameters()) + (experts - top_k) * hidden * 4  # + full routers
    assert (report["parameters"], report["active_parameters"]) == (total, active)
    assert report["experts"] == {"num_experts": 8, "num_experts_per_tok": 2, "sparse_layers": [0, 1, 2, 3]}
    assert report["integrations"]["experts kernels"]["grouped_mm"][0]
    assert main(["info", "small-moe"]) == 0
    assert f"active parameters per token: {active:,} (top-2 of 8 experts" in capsys.readouterr().out
    assert main(["info", "small-decoder", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert dense["active_parameters"] == dense["parameters"] and dense["experts"] is None


@pytest.mark.slow
def test_pretrain_the_moe_preset(tmp_path):
    """`hf-tfm pretrain --config small-moe` end to end: a per-expert checkpoint whose model card lists the experts."""
    from hf_tfm.cli import main

    (tmp_path / "train.txt").write_text("\n".join(f"def function_{i}(x):\n    return x + {i}" for i in range(60)))
    argv = ["pretrain", "--train-file", str(tmp_path / "train.txt"), "--config", "small-moe"]
    assert main([*argv, "--output-dir", str(tmp_path / "lm"), "--max-steps", "2", "--seq-len", "16"]) == 0
    assert "| `num_experts` | 8 |" in (tmp_path / "lm" / "README.md").read_text()
    with safe_open(str(tmp_path / "lm" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in set(f.keys())
    model = TfmForCausalLM.from_pretrained(tmp_path / "lm")
    assert len(model(input_ids=torch.tensor([[5, 6, 7]])).router_logits) == 4  # the preset returns them


def test_docs_moe_blocks_run(tmp_path, monkeypatch):
    """The docs' Mixture-of-experts blocks run as written (in one namespace, in a scratch directory)."""
    namespace = run_doc_blocks("moe", 5, tmp_path, monkeypatch)
    train_loss = namespace["trainer"].state.log_history[-1]["train_loss"]
    assert 0 < train_loss < 5.0, train_loss  # ln(99) = 4.6 untrained, plus the aux loss (~0.002)
    assert (tmp_path / "out" / "moe-lora" / "adapter_config.json").is_file()
    assert type(namespace["merged"]) is TfmForCausalLM and type(namespace["back"]).__name__ == "MixtralForCausalLM"


# ---------------------------------------------------------------------------------------------------------------------
# Two processes (gloo): DDP with Trainer, tensor and expert parallelism


@pytest.mark.slow
@pytest.mark.solo
def test_torchrun_ddp_matches_the_replayed_steps(tmp_path):
    """2-process DDP with Trainer == the steps replayed in one process from the batches each rank trained on, with
    each rank's aux loss weighted by its share of the step's tokens; a plain sum of the ranks' aux losses differs."""
    from test_distributed import launch, torchrun

    launch(torchrun("train_ddp_moe.py", str(tmp_path)), tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert result["wrapper"] == "DistributedDataParallel" and result["replicas_equal"]
    assert result["batch_sizes"] == [[4, 4]] * 4
    for loss, reference in zip(result["losses"], result["reference_losses"], strict=True):
        assert abs(loss - reference) < 1e-5
    assert result["max_weight_diff"] < 1e-5
    assert result["max_weight_diff_summed_aux"] > 1e-3


@pytest.fixture(scope="module")
def parallel_logits(tmp_path_factory, request) -> dict[str, dict]:
    """tests/dist/moe_parallel.py's record of each (mode, implementation) case the session's tests of this file read,
    by "mode:implementation": one launch for them all, each case's load in turn (a launch's start-up, 2 ranks'
    imports, is most of a case's time)."""
    from test_distributed import launch, torchrun

    cases = sorted(
        "{mode}:{implementation}".format(**item.callspec.params)
        for item in request.session.items
        if item.path == request.path and "parallel_logits" in item.fixturenames
    )
    folder = tmp_path_factory.mktemp("moe_parallel")
    torch.manual_seed(0)
    config = moe_config(vocab_size=98, mlp_only_layers=[0], shared_expert_intermediate_size=24)
    TfmForCausalLM(config).save_pretrained(folder / "model")
    out = folder / "result.json"
    launch(torchrun("moe_parallel.py", str(folder / "model"), str(out), *cases), folder)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.solo
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_tensor_and_expert_parallel_logits_equal_one_process(parallel_logits, mode, implementation):
    """DistributedConfig(tp_size=2) shards each expert's width (packed [gate; up]); expert parallelism puts half the
    experts on each rank. Both give the single-process logits."""
    result = parallel_logits[f"{mode}:{implementation}"]
    assert result["implementation"] == implementation
    if mode == "tp":
        assert result["local_gate_up_proj"] == [4, 16, 32] and result["local_num_experts"] == 4  # 2 x 16 / 2 ranks
    else:
        assert result["local_gate_up_proj"] == [2, 32, 32] and result["local_num_experts"] == 2
    assert result["max_logit_diff"] < 1e-5
