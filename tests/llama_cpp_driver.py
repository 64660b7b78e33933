"""Run a GGUF file in llama.cpp (llama-cpp-python), in .venv-llama-cpp where neither torch nor hf_tfm is installed.

Reads a JSON request on stdin ({"gguf": path, "prompts": [[ids]], "max_new_tokens": n, "texts": [str]}) and writes,
per prompt, the prefill logits of every position and the greedy continuation, and the ids llama.cpp's tokenizer gives
each text (with the BOS token the file asks for). The KV cache is f32 (llama.cpp's default is f16), so an
f32 file is compared with PyTorch at float32 precision. Used by tests/test_export_llama_cpp.py.
"""

import json
import sys

from llama_cpp import GGML_TYPE_F32, Llama


def main() -> None:
    request = json.load(sys.stdin)
    llm = Llama(
        request["gguf"],
        n_ctx=256,
        n_threads=2,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    results = []
    for prompt in request["prompts"]:
        llm.reset()
        llm.eval(prompt)
        logits = [row.tolist() for row in llm.scores[: llm.n_tokens]]
        tokens = []
        for token in llm.generate(prompt, temp=0.0, reset=True):  # temp 0: llama.cpp's greedy sampler
            tokens.append(int(token))
            if len(tokens) == request["max_new_tokens"]:
                break
        results.append({"logits": logits, "tokens": tokens})
    tokenized = [llm.tokenize(text.encode(), add_bos=True, special=False) for text in request.get("texts", [])]
    json.dump({"results": results, "tokenized": tokenized, "vocab": llm.n_vocab()}, sys.stdout)


if __name__ == "__main__":
    main()
