"""hf_tfm: a configurable transformer (encoder or decoder) that plugs into Hugging Face transformers.

Importing the package registers `TfmConfig` and every model class with transformers' Auto classes (idempotent), and
marks them for remote code, so each saved checkpoint carries `configuration.py`, `modeling.py` (with the modules it
imports: `checkpoint.py`, `distributed.py`) and an `auto_map`.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration import TfmConfig, TfmDecoderConfig, TfmEncoderConfig, TfmSeq2SeqConfig
from .inference import compile_generation, load_for_inference
from .modeling import (
    TfmForCausalLM,
    TfmForConditionalGeneration,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
    TfmMoeModel,
    TfmPreTrainedModel,
    TfmSeq2SeqModel,
)

__version__ = "0.3.1"

AUTO_CLASSES = {
    "AutoModel": (AutoModel, TfmModel),
    "AutoModelForCausalLM": (AutoModelForCausalLM, TfmForCausalLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, TfmForSequenceClassification),
    "AutoModelForMaskedLM": (AutoModelForMaskedLM, TfmForMaskedLM),
    "AutoModelForTokenClassification": (AutoModelForTokenClassification, TfmForTokenClassification),
    "AutoModelForQuestionAnswering": (AutoModelForQuestionAnswering, TfmForQuestionAnswering),
}
SEQ2SEQ_AUTO_CLASSES = {
    "AutoModel": (AutoModel, TfmSeq2SeqModel),
    "AutoModelForSeq2SeqLM": (AutoModelForSeq2SeqLM, TfmForConditionalGeneration),
}


def _register() -> None:
    for config_class, classes in ((TfmConfig, AUTO_CLASSES), (TfmSeq2SeqConfig, SEQ2SEQ_AUTO_CLASSES)):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_name, (auto_class, model_class) in classes.items():
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_name)


_register()

_CONVERT_NAMES = ("convert_path", "from_hf", "in_tree_blockers", "to_hf")


def __getattr__(name: str):
    """`hf_tfm.from_hf` / `to_hf` / `convert_path` / `in_tree_blockers` / `from_torch` and `hf_tfm.export`
    (`hf_tfm.exporters.export`): imported on first use (they load the in-tree model families, or the exporters)."""
    if name in _CONVERT_NAMES:
        from . import convert

        return getattr(convert, name)
    if name == "from_torch":
        from .convert.from_torch import from_torch

        return from_torch
    if name == "export":
        from .exporters import export

        return export
    raise AttributeError(f"module 'hf_tfm' has no attribute {name!r}")


__all__ = [
    "TfmConfig",
    "TfmDecoderConfig",
    "TfmEncoderConfig",
    "TfmForCausalLM",
    "TfmForConditionalGeneration",
    "TfmForMaskedLM",
    "TfmForQuestionAnswering",
    "TfmForSequenceClassification",
    "TfmForTokenClassification",
    "TfmModel",
    "TfmMoeModel",
    "TfmPreTrainedModel",
    "TfmSeq2SeqConfig",
    "TfmSeq2SeqModel",
    "compile_generation",
    "convert_path",
    "export",
    "from_hf",
    "from_torch",
    "in_tree_blockers",
    "load_for_inference",
    "to_hf",
]
