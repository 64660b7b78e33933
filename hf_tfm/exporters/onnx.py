"""ONNX for ONNX Runtime: hf_tfm's own forward traced by `torch.export`, through transformers' exporters.

No runtime architecture has to match: `transformers.exporters.OnnxExporter` traces hf_tfm's modeling code, so every
knob that traces (every position type, norm placement, parallel residual, qk-norm, sliding windows, MoE, ...) is
computed exactly. What is written, by head:

* causal LM (`TfmForCausalLM`): `prefill.onnx` (ids, mask, positions -> logits and the KV cache) and `decode.onnx`
  (one token per sequence and the cache -> logits and the grown cache), traced from a real `generate()` call on a
  left-padded batch of two, so batch, prompt and cache lengths are dynamic and padded batches decode.
* encoders (`TfmModel`, the classification, QA and masked-LM heads): `model.onnx` (ids and mask -> the head's output).
* the encoder-decoder (`TfmForConditionalGeneration`): `encoder.onnx` (ids and mask -> its states), and `prefill.onnx`
  / `decode.onnx` for the decoder over the encoder's states, with its self-attention and cross-attention caches.

Beside the graphs: `config.json`, the tokenizer's files, `onnx_export.json` (what each graph takes and returns, and the
generation ids) and, for the models that generate, `ort_generate.py`: `OnnxGenerator(folder).generate(prompts,
max_new_tokens)`, greedy decoding of a padded batch with onnxruntime and numpy alone (no torch). Verification runs
that same code.
`quantize="int8"` stores MatMul weights as int8 per output channel and quantizes their inputs to 8 bits on the fly
(onnxruntime's dynamic quantization: integer matmuls); `"int4"` stores them as 4-bit blocks of 32 (`MatMulNBits`)
and keeps float32 activations.
"""

import json
import os
import shutil
from pathlib import Path
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
    prompt_ids,
)
from .registry import ExportFormat

RUNTIME = "ONNX Runtime"
# --quantize value -> what is stored for MatMul weights
TYPES = {"float32": "float32", "int8": "int8 per output channel (dynamic quantization)", "int4": "int4, blocks of 32"}
MANIFEST = "onnx_export.json"
SIDE = "onnxruntime_side"  # `OnnxGenerator` and verification's side (hf_tfm.programs): onnxruntime and numpy only
RUNNER = "ort_generate.py"  # that program, written beside the graphs of a model that generates
INSTALL_HINT = 'ONNX export needs onnx, onnxscript and onnxruntime: pip install "hf-tfm[export]"'
GENERATORS = ("TfmForCausalLM", "TfmForConditionalGeneration")  # exported as graphs that decode with a KV cache
TAKES = ("TfmForCausalLM", "TfmForConditionalGeneration", "the encoder heads")


def _import_exporters():
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
        from transformers.exporters import OnnxConfig, OnnxExporter
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return OnnxExporter, OnnxConfig


def onnx_blockers(config: TfmConfig | TfmSeq2SeqConfig, traces_sliding: bool | None = None) -> list[str]:
    """Empty when the ONNX export takes `config`: every decoder, encoder and encoder-decoder config traces, except
    sliding layers in a decoder where transformers' exporter does not trace them (`traces_sliding`: whether it does;
    None: the installed release's answer)."""
    if traces_sliding is None:
        traces_sliding = _traces_sliding_layers()
    decoder = config.decoder if isinstance(config, TfmSeq2SeqConfig) else config
    if decoder.is_causal and "sliding_attention" in decoder.layer_types and not traces_sliding:
        import transformers

        return [
            f"{RUNTIME}: `layer_types` has sliding layers, and transformers {transformers.__version__}'s exporter "
            "traces the sliding cache's cut to the window into the graph (decoding past the window breaks); releases "
            "whose exporter traces it as a full layer with a sliding mask (5.24 does) take it"
        ]
    return []


