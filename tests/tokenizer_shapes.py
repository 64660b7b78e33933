"""Small tokenizers in the shapes real models ship, trained with `tokenizers` on a few standard-library files (nothing
is downloaded): what the GGUF tokenizer tests export (tests/test_export_gguf.py, tests/test_export_llama_cpp.py).

Each is built as the model family's tokenizer.json is (the recipes of /work/shared/tokenizer_notes.md, §6) and
returned as a transformers fast tokenizer with its special tokens named; `build` caches them per process.
"""

import functools
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from hf_tfm.exporters.gguf_vocab import SPLITS

CACHE = Path(os.environ.get("HF_TFM_CACHE", Path.home() / ".cache" / "hf_tfm")) / "tokenizer-fixtures"
MISTRAL_COMMON = "mistral-common==1.13.1"  # its wheel ships Mistral 7B v0.1's tokenizer.model (Apache-2.0)
VOCAB = 600  # a vocabulary of a few hundred merges: fast to train, every shape's rules exercised
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# byte-level shape -> (pre-tokenizer steps, BPE ignore_merges, normalizer), as each family's tokenizer.json has them
BYTE_LEVEL = {
    "gpt-2": ([pre_tokenizers.ByteLevel(add_prefix_space=False)], False, None),
    "starcoder": (
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
        False,
        None,
    ),
    "llama-bpe": ("llama3", True, None),
    "smaug-bpe": ("llama3", False, None),
    "qwen2": ("qwen2", False, normalizers.NFC()),
    "qwen35": ("qwen35", False, normalizers.NFC()),
    "gpt-4o": ("gpt-4o", False, None),
    "tekken": ("tekken", True, None),
}
# SentencePiece-shaped BPE -> (normalizer, pre-tokenizer): Llama 2's legacy tokenizer.json, transformers 5's conversion
# of a .model (Metaspace), one without the prefix space, and Gemma's (spaces replaced, no prefix, a no-op split)
META = "\u2581"
SENTENCEPIECE = {
    "legacy": (normalizers.Sequence([normalizers.Prepend(META), normalizers.Replace(" ", META)]), None),
    "metaspace": (None, pre_tokenizers.Metaspace(replacement=META, prepend_scheme="first", split=False)),
    "never": (None, pre_tokenizers.Metaspace(replacement=META, prepend_scheme="never", split=False)),
    "gemma": (normalizers.Replace(" ", META), pre_tokenizers.Split(" ", behavior="merged_with_previous")),
}


@functools.cache
def training_texts(files: int = 12, chars: int = 20000) -> tuple[str, ...]:
    """The first `chars` characters of the first `files` standard-library modules (sorted by name)."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:files]
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            texts.append(file.read(chars))
    return tuple(texts)


@functools.cache
def held_out_texts(count: int = 60) -> tuple[str, ...]:
    """Six-line chunks of other standard-library modules than the training ones: more code to compare on."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[40:]
    chunks = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines(keepends=True)
        chunks += ["".join(lines[i : i + 6]) for i in range(0, min(len(lines), 60), 30)]
        if len(chunks) >= count:
            break
    return tuple(chunks[:count])


def _fast(tokenizer: Tokenizer, **special: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def byte_level(pre: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE with the pre-tokenizer llama.cpp calls `pre`: GPT-2's (adds nothing), Llama 3's (adds
    <|begin_of_text|>), Qwen2's (NFC, a ChatML template), ..."""
    steps, ignore_merges, normalizer = BYTE_LEVEL[pre]
    if isinstance(steps, str):
        steps = [
            pre_tokenizers.Split(Regex(SPLITS[steps]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    llama3 = pre in ("llama-bpe", "smaug-bpe")
    qwen = pre.startswith("qwen")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] if llama3 else ["<|endoftext|>"]
    specials += ["<|im_start|>", "<|im_end|>"] if qwen else []
    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)  # GPT-2's: one
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(training_texts(), trainer)
    if llama3:
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
        )
        return _fast(tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    if qwen:
        fast = _fast(tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        fast.chat_template = CHATML
        return fast
    return _fast(tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def sentencepiece(scheme: str = "legacy", byte_tokens: int = 256) -> PreTrainedTokenizerFast:
    """SentencePiece-shaped BPE with byte fallback, as Llama 2 / Mistral / Gemma tokenizer.json files are: <unk>, <s>,
    </s>, then the `byte_tokens` first <0xXX> tokens, then the merged pieces; spaces spelled ▁
    (`SENTENCEPIECE[scheme]`) and <s> added before the text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META, prepend_scheme="always", split=True)
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 256, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(training_texts(), trainer)
    spec = json.loads(tokenizer.to_str())
    # The byte tokens go at ids 3-258, as in Llama 2's vocabulary; the learned pieces after them
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])[len(specials) :]
    order = specials + [f"<0x{b:02X}>" for b in range(byte_tokens)] + [token for token, _ in learned]
    spec["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    normalizer, pre = SENTENCEPIECE[scheme]
    spec["normalizer"] = json.loads(normalizer.__getstate__()) if normalizer else None
    spec["pre_tokenizer"] = json.loads(pre.__getstate__()) if pre else None
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    strip = [decoders.Strip(" ", 1, 0)] if scheme in ("legacy", "metaspace") else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(META, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return _fast(tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordpiece(lowercase: bool = True) -> PreTrainedTokenizerFast:
    """BERT's WordPiece: BertNormalizer (lowercasing or cased), BertPreTokenizer, [CLS] ... [SEP] around the text."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(training_texts(), trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    names = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    return _fast(tokenizer, **dict(zip(names, specials, strict=True)))


def unigram() -> PreTrainedTokenizerFast:
    """A SentencePiece Unigram (T5's shape): what llama.cpp's t5 vocabulary is not written from here."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META, prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tokenizer.train_from_iterator(training_texts(files=3), trainer)
    return _fast(tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


SHAPES = {
    **{f"bpe-{pre}": functools.partial(byte_level, pre) for pre in BYTE_LEVEL},
    **{f"spm-{scheme}": functools.partial(sentencepiece, scheme) for scheme in SENTENCEPIECE},
    "bert-uncased": functools.partial(wordpiece, True),
    "bert-cased": functools.partial(wordpiece, False),
}


@functools.cache
def build(shape: str) -> PreTrainedTokenizerFast:
    """The tokenizer of `shape` (a `SHAPES` key), trained once per process."""
    return SHAPES[shape]()


def mistral_tokenizer_model() -> Path:
    """Mistral 7B v0.1's SentencePiece model (32000 pieces, BPE with byte fallback: Llama 2's shape), from the
    mistral-common wheel, fetched with pip once and kept under ~/.cache/hf_tfm; `RuntimeError` with a one-line reason
    when the registry cannot be reached."""
    target = CACHE / MISTRAL_COMMON.replace("==", "-") / "tokenizer.model"
    if target.is_file():
        return target
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([*command, "-d", tmp, MISTRAL_COMMON], check=True, capture_output=True, timeout=300)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
            raise RuntimeError(f"{MISTRAL_COMMON} could not be downloaded ({type(err).__name__})") from err
        (wheel,) = Path(tmp).glob("mistral_common-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read("mistral_common/data/tokenizer.model.v1")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, target)  # whole or not at all
    return target
