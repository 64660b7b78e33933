"""transformers' own common model tests against hf_tfm: every suite an in-tree model passes, built the way an in-tree
`tests/models/x/test_modeling_x.py` builds them (a model tester with tiny sizes, `ModelTesterMixin`, `ConfigTester`).

Suites: a decoder and an encoder per position scheme, a mixture-of-experts decoder, and three encoder-decoders (BART-
like, the original Transformer, a modern pre-norm RMSNorm/SwiGLU/RoPE one). The tests come from the installed
release's sdist (`transformers_tests.load`); without it the module skips in one line. Skips are listed in `SKIPS`,
each with a reason that holds for hf_tfm itself, checked by `test_skip_reasons_hold`.
"""

import unittest
from unittest.mock import patch

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers_tests import load

from hf_tfm import (
    TfmConfig,
    TfmForCausalLM,
    TfmForConditionalGeneration,
    TfmForMaskedLM,
    TfmForQuestionAnswering,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmModel,
    TfmSeq2SeqConfig,
    TfmSeq2SeqModel,
)

try:
    modeling_common, configuration_common = load()
except RuntimeError as err:
    pytest.skip(str(err), allow_module_level=True)

ModelTesterMixin = modeling_common.ModelTesterMixin
ConfigTester = configuration_common.ConfigTester
ids_tensor = modeling_common.ids_tensor
GenerationTesterMixin = modeling_common.GenerationTesterMixin


def dense(knobs: dict) -> bool:
    return "num_experts" not in knobs


# Every skip, with a reason that holds for hf_tfm itself (`test_skip_reasons_hold` checks it): test name (or its start,
# for parameterized tests) -> (the suites it applies to, by their knobs; reason). hf_tfm's one modeling file covers
# every variant, where transformers' mixin tells some variants apart by the source text of the class.
SKIPS = {
    "test_eager_matches_batched_and_grouped_inference": (
        dense,
        "a dense configuration builds no experts module, so there is no experts implementation to run batched or "
        "grouped (the mixin decides by class, and hf_tfm's classes serve dense and expert configurations alike; it "
        "skips in-tree dense classes, which cannot set an experts implementation)",
    ),
}

