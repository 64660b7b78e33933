"""The shared core of hf_tfm's converters: weight-name rules, the `Family` record, the blockers every family checks,
the family registry, and the public functions that run a registered family in either direction.

A family module (`llama_like.py`, `gpt2.py`, ...) builds one or more `Family` records and calls `register` on import;
nothing here names a family, so adding one touches no other family's code.
"""

import inspect
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from .. import modeling
from ..checks import need, need_dense, need_rope
from ..configuration import TfmConfig, TfmSeq2SeqConfig
from ..scale_out import full_parameters, partitioned

logger = logging.get_logger(__name__)

HEADS = (
    "base",
    "causal_lm",
    "sequence_classification",
    "token_classification",
    "masked_lm",
    "question_answering",
    "seq2seq",
    "seq2seq_lm",
)
# The heads of the decoder families (Llama-style, GPT-2): their backbone, causal LM, classifiers and span QA
DECODER_HEADS = ("base", "causal_lm", "sequence_classification", "token_classification", "question_answering")
BASE_HEADS = ("base", "seq2seq")  # backbones: their weight names carry no head prefix
TFM_CLASSES = {
    "base": modeling.TfmModel,
    "causal_lm": modeling.TfmForCausalLM,
    "sequence_classification": modeling.TfmForSequenceClassification,
    "token_classification": modeling.TfmForTokenClassification,
    "masked_lm": modeling.TfmForMaskedLM,
    "question_answering": modeling.TfmForQuestionAnswering,
    "seq2seq": modeling.TfmSeq2SeqModel,
    "seq2seq_lm": modeling.TfmForConditionalGeneration,
}
# Config fields every head carries unchanged in both directions (labels, problem type).
CARRIED_FIELDS = ("id2label", "label2id", "problem_type")


def _head_of(model: torch.nn.Module) -> str:
    kind = modeling.TfmModel if isinstance(model, modeling.TfmMoeModel) else type(model)  # the backbone, with experts
    for head, cls in TFM_CLASSES.items():
        if kind is cls:
            return head
    for family in FAMILIES.values():
        for head, cls in family.classes.items():
            if type(model) is cls:
                return head
    if type(model) in REFUSED_IMPORTS:
        raise ValueError(f"No hf_tfm import for {type(model).__name__}: {REFUSED_IMPORTS[type(model)]}.")
    raise ValueError(f"No conversion for {type(model).__name__}.")


# ---------------------------------------------------------------------------------------------------------------------
# Weight-name rules. A template like "layers.{i}.attn_norm.{p}" matches a key with a layer index and weight/bias; the
# same rule read right-to-left maps the other way. `transpose` marks GPT-2's Conv1D weights ((in, out) layout).


@dataclass(frozen=True)
class Rule:
    tfm: str
    hf: str
    transpose: bool = False


def _regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in (("i", r"\d+"), ("p", r"weight|bias"), ("n", r"[a-z_]+")):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{group})")
    return re.compile(pattern)


def _rename(key: str, rules: list[Rule], to_hf: bool) -> tuple[str, bool] | None:
    for rule in rules:
        src, dst = (rule.tfm, rule.hf) if to_hf else (rule.hf, rule.tfm)
        match = _regex(src).fullmatch(key)
        if match:
            return dst.format(**match.groupdict()), rule.transpose and match.groupdict().get("p") == "weight"
    return None


def _prefixed(rules: list[Rule], tfm_prefix: str, hf_prefix: str) -> list[Rule]:
    return [Rule(tfm_prefix + r.tfm, hf_prefix + r.hf, r.transpose) for r in rules]


