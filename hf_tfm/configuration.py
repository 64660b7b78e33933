"""TfmConfig: one flat config that describes every block hf_tfm can build.

Each architectural axis is one `Literal` field, so an invalid variant cannot be spelled; values that cannot be computed
fail at construction with a `ValueError` that names the knob. As in transformers' in-tree configs, a knob without
effect in its configuration and a key no knob reads are accepted (kept, saved back) and named in a warning. This file
imports no torch, as HF configs don't.
"""

import dataclasses
import difflib
import functools
import math
from typing import Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import DistributedConfig, GenerationConfig, PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging

logger = logging.get_logger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention")
# config.json keys written by transformers or the ecosystem that are not fields of a default config (legacy RoPE keys
# are folded into `rope_parameters`; quantizers add `quantization_config`).
EXTRA_CONFIG_KEYS = {
    "auto_map",
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "rope_theta",
    "rope_scaling",
    "num_labels",
}
# Expert parallelism of the mixture-of-experts layers, as the release's in-tree MoE models declare it: 5.19 added
# token dispatch (`DistributedConfig.ep_size`, the `ep_dispatch_experts` style) and later releases removed the
# router-masking plan (`ep_router` + an all-reduce) that is all 5.16 has.
if "ep_size" in DistributedConfig.__dataclass_fields__:
    MOE_EP_PLAN = {"layers.*.mlp.experts": "ep_dispatch_experts"}
else:
    MOE_EP_PLAN = {"layers.*.mlp.gate": "ep_router", "layers.*.mlp.experts": "moe_tp_experts"}
MOE_EP_PLAN |= {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm"}
# Tensor parallelism, as Llama's plan; `TfmConfig.base_model_tp_plan` keeps the entries its configuration builds.
# `embed_tokens` is named here, not left to the release (newer ones add it, 5.16 does not), so a head tied to it
# (`lm_head`, sharded on the vocabulary too) is sharded together with it on every release.
ATTENTION_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
GLU_TP_PLAN = {"layers.*.mlp.gate_proj": "colwise"}
MLP_TP_PLAN = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
# Mixture-of-experts layers: experts sharded on their width, as Mixtral / Qwen2-MoE; the router and the shared expert
# are replicated.
EXPERTS_TP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
# A q/k norm over the whole projection (`qk_norm_scope="projection"`) needs every head: the projections are gathered
# before it and split again before `o_proj`, as OLMoE's plan does.
PROJECTION_QK_NORM_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise_gather_output",
    "layers.*.self_attn.k_proj": "colwise_gather_output",
    "layers.*.self_attn.v_proj": "colwise_gather_output",
    "layers.*.self_attn.o_proj": "rowwise_split_input",
}


def _no_effect(knob: str, value, why: str) -> None:
    """A knob set where this configuration does not read it: accepted, as the in-tree configs accept it, and said."""
    logger.warning(f"`{knob}`={value!r} has no effect: {why}.")


@functools.cache
def _known_keys(config_class: type) -> frozenset[str]:
    """Every key a config of this class reads or transformers writes into its config.json."""
    own = set(config_class().to_dict()) | {field.name for field in dataclasses.fields(config_class)}
    # properties, the base class's too: `from_pretrained` passes `name_or_path` (PreTrainedConfig's property) back in
    own |= {
        name for klass in config_class.__mro__ for name, value in vars(klass).items() if isinstance(value, property)
    }
    return frozenset(
        own | set(PreTrainedConfig().to_dict()) | set(config_class.attribute_map) | EXTRA_CONFIG_KEYS | _base_keys()
    )


def _base_keys() -> set[str]:
    """The keys PreTrainedConfig itself takes out of the kwargs: the implementation choices (`from_pretrained(...,
    attn_implementation=...)` and `transformers serve` pass them through the config) and, read from the release,
    the generation parameters an old config.json may still hold."""
    keys = {"attn_implementation", "experts_implementation", "output_attentions", "per_layer_config", "name_or_path"}
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)  # what __init__ pops, per release
    return keys | set(defaults() if defaults is not None else ())


def _warn_unknown_keys(config: PreTrainedConfig, keys) -> None:
    """Keys the config does not read are kept as attributes and saved back, as in-tree configs keep them (tools and
    transformers' own tests write such keys); a misspelt knob, though, would silently build another model: one warning
    names them, with the nearest knob."""
    keys = [key for key in keys if not key.startswith("_") and not key.endswith("_token_id")]  # bookkeeping, ids
    unknown = sorted(set(keys) - _known_keys(type(config))) if keys else []
    if not unknown:
        return
    knobs = [field.name for field in dataclasses.fields(type(config))]
    hints = [
        f"`{key}`" + "".join(f" (did you mean `{m}`?)" for m in difflib.get_close_matches(key, knobs, 1))
        for key in unknown
    ]
    logger.warning(
        f"{type(config).__name__} does not read {', '.join(hints)}: kept as attributes (and saved), but this model "
        "ignores them. If a newer hf_tfm saved this config, they may be knobs this version does not know, and the "
        "model may compute something else than it did there: upgrade hf_tfm."
    )