# The in-tree testers' sizes (LlamaModelTester, BertModelTester, BartModelTester): batch 13, 7 tokens, vocabulary
# 99, width 32, 2 layers, 4 heads.
SIZES = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class TfmModelTester:
    """Tiny configs and inputs for one hf_tfm configuration (an in-tree `ModelTester`'s interface)."""

    batch_size = 13
    seq_length = 7
    is_training = True
    num_labels = 3

    def __init__(self, parent: unittest.TestCase, knobs: dict) -> None:
        self.parent = parent
        self.knobs = knobs
        self.vocab_size = SIZES["vocab_size"]
        self.hidden_size = SIZES["hidden_size"]
        self.num_hidden_layers = SIZES["num_hidden_layers"]
        self.num_attention_heads = knobs.get("num_attention_heads", SIZES["num_attention_heads"])
        self.pad_token_id = SIZES["pad_token_id"]

    def get_config(self) -> TfmConfig:
        return TfmConfig(**{**SIZES, "num_labels": self.num_labels, **self.knobs})

    def prepare_config_and_inputs_for_common(self) -> tuple[TfmConfig, dict]:
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # Left padding on some rows (the masks, positions and pooling have to handle it), never a fully masked row.
        attention_mask = torch.ones_like(input_ids)
        attention_mask[: self.batch_size // 2, :2] = 0
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class TfmSeq2SeqModelTester(TfmModelTester):
    """Tiny encoder-decoder configs and inputs (BartModelTester's interface)."""

    def __init__(self, parent: unittest.TestCase, knobs: dict) -> None:
        super().__init__(parent, knobs)
        self.encoder_seq_length = self.decoder_seq_length = self.seq_length

    def get_config(self) -> TfmSeq2SeqConfig:
        side = {**SIZES, **self.knobs}
        return TfmSeq2SeqConfig(encoder=side, decoder=dict(side), num_labels=self.num_labels)

    def prepare_config_and_inputs_for_common(self) -> tuple[TfmSeq2SeqConfig, dict]:
        config, inputs = super().prepare_config_and_inputs_for_common()
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return config, {**inputs, "decoder_input_ids": decoder_input_ids}


class TfmCommonTests(ModelTesterMixin):
    """The mixin's tests for one configuration; subclasses name the knobs and the classes."""

    knobs: dict = {}
    model_tester_class = TfmModelTester
    config_class = TfmConfig

    def setUp(self) -> None:
        self.model_tester = self.model_tester_class(self, self.knobs)
        self.config_tester = ConfigTester(self, config_class=self.config_class, **SIZES)
        for name, (applies, reason) in SKIPS.items():
            if self._testMethodName.startswith(name) and applies(self.knobs):
                self.skipTest(reason)
        # The mixin tells heads apart by transformers' own Auto mappings (base models have no loss, which labels a
        # head takes), where every in-tree model is listed; hf_tfm's classes are listed there for the test's length.
        for mapping, names in AUTO_NAMES.items():
            patcher = patch.dict(getattr(modeling_auto, mapping), names)
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_config(self) -> None:
        self.config_tester.run_common_tests()


# hf_tfm's entries in transformers' Auto name mappings (model_type -> class name), as an in-tree model has them.
AUTO_NAMES = {
    "MODEL_MAPPING_NAMES": {"hf_tfm": "TfmModel", "hf_tfm_seq2seq": "TfmSeq2SeqModel"},
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {"hf_tfm": "TfmForCausalLM"},
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": {"hf_tfm": "TfmForMaskedLM"},
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": {"hf_tfm": "TfmForSequenceClassification"},
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": {"hf_tfm": "TfmForTokenClassification"},
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": {"hf_tfm": "TfmForQuestionAnswering"},
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": {"hf_tfm_seq2seq": "TfmForConditionalGeneration"},
}

DECODER_CLASSES = (
    TfmModel,
    TfmForCausalLM,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmForQuestionAnswering,
)
ENCODER_CLASSES = (
    TfmModel,
    TfmForMaskedLM,
    TfmForSequenceClassification,
    TfmForTokenClassification,
    TfmForQuestionAnswering,
)


class DecoderRopeTest(TfmCommonTests, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = DECODER_CLASSES
    knobs = {"num_key_value_heads": 2}  # Llama: RoPE, RMSNorm, SwiGLU, GQA


class DecoderAlibiTest(TfmCommonTests, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = DECODER_CLASSES
    knobs = {"position_embedding_type": "alibi", "norm_type": "layernorm", "ffn_type": "mlp", "hidden_act": "gelu"}


class DecoderLearnedTest(TfmCommonTests, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = DECODER_CLASSES
    knobs = {"position_embedding_type": "learned", "norm_type": "layernorm", "ffn_type": "mlp", "hidden_act": "gelu"}


class DecoderSinusoidalTest(TfmCommonTests, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = DECODER_CLASSES
    knobs = {"position_embedding_type": "sinusoidal", "norm_position": "post", "ffn_type": "mlp"}


class DecoderMoeTest(TfmCommonTests, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = DECODER_CLASSES
    knobs = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_key_value_heads": 2}
    test_all_params_have_gradient = False  # as Mixtral's: a tiny batch may route no token to some expert


class EncoderRopeTest(TfmCommonTests, unittest.TestCase):
    all_model_classes = ENCODER_CLASSES
    knobs = {"is_causal": False}


class EncoderAlibiTest(TfmCommonTests, unittest.TestCase):
    all_model_classes = ENCODER_CLASSES
    knobs = {"is_causal": False, "position_embedding_type": "alibi"}


class EncoderLearnedTest(TfmCommonTests, unittest.TestCase):
    all_model_classes = ENCODER_CLASSES
    knobs = {  # BERT
        "is_causal": False,
        "position_embedding_type": "learned",
        "norm_type": "layernorm",
        "norm_position": "post",
        "ffn_type": "mlp",
        "hidden_act": "gelu",
        "type_vocab_size": 2,
        "embedding_norm": True,
        "attention_bias": True,
        "mlp_bias": True,
    }


class EncoderSinusoidalTest(TfmCommonTests, unittest.TestCase):
    all_model_classes = ENCODER_CLASSES
    knobs = {"is_causal": False, "position_embedding_type": "sinusoidal"}


class Seq2SeqTests(TfmCommonTests):
    all_model_classes = (TfmSeq2SeqModel, TfmForConditionalGeneration)
    model_tester_class = TfmSeq2SeqModelTester
    config_class = TfmSeq2SeqConfig
    is_encoder_decoder = True

    def setUp(self) -> None:
        super().setUp()
        self.config_tester = ConfigTester(
            self,
            config_class=TfmSeq2SeqConfig,
            common_properties=["hidden_size", "num_attention_heads", "num_hidden_layers"],
        )


class Seq2SeqBartTest(Seq2SeqTests, GenerationTesterMixin, unittest.TestCase):
    knobs = {
        "position_embedding_type": "learned",
        "position_offset": 2,
        "norm_type": "layernorm",
        "norm_position": "post",
        "embedding_norm": True,
        "ffn_type": "mlp",
        "hidden_act": "gelu",
        "attention_bias": True,
        "mlp_bias": True,
    }


class Seq2SeqTransformerTest(Seq2SeqTests, GenerationTesterMixin, unittest.TestCase):
    knobs = {  # "Attention Is All You Need"
        "position_embedding_type": "sinusoidal",
        "norm_type": "layernorm",
        "norm_position": "post",
        "ffn_type": "mlp",
        "hidden_act": "relu",
        "attention_bias": True,
        "mlp_bias": True,
    }


class Seq2SeqModernTest(Seq2SeqTests, GenerationTesterMixin, unittest.TestCase):
    knobs = {"num_key_value_heads": 2}


def test_suites_ran_on_this_release() -> None:
    """The sdist's tests are the installed release's own (a stale cache of another release would test another)."""
    assert modeling_common.__file__.split("/")[-3] == transformers.__version__


@pytest.mark.parametrize("suite", [DecoderRopeTest, DecoderAlibiTest, EncoderLearnedTest, Seq2SeqBartTest])
def test_skip_reasons_hold(suite) -> None:
    """`SKIPS`' reason is true of hf_tfm: a dense configuration builds no experts module in any class, so the mixin's
    mocked experts implementation would have nothing to run; the mixin's own check, by class source, cannot tell."""
    from hf_tfm.modeling import TfmExperts

    tester = suite("test_config")  # a unittest case needs a method name to exist
    tester.model_tester = tester.model_tester_class(tester, suite.knobs)
    config, _ = tester.model_tester.prepare_config_and_inputs_for_common()
    assert dense(suite.knobs) and suite.all_model_classes[0]._can_set_experts_implementation()
    for model_class in suite.all_model_classes:
        model = model_class(config)
        assert not [name for name, module in model.named_modules() if isinstance(module, TfmExperts)]
    moe = DecoderMoeTest("test_config")  # the control: the suite with experts builds them
    moe.model_tester = moe.model_tester_class(moe, DecoderMoeTest.knobs)
    moe_config, _ = moe.model_tester.prepare_config_and_inputs_for_common()
    assert any(isinstance(module, TfmExperts) for module in TfmForCausalLM(moe_config).modules())