@dataclass(frozen=True)
class Fused:
    """In-tree weights that stack several hf_tfm projections along their outputs, in each layer (`layer`: a regex of
    a layer's key prefix): `fused` maps each such weight's name to the projections it holds, in row order. GPT-2's
    Conv1D weights (`conv1d`) are (in, out), so theirs stack along dim 1. `split` runs before the rules on import,
    `fuse` after them on export."""

    layer: str
    fused: dict[str, tuple[str, ...]]
    conv1d: bool = False

    def _dim(self, kind: str) -> int:
        return 1 if self.conv1d and kind == "weight" else 0

    def split(self, state: dict) -> dict:
        names = "|".join(map(re.escape, self.fused))
        pattern = re.compile(rf"(?P<pre>{self.layer})(?P<f>{names})\.(?P<p>weight|bias)")
        out = {}
        for key, value in state.items():
            match = pattern.fullmatch(key)
            if not match:
                out[key] = value
                continue
            parts = self.fused[match["f"]]
            for name, part in zip(parts, value.chunk(len(parts), dim=self._dim(match["p"])), strict=True):
                out[f"{match['pre']}{name}.{match['p']}"] = part
        return out

    def fuse(self, state: dict) -> dict:
        owner = {part: fused for fused, parts in self.fused.items() for part in parts}
        pattern = re.compile(rf"(?P<pre>{self.layer})(?P<n>{'|'.join(map(re.escape, owner))})\.(?P<p>weight|bias)")
        out, found = {}, {}
        for key, value in state.items():
            match = pattern.fullmatch(key)
            if match:
                found.setdefault((match["pre"], owner[match["n"]], match["p"]), {})[match["n"]] = value
            else:
                out[key] = value
        for (pre, fused, p), parts in found.items():
            out[f"{pre}{fused}.{p}"] = torch.cat([parts[n] for n in self.fused[fused]], dim=self._dim(p))
        return out


# ---------------------------------------------------------------------------------------------------------------------
# Families


@dataclass
class Family:
    """One in-tree family: its classes per head (the backbone first), the weight-name rules of its backbone and
    heads, and its three config mappings."""

    name: str
    classes: dict[str, type]  # head -> in-tree class
    base_rules: list[Rule]
    head_rules: dict[str, list[Rule]]
    config_from_hf: Callable  # (hf_config, head) -> TfmConfig kwargs
    blockers: Callable  # (TfmConfig, head) -> list of "knob=value (needs ...)"
    config_to_hf: Callable  # (TfmConfig, head) -> in-tree config kwargs
    hf_aliases: dict[str, str] = field(default_factory=dict)  # in-tree key -> the key it must equal (tied copies)
    split_state: Callable | None = None  # in-tree state dict -> the same with fused projections split (before rules)
    fuse_state: Callable | None = None  # the reverse, after the rules (GPT-2's c_attn, ModernBERT's Wqkv and Wi)
    seq2seq: bool = False  # an encoder-decoder family: its hf_tfm side is a TfmSeq2SeqConfig
    moe: bool = False  # has mixture-of-experts layers; the other families need `num_experts=None`

    @property
    def config_class(self) -> type:
        return next(iter(self.classes.values())).config_class

    def rules(self, head: str) -> list[Rule]:
        if head in BASE_HEADS:
            return self.base_rules + self.head_rules.get("base", [])
        # A head keeps its backbone under its class's `base_model_prefix` ("model", "transformer", "bert"; Llama's
        # question-answering head "transformer", Mistral's "model")
        prefix = f"{self.classes[head].base_model_prefix}."
        return _prefixed(self.base_rules, "model.", prefix) + self.head_rules.get(head, [])


# head -> the suffix of transformers' class for it, after the family's prefix ("Llama" + "ForCausalLM")
HEAD_SUFFIXES = {
    "base": "Model",
    "causal_lm": "ForCausalLM",
    "sequence_classification": "ForSequenceClassification",
    "token_classification": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "question_answering": "ForQuestionAnswering",
    "seq2seq": "Model",
    "seq2seq_lm": "ForConditionalGeneration",
}


