"""Quantized and bf16 weights on CPU: transformers' quantization configs on hf_tfm, QLoRA, and `--quantize`.

Every backend that installs and runs here with torch 2.13 loads an hf_tfm checkpoint through
`from_pretrained(..., quantization_config=...)` as it loads an in-tree model: the decoder's projections are
quantized, the embeddings and `lm_head` are not, the logits stay within the backend's `tolerance` of fp32, generate
runs, and serialisable backends save and reload (also through remote code, where hf_tfm cannot be imported).

Tolerances are max |quantized - fp32| over every logit, relative to the largest |fp32 logit|, on the model below
(random weights, 2 x 16 tokens). Measured over seeds 0-2 (torch 2.13 CPU): torchao int8 0.015-0.018, torchao int4
0.23-0.27, bitsandbytes int8 0.021-0.025, NF4 0.17-0.24, quanto int8 0.016-0.021, quanto int4 0.23-0.27, bf16
weights 0.007-0.009; each tolerance is the largest rounded up by about half. 4-bit errors are large on random
weights, whose uniform distribution NF4's levels (made for trained, normal-looking weights) fit worst;
`scripts/quality.py` measures a trained model.
The model is larger than the suite's tiny one because the 4-bit kernels need whole blocks: bitsandbytes' CPU kernel
takes output sizes divisible by 32, quanto's int4 groups 128 input features.
"""

import dataclasses
import json
import logging
from dataclasses import dataclass, field

import pytest
import torch
from conftest import ROOT, random_ids, run_doc_block, run_doc_blocks, run_without_hf_tfm
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_tfm import TfmConfig, TfmForCausalLM
from hf_tfm.training import PadCollator

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

MODEL = {
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.05,  # larger than the default: logits of order 1, so the tolerances are real checks
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Backend:
    name: str
    module: str  # importorskip'd: the default environments have every one of them
    make_config: object  # () -> a transformers quantization config
    tolerance: float
    dtype: torch.dtype = torch.float32
    serializable: bool = True
    save_error: str = "not serializable"  # what save_pretrained raises when it is not
    extra: dict = field(default_factory=dict)


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _torchao_int4():
    from hf_tfm.inference.quantize import quantization_kwargs

    return quantization_kwargs("int4", TfmConfig(**MODEL))["quantization_config"]


def _bnb(**kwargs):
    from transformers import BitsAndBytesConfig

    return lambda: BitsAndBytesConfig(**kwargs)


def _quanto(weights: str):
    from transformers import QuantoConfig

    return lambda: QuantoConfig(weights=weights)


NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}
BACKENDS = [
    Backend("torchao-int8", "torchao", _torchao_int8, 0.03),
    # torchao's CPU int4 layout has no safetensors support in torchao 0.18 (transformers does not know it, and fails
    # in torchao's flattening)
    Backend(
        "torchao-int4",
        "torchao",
        _torchao_int4,
        0.4,
        dtype=torch.bfloat16,
        serializable=False,
        save_error="Unsupported tensor type",
    ),
    Backend("bnb-int8", "bitsandbytes", _bnb(load_in_8bit=True), 0.04),
    Backend("bnb-nf4", "bitsandbytes", _bnb(**NF4), 0.35, dtype=torch.bfloat16),
    # transformers marks optimum-quanto models as not serialisable (save_pretrained raises)
    Backend("quanto-int8", "optimum.quanto", _quanto("int8"), 0.03, serializable=False),
    Backend("quanto-int4", "optimum.quanto", _quanto("int4"), 0.4, dtype=torch.bfloat16, serializable=False),
]
BY_NAME = {b.name: b for b in BACKENDS}


def require(backend: Backend) -> None:
    pytest.importorskip(backend.module, reason=f"{backend.name} needs {backend.module} (in the dev extra)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An fp32 hf_tfm causal LM saved to disk, and its logits on `IDS`."""
    torch.manual_seed(0)
    model = TfmForCausalLM(TfmConfig(**MODEL)).eval()
    folder = tmp_path_factory.mktemp("fp32")
    model.save_pretrained(folder)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return folder, logits


IDS = random_ids(2, 16, vocab_size=MODEL["vocab_size"])


def load(folder, backend: Backend, **kwargs):
    config = backend.make_config()
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=backend.dtype, **kwargs)


