"""Byte-level BPE tokenizer training with `tokenizers`, returned as a transformers fast tokenizer.

Byte-level means every string is encodable (the 256 byte symbols are the initial alphabet), so no `<unk>` appears at
run time. The tokenizer prepends `<s>` to every sequence; training code appends `</s>` between packed documents.
"""

import logging
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad, bos, eos as TfmConfig's defaults


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`; `<pad>`, `<s>`, `</s>`, `<unk>`, `<mask>` get ids 0-4."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for byte-level BPE")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=model_max_length,
    )
    logger.info("trained a byte-level BPE tokenizer with %d tokens", len(fast))
    return fast


__all__ = ["SPECIAL_TOKENS", "train_bpe_tokenizer"]
