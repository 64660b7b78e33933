"""Tokenizers for new models: byte-level BPE trained with `tokenizers`, or an existing one loaded from a folder or a
`tokenizer.json` file, as a transformers tokenizer.

Byte-level means every string is encodable (the 256 byte symbols are the initial alphabet), so no `<unk>` appears at
run time. The trained tokenizer prepends `<s>` to every sequence; training code appends `</s>` between packed
documents.
"""

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad, bos, eos as TfmConfig's defaults

# A folder holding a tokenizer has one of these (transformers' fast, sentencepiece and vocabulary formats).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)

# A bare tokenizer.json names no roles (transformers keeps them in tokenizer_config.json), only which added tokens are
# special: each role goes to the first of its usual names that is one of them (GPT-2's <|endoftext|> is both ends).
ROLE_NAMES = {
    "bos_token": ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "<|endoftext|>"),
    "eos_token": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[EOS]"),
    "pad_token": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
    "unk_token": ("<unk>", "[UNK]", "<|unk|>"),
    "mask_token": ("<mask>", "[MASK]"),
}


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


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """An existing tokenizer: from a folder (`AutoTokenizer`, with the special tokens its config names), or from a
    `tokenizers` `tokenizer.json` file, whose special tokens take the roles their names say (`ROLE_NAMES`: `<s>`,
    `</s>`, `<pad>`, ...; a role none of them names stays unset).

    `trust_remote_code`: run a tokenizer class the folder ships (transformers' flag). Raises `FileNotFoundError` for a
    path that does not exist and `ValueError` for a folder without a tokenizer or a file that is not one.
    """
    path = Path(path)
    if path.is_file():
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot read as a tokenizer
            raise ValueError(f"{path} is not a tokenizer.json file of the tokenizers library ({err})") from err
        special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
        roles = {role: next((n for n in names if n in special), None) for role, names in ROLE_NAMES.items()}
        return PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in roles.items() if v is not None})
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such tokenizer folder or tokenizer.json file")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def vocab_size_of(tokenizer: PreTrainedTokenizerBase) -> int:
    """The embedding rows a model needs for `tokenizer`: one for each id up to its largest, added tokens included (a
    vocabulary with gaps in its ids needs more rows than it has tokens)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


__all__ = ["ROLE_NAMES", "SPECIAL_TOKENS", "TOKENIZER_FILES", "load_tokenizer", "train_bpe_tokenizer", "vocab_size_of"]