def logits_of(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def is_quantized(module: nn.Module) -> bool:
    """Replaced by a quantized layer class (bitsandbytes, quanto), or holding a quantized tensor subclass (torchao)."""
    return type(module) is not nn.Linear or type(module.weight) not in (torch.Tensor, nn.Parameter)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_quantized_logits_close_to_fp32(checkpoint, backend):
    require(backend)
    folder, expected = checkpoint
    model = load(folder, backend).eval()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            assert is_quantized(module), name
    assert not is_quantized(model.lm_head) and type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight.dtype == backend.dtype
    error = relative_error(logits_of(model), expected)
    assert error <= backend.tolerance, f"max |quantized - fp32| / max |fp32| = {error:.3g}"
    assert error > 0  # the weights really were quantized


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_tied_embeddings_stay_tied_and_unquantized(backend, tmp_path):
    """With `tie_word_embeddings`, the quantizers skip both tied modules (transformers' default skip list) and the
    head still shares the input table; `device_map="auto"` places the model by `_no_split_modules` (all on CPU)."""
    require(backend)
    torch.manual_seed(0)
    TfmForCausalLM(TfmConfig(**MODEL, tie_word_embeddings=True)).save_pretrained(tmp_path)
    model = load(tmp_path, backend, device_map="auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight and not is_quantized(model.lm_head)
    assert is_quantized(model.model.layers[0].mlp.down_proj)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_quantized_generate_left_padded_batch(checkpoint, backend):
    require(backend)
    model = load(checkpoint[0], backend).eval()
    ids = IDS[:, :8].clone()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: generate builds positions from the mask
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)
    alone = model.generate(
        input_ids=ids[1:, 3:], attention_mask=mask[1:, 3:], max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    # the padded row decodes as it does alone (the same tokens, unless quantization noise flips a near tie)
    assert (out[1, 8:] == alone[0, 5:]).float().mean() >= 0.5


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.serializable], ids=lambda b: b.name)
def test_quantized_save_and_reload(checkpoint, backend, tmp_path):
    require(backend)
    model = load(checkpoint[0], backend).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" in saved and saved["auto_map"]["AutoModelForCausalLM"] == "modeling.TfmForCausalLM"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded.model.layers[0].mlp.up_proj) is type(model.model.layers[0].mlp.up_proj)
    assert torch.equal(logits_of(reloaded), logits_of(model))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if not b.serializable], ids=lambda b: b.name)
def test_unserializable_backend_refuses_to_save(checkpoint, backend, tmp_path):
    require(backend)
    with pytest.raises(ValueError, match=backend.save_error):
        load(checkpoint[0], backend).save_pretrained(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.serializable], ids=lambda b: b.name)
def test_quantized_checkpoint_loads_with_remote_code(checkpoint, backend, tmp_path):
    """A saved quantized folder loads in a fresh process where hf_tfm cannot be imported: identical logits."""
    require(backend)
    model = load(checkpoint[0], backend).eval()
    model.save_pretrained(tmp_path / "quantized")
    expected = logits_of(model)
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "quantized")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            print(json.dumps(model(input_ids=torch.tensor({IDS.tolist()})).logits.float().tolist()))
    """
    logits = json.loads(run_without_hf_tfm(code, tmp_path).strip().splitlines()[-1])
    assert torch.equal(torch.tensor(logits), expected)


def test_nf4_with_double_quantization_saves_after_running(checkpoint, tmp_path):
    """bitsandbytes 0.50 repacks 4-bit weights for its CPU kernel at the first forward and unpacks them to save; with
    single-quantized scales the unpacking scrambles them (README "Fast inference"), with double-quantized ones it
    does not: the reloaded model matches the one that ran, up to re-quantizing the scales."""
    backend = dataclasses.replace(BY_NAME["bnb-nf4"], make_config=_bnb(**NF4, bnb_4bit_use_double_quant=True))
    require(backend)
    model = load(checkpoint[0], backend).eval()
    before = logits_of(model)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert relative_error(logits_of(reloaded), before) < 0.02
    assert relative_error(logits_of(model), before) < 0.02


def test_classifier_and_seq2seq_heads_quantize(tmp_path):
    """The other heads load through a quantization config too. A classifier's `score` has a bias, so transformers'
    default skip list (which strips only `.weight` off the last parameter's name) misses it: skip it by name."""
    backend = BY_NAME["bnb-nf4"]
    require(backend)
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    from hf_tfm import TfmForConditionalGeneration, TfmForSequenceClassification, TfmSeq2SeqConfig

    torch.manual_seed(0)
    TfmForSequenceClassification(TfmConfig(**MODEL, num_labels=3)).save_pretrained(tmp_path / "clf")
    config = BitsAndBytesConfig(**NF4, llm_int8_skip_modules=["score"])
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf", quantization_config=config)
    assert is_quantized(classifier.model.layers[0].self_attn.q_proj) and not is_quantized(classifier.score)
    assert logits_of(classifier.eval()).shape == (2, 3)

    sides = {"encoder": MODEL, "decoder": MODEL}
    TfmForConditionalGeneration(TfmSeq2SeqConfig(**sides, decoder_start_token_id=1)).save_pretrained(tmp_path / "s2s")
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "s2s", quantization_config=BitsAndBytesConfig(**NF4))
    assert is_quantized(seq2seq.model.decoder.layers[0].encoder_attn.k_proj)
    assert seq2seq.generate(input_ids=IDS, max_new_tokens=4, do_sample=False).shape == (2, 5)