def in_tree_classes(prefix: str, heads: tuple[str, ...], **named: type) -> dict[str, type]:
    """head -> transformers' class `prefix + HEAD_SUFFIXES[head]` for each of `heads` (the backbone first), except
    those `named` gives under another name (GPT-2's causal LM is `GPT2LMHeadModel`)."""
    return {head: named.get(head) or getattr(transformers, prefix + HEAD_SUFFIXES[head]) for head in heads}


def common_blockers(
    config: TfmConfig,
    family: str,
    out: list[str],
    head: str,
    *,
    base_pooler: bool = False,
    first_layer_attn_norm: bool = True,
    final_norm: bool = True,
    flat_rope: bool = True,
    hidden_dropout: bool = True,
    qk_norm_scope: str | None = None,
) -> None:
    """The knobs most in-tree families fix; each keyword says what this family's block has."""
    if qk_norm_scope is None:
        need(config, out, family, "qk_norm", False)
    else:  # q/k norms of this scope ("head" or "projection")
        need(config, out, family, "qk_norm", True)
        need(config, out, family, "qk_norm_scope", qk_norm_scope)
    if head == "base" and not base_pooler:  # heads build no backbone pooler
        need(config, out, family, "add_pooling_layer", False, "False (no pooler in its base model)")
    need(config, out, family, "parallel_residual", False)
    need(config, out, family, "first_layer_attn_norm", first_layer_attn_norm)
    need(config, out, family, "final_norm", final_norm)
    if flat_rope:
        need_rope(config, out, family)
    if not hidden_dropout:  # no dropout outside attention in the block
        need(config, out, family, "hidden_dropout", 0.0)


# Mixture-of-experts families: the router (`mlp.gate`), the fused experts and the shared expert keep their names, which
# are Qwen2-MoE's and those of every in-tree MoE model once loaded (checkpoints on disk are converted by transformers).
MOE_RULES = [
    Rule("layers.{i}.mlp.experts.{n}", "layers.{i}.mlp.experts.{n}"),  # gate_up_proj (E, 2I, H), down_proj (E, H, I)
    Rule("layers.{i}.mlp.shared_expert.{n}.{p}", "layers.{i}.mlp.shared_expert.{n}.{p}"),
]


def moe_blockers(
    config: TfmConfig,
    family: str,
    out: list[str],
    *,
    norm_topk_prob: bool | None = None,
    router_weights_fp32: bool = False,
    shared_expert: bool = False,
    sparse_layer_rule: bool = False,
    jitter: bool = False,
) -> None:
    """The MoE knobs a family fixes; each keyword says what its block has (None: configurable)."""
    need(config, out, family, "num_experts", lambda v: v is not None, "mixture-of-experts layers (`num_experts`)")
    if config.num_experts is None:
        return
    if norm_topk_prob is not None:
        need(config, out, family, "norm_topk_prob", norm_topk_prob)
    need(config, out, family, "router_weights_fp32", router_weights_fp32)
    if shared_expert:
        need(config, out, family, "shared_expert_intermediate_size", lambda v: v is not None, "a shared expert")
    else:
        need(config, out, family, "shared_expert_intermediate_size", None)
    if not sparse_layer_rule:  # every layer sparse: `intermediate_size` is unused, the experts' width is exported
        need(config, out, family, "mlp_only_layers", lambda v: not v, "every layer sparse")
        need(config, out, family, "decoder_sparse_step", 1)
    if not jitter:
        need(config, out, family, "router_jitter_noise", 0.0)


def classifier_blockers(
    config: TfmConfig, head: str, family: str, out: list[str], pooling: str, bias: bool, dense: bool = False
) -> None:
    """Sequence classifiers pool `pooling` (then a tanh dense layer where `dense`); token classifiers have a bias."""
    if head == "sequence_classification":
        need(config, out, family, "classifier_pooling", pooling)
        need(config, out, family, "classifier_bias", bias)
        need(config, out, family, "classifier_dense", dense)
        if dense:
            need(config, out, family, "classifier_activation", "tanh")
            need(config, out, family, "classifier_norm", False)
            need(config, out, family, "head_dense_bias", True)
    if head == "token_classification":
        need(config, out, family, "classifier_bias", True)


