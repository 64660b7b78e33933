"""The checks every exact route out of hf_tfm makes, whether to an in-tree transformers family (`hf_tfm.convert`) or
to a runtime (`hf_tfm.exporters`): `need`, which names a knob whose value the target cannot take, and the checks
several targets share.

A target's blockers are a list of such messages, each naming the knob, its value, the target and what it needs: an
empty list means the target computes the config exactly. Targets write what they fix as tables, `{knob: value}`,
checked in order by `need_all`; a `Need` entry says what a plain value cannot (a predicate, the words, a condition).
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .configuration import TfmConfig


def need(config: TfmConfig, out: list[str], family: str, knob: str, expected: Any, why: str | None = None) -> None:
    """Append a blocker message when `config.<knob>` differs from `expected` (a value or a predicate). A knob the
    config does not have (the expert knobs of a dense config, `rope_parameters` without RoPE) reads as None."""
    value = getattr(config, knob, None)
    ok = expected(value) if callable(expected) else value == expected
    if not ok:
        needs = why or f"{expected!r}"
        out.append(f"`{knob}`={value!r} ({family} needs {needs})")


class Need(NamedTuple):
    """A table entry that a plain value does not say: `expected` (a value or a predicate on the knob's value), the
    words a refusal gives for it (`why`; None: the value's repr), and `when` it applies (a predicate on the config;
    None: always)."""

    expected: Any
    why: str | None = None
    when: Callable[[TfmConfig], bool] | None = None


def need_all(config: TfmConfig, out: list[str], family: str, values: dict[str, Any]) -> None:
    """`need` for each knob -> value (or `Need`) of `values`, in their order."""
    for knob, expected in values.items():
        entry = expected if isinstance(expected, Need) else Need(expected)
        if entry.when is None or entry.when(config):
            need(config, out, family, knob, entry.expected, entry.why)


def need_dense(config: TfmConfig, out: list[str], family: str) -> None:
    """No mixture-of-experts layers."""
    need(config, out, family, "num_experts", None, "None (no mixture-of-experts layers)")


def need_full_attention(config: TfmConfig, out: list[str], family: str, why: str = "only 'full_attention'") -> None:
    """Every layer a full-attention one (no sliding window)."""
    need(config, out, family, "layer_types", lambda v: set(v) == {"full_attention"}, why)


def need_no_gqa(config: TfmConfig, out: list[str], family: str) -> None:
    """As many key/value heads as query heads."""
    need(config, out, family, "num_key_value_heads", config.num_attention_heads, "`num_attention_heads` (no GQA)")


def need_default_head_dim(config: TfmConfig, out: list[str], family: str, why: str | None = "hidden/heads") -> None:
    """Heads `hidden_size / num_attention_heads` wide (`why` None: the message names the number)."""
    need(config, out, family, "head_dim", config.hidden_size // config.num_attention_heads, why)


def need_rope(config: TfmConfig, out: list[str], family: str, rope_types: Sequence[str] | None = None) -> None:
    """One RoPE for every layer type; with `rope_types`, also one of those types, on every dimension."""
    need(config, out, family, "rope_parameters", lambda v: not config.rope_per_layer_type, "one flat RoPE dict")
    if rope_types is None or config.rope_per_layer_type:
        return
    kinds = list(rope_types)
    need(config, out, family, "rope_parameters", lambda v: v["rope_type"] in kinds, f"rope_type in {kinds}")
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    need(config, out, family, "rope_parameters", lambda v: partial == 1.0, "RoPE on every dimension")


__all__ = [
    "Need",
    "need",
    "need_all",
    "need_default_head_dim",
    "need_dense",
    "need_full_attention",
    "need_no_gqa",
    "need_rope",
]
