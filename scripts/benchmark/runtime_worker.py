"""One runtime's greedy decoding, timed in a process of its own (`scripts/bench.py --runtimes` starts one per setting,
through `hf_tfm.programs.run_program`, which runs this file by path and calls `run(request)`).

Two OpenMP runtimes in one process slow each other (CTranslate2 next to torch slowed torch 1.7-2.4x here), so this
file imports only the runtime it times: torch for hf_tfm, onnxruntime + numpy for ONNX, ctranslate2 for CTranslate2;
nothing of the `benchmark` package, whose `__init__` imports torch and transformers. `run(request)` takes `format`,
`path`, `prompts`, `new`, `rounds`, `threads` (for hf_tfm `quantize`) and returns the median seconds of one decode
step (`step`) over `rounds` calls of `new` greedy tokens each. The prompts may differ in length: hf_tfm and ONNX
Runtime left-pad them into one batch, CTranslate2 and llama.cpp take them as they are. With `"mode": "ttft"` it
returns the median seconds from the call to the first new token (`ttft`), the prompts' processing; with `"mode":
"cold"` (`scripts/bench.py --cold`) a user's first call in a new process (`cold_start`); with `"mode": "score"`
(`scripts/quality.py --runtimes`) it scores the export's next-token predictions on `blocks` instead.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only by the hf_tfm runners: the other runtimes' processes go without it
    import torch


class StepClock:
    """Notes when each step's tokens arrive (as a `generate()` streamer, or a runtime's per-token callback).

    The decode steps' time is the span from the prefill's token to the last one, measured inside one call: a busy
    machine can make it long, never negative, as a difference of two separately timed calls can be."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:  # the streamer protocol: generate() puts the prompt first, then each step's ids
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_seconds(self, new: int) -> float:
        """Seconds per decode step of a call that made `new` tokens (its last `new` stamps)."""
        if new < 2 or len(self.stamps) < new:
            raise ValueError(f"{len(self.stamps)} stamps for {new} new tokens: at least two tokens are needed")
        return (self.stamps[-1] - self.stamps[-new]) / (new - 1)