def last_token_head_blockers(config: TfmConfig, head: str, family: str, out: list[str]) -> None:
    """A decoder family's heads: no masked-LM class; sequence classifiers pool the last token, with no bias."""
    if head == "masked_lm":
        out.append(f"head `masked_lm` ({family} has no masked-LM class)")
    classifier_blockers(config, head, family, out, pooling="last", bias=False)


def side_blockers(config: TfmSeq2SeqConfig, check: Callable[[TfmConfig, list[str]], None]) -> list[str]:
    """Run `check(side, out)` on the encoder's and the decoder's config; messages name `encoder.<knob>` etc."""
    out = []
    for side in ("encoder", "decoder"):
        found: list[str] = []
        check(getattr(config, side), found)
        out += [message.replace("`", f"`{side}.", 1) for message in found]
    return out


def same_on_both_sides(config: TfmSeq2SeqConfig, out: list[str], family: str, knobs: tuple[str, ...]) -> None:
    """Knobs the in-tree config holds once for both sides: the decoder's value must be the encoder's."""
    for knob in knobs:
        need(config.decoder, out, family, knob, getattr(config.encoder, knob), "the encoder's value: one field")
        if out and out[-1].startswith(f"`{knob}`"):
            out[-1] = f"`decoder.{out[-1][1:]}"


# ---------------------------------------------------------------------------------------------------------------------
# Registry: family modules add themselves on import, in the order `to_hf` tries them.

FAMILIES: dict[str, Family] = {}
# In-tree heads whose structure hf_tfm does not have: importing one raises this reason instead of guessing.
REFUSED_IMPORTS: dict[type, str] = {}


def register(*families: Family, refused: dict[type, str] | None = None) -> None:
    for family in families:
        if family.name in FAMILIES:
            raise ValueError(f"A converter for `{family.name}` is already registered.")
        FAMILIES[family.name] = family
    REFUSED_IMPORTS.update(refused or {})


# ---------------------------------------------------------------------------------------------------------------------
# Public API


def _load_in_tree(path: str | Path) -> PreTrainedModel:
    # Conversion reads installed classes only: a folder whose code would have to run is refused, not prompted for
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"`model_type={config.model_type!r}` in {path} is not importable; supported: {sorted(FAMILIES)}."
        )
    backbone = next(iter(FAMILIES[config.model_type].classes.values()))  # each family lists its backbone first
    architecture = (config.architectures or [backbone.__name__])[0]
    return getattr(transformers, architecture).from_pretrained(path)


def _build(cls, config, source: torch.nn.Module, state: dict, optional: set[str] = frozenset()) -> PreTrainedModel:
    """Instantiate `cls(config)` with the source's attention backend, load `state` strictly, match dtype.

    Keys in `optional` (aliases) may be absent from the built class; keys the class computes itself (its
    `_keys_to_ignore_on_load_missing`: Marian's sinusoid table, BART's zero logits bias) may be absent from `state`.
    """
    config._attn_implementation = source.config._attn_implementation
    if cls._can_set_experts_implementation():  # an MoE model keeps the experts kernel too (eager, grouped_mm, ...)
        config._experts_implementation = source.config._experts_implementation
    # A backbone carries a pooler when the weights have one (BertModel's `add_pooling_layer`, our config knob).
    takes_pooler = "add_pooling_layer" in inspect.signature(cls.__init__).parameters
    pooler = any(key.startswith("pooler.") for key in state)
    model = cls(config, add_pooling_layer=pooler) if takes_pooler else cls(config)
    dtype = next(source.parameters()).dtype
    own_keys = set(model.state_dict())
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if k in own_keys or k not in optional}, strict=False
    )
    computed = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    prefix = f"{model.base_model_prefix}."  # the patterns may name a backbone's keys as its heads do

    def is_computed(key: str) -> bool:
        return any(p.search(key) or p.search(prefix + key) for p in computed)

    missing = [k for k in missing if k not in _tied_targets(model) and not is_computed(k)]
    if missing or unexpected:
        raise ValueError(
            f"Weight mapping for {cls.__name__} is incomplete: missing {missing}, unexpected {unexpected}."
        )
    model.to(dtype)
    model.config.dtype = dtype  # saved as config.json's "dtype", as from_pretrained would record it
    if getattr(source, "generation_config", None) is not None and model.can_generate():
        model.generation_config = GenerationConfig.from_dict(source.generation_config.to_dict())
    model.train(source.training)
    return model


