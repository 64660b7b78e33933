"""Config mappings as data: for each hf_tfm knob, the in-tree config attribute that holds it.

A family writes its mapping as a table, `{knob: in-tree attribute}`, read one way by `config_from_hf`
(`knobs_from_hf`) and the other way by `config_to_hf` (`knobs_to_hf`), plus the values its block fixes; its code
keeps only what really differs between families (a width computed, a list that is empty rather than None, ...).
"""

from typing import Any

from ..configuration import TfmConfig

# GenericForTokenClassification / GPT-2's fallback when the config has none
IN_TREE_DEFAULT_CLASSIFIER_DROPOUT = 0.1
# The sizes and special ids every family names as hf_tfm does
SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)
# Knobs an in-tree config may hold as an int (a dropout of 0): TfmConfig holds floats
FLOAT_KNOBS = ("attention_dropout", "hidden_dropout")


def sizes(c: Any) -> dict[str, Any]:
    """`SIZES` and `use_cache` of either side's config: hf_tfm and the in-tree families name them alike."""
    return {
        **{name: getattr(c, name) for name in SIZES},
        "use_cache": getattr(c, "use_cache", True),  # ModernBERT (an encoder) has none
    }


def knobs_from_hf(c: Any, fields: dict[str, str]) -> dict[str, Any]:
    """hf_tfm knobs read from the in-tree config `c`, `fields` naming each knob's attribute (dicts, lists copied)."""
    return {
        knob: float(getattr(c, attr)) if knob in FLOAT_KNOBS else _copy(getattr(c, attr))
        for knob, attr in fields.items()
    }


def knobs_to_hf(config: TfmConfig, fields: dict[str, str]) -> dict[str, Any]:
    """The in-tree attributes `fields` names, from the hf_tfm config (dicts, lists copied)."""
    return {attr: _copy(getattr(config, knob)) for knob, attr in fields.items()}


def _copy(value: Any) -> Any:
    """A dict or list of its own (the two configs must not share one)."""
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) else value


def moe_fields(num_experts: str) -> dict[str, str]:
    """The MoE knobs every in-tree family names alike, and its own name for the expert count."""
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": "num_experts_per_tok",
        "router_aux_loss_coef": "router_aux_loss_coef",
        "output_router_logits": "output_router_logits",
    }


def last_token_classifier(c: Any, head: str) -> dict[str, Any]:
    """A decoder family's classifier knobs on import: the last token pooled, a bias on the token classifier only, and
    its dropout (the in-tree fallback when the config has none)."""
    dropout = getattr(c, "classifier_dropout", None)
    if head == "token_classification" and dropout is None:
        dropout = IN_TREE_DEFAULT_CLASSIFIER_DROPOUT
    return {
        "classifier_pooling": "last",
        "classifier_bias": head == "token_classification",
        "classifier_dropout": dropout,
    }


def token_dropout_to_hf(config: TfmConfig, head: str) -> dict[str, Any]:
    """Only the token classifier of Llama-like / GPT-2 models reads a (non-field) `classifier_dropout`."""
    if head != "token_classification":
        return {}
    p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
    return {} if p == IN_TREE_DEFAULT_CLASSIFIER_DROPOUT else {"classifier_dropout": p}
