"""llama.cpp's tokenizer on a GGUF file's vocabulary: the runtime's side of `verify_gguf`'s tokenizer check.

Run by path, in its own process, by the Python that has llama-cpp-python (neither torch nor hf_tfm needs to be there):

    python llama_cpp_tokenize.py RESULT.json < {"path": "model.gguf", "texts": ["...", ...]}

For each text it writes the ids `llama_tokenize` gives with the file's special tokens added and special-token text
matched (as a transformers tokenizer encodes), and the text `llama_detokenize` gives back from the ids of the plain
text (the whole sequence in one call: `Llama.detokenize` drops pieces longer than 32 bytes).
"""

import ctypes
import json
import sys
from pathlib import Path

# Run by path, this folder would come first on sys.path, where hf_tfm's gguf.py and onnx.py shadow the real packages
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def detokenize(llama_cpp, vocab, ids: list[int]) -> bytes:
    """`llama_detokenize` of the whole sequence: asked once for the size it needs (returned negated), then filled."""
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    needed = llama_cpp.llama_detokenize(vocab, tokens, len(ids), None, 0, False, False)
    buffer = ctypes.create_string_buffer(max(-needed, needed, 1))
    written = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buffer, len(buffer), False, False)
    return buffer.raw[:written]


def main() -> None:
    import llama_cpp

    request = json.load(sys.stdin)
    llm = llama_cpp.Llama(request["path"], vocab_only=True, verbose=False)
    result = {"runtime": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "ids": [], "detokenized": []}
    for text in request["texts"]:
        data = text.encode("utf-8")
        result["ids"].append(llm.tokenize(data, add_bos=True, special=True))  # add_bos: llama.cpp's add_special
        plain = llm.tokenize(data, add_bos=False, special=False)
        result["detokenized"].append(detokenize(llama_cpp, llm._model.vocab, plain).decode("utf-8", "replace"))
    Path(sys.argv[1]).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