# a runtime's greedy decoding of its prompts: one call making `new` tokens, each step's arrival noted on the clock
Runner = Callable[[int, StepClock], None]


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompts` as one batch, as `generate()` takes prompts of different lengths: each left-padded to the longest
    (the padding's id is masked out, so any does), and the attention mask of the real tokens."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _hf_tfm(
    path: str,
    prompts: list[list[int]],
    threads: int,
    quantize: str | None = None,
    compile: bool = False,
    warm: bool = True,
) -> Runner:
    import torch

    from hf_tfm import load_for_inference

    torch.set_num_threads(threads)
    model = load_for_inference(path, quantize=quantize, compile=compile)  # what `hf-tfm generate` loads
    if warm and getattr(model, "compiled_decode_step", None) is not None:  # not while its step compiles beside it
        from hf_tfm.inference import precompile

        precompile(model, (len(prompts),), verify=False)
    ids, mask = left_padded(prompts)

    def run(new: int, clock: StepClock) -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock
            )

    run.model = model  # cold_start reads its compiled step's calls
    return run


def _hf_tfm_compiled(
    path: str, prompts: list[list[int]], threads: int, quantize: str | None = None, warm: bool = True
) -> Runner:
    return _hf_tfm(path, prompts, threads, quantize, compile=True, warm=warm)


def _onnx(path: str, prompts: list[list[int]], threads: int) -> Runner:
    sys.path.insert(0, path)  # the export's own runner, as a deployment uses it
    from ort_generate import OnnxGenerator

    generator = OnnxGenerator(path, threads=threads)

    def run(new: int, clock: StepClock) -> None:
        generator.generate(prompts, new, on_token=clock.put)

    return run


def _ctranslate2(path: str, prompts: list[list[int]], threads: int) -> Runner:
    import ctranslate2

    generator = ctranslate2.Generator(path, device="cpu", compute_type="default", intra_threads=threads)
    with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as file:
        vocabulary = json.load(file)
    tokens = [[vocabulary[i] for i in prompt] for prompt in prompts]
    greedy = {"beam_size": 1, "sampling_topk": 1, "include_prompt_in_result": False}

    def run(new: int, clock: StepClock) -> None:
        arrived: dict[int, float] = {}  # step -> when its last sequence's token arrived (one call per sequence)

        def on_token(result) -> bool:
            arrived[result.step] = time.perf_counter()
            return False  # go on decoding

        generator.generate_batch(tokens, max_length=new, min_length=new, callback=on_token, **greedy)
        clock.stamps += [arrived[step] for step in sorted(arrived)]

    return run


def _llama_cpp(path: str, prompts: list[list[int]], threads: int) -> Runner:
    """llama.cpp through llama-cpp-python's C API (its own environment, .venv-llama-cpp): every prompt a sequence of
    one batch, as llama.cpp's own batched example decodes them; greedy argmax of each sequence's logits."""
    import llama_cpp as ll
    import numpy as np

    batch, longest = len(prompts), max(len(p) for p in prompts)
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(path.encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx = batch * (longest + 512)  # every sequence's prompt and new tokens (`new` stays far below 512)
    params.n_batch = params.n_ubatch = max(batch * longest, batch)
    params.n_seq_max, params.n_threads, params.n_threads_batch = batch, threads, threads
    context = ll.llama_init_from_model(model, params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    tokens = ll.llama_batch_init(max(batch * longest, batch), 0, batch)

    def fill(items: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits wanted)
        tokens.n_tokens = len(items)
        for i, (token, position, sequence, logits) in enumerate(items):
            tokens.token[i], tokens.pos[i], tokens.n_seq_id[i] = token, position, 1
            tokens.seq_id[i][0], tokens.logits[i] = sequence, logits

    def decode() -> list[int]:  # one greedy token per sequence, from the rows that asked for logits
        if ll.llama_decode(context, tokens) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i in range(tokens.n_tokens) if tokens.logits[i]]
        return [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(context, i), (vocab,)).argmax()) for i in rows]

    def run(new: int, clock: StepClock) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(context), True)
        fill([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])
        chosen = decode()
        clock.put(chosen)
        for step in range(1, new):
            fill([(t, len(p) + step - 1, s, True) for s, (p, t) in enumerate(zip(prompts, chosen, strict=True))])
            chosen = decode()
            clock.put(chosen)

    return run


RUNNERS = {
    "hf_tfm": _hf_tfm,
    "hf_tfm+compile": _hf_tfm_compiled,
    "onnx": _onnx,
    "ctranslate2": _ctranslate2,
    "gguf": _llama_cpp,
}


def score(request: dict) -> dict:
    """`scripts/quality.py --runtimes`: the export's logits on `blocks` (equal-length id lists): the summed next-token
    loss, the number of predictions and how many argmaxes equal `reference` (fp32's, per block)."""
    import numpy as np

    path, blocks = request["path"], request["blocks"]
    if request["format"] == "onnx":
        sys.path.insert(0, path)
        from ort_generate import OnnxGenerator

        generator = OnnxGenerator(path, threads=request["threads"])

        def logits(batch: list[list[int]]) -> np.ndarray:
            return generator.prefill(batch)[0]

    else:
        import ctranslate2

        generator = ctranslate2.Generator(path, device="cpu", compute_type="default", intra_threads=request["threads"])
        with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as file:
            vocabulary = json.load(file)

        def logits(batch: list[list[int]]) -> np.ndarray:
            return np.asarray(generator.forward_batch([[vocabulary[i] for i in ids] for ids in batch]))

    nll, count, agree = 0.0, 0, 0
    for i in range(0, len(blocks), 8):
        batch = blocks[i : i + 8]
        x = logits(batch)[:, :-1].astype(np.float64)  # (B, T-1, V)
        targets = np.array(batch)[:, 1:]
        x = x - x.max(-1, keepdims=True)
        log_probs = x - np.log(np.exp(x).sum(-1, keepdims=True))
        nll -= np.take_along_axis(log_probs, targets[..., None], -1).sum()
        count += targets.size
        agree += int((x.argmax(-1) == np.array(request["reference"][i : i + 8])).sum())
    return {"nll": float(nll), "count": count, "agree": agree}


def step_seconds(run: Runner, new: int) -> float:
    """Seconds per decode step of one call of `new` tokens, timed inside it (the prompt's processing left out)."""
    clock = StepClock()
    run(new, clock)
    return clock.step_seconds(new)


def first_token_seconds(run: Runner) -> float:
    """Seconds from a call to its first new token: the prompt's processing, and the choice of its next token."""
    clock = StepClock()
    start = time.perf_counter()
    run(1, clock)
    return clock.stamps[-1] - start


def cold_start(request: dict, options: dict) -> dict:
    """`"mode": "cold"`: a user's first call in a new process. Seconds from `spawned_at` (the caller's wall clock when
    it started this process) until the weights are loaded (the runtime imported), until the first new token and the
    last of `new` (one greedy call), and the longest wait between two new tokens; then the seconds of the same call
    again (`warm_s`). hf_tfm's compiled step is not waited for: one not stored yet compiles beside the decoding, as
    for a user; `library_steps` is how many of the call's steps it ran."""
    if request["format"].startswith("hf_tfm"):
        options = {**options, "warm": False}
    runner = RUNNERS[request["format"]](request["path"], request["prompts"], request["threads"], **options)
    wall, perf = time.time(), time.perf_counter()
    clock = StepClock()
    runner(request["new"], clock)
    since_spawn = [wall - request["spawned_at"] + stamp - perf for stamp in clock.stamps[-request["new"] :]]
    step = getattr(getattr(runner, "model", None), "compiled_decode_step", None)
    result = {
        "load_s": wall - request["spawned_at"],
        "first_token_s": since_spawn[0],
        "total_s": since_spawn[-1],
        "longest_gap_s": max(later - earlier for earlier, later in itertools.pairwise(since_spawn)),
        "library_steps": None if step is None else step.calls,
    }
    start = time.perf_counter()
    runner(request["new"], StepClock())
    return {**result, "warm_s": time.perf_counter() - start}


def run(request: dict) -> dict:
    """The answer to one request (see the module docstring)."""
    if request.get("mode") == "score":
        return score(request)
    options = {"quantize": request["quantize"]} if request.get("quantize") else {}
    if request.get("mode") == "cold":
        return cold_start(request, options)
    runner = RUNNERS[request["format"]](request["path"], request["prompts"], request["threads"], **options)
    if request.get("mode") == "ttft":
        first_token_seconds(runner)  # warm-up: kernels, allocations, caches (and compiling, for this prompt's length)
        times = [first_token_seconds(runner) for _ in range(request["rounds"])]
        return {"ttft": statistics.median(times)}
    step_seconds(runner, request["new"])  # warm-up: kernels, allocations, caches (and compiling)
    steps = [step_seconds(runner, request["new"]) for _ in range(request["rounds"])]
    return {"step": statistics.median(steps)}
