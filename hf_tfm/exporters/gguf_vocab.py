"""A tokenizer as a llama.cpp vocabulary (GGUF `tokenizer.ggml.*`), or a `ValueError` saying why it cannot be one.

llama.cpp tokenizes with its own code, one tokenizer per vocabulary type, configured only by the keys written here: a
tokenizer.json's normalizer and pre-tokenizer do not travel. So a tokenizer goes in only in a shape for which
llama.cpp's tokenizer gives its ids:

* `gpt2` (byte-level BPE) with the pre-tokenizer llama.cpp names (`tokenizer.ggml.pre`), recognised from the
  tokenizer.json structure: GPT-2's `ByteLevel(use_regex=True)` -> `gpt-2`; `Digits(individual)` + that ->
  `starcoder`; a `Split` whose regex is exactly one llama.cpp knows (`SPLITS`) + `ByteLevel(use_regex=False)` ->
  `llama-bpe` (Llama 3, with `ignore_merges`), `qwen2`, ... llama.cpp's converter identifies the pre-tokenizer by a
  hash of token ids, which no retrained vocabulary matches, so the name is written here.
* `llama` (SentencePiece-shaped BPE with byte fallback: Llama 2, Mistral, Gemma): llama.cpp merges the adjacent pair
  whose concatenation has the highest score, so each token's score is minus the rank of the first merge that makes it
  (flat scores make it greedy: 89 of 876 texts right). All 256 `<0xXX>` tokens are required: without them llama.cpp
  terminates the process on the first character outside the vocabulary.
* `bert` (WordPiece): llama.cpp's "phantom space" vocabulary (`▁` before each word-initial piece, `##` dropped), its
  special ids and whether it lowercases (llama.cpp lowercases unless told not to).

Everything else (Unigram, another pre-tokenizer or regex, a BPE without byte fallback, normalizers llama.cpp does not
apply) is refused with the reason. Special ids, add_bos/add_eos and the chat template come from the tokenizer; the
model's config only fills the ids the tokenizer does not name, so llama.cpp's per-type defaults (gpt2: BOS = EOS = 11)
never decide.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.utils import logging

from ..programs import run_program

logger = logging.get_logger(__name__)

RUNTIME = "llama.cpp"
# The Split regexes llama.cpp implements, as tokenizer.json spells them (llama-vocab.cpp keeps each original in a
# comment beside its rewrite; transformers' tokenizers define the same strings).
SPLITS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# (pre-tokenizer steps, BPE ignore_merges) -> llama.cpp's `tokenizer.ggml.pre`. Each name's regexes and its
# ignore_merges flag are llama.cpp's (llama-vocab.cpp `llm_tokenizer_bpe` and `load`): llama-bpe and tekken look whole
# words up before merging, the others do not.
BYTE_LEVEL_PRE = {
    (("ByteLevel(regex)",), False): "gpt-2",
    (("Digits(individual)", "ByteLevel(regex)"), False): "starcoder",
    (("Split(llama3)", "ByteLevel"), True): "llama-bpe",
    (("Split(llama3)", "ByteLevel"), False): "smaug-bpe",
    (("Split(qwen2)", "ByteLevel"), False): "qwen2",
    (("Split(qwen35)", "ByteLevel"), False): "qwen35",
    (("Split(gpt-4o)", "ByteLevel"), False): "gpt-4o",
    (("Split(tekken)", "ByteLevel"), True): "tekken",
}
# Qwen2's tokenizers compose text to NFC first; llama.cpp does not, so text that is not already NFC (decomposed
# accents) tokenizes differently there. Their vocabularies are still written, as llama.cpp's converter writes them.
NFC_PRE = ("qwen2", "qwen35")
SPECIALS = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")
METASPACE = "\u2581"  # SentencePiece's visible space, which WordPiece's phantom-space vocabulary borrows
# A score below every merge's: tokens no merge makes (characters, bytes, added tokens) are never a better pair
UNMERGED_SCORE = -1e9
PROBE = "Hello world"  # add_bos / add_eos are read from the ids the post-processor puts around this text
# gguf.TokenType values (kept here so the shape checks need no gguf import)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# What `verify_gguf` tokenizes with both tokenizers: code, whitespace runs, digits, mixed case, several scripts
TEXTS = (
    'import os\nimport sys\n\n\nclass Config:\n    """Return the settings."""\n\n    def __init__(self, path=None):\n'
    "        self.path = path or os.getcwd()\n        self._cache = {}  # filled lazily\n\n"
    "    def get(self, key, default=None):\n        if key not in self._cache:\n"
    "            self._cache[key] = os.environ.get(key.upper(), default)\n        return self._cache[key]\n",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n\n\n"
    "print(f\"{fib(30)=}\", end='\\n')\nassert fib(10) == 55, 'fib(10) should be 55'\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];  // dot product\n}\nreturn sum >= 0 ? sum : -sum;\n",
    '{"name": "hf_tfm", "version": "0.1.0", "sizes": [64, 128, 256], "ok": true, "none": null}',
    '<div class="note">&amp; 5 &lt; 6 &gt; 4</div>\n<a href="https://example.com/a/b?c=1&d=2#top">link</a>',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY id DESC LIMIT 10;",
    "3.14159 2.71828 1e-10 6.022e23 -42 +7 0x1F 0b1011 0o17 1_000_000 100,000,000.00",
    "2026-12-05T07:53:20Z 12:30 +1 (555) 123-4567 v1.2.3 192.168.0.1 99% $1,234.56 \u20ac78,90",
    "1234567890 12345678901234567890 007 2024 19 8 1 22 333 4444 55555",
    "a  b   c    d     e\t\tf\n\n\ng\r\nh \n i   \n\n   j",
    "    leading spaces and trailing spaces    ",
    " one leading space",
    "\ttab first, then spaces" + " " * 40 + "x" + " " * 17 + "end",
    "I'm sure you're right: WE'LL see, it'S fine, don't 'quote' me, they'd've, O'Neill's",
    "HTTPServer getHTTPResponseCode camelCase snake_case SCREAMING_CASE kebab-case PascalCase iPhone McDonald",
    "!!! ??? ... --- *** ### @@@ ~~~ ``` ''' \"\"\" ((())) [[[]]] {{{}}} <<<>>> ;;; ::: ,,, ___",
    "na\u00efve caf\u00e9 r\u00e9sum\u00e9 \u00dcn\u00efc\u00f6d\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m se\u00f1or "
    "Stra\u00dfe \u0153uvre",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 "
    "\u03ba\u03cc\u03c3\u03bc\u03b5. \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd. "
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u4e2d\u6587\u6587\u672c\u3002"
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8. \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e "
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u1780\u17d2\u179a\u17bb\u1798\u17a0\u17ca\u17bb\u1793",
    "emoji \U0001f999\U0001f680 \U0001f469\u200d\U0001f4bb \u2713 \u2605 \u2764\ufe0f \U0001f1eb\U0001f1f7 "
    "math \u2211\u222b\u221a\u221e\u2260\u2264 \u00bd \u00b2 \u2153 \u2160\u2161\u2162",
    "full\u3000width\u3000space, no\u00a0break\u00a0space, zero\u200bwidth, soft\u00adhyphen",
    "decomposed: cafe\u0301 nai\u0308ve A\u030angstro\u0308m",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the quick brown fox?",
    "total:    42\n    100 items\n\t\t7 days,   365 days,  12:00\nx=1;y  =  22;z   =333",
    "# Title\n\n- item one\n- item two\n  - nested item\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n> a quote\n\n"
    "```python\nprint('hi')\n```\n",
    "grep -E '^[a-z]+\\d{2,}$' file.txt | sort -u > out.log 2>&1 && echo \"done: $?\" # exit code\n"
    'export PATH="$HOME/.local/bin:$PATH"; ls -la ~/projects/*.py',
    "Tokenizers split text into pieces before merging them. A byte-level vocabulary can encode any string, while a "
    "WordPiece vocabulary marks pieces that continue a word. Il \u00e9tait une fois, dans un pays lointain... "
    "\u00bfD\u00f3nde est\u00e1 la biblioteca? Die Stra\u00dfe hei\u00dft \u201eHauptstra\u00dfe\u201c, oder?",
    "    return {k: v for k, v in sorted(items.items(), key=lambda kv: (-kv[1], kv[0])) if v is not None}\n"
    "\n\n\n\n        # deeply indented comment after blank lines\n",
)


@dataclass
class Vocabulary:
    """What `write_vocabulary` writes: llama.cpp's tokenizer type and pre-tokenizer, the tokens (padded to the model's
    vocab_size with unused ones), their types and (SentencePiece) scores, the BPE merges, special ids and flags."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool | None = None
    add_space_prefix: bool | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None
    chat_template: Any = None


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(source: str | os.PathLike | None, tokenizer: Any) -> tuple[Any, str]:
    """The fast tokenizer to embed and where it came from: `tokenizer` (a fast tokenizer, its folder or its
    tokenizer.json), else the model folder `source`'s. Loaded as transformers loads it, so the vocabulary written is
    the one `AutoTokenizer` users tokenize with (and `verify_gguf` compares against)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise ValueError(f"GGUF embeds a fast (tokenizers) tokenizer, not {type(tokenizer).__name__}.")
        return tokenizer, type(tokenizer).__name__
    location = tokenizer if tokenizer is not None else source
    path = Path(location) if location else None
    if path is not None and path.is_file():  # a tokenizer.json
        return PreTrainedTokenizerFast(tokenizer_file=str(path)), str(path)
    if path is not None and any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        # installed code only (a folder's own tokenizer class is refused, never prompted for); a tokenizer.model alone
        # is converted as transformers converts it
        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        if not hasattr(loaded, "backend_tokenizer"):
            raise ValueError(f"{path}: GGUF embeds a fast (tokenizers) tokenizer, not {type(loaded).__name__}.")
        return loaded, str(path)
    raise ValueError(
        "GGUF embeds the tokenizer: no tokenizer.json found"
        + (f" in {location}" if location else "")
        + "; pass `tokenizer=` (a tokenizer, its folder or its tokenizer.json)."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Shapes


def gguf_vocabulary(tokenizer: Any, config: Any, where: str) -> Vocabulary:
    """`tokenizer` (a fast tokenizer) as the llama.cpp vocabulary that tokenizes as it does, padded to
    `config.vocab_size`; a `ValueError` naming the reason when llama.cpp has none."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE" and _is_byte_level(spec):
        vocab = _byte_level_vocabulary(spec, config, where)
    elif kind == "BPE":
        vocab = _sentencepiece_vocabulary(spec, config, where)
    elif kind == "WordPiece":
        vocab = _wordpiece_vocabulary(spec, config, where)
    elif kind == "Unigram":
        raise ValueError(
            f"{where}: a Unigram tokenizer. llama.cpp's Unigram vocabulary (`t5`) is written from a SentencePiece "
            "model (its scores with its normalization rules and precompiled_charsmap, whitespace handling included), "
            "which a tokenizer.json does not carry exactly; not written."
        )
    else:
        raise ValueError(f"{where}: a {kind} tokenizer model; {RUNTIME} has no vocabulary for it.")
    _set_specials(vocab, tokenizer, config, where)
    _check_unique(vocab.tokens, where)
    return vocab