@strict
@dataclasses.dataclass(kw_only=True)
class TfmExpertKnobs:
    """The mixture-of-experts knobs of a `TfmConfig` with `num_experts` set: attributes of such a config, and of no
    other. Generic tools read their presence as "this model has experts", as in-tree configs carry them only in MoE
    families (Mixtral, Qwen2-MoE, OLMoE): TRL asks a model whose config has `output_router_logits` for its router
    logits and feeds them to the load-balancing loss, and counts FLOPs per expert when it has `num_experts_per_tok`.
    A dense config therefore has none of them: passed to one (or read from a config.json saved before this split),
    they are dropped, with a warning where a value differs from the default. `TfmConfig(num_experts=N, ...)` takes
    them as keyword arguments, typed and defaulted here."""

    # --- mixture of experts
    num_experts_per_tok: int = 2  # top-k: the experts each token runs, in [1, num_experts]
    moe_intermediate_size: int | None = None  # each expert's width; None: `intermediate_size`
    # Width of a sigmoid-gated dense expert every token uses besides the routed ones (Qwen2-MoE); None: no such expert.
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral; Qwen2-MoE, OLMoE: False)
    router_weights_fp32: bool = False  # scale expert outputs by fp32 routing weights (Mixtral), else the hidden dtype
    router_jitter_noise: float = 0.0  # in [0, 1); training only: the block's input times U(1 - noise, 1 + noise)
    mlp_only_layers: list[int] | None = None  # indices of layers that keep the dense feed-forward
    decoder_sparse_step: int = 1  # every step-th layer is sparse: (i + 1) % step == 0 (Qwen2-MoE; encoders too)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss the heads add to their loss
    output_router_logits: bool = False  # return the router logits and add that loss (`aux_loss`) without being asked


EXPERT_KNOBS = {field.name: field.default for field in dataclasses.fields(TfmExpertKnobs)}


def expert_knobs(config: "TfmConfig") -> dict:
    """The expert knobs of `config` by name: empty for a dense config, which has none."""
    return {name: getattr(config, name) for name in EXPERT_KNOBS if hasattr(config, name)}