# ---------------------------------------------------------------------------------------------------------------------
# bf16 weights (not autocast): inference and training

BF16_TOLERANCE = 0.015  # measured 0.007-0.009 (seeds 0-2) (tests/test_half_precision.py covers the config grid)


def test_bf16_weights_generate_close_to_fp32(checkpoint):
    folder, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    error = relative_error(logits_of(model), expected)
    assert 0 < error <= BF16_TOLERANCE, error
    assert model.generate(input_ids=IDS, max_new_tokens=5, do_sample=False).shape == (2, 21)


def train_examples() -> list[dict]:
    """Counting runs of 12 tokens from 8 starts: a pattern a few steps learn."""
    return [{"input_ids": list(range(start, start + 12))} for start in range(3, 11)] * 4


def run_trainer(model, tmp_path, steps: int = 12, lr: float = 1e-2) -> list[float]:
    args = TrainingArguments(
        str(tmp_path / "trainer"),
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=lr,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_examples(), data_collator=PadCollator())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_bf16_weights_train_with_trainer(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16)
    losses = run_trainer(model, tmp_path)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] * 0.7, losses
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # trained in bf16, not upcast


# ---------------------------------------------------------------------------------------------------------------------
# QLoRA: LoRA adapters on a quantized base, trained with Trainer


@pytest.mark.parametrize("backend", [BY_NAME["bnb-nf4"], BY_NAME["torchao-int8"]], ids=lambda b: b.name)
def test_qlora_trains_and_the_adapter_loads_on_quantized_and_full_bases(checkpoint, backend, tmp_path):
    require(backend)
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    folder, _ = checkpoint
    base = prepare_model_for_kbit_training(load(folder, backend), use_gradient_checkpointing=False)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    losses = run_trainer(model, tmp_path)
    assert losses[-1] < losses[0] * 0.7, losses
    model.save_pretrained(tmp_path / "adapter")
    trained = logits_of(model.eval())

    # prepared as for training: prepare_model_for_kbit_training upcasts what is not quantized (norms, embeddings,
    # lm_head) to fp32, which a bf16 base like NF4's would otherwise compute in
    quantized = prepare_model_for_kbit_training(load(folder, backend), use_gradient_checkpointing=False)
    on_quantized = PeftModel.from_pretrained(quantized, tmp_path / "adapter").eval()
    assert torch.equal(logits_of(on_quantized), trained)
    full = AutoModelForCausalLM.from_pretrained(folder)
    untrained = logits_of(full.eval())
    on_full = PeftModel.from_pretrained(full, tmp_path / "adapter").eval()
    # the full-precision base with the adapter is the trained model up to the base's quantization error, and much
    # closer to it than the base alone
    on_full_error = relative_error(logits_of(on_full), trained)
    assert on_full_error <= backend.tolerance
    assert relative_error(untrained, trained) > 2 * on_full_error


