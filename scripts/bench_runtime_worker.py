"""One runtime's greedy decoding, timed in a process of its own (`scripts/bench.py --runtimes` starts one per setting).

Two OpenMP runtimes in one process slow each other (CTranslate2 next to torch slowed torch 1.7-2.4x here), so this
script imports only the runtime it times: torch for hf_tfm, onnxruntime + numpy for ONNX, ctranslate2 for CTranslate2.
It reads a JSON request on stdin (`format`, `path`, `prompts`, `new`, `rounds`, `threads`; for hf_tfm `quantize`) and
prints, as JSON, the
median seconds of one decode step (`step`) over `rounds` calls of `new` greedy tokens each; with
`"mode": "score"` (`scripts/quality.py --runtimes`) it scores the export's next-token predictions on `blocks` instead.
"""

import json
import os
import statistics
import sys
import time


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


def _hf_tfm(path: str, prompts: list[list[int]], threads: int, quantize: str | None = None, compile: bool = False):
    import torch

    from hf_tfm import load_for_inference

    torch.set_num_threads(threads)
    model = load_for_inference(path, quantize=quantize, compile=compile)  # what `hf-tfm generate` loads
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(new: int) -> float:
        clock = StepClock()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock
            )
        return clock.step_seconds(new)

    return run


def _hf_tfm_compiled(path: str, prompts: list[list[int]], threads: int, quantize: str | None = None):
    return _hf_tfm(path, prompts, threads, quantize, compile=True)


def _hf_tfm_aot(path: str, prompts: list[list[int]], threads: int, quantize: str | None = None):
    import torch

    from hf_tfm import load_for_inference
    from hf_tfm.aot import AotDecoder

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts)
    model = load_for_inference(path, quantize=quantize)
    decoders = {}  # per max_length: each run's prompt plus its new tokens, the static cache generate() would make

    def run(new: int) -> float:
        if new not in decoders:
            decoders[new] = AotDecoder(model, ids.shape[1] + new, batch_size=len(ids))
        clock = StepClock()
        decoders[new].generate(ids, new, eos_token_id=[], streamer=clock)  # no end token: `new` tokens, as the others
        return clock.step_seconds(new)

    return run


def _onnx(path: str, prompts: list[list[int]], threads: int):
    sys.path.insert(0, path)  # the export's own runner, as a deployment uses it
    from ort_generate import OnnxGenerator

    generator = OnnxGenerator(path, threads=threads)

    def run(new: int) -> float:
        clock = StepClock()
        generator.generate(prompts, new, on_token=clock.put)
        return clock.step_seconds(new)

    return run


def _ctranslate2(path: str, prompts: list[list[int]], threads: int):
    import ctranslate2

    generator = ctranslate2.Generator(path, device="cpu", compute_type="default", intra_threads=threads)
    with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as file:
        vocabulary = json.load(file)
    tokens = [[vocabulary[i] for i in prompt] for prompt in prompts]
    greedy = {"beam_size": 1, "sampling_topk": 1, "include_prompt_in_result": False}

    def run(new: int) -> float:
        arrived: dict[int, float] = {}  # step -> when its last sequence's token arrived (one call per sequence)

        def on_token(result) -> bool:
            arrived[result.step] = time.perf_counter()
            return False  # go on decoding

        generator.generate_batch(tokens, max_length=new, min_length=new, callback=on_token, **greedy)
        clock = StepClock()
        clock.stamps = [arrived[step] for step in sorted(arrived)]
        return clock.step_seconds(new)

    return run


def _llama_cpp(path: str, prompts: list[list[int]], threads: int):
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

    def run(new: int) -> float:
        ll.llama_memory_clear(ll.llama_get_memory(context), True)
        clock = StepClock()
        fill([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])
        chosen = decode()
        clock.put(chosen)
        for step in range(1, new):
            fill([(t, len(p) + step - 1, s, True) for s, (p, t) in enumerate(zip(prompts, chosen, strict=True))])
            chosen = decode()
            clock.put(chosen)
        return clock.step_seconds(new)

    return run


RUNNERS = {
    "hf_tfm": _hf_tfm,
    "hf_tfm+compile": _hf_tfm_compiled,
    "hf_tfm+aot": _hf_tfm_aot,
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


def main() -> None:
    request = json.loads(sys.stdin.read())
    if request.get("mode") == "score":
        print(json.dumps(score(request)))
        return
    options = {"quantize": request["quantize"]} if request.get("quantize") else {}
    run = RUNNERS[request["format"]](request["path"], request["prompts"], request["threads"], **options)
    run(request["new"])  # warm-up: kernels, allocations, caches (and compiling)
    steps = [run(request["new"]) for _ in range(request["rounds"])]
    print(json.dumps({"step": statistics.median(steps)}))


if __name__ == "__main__":
    main()