@strict
class TfmConfig(PreTrainedConfig):
    r"""Configuration of an hf_tfm transformer: encoder (`is_causal=False`) or decoder (`is_causal=True`).

    `TfmConfig()` builds a small Llama-style decoder (RoPE, RMSNorm, SwiGLU, pre-norm). Field names follow
    `LlamaConfig` / `BertConfig` where those exist, so users' habits and transformers' own helpers (caches, masks,
    RoPE scaling, PEFT, Trainer) read them unchanged.
    """

    model_type = "hf_tfm"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the output field's name on newer / older releases
    _pair_side = None  # the side of a seq2seq folder `from_pretrained` reads: a side class's (see `get_config_dict`)
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # --- sizes: the model's dimensions (each must be positive)
    vocab_size: int = 1024  # token ids: rows of the token embeddings, and outputs of the LM heads
    hidden_size: int = 128  # width of the residual stream: the embeddings and every block's input and output
    num_hidden_layers: int = 2  # number of transformer blocks
    num_attention_heads: int = 4  # query heads of each attention layer
    # Key/value heads; must divide `num_attention_heads`. None: as many as the query heads (multi-head attention);
    # fewer: grouped-query attention (GQA, arXiv:2305.13245); 1: multi-query attention (MQA).
    num_key_value_heads: int | None = None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads; required when the heads do not divide it
    # Feed-forward width. None: 4 * hidden_size (mlp), or 8/3 * hidden_size rounded up to a multiple of 64 (glu: the
    # parameter count of a 4x MLP, the PaLM / Llama convention).
    intermediate_size: int | None = None
    # Longest sequence: a hard limit with learned positions (the table's rows); the reference length of RoPE scaling.
    max_position_embeddings: int = 2048

    # --- positions: added to the embeddings (sinusoidal, learned) or applied in attention (rope, alibi)
    # sinusoidal: the fixed sin/cos table of "Attention Is All You Need"; learned: a trained table (BERT, GPT-2);
    # rope: rotates queries and keys (arXiv:2104.09864); alibi: per-head linear distance biases (arXiv:2108.12409).
    position_embedding_type: Literal["sinusoidal", "learned", "rope", "alibi"] = "rope"
    # Sinusoidal only: the paper's sin/cos interleaved on even/odd dimensions (PyTorch tutorials), or a sine half then
    # a cosine half (fairseq, Marian). Configs saved before this knob existed load as "halves": see `from_dict`.
    sinusoidal_layout: Literal["interleaved", "halves"] = "interleaved"
    # transformers' RoPE dict (the v5 field): `rope_theta`, `rope_type` (default, linear, dynamic, yarn, llama3, ...)
    # and that type's scaling keys; None: {"rope_type": "default", "rope_theta": 10000.0}. Or nested, one such dict
    # per layer type ({"full_attention": {...}, "sliding_attention": {...}}): each layer type gets its own RoPE
    # (ModernBERT: theta 160k on full layers, 10k on sliding ones). See `rope_per_layer_type`. A config without RoPE
    # has no `rope_parameters` attribute, as in-tree configs without RoPE (GPT-2, BERT, BART) have none: tools read
    # its presence as "RoPE, which can be scaled".
    rope_parameters: RopeParameters | dict | None = dataclasses.field(default_factory=lambda: None)
    type_vocab_size: int = 0  # > 0 adds BERT-style token type (segment) embeddings, with this many types
    # Learned positions only: position p reads row p + offset, so the table has max_position_embeddings + offset rows
    # (BART and mBART keep two unused rows in front, a fairseq legacy).
    position_offset: int = 0
    # Token embeddings are multiplied by this (Marian, the original Transformer: sqrt(hidden_size)); `inputs_embeds`
    # are scaled too, so `inputs_embeds=model.get_input_embeddings()(ids)` equals passing the ids. None:
    # sqrt(hidden_size) with sinusoidal positions (the paper's; their token table then starts with std
    # 1/sqrt(hidden_size), as in tensor2tensor and fairseq: see `_init_weights`), else 1.0. Unscaled at
    # initializer_range, tokens are ~50x smaller than the +-1 table they are added to, and bf16 gets ~15% of their
    # signal wrong (scaled: under 1%, as in-tree Llama, GPT-2, BERT). A saved config
    # carries the number; one saved before the knob existed has 1.0.
    embedding_scale: float | None = None

    # --- normalisation
    norm_type: Literal["layernorm", "rmsnorm"] = "rmsnorm"  # the type of every norm (RMSNorm: arXiv:1910.07467)
    norm_eps: float = 1e-6  # epsilon of every norm
    norm_bias: bool = True  # a bias in every norm: LayerNorm only (RMSNorm has none)
    # pre: a norm before each sub-layer (Llama, GPT-2); post: after each residual sum (the original Transformer, BERT).
    norm_position: Literal["pre", "post"] = "pre"
    # A norm after the last layer. None: exactly for pre-norm (Llama, GPT-2 have one; BERT does not); torch's
    # nn.TransformerEncoder(norm=...) can put one after post-norm layers too, or leave it out after pre-norm ones.
    final_norm: bool | None = None
    embedding_norm: bool = False  # a norm right after the embeddings (BERT, ModernBERT)
    first_layer_attn_norm: bool = (
        True  # False: layer 0 has no attention norm (ModernBERT: its input is already normed)
    )

    # --- feed-forward: "glu" is gate_proj/up_proj/down_proj (silu -> SwiGLU, gelu -> GeGLU; arXiv:2002.05202)
    ffn_type: Literal["mlp", "glu"] = "glu"  # mlp: down(act(up(x))); glu: down(act(gate(x)) * up(x))
    hidden_act: str = "silu"  # the feed-forward's activation: any transformers `ACT2FN` name (silu, gelu, gelu_new...)
    mlp_bias: bool = False  # biases on the feed-forward's linear layers

    # --- mixture of experts: a router sends each token to its top-k gated (glu) experts; names as in Qwen2-MoE/Mixtral
    # Experts in each sparse layer (Switch Transformer arXiv:2101.03961, Mixtral arXiv:2401.04088). None: every layer
    # has the dense feed-forward, and the config has none of the expert knobs below (`TfmExpertKnobs`): in-tree dense
    # configs have none, and tools read their presence as "this model has experts". `is_sparse_layer(i)` says which
    # layers have experts.
    num_experts: int | None = None

    # --- attention
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool | None = None  # bias on o_proj; None: same as attention_bias (Qwen2 sets False)
    attention_dropout: float = 0.0  # dropout on the attention probabilities, in [0, 1)
    hidden_dropout: float = 0.0  # dropout on the embeddings and on each sub-layer's output, in [0, 1)
    is_causal: bool = True  # True: decoder (causal mask, KV cache); False: bidirectional encoder
    # Local attention for the "sliding_attention" layers: a decoder sees itself and (window - 1) previous tokens, an
    # encoder +-window tokens.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" / "sliding_attention"; None: all one kind
    qk_norm: bool = False  # a norm of queries and keys before RoPE (a stabiliser: Qwen3, OLMo2, OLMoE)
    # What `qk_norm` normalises: each head's `head_dim` values (Qwen3, Gemma 3), or the whole q / k projection (OLMo2,
    # OLMoE).
    qk_norm_scope: Literal["head", "projection"] = "head"
    # x + attn(norm1(x)) + mlp(norm2(x)): attention and feed-forward side by side, as GPT-J/NeoX/PaLM; needs pre-norm.
    parallel_residual: bool = False
    # A decoder that also attends to an encoder's output: each block gets `encoder_attn` (+ its norm,
    # `cross_attn_norm`) between the self-attention and the FFN. `TfmSeq2SeqConfig` sets it on its decoder; BERT's
    # knob of the same name.
    add_cross_attention: bool = False

    # --- heads and embeddings
    tie_word_embeddings: bool = True  # the LM heads' output layer shares `embed_tokens`' weights (saved once)
    lm_head_bias: bool = False  # bias on the causal LM's `lm_head` (an nn.Linear output layer of a torch GPT has one)
    # Sequence-classification pooling: the first token, the mean of the real tokens or the last real one. None:
    # "first" for an encoder, "last" for a decoder (whose first token sees nothing else).
    classifier_pooling: Literal["first", "mean", "last"] | None = None
    classifier_dropout: float | None = None  # dropout before the classifiers' `score`, in [0, 1); None: hidden_dropout
    # Sequence classification: a hidden_size -> hidden_size dense + `classifier_activation` on the pooled vector,
    # before `score` (BERT's pooler: dense + tanh; ModernBERT's adds a norm, `classifier_norm`).
    classifier_dense: bool = False
    classifier_activation: str = "tanh"  # activation of that dense (any ACT2FN name); used only with classifier_dense
    classifier_norm: bool = False  # a `norm_type` norm after that activation; needs classifier_dense
    classifier_bias: bool = True  # bias on the `score` layer of both classifiers (Llama/GPT-2 style heads have none)
    # A pooler on the bare backbone (TfmModel): the `classifier_pooling` token -> dense -> `classifier_activation`,
    # returned as `pooler_output` (BERT's pooler). Heads have their own and build none.
    add_pooling_layer: bool = False
    head_dense_bias: bool = (
        True  # bias on the dense of the masked-LM transform and of `classifier_dense` (ModernBERT: no)
    )
    mlm_head_activation: str | None = None  # masked-LM transform's activation; None: gelu for glu, else hidden_act
    pad_token_id: int | None = 0  # padding token: without an `attention_mask`, pooling leaves these tokens out
    bos_token_id: int | None = 1  # beginning-of-sequence token (generation)
    eos_token_id: int | list[int] | None = 2  # end-of-sequence token(s): generation stops there
    initializer_range: float = 0.02  # std of the normal init of the weights (o_proj, down_proj: GPT-2's scaled init)
    use_cache: bool = True  # decoders return and reuse a KV cache by default (generation); encoders build none

    def __post_init__(self, **kwargs):
        experts = {name: kwargs.pop(name) for name in EXPERT_KNOBS if name in kwargs}
        _warn_unknown_keys(self, kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            if self.ffn_type == "glu":  # keeps the parameter count of a 4x MLP (PaLM/Llama convention)
                self.intermediate_size = 64 * ((8 * self.hidden_size // 3 + 63) // 64)
            else:
                self.intermediate_size = 4 * self.hidden_size
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        self._set_expert_knobs(experts)
        if self.position_embedding_type != "rope":
            self._drop_rope_parameters(kwargs)
        if self.classifier_pooling is None:
            self.classifier_pooling = "last" if self.is_causal else "first"
        if self.final_norm is None:
            self.final_norm = self.norm_position == "pre"
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if self.embedding_scale is None:  # a size <= 0 is refused by `validate_architecture`, not by sqrt here
            paper = self.position_embedding_type == "sinusoidal" and self.hidden_size > 0
            self.embedding_scale = math.sqrt(self.hidden_size) if paper else 1.0
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Raise a `ValueError` naming the knob for every invalid value or combination."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}.")
        if self.head_dim is None:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) is not divisible by `num_attention_heads` "
                f"({self.num_attention_heads}); set `head_dim` explicitly."
            )
        if self.head_dim <= 0 or self.intermediate_size <= 0 or self.num_key_value_heads <= 0:
            raise ValueError("`head_dim`, `intermediate_size` and `num_key_value_heads` must be positive.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be divisible by `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"`head_dim` must be even for rotary `position_embedding_type`, got {self.head_dim}.")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"`sliding_window` must be a positive int or None, got {self.sliding_window}.")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(
                f"`layer_types` must list one of {LAYER_TYPES} per layer ({self.num_hidden_layers}), "
                f"got {self.layer_types}."
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("`layer_types` has 'sliding_attention' layers but `sliding_window` is None.")
        if self.sliding_window is not None and "sliding_attention" not in self.layer_types:
            _no_effect("sliding_window", self.sliding_window, "`layer_types` has no 'sliding_attention' layer")
        if not self.first_layer_attn_norm and self.norm_position != "pre":
            raise ValueError("`first_layer_attn_norm=False` needs `norm_position='pre'` (a post-norm is the output).")
        if self.parallel_residual and self.norm_position == "post":
            raise ValueError(
                "`parallel_residual` needs `norm_position='pre'` (a post-norm parallel block is undefined)."
            )
        if self.sinusoidal_layout != "interleaved" and self.position_embedding_type != "sinusoidal":
            # It is easy to read as RoPE's rotate-half layout, which it does not change: said, not silently ignored.
            why = f"it lays out the sinusoidal table only (`position_embedding_type`={self.position_embedding_type!r})"
            _no_effect("sinusoidal_layout", self.sinusoidal_layout, why)
        if self.position_offset < 0:
            raise ValueError(f"`position_offset` must be >= 0, got {self.position_offset}.")
        if self.position_offset and self.position_embedding_type != "learned":
            why = f"it shifts the learned table's lookup (`position_embedding_type`={self.position_embedding_type!r})"
            _no_effect("position_offset", self.position_offset, why)
        if not self.embedding_scale > 0:
            raise ValueError(f"`embedding_scale` must be positive, got {self.embedding_scale}.")
        if self.add_cross_attention and not self.is_causal:
            raise ValueError("`add_cross_attention=True` needs `is_causal=True` (cross-attention is a decoder's).")
        if self.add_cross_attention and self.parallel_residual:
            raise ValueError("`add_cross_attention` cannot combine with `parallel_residual` (no parallel form).")
        if self.type_vocab_size < 0:
            raise ValueError(f"`type_vocab_size` must be >= 0, got {self.type_vocab_size}.")
        for name in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {value}.")
        if self.norm_eps <= 0:
            raise ValueError(f"`norm_eps` must be positive, got {self.norm_eps}.")
        if self.classifier_norm and not self.classifier_dense:
            _no_effect("classifier_norm", True, "the norm follows `classifier_dense`, which is False")
        if self.is_causal and self.classifier_pooling == "first":
            raise ValueError(
                "`classifier_pooling='first'` sees only the first token in a causal decoder; use 'last' or 'mean'."
            )
        if self.qk_norm_scope != "head" and not self.qk_norm:
            _no_effect("qk_norm_scope", self.qk_norm_scope, "`qk_norm` is False")
        self._validate_moe()
        self._validate_attn_implementation(self._attn_implementation)

    def _drop_rope_parameters(self, kwargs: dict) -> None:
        """A config without RoPE keeps no `rope_parameters`, nor the legacy `rope_theta` / `rope_scaling` keys (every
        config saved before this change holds the default dict); RoPE scaling asked of it has no effect, and is said.
        """
        params = self.__dict__.pop("rope_parameters", None)
        legacy = kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_theta", None)
        nested = isinstance(params, dict) and any(key in LAYER_TYPES for key in params)
        entries = [*(params.values() if nested else [params]), legacy]
        scaled = sorted({p.get("rope_type", p.get("type", "default")) for p in entries if p} - {"default"})
        if scaled:  # the default, unscaled parameters are every old config's: unused, and not worth a word
            why = f"`position_embedding_type`={self.position_embedding_type!r} has no RoPE to scale"
            _no_effect("rope_parameters", f"RoPE scaling {', '.join(scaled)}", why)

    def _set_expert_knobs(self, experts: dict) -> None:
        """Give a config with experts its knobs (typed, with their defaults); drop them from a dense one."""
        if self.num_experts is None:
            for name, value in experts.items():
                if value not in (EXPERT_KNOBS[name], []):  # [] and None: no dense-only layers
                    _no_effect(name, value, "`num_experts` is None: no layer has experts, and the knob is dropped")
            return
        for name, value in vars(TfmExpertKnobs(**experts)).items():
            setattr(self, name, value)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    def __eq__(self, other: object) -> bool:
        # The dataclass' comparison of the fields, and the expert knobs, which are attributes but not fields.
        return (
            type(other) is type(self)
            and all(getattr(self, f.name, None) == getattr(other, f.name, None) for f in dataclasses.fields(self))
            and expert_knobs(self) == expert_knobs(other)
        )

    __hash__ = None  # mutable, as every dataclass that compares by value

    def _validate_moe(self) -> None:
        """The mixture-of-experts knobs: sizes, top-k, sparse layers."""
        if self.num_experts is None:
            return
        if self.num_experts <= 0:
            raise ValueError(f"`num_experts` must be positive or None (dense), got {self.num_experts}.")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` must lie in [1, `num_experts`={self.num_experts}], "
                f"got {self.num_experts_per_tok}."
            )
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}.")
        outside = sorted({i for i in self.mlp_only_layers or () if not 0 <= i < self.num_hidden_layers})
        if outside:
            raise ValueError(
                f"`mlp_only_layers` has layer indices {outside} outside [0, "
                f"num_hidden_layers={self.num_hidden_layers})."
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"`router_aux_loss_coef` must be >= 0, got {self.router_aux_loss_coef}.")
        if not 0.0 <= self.router_jitter_noise < 1.0:
            raise ValueError(f"`router_jitter_noise` must be in [0, 1), got {self.router_jitter_noise}.")
        # Every in-tree MoE family has bias-free gated experts: transformers' fused kernels take that layout.
        if self.ffn_type != "glu":
            raise ValueError(f"`ffn_type={self.ffn_type!r}` with `num_experts`: experts are gated; use 'glu'.")
        if self.mlp_bias:
            raise ValueError("`mlp_bias=True` with `num_experts`: experts have no biases; use mlp_bias=False.")

    def validate_rope(self) -> None:
        """transformers' RoPE checks (an even `head_dim`, scaling keys), only where RoPE is used: an odd `head_dim` is
        fine with sinusoidal, learned or ALiBi positions, and transformers runs this check on every config."""
        if self.position_embedding_type == "rope":
            super().validate_rope()

    def _validate_attn_implementation(self, implementation: str | None) -> None:
        # Flash kernels take no additive bias: ALiBi would be silently dropped.
        if self.position_embedding_type == "alibi" and implementation and implementation.startswith("flash"):
            raise ValueError(
                f"`position_embedding_type='alibi'` cannot run on attn_implementation={implementation!r} "
                "(flash kernels take no additive bias); use 'sdpa', 'eager' or 'flex_attention'."
            )

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "TfmConfig":
        """`PreTrainedConfig.from_dict` (the path of `from_pretrained` and `AutoConfig`), reading configs saved by
        older hf_tfm."""
        return super().from_dict(upgrade_saved_config(config_dict), **kwargs)

    @classmethod
    def from_json_file(cls, json_file) -> "TfmConfig":
        """`PreTrainedConfig.from_json_file`, reading configs saved by older hf_tfm."""
        return cls(**upgrade_saved_config(cls._dict_from_json_file(json_file)))

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """`PreTrainedConfig.get_config_dict` (the path of `from_pretrained`), reading one side of an encoder-decoder.

        A seq2seq folder holds two `TfmConfig`s. transformers would give the last dict of this model_type, the
        decoder's, for either: a side class (`TfmEncoderConfig`, `TfmDecoderConfig`) reads its own side, and
        `TfmConfig` refuses to guess.
        """
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == TfmSeq2SeqConfig.model_type:
            if cls._pair_side is None:
                raise ValueError(
                    f"{pretrained_model_name_or_path} holds an encoder-decoder pair (model_type "
                    f"{TfmSeq2SeqConfig.model_type!r}), and {cls.__name__} cannot tell which side to read: load the "
                    "pair with `TfmSeq2SeqConfig.from_pretrained` (then `.encoder` or `.decoder`), or one side with "
                    "`TfmEncoderConfig.from_pretrained` / `TfmDecoderConfig.from_pretrained`."
                )
            config_dict = config_dict[cls._pair_side]
        return config_dict, kwargs

    def convert_rope_params_to_dict(self, **kwargs) -> dict:
        """transformers' RoPE standardisation; a `rope_parameters` nested by layer type stays nested on every release.

        Releases before 5.2x put the default `rope_theta` next to the nested entries, which un-nests the dict; here the
        defaults go into each entry, as newer releases do.
        """
        if not self.rope_per_layer_type:
            return super().convert_rope_params_to_dict(**kwargs)
        missing = sorted(t for t in set(self.layer_types) if not self.rope_parameters.get(t))
        if missing:
            raise ValueError(
                f"`rope_parameters` is nested by layer type but has no entry for {missing} (in `layer_types`)."
            )
        rope_theta = kwargs.pop("rope_theta", self.default_theta)
        for params in self.rope_parameters.values():
            if params is not None:
                params.setdefault("rope_type", params.get("type", "default"))
                params.setdefault("rope_theta", rope_theta)
                if params["rope_type"] in ("llama3", "yarn", "longrope"):
                    params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return kwargs

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan of what this configuration builds: every entry names a parameter or module of it
        (dense and expert feed-forwards as the layers have them, cross-attention where a decoder has it). A plan set
        on the config (transformers 5.16 sets one at construction, quantizers set theirs) is returned as set."""
        if (plan := self.__dict__.get("base_model_tp_plan")) is not None:
            return plan
        sparse = [self.is_sparse_layer(i) for i in range(self.num_hidden_layers)]
        plan = dict(ATTENTION_TP_PLAN)
        if self.qk_norm and self.qk_norm_scope == "projection":
            plan |= PROJECTION_QK_NORM_TP_PLAN
        if self.add_cross_attention:  # a seq2seq decoder's cross-attention is sharded like its self-attention
            plan |= {k.replace(".self_attn.", ".encoder_attn."): v for k, v in plan.items() if ".self_attn." in k}
        if not all(sparse):
            plan |= (GLU_TP_PLAN if self.ffn_type == "glu" else {}) | MLP_TP_PLAN
        if any(sparse):
            plan |= EXPERTS_TP_PLAN
        return plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str] | None) -> None:
        self.__dict__["base_model_tp_plan"] = plan  # not saved: `to_dict` leaves this key out

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """The expert-parallel plan, for a configuration with experts."""
        return MOE_EP_PLAN if self.num_experts is not None else None

    @property
    def rope_per_layer_type(self) -> bool:
        """True when `rope_parameters` is nested by layer type (one RoPE per entry of `layer_types`)."""
        params = getattr(self, "rope_parameters", None)
        return bool(params) and any(key in LAYER_TYPES for key in params)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a mixture-of-experts feed-forward (Qwen2-MoE's rule) or the dense one."""
        return (
            self.num_experts is not None
            and layer_idx not in (self.mlp_only_layers or ())
            and self.decoder_sparse_step > 0  # a step <= 0 is refused by `validate_architecture`, not by a % 0 here
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_kv_groups(self) -> int:
        """How many query heads share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads


@strict
class TfmEncoderConfig(TfmConfig):
    """The encoder side of a `TfmSeq2SeqConfig`: a `TfmConfig`, bidirectional by default. `from_pretrained` reads the
    encoder of a pair's folder, or a side saved alone."""

    _pair_side = "encoder"
    __eq__ = TfmConfig.__eq__  # not the dataclass' own, which would miss the expert knobs
    __hash__ = None
    is_causal: bool = False


@strict
class TfmDecoderConfig(TfmConfig):
    """The decoder side of a `TfmSeq2SeqConfig`: a `TfmConfig`, causal and cross-attending by default.
    `from_pretrained` reads the decoder of a pair's folder, or a side saved alone."""

    _pair_side = "decoder"
    __eq__ = TfmConfig.__eq__
    __hash__ = None
    add_cross_attention: bool = True


def upgrade_saved_config(config_dict: dict) -> dict:
    """A saved config's fields as this version reads them: a knob added since gets the value the model was built with.

    Sinusoidal checkpoints saved before `sinusoidal_layout` existed were built with the halves table (the only layout
    then), while a fresh config gets the paper's interleaved one. A missing key means "halves" only in a *saved*
    config, which `__post_init__` cannot tell from `TfmConfig(position_embedding_type="sinusoidal")`; so it is decided
    here, where saved configs are read (`from_dict`, `from_json_file`, `presets.load_config`). A saved config is one
    transformers wrote: it carries `transformers_version` (a hand-written dict or JSON gets the new default).

    Likewise `embedding_scale`: a sinusoidal config saved before the knob existed was built unscaled (1.0), while a
    fresh one gets sqrt(hidden_size). Configs saved since carry the number, so they load as they were saved.
    """
    saved = "transformers_version" in config_dict
    if saved and config_dict.get("position_embedding_type") == "sinusoidal":
        old_defaults = {"sinusoidal_layout": "halves", "embedding_scale": 1.0}
        config_dict = {**old_defaults, **config_dict}
    return config_dict


@strict
class TfmSeq2SeqConfig(PreTrainedConfig):
    r"""Configuration of an hf_tfm encoder-decoder ("Attention Is All You Need", BART, Marian): two `TfmConfig`s.

    `encoder` and `decoder` are full `TfmConfig`s (or their dicts), so every knob works on either side and the sides
    may differ (depth, heads, GQA, FFN, positions, ...); they must share `hidden_size`, which cross-attention reads.
    The encoder is bidirectional and the decoder causal with cross-attention: dicts get `is_causal` and
    `add_cross_attention` filled in, `TfmConfig` objects must already have them. `decoder=None` mirrors the encoder.

    ```python
    common = dict(hidden_size=256, num_attention_heads=4, position_embedding_type="sinusoidal")
    config = TfmSeq2SeqConfig(encoder={**common, "num_hidden_layers": 6}, decoder={**common, "num_hidden_layers": 3})
    ```
    """

    model_type = "hf_tfm_seq2seq"
    sub_configs = {"encoder": TfmEncoderConfig, "decoder": TfmDecoderConfig}
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    # --- encoder-decoder: `encoder` and `decoder` are `TfmConfig`s, so every knob above works on either side
    encoder: TfmConfig | dict | None = None  # a TfmConfig or dict; None: TfmConfig's defaults, bidirectional
    decoder: TfmConfig | dict | None = None  # a TfmConfig or dict; None: the encoder's knobs, causal, cross-attending
    # One token table for both sides (BART, Marian), which needs one vocabulary; False: a table per side.
    share_encoder_decoder_embeddings: bool = True
    tie_word_embeddings: bool = True  # `lm_head` shares the decoder's token embeddings
    is_encoder_decoder: bool = True  # tells transformers (generation, Trainer) that this model has two sides
    use_cache: bool = True  # the model's default; decides for the decoder (whose own `use_cache` is not read)
    decoder_start_token_id: int | None = None  # the first decoder token; None: the decoder's `bos_token_id`
    pad_token_id: int | None = None  # padding token (decoder inputs built from labels); None: the decoder's
    bos_token_id: int | None = None  # beginning-of-sequence token; None: the decoder's
    eos_token_id: int | list[int] | None = None  # end-of-sequence token(s) ending generation; None: the decoder's

    def __post_init__(self, **kwargs):
        _warn_unknown_keys(self, kwargs)
        self.encoder = _side_config(self.encoder, "encoder", decoder=False)
        if self.decoder is None:
            self.decoder = _mirror_as_decoder(self.encoder)
        self.decoder = _side_config(self.decoder, "decoder", decoder=True)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(self.decoder, name))
        if self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.decoder.bos_token_id
        super().__post_init__(**kwargs)

    # The top-level sizes generic code reads on every encoder-decoder config (generation, cache sizing, ConfigTester),
    # as BART maps them: the encoder's heads and depth, the one width, the vocabulary of the logits. Setting one sets
    # it on both sides (the vocabulary: on the encoder too only when the sides share their token table).
    @property
    def hidden_size(self) -> int:
        return self.encoder.hidden_size

    @hidden_size.setter
    def hidden_size(self, value: int) -> None:
        self.encoder.hidden_size = self.decoder.hidden_size = value

    @property
    def num_attention_heads(self) -> int:
        return self.encoder.num_attention_heads

    @num_attention_heads.setter
    def num_attention_heads(self, value: int) -> None:
        self.encoder.num_attention_heads = self.decoder.num_attention_heads = value

    @property
    def num_hidden_layers(self) -> int:
        return self.encoder.num_hidden_layers

    @num_hidden_layers.setter
    def num_hidden_layers(self, value: int) -> None:
        self.encoder.num_hidden_layers = self.decoder.num_hidden_layers = value

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self.decoder.vocab_size = value
        if self.share_encoder_decoder_embeddings:
            self.encoder.vocab_size = value

    def validate_architecture(self):
        """Raise a `ValueError` naming the knob when the two sides do not fit together."""
        if self.encoder.hidden_size != self.decoder.hidden_size:
            raise ValueError(
                f"`encoder.hidden_size` ({self.encoder.hidden_size}) and `decoder.hidden_size` "
                f"({self.decoder.hidden_size}) must be equal: cross-attention reads the encoder's output."
            )
        if self.share_encoder_decoder_embeddings and self.encoder.vocab_size != self.decoder.vocab_size:
            raise ValueError(
                f"`share_encoder_decoder_embeddings=True` needs one vocabulary, got `encoder.vocab_size`="
                f"{self.encoder.vocab_size} and `decoder.vocab_size`={self.decoder.vocab_size}."
            )
        start = self.decoder_start_token_id
        if start is not None and not 0 <= start < self.decoder.vocab_size:
            raise ValueError(
                f"`decoder_start_token_id`={start} is outside the decoder's vocabulary [0, {self.decoder.vocab_size})."
            )


def _side_config(value: TfmConfig | dict | None, name: str, decoder: bool) -> TfmConfig:
    """One side of a seq2seq config: a dict gets the side's `is_causal` / `add_cross_attention`; either way they must
    be the side's (an encoder that cannot see all the source, or a decoder without cross-attention, is not seq2seq)."""
    if not isinstance(value, TfmConfig):
        fields = dict(value or {})
        fields.setdefault("is_causal", decoder)
        fields.setdefault("add_cross_attention", decoder)
        value = (TfmDecoderConfig if decoder else TfmEncoderConfig)(**fields)
    for knob in ("is_causal", "add_cross_attention"):
        if getattr(value, knob) != decoder:
            raise ValueError(f"`{name}.{knob}` must be {decoder} in a TfmSeq2SeqConfig, got {getattr(value, knob)}.")
    return value


def _mirror_as_decoder(encoder: TfmConfig) -> dict:
    """The encoder's knobs as a decoder's: causal, with cross-attention, and the pooling re-derived for a decoder."""
    fields = {f.name: getattr(encoder, f.name) for f in dataclasses.fields(TfmConfig) if f.name in TfmConfig.__dict__}
    fields |= expert_knobs(encoder)
    return {**fields, "is_causal": True, "add_cross_attention": True, "classifier_pooling": None}


def _raise_value_errors(init):
    """Re-raise `@strict`'s field and class validation errors as the `ValueError` users catch for bad configs."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except StrictDataclassError as err:
            raise ValueError(f"Invalid {type(self).__name__}: {err}") from err

    return wrapper


for _config_class in (TfmConfig, TfmEncoderConfig, TfmDecoderConfig):
    _config_class.__init__ = _raise_value_errors(_config_class.__init__)
TfmSeq2SeqConfig.__init__ = _raise_value_errors(TfmSeq2SeqConfig.__init__)

__all__ = [
    "EXPERT_KNOBS",
    "TfmConfig",
    "TfmDecoderConfig",
    "TfmEncoderConfig",
    "TfmExpertKnobs",
    "TfmSeq2SeqConfig",
    "expert_knobs",
    "upgrade_saved_config",
]