# ---------------------------------------------------------------------------------------------------------------------
# hf-tfm generate --quantize


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    """A causal LM folder with a tokenizer, as `hf-tfm pretrain` writes one."""
    from hf_tfm.tokenization import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("lm")
    tokenizer = train_bpe_tokenizer([f"def function_{i}(x):\n    return x + {i}" for i in range(50)], vocab_size=300)
    torch.manual_seed(0)
    TfmForCausalLM(TfmConfig(**{**MODEL, "vocab_size": len(tokenizer)})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("setting", ["int8", "int4", "nf4"])
def test_cli_generate_quantize(lm_folder, setting, capsys):
    from hf_tfm.cli import main
    from hf_tfm.inference.quantize import SETTINGS

    pytest.importorskip(SETTINGS[setting].module, reason=f"--quantize {setting} needs {SETTINGS[setting].pip_spec}")
    argv = ["generate", str(lm_folder), "--prompt", "def ", "--max-new-tokens", "4", "--greedy", "--no-stream"]
    assert main([*argv, "--quantize", setting]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_load_for_inference_quantizes_and_compiles_what_transformers_can(lm_folder, caplog):
    """torchao int4 decodes compiled (it built a graph); bitsandbytes NF4 cannot be compiled: a warning, and eager
    decoding."""
    from torch._dynamo.utils import counters

    from hf_tfm import load_for_inference

    pytest.importorskip("torchao")
    int4 = load_for_inference(lm_folder, quantize="int4")
    assert is_quantized(int4.model.layers[0].mlp.up_proj) and int4.generation_config.cache_implementation == "static"
    torch._dynamo.reset()
    counters.clear()
    compiled = int4.generate(IDS[:1, :8], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert counters["stats"]["unique_graphs"] >= 1
    eager = int4.generate(IDS[:1, :8], max_new_tokens=8, min_new_tokens=8, do_sample=False, disable_compile=True)
    assert compiled.shape == eager.shape == (1, 16)
    pytest.importorskip("bitsandbytes")
    with caplog.at_level(logging.WARNING, logger="hf_tfm.inference"):
        nf4 = load_for_inference(lm_folder, quantize="nf4")
    assert "cannot be compiled" in caplog.text and nf4.generation_config.cache_implementation is None


@pytest.mark.parametrize(("hidden", "group_size"), [(128, 128), (192, 64), (96, 32)])
def test_int4_groups_fit_every_linear_layer(hidden, group_size):
    """torchao leaves a layer whose input features are not a whole number of groups unquantized, without an error:
    `--quantize int4` picks a group size every linear layer takes, and refuses a model no group size fits."""
    pytest.importorskip("torchao")
    from hf_tfm.inference.quantize import quantization_kwargs

    config = TfmConfig(**{**MODEL, "hidden_size": hidden, "intermediate_size": 4 * hidden})
    assert quantization_kwargs("int4", config)["quantization_config"].quant_type.group_size == group_size
    with pytest.raises(ValueError, match="intermediate_size"):
        quantization_kwargs("int4", TfmConfig(**{**MODEL, "intermediate_size": 200}))


def test_cli_generate_bf16(lm_folder, capsys):
    from hf_tfm.cli import main

    argv = ["generate", str(lm_folder), "--prompt", "def ", "--max-new-tokens", "4", "--greedy", "--no-stream"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_cli_refuses_an_unavailable_backend_naming_what_to_install(lm_folder, capsys, monkeypatch):
    from hf_tfm.cli import main
    from hf_tfm.inference import quantize

    missing = dataclasses.replace(quantize.SETTINGS["int4"], module="no_such_quantization_package")
    monkeypatch.setitem(quantize.SETTINGS, "int4", missing)
    assert main(["generate", str(lm_folder), "--prompt", "def ", "--quantize", "int4"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install '{missing.pip_spec}'" in err, err


# ---------------------------------------------------------------------------------------------------------------------
# The docs' "Fast inference" blocks


def test_docs_fast_inference_blocks(tmp_path, monkeypatch):
    """The docs' recommended setting (q4 through load_for_inference), other backends and QLoRA blocks run as
    written (one namespace, a scratch directory); then the GPTQ block, where llm-compressor's environment is made (as
    in CI)."""
    from hf_tfm import load_for_inference

    for module in ("bitsandbytes", "torchao", "peft"):
        pytest.importorskip(module, reason="the page's blocks use it (in the dev extra)")
    namespace = run_doc_blocks("fast-inference", 4, tmp_path, monkeypatch, first=3)
    model = namespace["model"]
    assert type(model.lm_head).__name__ == "Int8StreamingLinear"
    assert model.compiled_decode_step.calls > 0  # generate()'s steps ran through the step compiled ahead of time
    assert namespace["tokens"].shape == namespace["sampled"].shape == (1, 12)
    eager = load_for_inference(tmp_path / "out" / "small-lm", quantize="q4", compile=False)
    eager_tokens = eager.generate(input_ids=namespace["prompt"], max_new_tokens=8, do_sample=False)
    assert torch.equal(namespace["tokens"], eager_tokens)  # compiled: the eager model's greedy tokens
    assert is_quantized(namespace["int8"].model.layers[0].mlp.up_proj)
    assert namespace["out"].shape == namespace["fast"].shape == (1, 12)
    assert is_quantized(namespace["int4"].model.layers[0].mlp.up_proj)
    assert json.loads((tmp_path / "out" / "lm-int8" / "config.json").read_text())["quantization_config"]
    assert {p.dtype for p in namespace["bf16"].parameters()} == {torch.bfloat16}
    losses = [e["loss"] for e in namespace["trainer"].state.log_history if "loss" in e]
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "out" / "qlora" / "adapter" / "adapter_config.json").is_file()
    assert type(namespace["full"].base_model.model).__name__ == "TfmForCausalLM"
    llmcompressor = ROOT / ".venv-llmcompressor" / "bin" / "python"
    if not llmcompressor.exists():
        pytest.skip("the GPTQ block needs llm-compressor's environment: make llmcompressor-env")
    monkeypatch.setenv("HF_TFM_LLMCOMPRESSOR_PYTHON", str(llmcompressor))
    run_doc_block("fast-inference", 3, namespace)
    assert namespace["gptq_tokens"].shape == (1, 12)
    assert type(namespace["gptq_fast"].model.layers[0].mlp.gate_up_proj).__name__ == "Int8StreamingLinear"
