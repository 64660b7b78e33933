"""The numbers a trained model's card reports beside its loss: a classifier's accuracy, and a seq2seq model's exact
match and word F1 next to the baseline of always answering the most common target (a score means little without it).
"""

import re
from collections import Counter
from typing import Any


def label_accuracy(logits: Any, labels: list[int]) -> float:
    """The share of examples whose highest logit is their label (`logits` may come as the first of a tuple)."""
    logits = logits[0] if isinstance(logits, tuple) else logits
    predicted = logits.argmax(-1).tolist()
    return sum(p == t for p, t in zip(predicted, labels, strict=True)) / max(len(labels), 1)


def word_f1(prediction: str, target: str) -> float:
    """F1 of the lower-cased words (split at anything not a letter or digit, `_` too) two texts have in common.

    Partial credit where exact match gives none: `show_list` for `show_window` scores 0.5.
    """
    predicted, wanted = (Counter(w for w in re.split(r"[\W_]+", t.lower()) if w) for t in (prediction, target))
    common = sum((predicted & wanted).values())
    if not common:
        return float(predicted == wanted)  # both empty: a match
    precision, recall = common / sum(predicted.values()), common / sum(wanted.values())
    return 2 * precision * recall / (precision + recall)


def score_texts(predictions: list[str], targets: list[str]) -> dict[str, float]:
    """Exact match (after stripping whitespace) and mean word F1 of predicted texts against the targets."""
    pairs = list(zip(predictions, targets, strict=True))
    return {
        "exact_match": sum(p.strip() == t.strip() for p, t in pairs) / max(len(pairs), 1),
        "word_f1": sum(word_f1(p, t) for p, t in pairs) / max(len(pairs), 1),
    }


def generation_scores(predictions: list[str], test: tuple[list[str], list[str]], majority: str) -> dict[str, Any]:
    """Exact match and word F1 of the predictions, the same for always answering `majority` (the baseline), and the
    first 8 examples (sources cut to 200 characters)."""
    scores, baseline = score_texts(predictions, test[1]), score_texts([majority] * len(test[1]), test[1])
    return {
        **scores,
        "baseline_target": majority,
        "baseline_exact_match": baseline["exact_match"],
        "baseline_word_f1": baseline["word_f1"],
        "examples": [
            {"source": source[:200], "target": target, "prediction": prediction}
            for source, target, prediction in list(zip(*test, predictions, strict=True))[:8]
        ],
    }


__all__ = ["generation_scores", "label_accuracy", "score_texts", "word_f1"]
