"""Data for the `hf-tfm` command: the embedded corpus, its labelled task, and users' own files.

Nothing is downloaded. The embedded corpus is the Python standard library's own source, found at run time through
`sysconfig` (every Python installation has it). The labelled task asks which standard-library package a docstring
comes from; it is split by file, so no source file contributes to both train and test. User files (.txt, .jsonl,
.json, .csv) are read through `datasets`, and every problem is reported as a `DataError` naming the file and the fix.
"""

import ast
import logging
import random
import re
import sysconfig
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3_tests"}


class DataError(ValueError):
    """Bad user data (missing or empty file, unknown format, missing column, a single class): a clear message."""


@dataclass
class SourceFile:
    """One standard-library module: its path relative to the stdlib root, its top-level package and its text."""

    path: str
    package: str
    text: str


@dataclass
class LabelledSplit:
    """Texts with integer labels for train and test, the label names, and which files went to each side."""

    train_texts: list[str]
    train_labels: list[int]
    test_texts: list[str]
    test_labels: list[int]
    label_names: list[str]
    train_files: set[str] = field(default_factory=set)
    test_files: set[str] = field(default_factory=set)

    def majority_baseline(self) -> tuple[str, float]:
        """The most frequent training label and its accuracy on the test split (what always guessing it scores)."""
        majority = Counter(self.train_labels).most_common(1)[0][0]
        accuracy = sum(label == majority for label in self.test_labels) / max(len(self.test_labels), 1)
        return self.label_names[majority], accuracy


