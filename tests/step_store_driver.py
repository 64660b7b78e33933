"""A fresh process decoding with a folder whose step another process compiled (tests/test_step_store.py runs it by
path): `python step_store_driver.py FOLDER QUANTIZE BATCH` prints, as JSON, the libraries this process compiled
(none when the store had them), the calls they ran, and the greedy tokens."""

import json
import sys

import torch

from hf_tfm import load_for_inference
from hf_tfm.inference import precompile


def main() -> None:
    folder, quantize, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = load_for_inference(folder, quantize=None if quantize == "none" else quantize)
    compiled = precompile(model, (batch,), verify=False)
    ids = torch.arange(1, 1 + 6 * batch).view(batch, 6) % model.config.vocab_size
    tokens = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    print(json.dumps({"compiled": compiled, "calls": model.compiled_decode_step.calls, "tokens": tokens.tolist()}))


if __name__ == "__main__":
    main()
