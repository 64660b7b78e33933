"""llama.cpp's side of a GGUF export (`hf_tfm.exporters.gguf`), through llama-cpp-python.

Run by the Python that has llama-cpp-python, always in a process of its own and without torch (llama.cpp loaded
next to torch segfaulted on this kind of machine). `args["task"]` picks what it does with the file `args["path"]`:

* `quantize`: llama.cpp's quantizer writes `args["out"]` as `args["ftype"]` (K-quants: a type per tensor, as
  `llama-quantize` chooses);
* `generate`: the logits of every position of each reference sequence, and greedy decoding (the argmax of each
  step's logits, `suppress`ed ids never chosen), with an f32 KV cache (llama.cpp's default is f16);
* `embed`: an encoder's hidden states for every token of each prompt (no pooling), one prompt a batch;
* `tokenize`: for each text, the ids `llama_tokenize` gives with the file's special tokens added and special-token
  text matched (as a transformers tokenizer encodes), and the text `llama_detokenize` gives back from the ids of the
  plain text.
"""

import ctypes

import llama_cpp
import numpy as np


def quantize(args: dict) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, args["ftype"])
    params.nthread = args["threads"]
    status = llama_cpp.llama_model_quantize(args["path"].encode(), args["out"].encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")


def generate(args: dict) -> dict:
    llm = llama_cpp.Llama(
        args["path"],
        n_ctx=max(map(len, args["references"])) + 1,
        n_threads=args["threads"],
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    result = {"class": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "tokens": [], "logits": []}
    for prompt, reference in zip(args["prompts"], args["references"], strict=True):
        llm.reset()
        llm.eval(reference)
        result["logits"].append(np.array(llm.scores[: llm.n_tokens]))
        llm.reset()
        llm.eval(prompt)
        tokens: list[int] = []
        while len(tokens) < args["max_new_tokens"]:
            row = np.array(llm.scores[llm.n_tokens - 1])
            row[args["suppress"]] = -np.inf
            tokens.append(int(row.argmax()))
            llm.eval(tokens[-1:])
        result["tokens"].append(tokens)
    return result


def embed(args: dict) -> dict:
    llm = llama_cpp.Llama(
        args["path"],
        n_ctx=max(map(len, args["prompts"])),
        n_threads=args["threads"],
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
        verbose=False,
    )
    rows = []
    for prompt in args["prompts"]:
        llm._batch.reset()
        llm._batch.add_sequence(prompt, 0, True)
        llm._ctx.kv_cache_clear()
        llm._ctx.decode(llm._batch)
        values = llama_cpp.llama_get_embeddings(llm._ctx.ctx)[: len(prompt) * llm.n_embd()]
        rows.append(np.array(values, dtype=np.float32).reshape(len(prompt), llm.n_embd()))
    return {"last_hidden_state": rows}


def detokenize(vocab, ids: list[int]) -> bytes:
    """`llama_detokenize` of the whole sequence in one call (`Llama.detokenize` drops pieces longer than 32 bytes):
    asked once for the size it needs (returned negated), then filled."""
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    needed = llama_cpp.llama_detokenize(vocab, tokens, len(ids), None, 0, False, False)
    buffer = ctypes.create_string_buffer(max(-needed, needed, 1))
    written = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buffer, len(buffer), False, False)
    return buffer.raw[:written]


def tokenize(args: dict) -> dict:
    llm = llama_cpp.Llama(args["path"], vocab_only=True, verbose=False)
    result = {"runtime": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "ids": [], "detokenized": []}
    for text in args["texts"]:
        data = text.encode("utf-8")
        result["ids"].append(llm.tokenize(data, add_bos=True, special=True))  # add_bos: llama.cpp's add_special
        plain = llm.tokenize(data, add_bos=False, special=False)
        result["detokenized"].append(detokenize(llm._model.vocab, plain).decode("utf-8", "replace"))
    return result


TASKS = {"quantize": quantize, "generate": generate, "embed": embed, "tokenize": tokenize}


def run(args: dict) -> dict | None:
    return TASKS[args["task"]](args)