def _state_of(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's state dict, whole also where DeepSpeed ZeRO-3 partitioned its parameters (gathered on every rank,
    which must all convert, and copied)."""
    if not partitioned(model):
        return model.state_dict()
    with full_parameters(model):
        return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _tied_targets(model: PreTrainedModel) -> set[str]:
    """Keys that are tied copies of another weight (filled by tying, not by the state dict)."""
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def from_hf(model_or_path: PreTrainedModel | str | Path) -> modeling.TfmPreTrainedModel:
    """An in-tree Llama / Mistral / Qwen2 / GPT-2 / BERT / ModernBERT / Mixtral / Qwen2-MoE / OLMoE model (object or
    folder) as hf_tfm's equivalent.

    The head follows the source: `*Model` -> `TfmModel`, `*ForCausalLM`/`GPT2LMHeadModel` -> `TfmForCausalLM`,
    `*ForSequenceClassification`, `*ForTokenClassification`, `*ForQuestionAnswering`, `*ForMaskedLM` -> the hf_tfm head
    of that name (not ModernBertForQuestionAnswering, whose span head has an extra transform). Weights
    are copied (GPT-2's Conv1D ones transposed), the attention backend, dtype and generation config are kept.
    """
    source = _load_in_tree(model_or_path) if isinstance(model_or_path, (str, Path)) else model_or_path
    family = FAMILIES.get(source.config.model_type)
    if family is None:
        raise ValueError(
            f"No hf_tfm import for model_type={source.config.model_type!r}; supported: {sorted(FAMILIES)}."
        )
    head = _head_of(source)
    kwargs = family.config_from_hf(source.config, head)
    kwargs.update({name: getattr(source.config, name) for name in CARRIED_FIELDS})
    state = _state_of(source)
    if family.split_state is not None:
        state = family.split_state(state)
    rules = family.rules(head)
    converted = {}
    for key, value in state.items():
        if key in family.hf_aliases:
            continue
        renamed = _rename(key, rules, to_hf=False)
        if renamed is None:
            raise ValueError(f"from_hf: no hf_tfm counterpart for {family.name} weight `{key}`.")
        name, transpose = renamed
        converted[name] = value.t() if transpose else value
    if not family.seq2seq:
        kwargs["add_pooling_layer"] = head == "base" and any(key.startswith("pooler.") for key in converted)
    config = (TfmSeq2SeqConfig if family.seq2seq else TfmConfig)(**kwargs)
    return _build(TFM_CLASSES[head], config, source, {k: v.detach().clone() for k, v in converted.items()})


def in_tree_blockers(config: TfmConfig, head: str = "base") -> dict[str, list[str]]:
    """Why `config` (with this head) cannot become each in-tree transformers family of its kind (encoder-decoder or
    not): family -> the knobs that keep it out, empty where `to_hf` takes it."""
    seq2seq = isinstance(config, TfmSeq2SeqConfig)
    blockers = {name: family.blockers(config, head) for name, family in FAMILIES.items() if family.seq2seq == seq2seq}
    for name, found in blockers.items():
        if head == "causal_lm":  # no in-tree family has a bias on its causal LM head
            need(config, found, name, "lm_head_bias", False)
        if FAMILIES[name].moe:
            continue

        def dense(side: TfmConfig, out: list[str], family: str = name) -> None:
            need_dense(side, out, family)

        if seq2seq:
            found += side_blockers(config, dense)
        else:
            dense(config, found)
    return blockers


def to_hf(model: modeling.TfmPreTrainedModel | str | Path) -> PreTrainedModel:
    """The in-tree transformers model equal to an hf_tfm model, or a `ValueError` naming every blocking knob.

    The first registered family that expresses the config exactly wins, in the order of `FAMILIES` (llama, mistral,
    qwen2, gpt2, bert, modernbert, mixtral, qwen2_moe, olmoe), so an all-full-attention Mistral comes back as Llama,
    which is the same architecture. The result saves and loads with plain transformers, no `trust_remote_code`.
    """
    if isinstance(model, (str, Path)):
        config = AutoConfig.from_pretrained(model, trust_remote_code=False)
        architecture = (config.architectures or ["TfmModel"])[0]
        model = getattr(modeling, architecture).from_pretrained(model)
    head = _head_of(model)
    config = model.config
    blockers = in_tree_blockers(config, head)
    name = next((name for name, found in blockers.items() if not found and head in FAMILIES[name].classes), None)
    if name is None:
        moe = getattr(config, "num_experts", None) is not None  # closest among those with (or without) experts
        ranked = sorted(blockers.items(), key=lambda item: (FAMILIES[item[0]].moe is not moe, len(item[1])))
        closest, found = ranked[0]
        others = "; ".join(f"{n}: {len(b)} knobs" for n, b in ranked[1:])
        raise ValueError(
            f"This hf_tfm config ({head}) has no in-tree transformers equivalent. Closest family: {closest}, blocked "
            f"by: {'; '.join(found)}. Other families: {others}."
        )
    family = FAMILIES[name]
    kwargs = family.config_to_hf(config, head)
    kwargs.update({field_name: getattr(config, field_name) for field_name in CARRIED_FIELDS})
    hf_config = family.config_class(**kwargs)

    rules = family.rules(head)
    converted = {}
    for key, value in _state_of(model).items():
        renamed = _rename(key, rules, to_hf=True)
        if renamed is None:
            raise ValueError(f"to_hf: no {name} counterpart for hf_tfm weight `{key}`.")
        hf_key, transpose = renamed
        converted[hf_key] = value.t() if transpose else value
    if family.fuse_state is not None:
        converted = family.fuse_state(converted)
    for alias, original in family.hf_aliases.items():
        if original in converted:
            converted[alias] = converted[original]
    state = {k: v.detach().clone() for k, v in converted.items()}
    return _build(family.classes[head], hf_config, model, state, optional=set(family.hf_aliases))


def convert_path(src: str | Path, dst: str | Path) -> PreTrainedModel:
    """Convert a saved folder: hf_tfm -> in-tree if its `model_type` is "hf_tfm", else in-tree -> hf_tfm.

    Writes safetensors and the config (and generation config) to `dst`, and copies the other files of `src`
    (tokenizer and the like) unchanged. Returns the converted model.
    """
    src, dst = Path(src), Path(dst)
    config = PreTrainedConfig.get_config_dict(src)[0]  # TfmConfig's reads one side of a seq2seq pair
    ours = (TfmConfig.model_type, TfmSeq2SeqConfig.model_type)
    converted = to_hf(src) if config.get("model_type") in ours else from_hf(src)
    dst.mkdir(parents=True, exist_ok=True)
    converted.save_pretrained(dst, safe_serialization=True)
    skip = re.compile(r"config\.json|generation_config\.json|.*\.safetensors(\.index\.json)?|pytorch_model.*|.*\.py")
    for file in src.iterdir() if src.is_dir() else ():  # a Hub id has no local files to carry
        if file.is_file() and not skip.fullmatch(file.name) and not (dst / file.name).exists():
            shutil.copy2(file, dst / file.name)
    return converted


__all__ = ["convert_path", "from_hf", "in_tree_blockers", "to_hf"]