def _traces_sliding_layers() -> bool:
    """Whether transformers' exporter traces a sliding cache layer as a full one, the window applied by the mask."""
    try:
        from transformers.exporters import exporter_dynamo
    except ImportError:  # no exporters at all: export_onnx says what to install
        return True
    return hasattr(exporter_dynamo, "_patch_sliding_window_layer")


# ---------------------------------------------------------------------------------------------------------------------
# Export


def _class_refusal(architecture: str) -> str | None:
    if architecture in (*GENERATORS, *ENCODER_CLASSES):
        return None
    return f"ONNX export takes {', '.join(TAKES)}, not {architecture}"


def refusal(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str | None:
    """Why a model of this config and class is not exported to ONNX (the blocking knobs, else the class), or None."""
    return "; ".join(onnx_blockers(config)) or _class_refusal(architecture)


def _summary(config: TfmConfig | TfmSeq2SeqConfig, architecture: str) -> str:
    graphs = {"TfmForCausalLM": "prefill + decode graphs", "TfmForConditionalGeneration": "encoder + prefill + decode"}
    return f"{graphs.get(architecture, 'one graph')}, traced from hf_tfm's code"


def _load(model_or_folder: Any) -> tuple[torch.nn.Module, str | None]:
    from transformers import AutoConfig

    from .. import modeling

    if isinstance(model_or_folder, (str, os.PathLike)):
        folder = Path(model_or_folder)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # exports installed classes only
        default = "TfmForConditionalGeneration" if isinstance(config, TfmSeq2SeqConfig) else "TfmForCausalLM"
        architecture = (getattr(config, "architectures", None) or [default])[0]
        refused = refusal(config, architecture)
        if refused:
            raise ValueError(f"{folder}: {refused}.")
        return getattr(modeling, architecture).from_pretrained(folder).eval(), str(folder)
    refused = _class_refusal(type(model_or_folder).__name__) or "; ".join(onnx_blockers(model_or_folder.config))
    if refused:
        raise ValueError(f"{refused}.")
    return model_or_folder.eval(), getattr(model_or_folder, "name_or_path", None) or None


def _sample_batch(config: TfmConfig) -> dict[str, torch.Tensor]:
    """Two left-padded prompts of different lengths. Sizes of 2+ keep batch and lengths dynamic (torch.export
    specialises a dimension whose sample size is 0 or 1), and a zero in the mask makes it a real input."""
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    token = next(t for t in range(config.vocab_size) if t not in (pad, config.bos_token_id, config.eos_token_id))
    ids = torch.full((2, 6), token)
    ids[0, :2] = pad
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _components(model: torch.nn.Module, generation: bool) -> dict[str, Any]:
    """name -> traced ONNX program (`torch.onnx.ONNXProgram`, or an onnx_ir model from transformers 5.23 on)."""
    exporter_class, config_class = _import_exporters()
    exporter = exporter_class()
    seq2seq = isinstance(model.config, TfmSeq2SeqConfig)
    sample = _sample_batch(model.config.encoder if seq2seq else model.config)
    options = config_class(dynamic=True)
    programs = {}
    with torch.no_grad():
        if seq2seq:
            # The encoder runs once per batch, outside the decoder's graphs (which read its states). Two decoder
            # tokens in the capture keep the decoder's length and its cache length dynamic (sizes of 1 specialise).
            programs["encoder"] = exporter.export(model.get_encoder(), sample, options)
            start = model.config.decoder_start_token_id
            sample = {**sample, "decoder_input_ids": torch.tensor([[start, sample["input_ids"][1, -1]]] * 2)}
        if generation:
            from transformers import GenerationConfig

            # Greedy, whatever the model's own generation config says: the exporter's capture runs generate() for two
            # tokens, one prefill call and one decode call, and traces each.
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
            capture = GenerationConfig(do_sample=False, pad_token_id=pad)
            exported = exporter.export_for_generation(model, sample, options, generation_config=capture)
        else:
            exported = exporter.export(model, sample, options)
    return {**{name: _unwrap(result)["model"] for name, result in programs.items()}, **_unwrap(exported)}


def _unwrap(result: Any) -> dict[str, Any]:
    """name -> program: transformers 5.23+ returns an ExportedModel, 5.16-5.22 the program (a dict for generation)."""
    if hasattr(result, "components"):
        return {name: component.program for name, component in result.components.items()}
    return result if isinstance(result, dict) else {"model": result}


def _io(path: Path) -> dict[str, list[str]]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return {"inputs": [i.name for i in session.get_inputs()], "outputs": [o.name for o in session.get_outputs()]}


# What the runner feeds each step; the other inputs are the cache (and constants of the empty cache)
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids", "decoder_input_ids", "encoder_outputs.last_hidden_state")


def _prefill_constants(inputs: list[str], config: TfmConfig) -> dict[str, int]:
    """Values for the prefill graph's inputs beyond ids, mask and positions: what the empty cache holds. A sliding
    layer's window is one (a scalar the cache carries from step to step)."""
    constants = {}
    for name in inputs:
        if name in STEP_INPUTS:
            continue
        if not name.endswith("_sliding_window_tensor"):
            raise RuntimeError(f"the traced prefill graph takes {name!r}, which hf_tfm's ONNX runner cannot feed.")
        constants[name] = config.sliding_window
    return constants


def _save(program: Any, path: Path) -> None:
    """One graph, its weights in `<name>.onnx.data` beside it (the 2 GB protobuf limit never applies)."""
    if hasattr(program, "save"):  # torch.onnx.ONNXProgram
        program.save(path, external_data=True)
    else:  # an onnx_ir model
        import onnx_ir

        onnx_ir.save(program, path, external_data=f"{path.name}.data")


def _quantize(path: Path, quantize: str) -> None:
    """Rewrite `path` with its MatMul weights in `quantize` (int8: dynamic quantization, whose integer matmuls also
    round their inputs to 8 bits per call; int4: weight-only)."""
    import onnx

    target = path.with_name(f".{path.name}.q")
    if quantize == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(path, target, weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul"])
        model = onnx.load(target)
        target.unlink()
    else:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(path), block_size=32, is_symmetric=True)
        quantizer.process()
        model = quantizer.model.model
    for stale in (path, path.with_name(f"{path.name}.data")):
        stale.unlink(missing_ok=True)
    onnx.save(model, path, save_as_external_data=True, location=f"{path.name}.data")


def export_onnx(
    model_or_folder: Any, out: str | os.PathLike, quantize: str | None = None, tokenizer: Any = None
) -> Path:
    """Write an hf_tfm causal LM or encoder (model or saved folder) as ONNX graphs in the folder `out`; see
    `hf_tfm.exporters.export`. An existing `out` is replaced only once the new export is complete."""
    qtype = quantize or "float32"
    if qtype not in TYPES:
        raise ValueError(f"quantize={quantize!r}: ONNX weight types written here are {list(TYPES)}.")
    _import_exporters()
    model, source = _load(model_or_folder)
    generation = type(model).__name__ in GENERATORS
    out = Path(out)
    with staged_folder(out) as tmp:
        components = _components(model, generation)
        manifest: dict[str, Any] = {"architecture": type(model).__name__, "weights": qtype, "components": {}}
        for name, program in components.items():
            path = tmp / f"{name}.onnx"
            _save(program, path)
            if qtype != "float32":
                _quantize(path, qtype)
            manifest["components"][name] = {"file": path.name, **_io(path)}
        if generation:
            manifest["components"]["prefill"]["constants"] = _prefill_constants(
                manifest["components"]["prefill"]["inputs"], model.config
            )
        config = model.config
        manifest.update(
            decoder_start_token_id=getattr(config, "decoder_start_token_id", None),
            pad_token_id=config.pad_token_id,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
        )
        config.save_pretrained(tmp)
        copy_tokenizer(source, tokenizer, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if generation:
            shutil.copyfile(program_path(SIDE), tmp / RUNNER)
    return out


def _ort_side(args: dict, fresh_process: bool) -> dict:
    # torch is blocked there: what runs is what a deployment without PyTorch runs
    return run_program(SIDE, args, RUNTIME, fresh_process=fresh_process, blocked=("torch",))


def verify_onnx(
    exported: str | os.PathLike,
    model_or_folder: Any,
    prompts: list[list[int]] | list[str] | None = None,
    max_new_tokens: int = 32,
    fresh_process: bool = True,
) -> dict[str, Any]:
    """Run an ONNX export in ONNX Runtime (in a fresh process that imports no torch, unless `fresh_process=False`)
    and compare it with the hf_tfm model. A causal LM or encoder-decoder: greedy tokens of all prompts decoded as one
    padded batch against `generate()` on each prompt alone (EOS suppressed on both sides), and the prefill logits on
    hf_tfm's greedy sequences; returns `tokens_equal`, `agreement`, `max_logit_diff`, `weights`, `prompts`,
    `max_new_tokens`. An encoder: each output on the padded batch (`outputs`, `max_diff`)."""
    exported = Path(exported).resolve()
    manifest = json.loads((exported / MANIFEST).read_text())
    model, source = _load(model_or_folder)
    if type(model).__name__ != manifest["architecture"]:
        raise ValueError(f"{exported} is a {manifest['architecture']} export, the model a {type(model).__name__}.")
    config = model.config
    prompts = prompt_ids(prompts, source)
    if manifest["architecture"] in ENCODER_CLASSES:
        return _verify_encoder(exported, model, prompts, manifest, fresh_process)
    seq2seq = manifest["architecture"] == "TfmForConditionalGeneration"
    references = greedy_references(model, prompts, max_new_tokens)
    ours = []
    with torch.no_grad():
        for prompt, reference in zip(prompts, references, strict=True):
            # The logits of the greedy sequence: after the prompt, or (encoder-decoder) of the decoder over the source
            out = torch.tensor([reference])
            inputs = {"input_ids": torch.tensor([prompt]), "decoder_input_ids": out} if seq2seq else {"input_ids": out}
            ours.append(model(**inputs).logits[0].float())
    args = {
        "path": str(exported),
        "prompts": prompts,
        "references": references,
        "max_new_tokens": max_new_tokens,
        "suppress": eos_ids(config),
        "threads": torch.get_num_threads(),
    }
    theirs = _ort_side(args, fresh_process)
    return {
        "weights": manifest["weights"],
        **agreement_report(ours, theirs, references, prompts, seq2seq, max_new_tokens),
    }


def _verify_encoder(exported: Path, model: torch.nn.Module, prompts: list, manifest: dict, fresh: bool) -> dict:
    """Each output of the export on the prompts as one padded batch against the model on each prompt alone (per
    token outputs compared on the prompt's own positions)."""
    args = {"path": str(exported), "prompts": [list(map(int, p)) for p in prompts], "encoder": True}
    theirs = _ort_side({**args, "threads": torch.get_num_threads()}, fresh)
    return {
        "weights": manifest["weights"],
        "outputs": sorted(theirs),
        "max_diff": encoder_max_diff(model, prompts, theirs, exported),
        "prompts": len(prompts),
    }


FORMAT = ExportFormat(
    name="onnx",
    title="ONNX (ONNX Runtime)",
    runtime=RUNTIME,
    takes=(*GENERATORS, *ENCODER_CLASSES),
    quantize=tuple(TYPES),
    requires=("onnx", "onnxscript", "onnxruntime"),
    blockers=onnx_blockers,
    refusal=refusal,
    summary=_summary,
    export=export_onnx,
    verify=verify_onnx,
    recognizes=lambda path: path.is_dir() and any(path.glob("*.onnx")),
)


__all__ = ["ENCODER_CLASSES", "FORMAT", "MANIFEST", "RUNNER", "TYPES", "export_onnx", "onnx_blockers", "verify_onnx"]