def _steps(node: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer as its list of steps (a Sequence flattened; none: [])."""
    if not node:
        return []
    if node.get("type") != "Sequence":
        return [node]
    items = node.get("pretokenizers", node.get("normalizers", []))
    return [step for item in items for step in _steps(item)]


def _is_byte_level(spec: dict) -> bool:
    return any(step.get("type") == "ByteLevel" for step in _steps(spec.get("pre_tokenizer")))


def _base_tokens(spec: dict, config: Any, where: str) -> tuple[list[str], list[int], dict[str, int]]:
    """Tokens by id (model vocabulary, then added tokens over it), padded to vocab_size with `[PADi]` UNUSED ones;
    their types (added: CONTROL when special, else USER_DEFINED; the rest NORMAL); and the vocabulary."""
    model = spec["model"]
    vocab = dict(model["vocab"]) if isinstance(model["vocab"], dict) else {}
    added = {token["content"]: token for token in spec.get("added_tokens", [])}
    vocab.update({content: token["id"] for content, token in added.items()})
    if max(vocab.values()) >= config.vocab_size:
        raise ValueError(
            f"{where}: token id {max(vocab.values())} is outside the model's vocab_size {config.vocab_size}."
        )
    # llama.cpp needs every string once: a padding name the tokenizer already uses gets underscores
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    tokens = [
        name if name not in vocab else name + "_" * (1 + sum(n.startswith(name) for n in vocab)) for name in tokens
    ]
    types = [UNUSED] * config.vocab_size
    for token, token_id in vocab.items():
        tokens[token_id] = token
        types[token_id] = (CONTROL if added[token].get("special") else USER_DEFINED) if token in added else NORMAL
    return tokens, types, vocab


def _merges(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def _check_bpe_options(model: dict, where: str) -> None:
    """BPE options llama.cpp's tokenizers have no form of."""
    if model.get("dropout"):
        raise ValueError(f"{where}: BPE dropout={model['dropout']} (random merges); {RUNTIME} merges the same always.")
    for option in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            raise ValueError(f"{where}: BPE {option}={model[option]!r}; {RUNTIME}'s BPE vocabularies have none.")


def _step_name(step: dict, where: str) -> str:
    """A pre-tokenizer step as `BYTE_LEVEL_PRE` names it, or a `ValueError` for one llama.cpp has no form of."""
    kind = step.get("type")
    if kind == "ByteLevel":
        if step.get("add_prefix_space"):
            raise ValueError(
                f"{where}: ByteLevel(add_prefix_space=True) puts a space before the text; {RUNTIME}'s gpt2 vocabulary "
                "never does."
            )
        return "ByteLevel(regex)" if step.get("use_regex", True) else "ByteLevel"
    if kind == "Digits" and step.get("individual_digits"):
        return "Digits(individual)"
    if kind == "Split":
        pattern = step.get("pattern", {}).get("Regex")
        name = next((name for name, regex in SPLITS.items() if regex == pattern), None)
        if name is None or step.get("behavior") != "Isolated" or step.get("invert"):
            raise ValueError(
                f"{where}: pre-tokenizer Split({pattern or step.get('pattern')!r}, {step.get('behavior')}) is not one "
                f"of the regexes {RUNTIME} implements (its Split patterns: {', '.join(SPLITS)}), so {RUNTIME} would "
                "split text differently."
            )
        return f"Split({name})"
    raise ValueError(f"{where}: pre-tokenizer step {json.dumps(step)} has no {RUNTIME} form.")


def _byte_level_vocabulary(spec: dict, config: Any, where: str) -> Vocabulary:
    """Byte-level BPE as llama.cpp's `gpt2` vocabulary: the tokens in their byte-alphabet spelling, the merges, and
    the pre-tokenizer llama.cpp names for the tokenizer.json's."""
    model = spec["model"]
    _check_bpe_options(model, where)
    steps = tuple(_step_name(step, where) for step in _steps(spec.get("pre_tokenizer")))
    ignore_merges = bool(model.get("ignore_merges"))
    pre = BYTE_LEVEL_PRE.get((steps, ignore_merges))
    if pre is None:
        other = BYTE_LEVEL_PRE.get((steps, not ignore_merges))
        if other is not None:
            raise ValueError(
                f"{where}: BPE ignore_merges={ignore_merges} with the {' + '.join(steps)} pre-tokenizer; {RUNTIME}'s "
                f"'{other}' pre-tokenizer has ignore_merges={not ignore_merges} (whole words looked up before "
                "merging or not), so it would tokenize differently."
            )
        raise ValueError(
            f"{where}: byte-level BPE with the pre-tokenizer {' + '.join(steps)}, which none of {RUNTIME}'s "
            f"pre-tokenizers matches (written: {sorted(set(BYTE_LEVEL_PRE.values()))})."
        )
    normalizers = [step.get("type") for step in _steps(spec.get("normalizer"))]
    if normalizers and not (normalizers == ["NFC"] and pre in NFC_PRE):
        raise ValueError(
            f"{where}: normalizer {' + '.join(normalizers)}; {RUNTIME} applies no normalizer to a BPE vocabulary, so "
            "its ids would differ on any text the normalizer changes."
        )
    if normalizers:
        logger.info("%s: llama.cpp does not apply its NFC normalizer (text not in NFC tokenizes differently)", where)
    tokens, types, _ = _base_tokens(spec, config, where)
    merges = [" ".join(pair) for pair in _merges(model)]
    return Vocabulary(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges)


def _sentencepiece_space_prefix(spec: dict, where: str) -> bool:
    """Whether a SentencePiece-shaped tokenizer.json puts a `▁` before the text (llama.cpp's add_space_prefix), from
    the two shapes that spell spaces as `▁`: the normalizer Replace(" ", "▁") [+ Prepend("▁")] with no pre-tokenizer
    (Llama 2's legacy file; Gemma's, whose split at spaces after it is a no-op), or Metaspace(split=False) alone.
    llama.cpp prepends always, also before text that starts with a space; Metaspace does not there (a known
    difference on such texts)."""
    normalizers, pres = _steps(spec.get("normalizer")), _steps(spec.get("pre_tokenizer"))
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
    prepend = {"type": "Prepend", "prepend": METASPACE}
    if replace in normalizers and all(step in (replace, prepend) for step in normalizers):
        no_op = {"type": "Split", "pattern": {"String": " "}}  # no space is left to split at
        if all(no_op.items() <= step.items() for step in pres):
            return prepend in normalizers
    if len(pres) == 1 and pres[0].get("type") == "Metaspace" and not normalizers:
        meta = pres[0]
        if meta.get("split", True):
            raise ValueError(
                f"{where}: Metaspace(split=True) cuts the text at every space; {RUNTIME}'s SentencePiece tokenizer "
                "merges across them."
            )
        if meta.get("replacement") != METASPACE:
            raise ValueError(f"{where}: Metaspace(replacement={meta.get('replacement')!r}); {RUNTIME} uses '▁'.")
        return meta.get("prepend_scheme", "always") != "never"
    described = " + ".join(step.get("type", "?") for step in normalizers + pres) or "none"
    raise ValueError(
        f"{where}: a BPE tokenizer that is neither byte-level nor SentencePiece-shaped (normalizer/pre-tokenizer: "
        f"{described}); {RUNTIME} has a vocabulary for byte-level BPE (gpt2) and for SentencePiece BPE with spaces "
        "spelled '▁' and byte fallback (llama)."
    )


def _sentencepiece_vocabulary(spec: dict, config: Any, where: str) -> Vocabulary:
    """SentencePiece-shaped BPE as llama.cpp's `llama` vocabulary: scores from the merge ranks, byte tokens typed BYTE
    (the unknown token is typed UNKNOWN with the special ids)."""
    model = spec["model"]
    _check_bpe_options(model, where)
    add_space_prefix = _sentencepiece_space_prefix(spec, where)
    if model.get("ignore_merges"):
        raise ValueError(f"{where}: BPE ignore_merges=True; {RUNTIME}'s SentencePiece tokenizer always merges.")
    if not model.get("byte_fallback"):
        raise ValueError(
            f"{where}: a SentencePiece-shaped BPE without byte_fallback. {RUNTIME}'s SentencePiece vocabulary falls "
            "back to the 256 <0xXX> byte tokens for characters outside the vocabulary (without them it terminates "
            "the process)."
        )
    tokens, types, vocab = _base_tokens(spec, config, where)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    missing = [t for t in byte_tokens if t not in vocab]
    if missing:
        raise ValueError(
            f"{where}: byte_fallback without the byte tokens {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of 256 missing); {RUNTIME} terminates the process "
            "when it needs one."
        )
    for token in byte_tokens:
        types[vocab[token]] = BYTE
    # llama.cpp merges the best-scored pair first: a token scores minus the rank of the first merge that makes it
    scores = [UNMERGED_SCORE] * len(tokens)
    made: set[str] = set()
    for rank, (a, b) in enumerate(_merges(model)):
        token = a + b
        if token in vocab and token not in made:
            made.add(token)
            scores[vocab[token]] = -float(rank)
    return Vocabulary(
        model="llama", pre="default", tokens=tokens, types=types, scores=scores, add_space_prefix=add_space_prefix
    )


def _wordpiece_vocabulary(spec: dict, config: Any, where: str) -> Vocabulary:
    """WordPiece as llama.cpp's `bert` vocabulary: control tokens as they are, `##x` as `x`, every other token with
    `▁` before it (llama.cpp puts one before each word and matches greedily, longest first), and BertNormalizer's
    lowercasing and accent stripping as llama.cpp's normalizer keys."""
    model = spec["model"]
    if model.get("continuing_subword_prefix") != "##":
        raise ValueError(
            f"{where}: WordPiece continuing_subword_prefix={model.get('continuing_subword_prefix')!r}; {RUNTIME}'s "
            "bert vocabulary is written from '##' pieces."
        )
    normalizer = spec.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer":
        raise ValueError(
            f"{where}: WordPiece with normalizer {normalizer.get('type')}; {RUNTIME}'s bert tokenizer normalizes as "
            "BertNormalizer does (and only that)."
        )
    for option in ("clean_text", "handle_chinese_chars"):
        if not normalizer.get(option, True):
            raise ValueError(f"{where}: BertNormalizer({option}=False); {RUNTIME}'s bert tokenizer always does it.")
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "BertPreTokenizer":
        raise ValueError(
            f"{where}: WordPiece with pre-tokenizer {pre.get('type')}; {RUNTIME}'s bert tokenizer splits as "
            "BertPreTokenizer does (whitespace and punctuation)."
        )
    tokens, types, _ = _base_tokens(spec, config, where)
    for i, token in enumerate(tokens):
        if types[i] in (CONTROL, UNUSED):
            continue
        tokens[i] = token[2:] if token.startswith("##") else METASPACE + token
    lowercase = bool(normalizer.get("lowercase", True))
    strip_accents = normalizer.get("strip_accents")
    return Vocabulary(
        model="bert",
        pre="default",
        tokens=tokens,
        types=types,
        lowercase=lowercase,
        strip_accents=lowercase if strip_accents is None else bool(strip_accents),  # None: as lowercase (both)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Special tokens


def _set_specials(vocab: Vocabulary, tokenizer: Any, config: Any, where: str) -> None:
    """Special ids, add_* flags and the chat template, from the tokenizer; the config fills BOS/EOS (the ids the model
    generates with) where the tokenizer names none. The flags say what the post-processor puts around plain text, and
    are refused where llama.cpp cannot add the same: at most one BOS and one EOS (bert: always [CLS] ... [SEP])."""
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIALS}
    for name in ("bos", "eos") if vocab.model != "bert" else ():
        if ids[name] is None:
            value = getattr(config, f"{name}_token_id", None)
            ids[name] = value[0] if isinstance(value, list) else value
    prefix, suffix = _added_around(tokenizer, where)
    if vocab.model == "bert":
        if ids["cls"] is None or prefix != [ids["cls"]] or ids["sep"] is None or suffix != [ids["sep"]]:
            raise ValueError(
                f"{where}: its post-processor adds {prefix} ... {suffix}; {RUNTIME}'s bert tokenizer always adds "
                f"[CLS] ... [SEP] (ids {ids['cls']} ... {ids['sep']})."
            )
        ids["bos"] = ids["cls"]  # llama.cpp's bert tokenizer adds its BOS as [CLS]
        vocab.add_bos, vocab.add_eos, vocab.add_sep = True, False, True
    else:
        if len(prefix) > 1 or len(suffix) > 1 or (suffix and suffix[0] != ids["eos"]):
            raise ValueError(
                f"{where}: its post-processor adds {prefix} ... {suffix}; {RUNTIME} adds at most its BOS before the "
                f"text and its EOS ({ids['eos']}) after it."
            )
        if prefix:
            ids["bos"] = prefix[0]  # what llama.cpp must add is what the post-processor adds
        vocab.add_bos, vocab.add_eos = bool(prefix), bool(suffix)
        if ids["eos"] is None:
            default = 11 if vocab.model == "gpt2" else 2
            raise ValueError(
                f"{where}: no end-of-sequence token in the tokenizer or the config; {RUNTIME} would stop generating "
                f"at its default ({default})."
            )
        if ids["bos"] is None:  # never added (no prefix): GPT-2's convention rather than llama.cpp's default
            ids["bos"] = ids["eos"]
    outside = {name: i for name, i in ids.items() if i is not None and not 0 <= int(i) < len(vocab.tokens)}
    if outside:
        raise ValueError(f"{where}: special token ids {outside} are outside the vocabulary ({len(vocab.tokens)}).")
    vocab.special = {name: int(i) for name, i in ids.items() if i is not None}
    if vocab.model == "llama" and ids["unk"] is not None:  # as SentencePiece types it (llama.cpp's converter too)
        vocab.types[ids["unk"]] = UNKNOWN
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: gguf-py writes the "default" one as tokenizer.chat_template
        template = [{"name": name, "template": text} for name, text in template.items()]
    vocab.chat_template = template or None


def _added_around(tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after plain text."""
    plain = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(PROBE, add_special_tokens=True)["input_ids"]
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if start is None:
        raise ValueError(f"{where}: its post-processor changes the text's ids; {RUNTIME} only adds tokens around it.")
    return full[:start], full[start + len(plain) :]


def _check_unique(tokens: list[str], where: str) -> None:
    """llama.cpp aborts (an assertion, not an error) on a vocabulary with a token string twice."""
    seen: set[str] = set()
    twice = [t for t in tokens if t in seen or seen.add(t)]
    if twice:
        raise ValueError(
            f"{where}: the token strings {twice[:4]} occur twice in the vocabulary {RUNTIME} would read; it aborts on "
            "duplicates."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def write_vocabulary(writer: Any, vocab: Vocabulary) -> None:
    """The `tokenizer.ggml.*` keys of `vocab` (and the chat template) on a `gguf.GGUFWriter`."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
        "sep": writer.add_sep_token_id,
        "mask": writer.add_mask_token_id,
    }
    for name, token_id in vocab.special.items():
        if name == "cls":  # llama.cpp reads [CLS] as the BOS id; the key is kept for readers that look for it
            writer.add_uint32("tokenizer.ggml.cls_token_id", token_id)
        else:
            adders[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_sep is not None:
        writer.add_add_sep_token(vocab.add_sep)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.lowercase is not None:  # llama.cpp's BertNormalizer options (this gguf release has no add_* for them)
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", vocab.lowercase)
        writer.add_bool("tokenizer.ggml.normalizer.strip_accents", vocab.strip_accents)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


# ---------------------------------------------------------------------------------------------------------------------
# Verification


def tokenizer_agreement(
    path: str | os.PathLike, tokenizer: Any, python: str, texts: tuple[str, ...] | list[str] = TEXTS
) -> dict[str, Any]:
    """llama.cpp's tokenizer, reading the file at `path` (in its own process, run by `python`), against `tokenizer`
    on `texts`, special tokens added as each adds them: `tokenizer_agreement` (the share of texts with equal ids),
    `tokenizer_differs` (those that differ), the texts' count and length, and `detokenized_agreement` (the share
    whose plain ids llama.cpp turns back into the text; llama.cpp tidies spaces before punctuation for some
    pre-tokenizers, and a bert vocabulary's text comes back normalized)."""
    args = {"task": "tokenize", "path": str(path), "texts": list(texts)}
    theirs = run_program("llama_cpp_side", args, RUNTIME, python=python)
    differs = [text for text, ids in zip(texts, theirs["ids"], strict=True) if tokenizer(text)["input_ids"] != ids]
    back = sum(text == detokenized for text, detokenized in zip(texts, theirs["detokenized"], strict=True))
    return {
        "tokenizer_runtime": theirs["runtime"],
        "tokenizer_agreement": 1 - len(differs) / len(texts),
        "tokenizer_differs": differs,
        "tokenizer_texts": len(texts),
        "tokenizer_chars": sum(map(len, texts)),
        "detokenized_agreement": back / len(texts),
    }


__all__ = [
    "BYTE_LEVEL_PRE",
    "SPLITS",
    "TEXTS",
    "Vocabulary",
    "gguf_vocabulary",
    "load_tokenizer",
    "tokenizer_agreement",
    "write_vocabulary",
]