@dataclass
class PairSplit:
    """Source/target text pairs for train and test, and which files went to each side."""

    train_sources: list[str]
    train_targets: list[str]
    test_sources: list[str]
    test_targets: list[str]
    train_files: set[str] = field(default_factory=set)
    test_files: set[str] = field(default_factory=set)

    def majority_baseline(self) -> tuple[str, list[str]]:
        """The most frequent training target, and what always answering it predicts for the test sources."""
        majority = Counter(self.train_targets).most_common(1)[0][0]
        return majority, [majority] * len(self.test_sources)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_chars: int | None = None, max_file_chars: int | None = None) -> list[SourceFile]:
    """Source files of the standard library's packages (not tests, not site-packages), in a stable order.

    Top-level modules (``os.py``) get the package name ``"<module>"``. `max_chars` caps the total text kept, taking
    files in a fixed pseudo-random order (a hash of the path) so that a cap samples every part of the library;
    `max_file_chars` truncates long files, so a cap is not spent on a handful of huge modules.
    """
    root = stdlib_root()
    files: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIP_DIRS.intersection(relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        package = relative.parts[0] if len(relative.parts) > 1 else "<module>"
        files.append(SourceFile(relative.as_posix(), package, text[:max_file_chars] if max_file_chars else text))
    if not files:
        raise DataError(f"found no Python sources under the standard library directory {root}")
    if max_chars is not None:
        kept, total = [], 0
        for source in sorted(files, key=lambda f: zlib.crc32(f.path.encode())):
            if total + len(source.text) <= max_chars:
                kept.append(source)
                total += len(source.text)
        files = sorted(kept, key=lambda f: f.path)
    logger.info(
        "standard library corpus: %d files, %.1f MB, from %s", len(files), sum(len(f.text) for f in files) / 1e6, root
    )
    return files


def docstrings(source: str, min_chars: int = 40) -> list[str]:
    """The docstrings of a module and of its classes and functions, at least `min_chars` long, cleaned of indent."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                found.append(doc)
    return found


def docstring_task(
    files: list[SourceFile],
    num_classes: int = 6,
    max_per_file: int = 30,
    max_per_class: int = 200,
    test_fraction: float = 0.3,
    min_files: int = 4,
    seed: int = 0,
) -> LabelledSplit:
    """Which standard-library package does a docstring come from? Split by file, `num_classes` packages.

    The classes are the packages with the most docstrings among those with at least `min_files` files (so each can
    put whole files on both sides). Per package, shuffled files are assigned to test until about `test_fraction`
    of its docstrings are there. `max_per_file` stops one huge module (tkinter's ``__init__``) from dominating and
    `max_per_class` keeps the classes roughly balanced, which keeps the majority-class baseline honest.
    """
    rng = random.Random(seed)
    per_file: dict[str, list[str]] = {}
    files_of: dict[str, list[str]] = defaultdict(list)
    for source in files:
        if source.package == "<module>":
            continue
        docs = docstrings(source.text)
        if docs:
            rng.shuffle(docs)
            per_file[source.path] = docs[:max_per_file]
            files_of[source.package].append(source.path)
    eligible = [p for p, paths in files_of.items() if len(paths) >= min_files]
    counts = {p: sum(len(per_file[f]) for f in files_of[p]) for p in eligible}
    labels = sorted(sorted(counts, key=lambda p: (-counts[p], p))[:num_classes])
    if len(labels) < 2:
        raise DataError("the standard library corpus yields fewer than 2 packages with docstrings")
    split = LabelledSplit([], [], [], [], labels)
    for label_id, package in enumerate(labels):
        paths = sorted(files_of[package])
        rng.shuffle(paths)
        total = min(counts[package], max_per_class)
        budget_test, budget_train = round(total * test_fraction), total - round(total * test_fraction)
        n_test = 0
        for i, path in enumerate(paths):
            docs = per_file[path]
            to_test = n_test < budget_test and (i < len(paths) - 1 or n_test == 0)
            if to_test:
                take = docs[: budget_test - n_test]
                split.test_texts += take
                split.test_labels += [label_id] * len(take)
                split.test_files.add(path)
                n_test += len(take)
            else:
                take = docs[: max(budget_train - split.train_labels.count(label_id), 0)]
                if take:
                    split.train_texts += take
                    split.train_labels += [label_id] * len(take)
                    split.train_files.add(path)
    logger.info(
        "docstring task: %d classes %s, %d train / %d test docstrings from %d / %d files",
        len(labels),
        labels,
        len(split.train_texts),
        len(split.test_texts),
        len(split.train_files),
        len(split.test_files),
    )
    return split


def docstring_name_task(files: list[SourceFile], test_fraction: float = 0.2, seed: int = 0) -> PairSplit:
    """A function's docstring in, its name out, split by file.

    The source is the first paragraph of the docstring; the target is the name's words, lower-cased and
    space-separated (`_from_iterable` -> `from iterable`). Kept are the functions and methods whose name is made of
    words of that paragraph ("Send a value into the generator." -> `send`): about a third of the documented ones,
    the part a model can learn from the text alone (which words, in which order), where the rest are names no
    description spells. Dunder methods are left out. About `test_fraction` of the files (shuffled by seed), with
    all their functions, form the test side.
    """
    per_file: dict[str, list[tuple[str, str]]] = {}
    for source in files:
        try:
            tree = ast.parse(source.text)
        except (SyntaxError, ValueError):
            continue
        pairs = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            summary = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
            words = [w for w in node.name.lower().split("_") if w]
            if words and set(words) <= set(re.findall(r"[a-z0-9]+", summary.lower())):
                pairs.append((summary, " ".join(words)))
        if pairs:
            per_file[source.path] = pairs
    paths = sorted(per_file)
    if len(paths) < 2:
        raise DataError("the standard library corpus yields fewer than 2 files with documented functions")
    random.Random(seed).shuffle(paths)
    test_files = set(paths[: max(1, round(len(paths) * test_fraction))])
    split = PairSplit([], [], [], [], train_files=set(paths) - test_files, test_files=test_files)
    for path in sorted(per_file):
        test = path in test_files
        for summary, name in per_file[path]:
            (split.test_sources if test else split.train_sources).append(summary)
            (split.test_targets if test else split.train_targets).append(name)
    logger.info(
        "docstring -> name task: %d train / %d test functions from %d / %d files",
        len(split.train_sources),
        len(split.test_sources),
        len(split.train_files),
        len(split.test_files),
    )
    return split


# ---------------------------------------------------------------------------------------------------------------------
# User files


def _read(path: str | Path):
    """A `datasets.Dataset` from a .txt/.jsonl/.json/.csv file, after the checks that give clear messages."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unknown format {path.suffix or '(no extension)'!r}; use one of {', '.join(FORMATS)}")
    if not path.read_bytes().strip():
        raise DataError(f"{path}: the file is empty")
    import datasets

    datasets.disable_progress_bars()
    try:
        kwargs = {"keep_linebreaks": False} if builder == "text" else {}
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as err:  # datasets raises many types for malformed files
        raise DataError(f"{path}: could not be read as {builder}: {type(err).__name__}: {err}") from err
    if len(dataset) == 0:
        raise DataError(f"{path}: the file holds no rows")
    return dataset


def _column(dataset, path: str | Path, column: str, role: str) -> list:
    if column not in dataset.column_names:
        raise DataError(
            f"{path}: no {role} column {column!r}; the columns are {dataset.column_names} "
            f"(choose one with --{role}-column)"
        )
    return dataset[column]


def load_texts(path: str | Path, text_column: str = "text") -> list[str]:
    """The non-blank texts of a user file (.txt: one text per line)."""
    dataset = _read(path)
    texts = [str(t) for t in _column(dataset, path, text_column, "text") if t is not None and str(t).strip()]
    if not texts:
        raise DataError(f"{path}: column {text_column!r} holds no non-blank text")
    return texts


def load_labelled(
    path: str | Path, text_column: str = "text", label_column: str = "label", label_names: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Texts and their labels (as strings) from a .jsonl/.json/.csv file; rows missing either are dropped.

    With `label_names` (the training labels, when reading an eval file), an unseen label is an error.
    """
    dataset = _read(path)
    if FORMATS[Path(path).suffix.lower()] == "text":
        raise DataError(f"{path}: a .txt file has no label column; use .jsonl or .csv with a {label_column!r} column")
    texts, labels = [], []
    rows = zip(_column(dataset, path, text_column, "text"), _column(dataset, path, label_column, "label"), strict=True)
    for text, label in rows:
        if text is not None and str(text).strip() and label is not None and str(label).strip():
            texts.append(str(text))
            labels.append(str(label))
    if not texts:
        raise DataError(f"{path}: no row has both a text and a label")
    if label_names is None:
        distinct = sorted(set(labels))
        if len(distinct) < 2:
            raise DataError(
                f"{path}: the label column {label_column!r} has a single class {distinct[0]!r}; "
                "a classifier needs at least two"
            )
    else:
        unseen = sorted(set(labels) - set(label_names))
        if unseen:
            raise DataError(f"{path}: labels {unseen} do not occur in the training file (labels: {label_names})")
    return texts, labels


def load_pairs(
    path: str | Path, source_column: str = "source", target_column: str = "target"
) -> tuple[list[str], list[str]]:
    """Source/target text pairs from a .jsonl/.json/.csv file; rows missing either side are dropped."""
    dataset = _read(path)
    if FORMATS[Path(path).suffix.lower()] == "text":
        raise DataError(
            f"{path}: a .txt file has no source/target columns; use .jsonl or .csv with {source_column!r} and "
            f"{target_column!r} columns"
        )
    columns = (_column(dataset, path, source_column, "source"), _column(dataset, path, target_column, "target"))
    pairs = [
        (str(source), str(target))
        for source, target in zip(*columns, strict=True)
        if source is not None and str(source).strip() and target is not None and str(target).strip()
    ]
    if not pairs:
        raise DataError(f"{path}: no row has both a source and a target text")
    return [source for source, _ in pairs], [target for _, target in pairs]


__all__ = [
    "FORMATS",
    "DataError",
    "LabelledSplit",
    "PairSplit",
    "SourceFile",
    "docstring_name_task",
    "docstring_task",
    "docstrings",
    "load_labelled",
    "load_pairs",
    "load_texts",
    "stdlib_files",
    "stdlib_root",
]
