"""ExecuTorch for on-device runtimes: hf_tfm's own forward captured by `torch.export`, lowered to XNNPACK.

No runtime architecture has to match: the program is hf_tfm's modeling code, so every knob that traces (every
position type, norm placement, parallel residual, qk-norm, sliding windows, MoE, ...) is computed exactly. What is
written for a causal LM (`TfmForCausalLM`):

* `model.pte`: one method, `forward(input_ids (1, T), cache_position (T,)) -> logits (1, T, V)`, float32, delegated
  to XNNPACK. The KV cache is a static cache of `max_cache_len` positions held inside the program as mutable buffers,
  so the same method prefills a prompt (T dynamic, 1..max_cache_len) and decodes one token at a time. Batch 1.
  `max_cache_len` is min(max_position_embeddings, 1024): prompt plus new tokens must fit in it.
* `config.json`, the tokenizer's files, `executorch_export.json` (the method's inputs and outputs, max_cache_len and
  the generation ids) and `et_generate.py`: `ExecutorchGenerator(folder).generate(prompt, max_new_tokens)`, greedy
  decoding with executorch's runtime alone (no transformers, no hf_tfm). Verification runs that same code.

For an encoder (`TfmModel` or a task head: sequence or token classification, question answering, masked LM):
`model.pte` with one method, `forward(input_ids (B, T), attention_mask (B, T)[, token_type_ids (B, T)]) -> the
model's outputs` (features, pooler, logits: named in the manifest), batch and length dynamic, and `et_encode.py`,
whose `ExecutorchEncoder(folder)(ids, mask)` runs it on a padded batch with executorch's runtime alone.

Why one program with a static cache: transformers' exporters write prefill + decode programs around a `DynamicCache`
whose traced shapes only decode one step, and their static-cache variant takes a 4-D attention mask per step. Here
each step's only inputs are the ids and their positions; positions set the cache's fill level, the mask comes from
them inside the program (later, stale cache entries are masked), and a new prompt simply starts again at position 0.
Sliding-window layers keep a full-length cache, the window applied by the mask, so they are exact past the window.
Mixture-of-experts layers run every expert on every token, weighted by the router (zero for the unchosen), because
the data-dependent routing of the eager path does not export: E / k times the FFN compute, the same sums.
"""

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MethodType
from typing import Any

import torch

from ..checkpoint import staged_folder
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..programs import program_path, run_program
from ._common import (
    ENCODER_CLASSES,
    agreement_report,
    copy_tokenizer,
    encoder_max_diff,
    eos_ids,
    greedy_references,
    new_tokens,
    prompt_ids,
)
from .registry import ExportFormat

RUNTIME = "ExecuTorch"
# --quantize value -> what is stored (activations too): float32 only for now
TYPES = {"float32": "float32 (XNNPACK)"}
MANIFEST = "executorch_export.json"
PROGRAM = "model.pte"
# The runtime's side (hf_tfm.programs), written beside the .pte as its runner: `ExecutorchGenerator` for a causal LM,
# `ExecutorchEncoder` for an encoder; executorch's runtime and torch only
SIDE, RUNNER = "executorch_side", "et_generate.py"
ENCODER_SIDE, ENCODER_RUNNER = "executorch_encoder_side", "et_encode.py"
# Blocked where they run: what runs is what a deployment with executorch alone runs (its runtime imports torch itself)
EXECUTORCH_ONLY = ("transformers", "hf_tfm")
TAKES = ("TfmForCausalLM", *ENCODER_CLASSES)
INSTALL_HINT = 'ExecuTorch export needs executorch: pip install "hf-tfm[executorch]" (or pip install executorch)'
MAX_CACHE_LEN = 1024  # the cap on the program's KV cache (memory is allocated for all of it)
# rope types that rebuild their frequencies from the sequence length at run time (`dynamic_rope_update`)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _import_executorch():
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return to_edge_transform_and_lower, XnnpackPartitioner


def executorch_blockers(config: TfmConfig | TfmSeq2SeqConfig) -> list[str]:
    """Empty when the ExecuTorch export takes `config`: decoders and encoders (not encoder-decoders), whose RoPE (if
    any) does not depend on the sequence length."""
    if isinstance(config, TfmSeq2SeqConfig):
        return [f"{RUNTIME}: the encoder-decoder (TfmSeq2SeqConfig) has no ExecuTorch export"]
    out = []
    if config.add_cross_attention:
        out.append(f"{RUNTIME}: `add_cross_attention=True` needs an encoder's states, which the program does not take")
    if config.position_embedding_type == "rope" and config.rope_parameters:
        entries = config.rope_parameters.values() if config.rope_per_layer_type else [config.rope_parameters]
        scaled = sorted({p.get("rope_type") for p in entries if p.get("rope_type") in LENGTH_DEPENDENT_ROPE})
        if scaled:
            out.append(
                f"{RUNTIME}: `rope_parameters` rope_type {', '.join(map(repr, scaled))} rebuilds its frequencies from "
                "the sequence length at run time, which a captured program freezes"
            )
    return out


def max_cache_length(config: TfmConfig) -> int:
    """The program's KV cache length: the model's position limit, capped at `MAX_CACHE_LEN`."""
    return min(config.max_position_embeddings, MAX_CACHE_LEN)


# ---------------------------------------------------------------------------------------------------------------------
# Export


def _load(model_or_folder: Any) -> tuple[torch.nn.Module, str | None]:
    """The causal LM or encoder in float32 (a copy when it is in another dtype) and its folder, if any."""
    from transformers import AutoConfig

    from .. import modeling

    if isinstance(model_or_folder, (str, os.PathLike)):
        folder = Path(model_or_folder)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # exports installed classes only
        blocked = executorch_blockers(config)
        if blocked:
            raise ValueError(f"{folder}: {'; '.join(blocked)}.")
        architecture = (getattr(config, "architectures", None) or ["TfmForCausalLM"])[0]
        _check_class(architecture, config, where=f"{folder}: ")
        model_class = getattr(modeling, architecture)
        return model_class.from_pretrained(folder, dtype=torch.float32).eval(), str(folder)
    blocked = executorch_blockers(getattr(model_or_folder, "config", None))
    if blocked:
        raise ValueError("; ".join(blocked) + ".")
    _check_class(type(model_or_folder).__name__, model_or_folder.config)
    model = model_or_folder
    if model.dtype != torch.float32:
        import copy

        model = copy.deepcopy(model).float()
    return model.eval(), getattr(model_or_folder, "name_or_path", None) or None


def _class_refusal(architecture: str, config: TfmConfig) -> str | None:
    if architecture not in TAKES:
        return f"ExecuTorch export takes {', '.join(TAKES)}, not {architecture}"
    if architecture == "TfmForCausalLM" and not config.is_causal:
        return "a TfmForCausalLM with `is_causal=False` generates nothing: export its encoder class"
    return None


def _check_class(architecture: str, config: TfmConfig, where: str = "") -> None:
    refused = _class_refusal(architecture, config)
    if refused:
        raise ValueError(f"{where}{refused}.")


def refusal(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str | None:
    """Why a model of this config and class is not exported to ExecuTorch (the blocking knobs, else the class), or
    None."""
    return "; ".join(executorch_blockers(config)) or _class_refusal(architecture, config)


def _summary(config: TfmConfig, architecture: str) -> str:
    if architecture == "TfmForCausalLM":
        return f"one program, batch 1, a static cache of {max_cache_length(config)} positions"
    return "one program: a padded batch's outputs, batch and length dynamic"


class StaticCacheLM(torch.nn.Module):
    """forward(input_ids (B, T), cache_position (T,)) -> logits, the KV cache a static cache kept in buffers (also the
    step `hf_tfm.inference.aot` compiles)."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int, batch_size: int = 1) -> None:
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        from ..modeling import CACHE_NAME

        self.model, self.cache_name = model, CACHE_NAME
        config = model.config
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        # Sliding layers become full-length ones: the sliding mask still applies the window, and a sliding layer's
        # roll-over is data-dependent control flow that does not export.
        self.cache.layers = [StaticLayer(max_cache_len) for _ in self.cache.layers]
        self.cache.early_initialization(
            batch_size, config.num_key_value_heads, config.head_dim, model.dtype, model.device
        )
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):
            # The cache reads this module's buffers: non-strict torch.export swaps the buffers for traced stand-ins,
            # and tensors reached only through the cache would become constants, their updates lost.
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = getattr(self, f"cumulative_length_{i}")
            # The fill level is the first position: a new prompt (position 0) restarts, later entries are masked.
            layer.cumulative_length.copy_(cache_position[0])
        options = {self.cache_name: self.cache, "use_cache": True}
        if self.model.config.num_experts:
            options["output_router_logits"] = False  # the load-balancing loss (histc) is training's
        return self.model(input_ids=input_ids, position_ids=cache_position[None], **options).logits


def _all_experts(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor):
    """`TfmExperts.forward` without data-dependent shapes: each expert on every token, weighted by its routing weight
    (zero where not chosen), summed in expert order as the eager loop sums (adding exact zeros changes nothing)."""
    out = torch.zeros_like(hidden_states)
    width = self.gate_up_proj.shape[1] // 2
    for expert in range(self.num_experts):
        weight = (weights * (top_k_index == expert)).sum(-1, keepdim=True)  # (T, 1)
        gate_up = torch.nn.functional.linear(hidden_states, self.gate_up_proj[expert])
        # slices, not chunk: executorch's edge verifier takes len() of a list-returning op's output, which pins the
        # token count to the sample's
        gate, up = gate_up[:, :width], gate_up[:, width:]
        current = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
        out = out + (current * weight).to(out.dtype)
    return out


@contextmanager
def exportable(model: torch.nn.Module, attention: str | None = None) -> Iterator[None]:
    """The model as the capture needs it (experts without data-dependent shapes; `attention`, by default the model's
    own where it is SDPA or eager and SDPA otherwise), restored after."""
    original = model.config._attn_implementation
    attention = attention or (original if original in ("sdpa", "eager") else "sdpa")
    experts = [m for m in model.modules() if type(m).__name__ == "TfmExperts"]
    if attention != original:
        model.set_attn_implementation(attention)
    for module in experts:
        module.forward = MethodType(_all_experts, module)
    try:
        yield
    finally:
        for module in experts:
            del module.forward
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def _lower(model: torch.nn.Module, max_cache_len: int) -> Any:
    """The `ExecutorchProgramManager` of the model's generation program."""
    to_edge_transform_and_lower, partitioner_class = _import_executorch()
    with exportable(model), torch.no_grad():
        module = StaticCacheLM(model, max_cache_len).eval()
        # A sample of 2+ tokens keeps T dynamic (torch.export specialises a dimension whose sample size is 0 or 1).
        sample = min(4, max_cache_len)
        length = torch.export.Dim("tokens", min=1, max=max_cache_len)
        exported = torch.export.export(
            module,
            (torch.zeros((1, sample), dtype=torch.long), torch.arange(sample)),
            dynamic_shapes=({1: length}, {0: length}),
            strict=False,
        )
        return to_edge_transform_and_lower(exported, partitioner=[partitioner_class()]).to_executorch()


class _Encoder(torch.nn.Module):
    """forward(input_ids, attention_mask[, token_type_ids]) -> the model's tensor outputs, in `names` order."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple:
        options = {"output_router_logits": False} if self.model.config.num_experts else {}
        if token_type_ids is not None:
            options["token_type_ids"] = token_type_ids
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **options)
        return tuple(out[name] for name in self.names)


def _encoder_partitioner(partitioner_class: Any) -> Any:
    """XNNPACK's partitioner, except for unsqueezes with more than one dynamic dimension, which stay in executorch's
    portable kernels: XNNPACK's reshape takes one (executorch 1.5.1 delegates them, then fails to serialize them; a
    padded batch has two: batch and length, as in the sinusoidal table's `positions[..., None]`)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import UnsqueezeCopyConfig
    from torch.fx.experimental.symbolic_shapes import free_symbols

    class OneDynamicDimUnsqueeze(UnsqueezeCopyConfig):
        def check_constraints(self, node: torch.fx.Node, ep: Any) -> bool:
            dynamic = sum(bool(free_symbols(size)) for size in node.meta["val"].shape)
            return dynamic <= 1 and super().check_constraints(node, ep)

    configs = [OneDynamicDimUnsqueeze if c is UnsqueezeCopyConfig else c for c in ALL_PARTITIONER_CONFIGS]
    return partitioner_class(configs=configs)


def _encoder_inputs(config: TfmConfig) -> list[str]:
    return ["input_ids", "attention_mask", *(["token_type_ids"] if config.type_vocab_size else [])]


def _lower_encoder(model: torch.nn.Module) -> tuple[Any, list[str]]:
    """The `ExecutorchProgramManager` of an encoder's one forward, and its outputs' names."""
    to_edge_transform_and_lower, partitioner_class = _import_executorch()
    config = model.config
    # Two right-padded texts: sizes of 2+ keep batch and length dynamic, a zero in the mask makes it a real input
    ids = torch.full((2, 6), 5, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    sample = dict(zip(_encoder_inputs(config), (ids, mask, torch.zeros_like(ids)), strict=False))
    with exportable(model), torch.no_grad():
        out = model(**sample)
        names = [name for name, value in out.items() if isinstance(value, torch.Tensor) and name != "router_logits"]
        batch = torch.export.Dim("batch", min=1, max=1024)
        length = torch.export.Dim("tokens", min=1, max=config.max_position_embeddings)
        exported = torch.export.export(
            _Encoder(model, names).eval(),
            (),
            sample,
            dynamic_shapes={name: {0: batch, 1: length} for name in sample},
            strict=False,
        )
        partitioner = _encoder_partitioner(partitioner_class)
        program = to_edge_transform_and_lower(exported, partitioner=[partitioner]).to_executorch()
    return program, names


def _write_program(program: Any, path: Path) -> None:
    with open(path, "wb") as file:
        program.write_to_file(file)  # streamed: `.buffer` would hold the whole program in memory first


def export_executorch(
    model_or_folder: Any, out: str | os.PathLike, quantize: str | None = None, tokenizer: Any = None
) -> Path:
    """Write an hf_tfm causal LM or encoder (model or saved folder) as an ExecuTorch program in the folder `out`; see
    the module docstring. An existing `out` is replaced only once the new export is complete."""
    qtype = quantize or "float32"
    if qtype not in TYPES:
        raise ValueError(f"quantize={quantize!r}: ExecuTorch weight types written here are {list(TYPES)}.")
    _import_executorch()
    model, source = _load(model_or_folder)
    config = model.config
    out = Path(out)
    with staged_folder(out) as tmp:
        if type(model).__name__ == "TfmForCausalLM":
            max_cache_len = max_cache_length(config)
            program = _lower(model, max_cache_len)
            fields = {
                "inputs": ["input_ids", "cache_position"],  # (1, T) int64 and (T,) int64: positions start..start+T-1
                "outputs": ["logits"],  # (1, T, vocab_size) float32
                "batch_size": 1,
                "max_cache_len": max_cache_len,
                "vocab_size": config.vocab_size,
            }
            runner = (RUNNER, SIDE)
        else:
            program, names = _lower_encoder(model)
            fields = {
                "inputs": _encoder_inputs(config),  # each (B, T) int64; attention_mask 1 for a token, 0 for padding
                "outputs": names,  # float32, as the model returns them
                "max_length": config.max_position_embeddings,
            }
            runner = (ENCODER_RUNNER, ENCODER_SIDE)
        _write_program(program, tmp / PROGRAM)
        _write_folder(tmp, model, qtype, fields, runner, source, tokenizer)
    return out


def _write_folder(tmp: Path, model: Any, qtype: str, fields: dict, runner: tuple, source: Any, tokenizer: Any) -> None:
    """Beside the program: the config, the tokenizer's files, the manifest and the runner (its file name, and the
    program of `hf_tfm.programs` it is)."""
    import executorch

    config = model.config
    manifest = {
        "architecture": type(model).__name__,
        "weights": qtype,
        "backend": "xnnpack",
        "program": PROGRAM,
        "method": "forward",
        **fields,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "executorch_version": getattr(executorch, "__version__", None),
    }
    config.save_pretrained(tmp)
    copy_tokenizer(source, tokenizer, tmp)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    name, program = runner
    shutil.copyfile(program_path(program), tmp / name)


def verify_executorch(
    exported: str | os.PathLike,
    model_or_folder: Any,
    prompts: list[list[int]] | list[str] | None = None,
    max_new_tokens: int = 32,
    fresh_process: bool = True,
) -> dict[str, Any]:
    """Run an ExecuTorch export in executorch's runtime (in a fresh process that imports neither transformers nor
    hf_tfm, unless `fresh_process=False`) and compare it with the hf_tfm model: greedy tokens of each prompt against
    `generate()` (EOS suppressed on both sides), and logits: each decoding step's while the tokens agree, and the
    prefill of hf_tfm's greedy sequences. Returns `tokens_equal`, `agreement`, `max_logit_diff`, `weights`,
    `prompts`, `max_new_tokens`. An encoder's export runs the prompts as one padded batch, compared with the model on
    each prompt alone: `outputs`, `max_diff`, `weights`, `prompts`."""
    exported = Path(exported).resolve()
    manifest = json.loads((exported / MANIFEST).read_text())
    model, source = _load(model_or_folder)
    prompts = prompt_ids(prompts, source)
    if manifest["architecture"] != "TfmForCausalLM":  # an encoder: its outputs on the prompts as one padded batch
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        args = {"path": str(exported), "prompts": prompts, "pad": pad}
        theirs = run_program(ENCODER_SIDE, args, RUNTIME, fresh_process=fresh_process, blocked=EXECUTORCH_ONLY)
        return {
            "weights": manifest["weights"],
            "outputs": sorted(theirs),
            "max_diff": encoder_max_diff(model, prompts, theirs, exported),
            "prompts": len(prompts),
        }
    limit = manifest["max_cache_len"]
    for prompt in prompts:
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones exceed the export's "
                f"max_cache_len={limit}."
            )
    references = greedy_references(model, prompts, max_new_tokens)
    with torch.no_grad():
        ours = [model(torch.tensor([ref])).logits[0].float() for ref in references]
    args = {
        "path": str(exported),
        "prompts": prompts,
        "references": references,
        "max_new_tokens": max_new_tokens,
        "suppress": eos_ids(model.config),
    }
    theirs = run_program(SIDE, args, RUNTIME, fresh_process=fresh_process, blocked=EXECUTORCH_ONLY)
    report = agreement_report(ours, theirs, references, prompts, False, max_new_tokens)
    ref_tokens = new_tokens(references, prompts, seq2seq=False)
    diff = report["max_logit_diff"]
    for prompt, mine, steps, expected, got in zip(
        prompts, ours, theirs["steps"], ref_tokens, theirs["tokens"], strict=True
    ):
        # step j's logits follow the prompt and tokens[:j]: comparable with the model's while those agree
        agree = next((j for j, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), len(expected))
        count = min(agree + 1, len(steps))
        start = len(prompt) - 1
        diff = max(diff, float((mine[start : start + count] - steps[:count]).abs().max()))
    return {"weights": manifest["weights"], **report, "max_logit_diff": diff}


FORMAT = ExportFormat(
    name="executorch",
    title="ExecuTorch (XNNPACK)",
    runtime=RUNTIME,
    takes=TAKES,
    quantize=tuple(TYPES),
    requires=("executorch",),
    blockers=executorch_blockers,
    refusal=refusal,
    summary=_summary,
    export=export_executorch,
    verify=verify_executorch,
    recognizes=lambda path: (path / PROGRAM).is_file(),
)


__all__ = [
    "ENCODER_RUNNER",
    "FORMAT",
    "INSTALL_HINT",
    "MANIFEST",
    "MAX_CACHE_LEN",
    "PROGRAM",
    "RUNNER",
    "TYPES",
    "executorch_blockers",
    "export_executorch",
    "max_cache_length",
    "verify_executorch",
]
