"""A checkpoint saved under one supported transformers release loads through its remote code under the others.

`make test-matrix` gives each supported release an environment of its own (.venv, .venv-transformers-X.Y.Z). This
file saves a checkpoint with the release running the tests, then loads it in every other environment present, where
hf_tfm is blocked so only the checkpoint's own code can run, and compares logits and greedy tokens. Run under each
release in turn, it covers both directions (newest -> oldest and back).
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import build, random_ids, run_without_hf_tfm, tiny_config

from hf_tfm import TfmForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OTHERS = sorted(
    python
    for python in ROOT.glob(".venv*/bin/python")
    # vLLM's and llama.cpp's environments are runtimes' own: no hf_tfm test environment (llama.cpp's has no torch)
    if python.parent.parent.name not in (".venv-vllm", ".venv-llama-cpp") and python.parent.parent != Path(sys.prefix)
)

pytestmark = pytest.mark.slow

LOAD = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM
folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    logits = model(input_ids=ids).logits
    tokens = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
print(json.dumps({"version": transformers.__version__, "logits": logits.tolist(), "tokens": tokens.tolist()}))
"""


@pytest.mark.skipif(not OTHERS, reason="no other release's environment: `make test-matrix` creates them")
@pytest.mark.parametrize("python", OTHERS, ids=lambda p: p.parent.parent.name)
@pytest.mark.parametrize("variant", [{}, {"position_embedding_type": "learned", "norm_position": "post"}])
def test_checkpoint_loads_under_another_release(python, variant, tmp_path):
    model = build(TfmForCausalLM, tiny_config(**variant))
    model.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(2, 7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    code = f"import sys; sys.argv = ['x', {str(tmp_path / 'ckpt')!r}, {json.dumps(ids.tolist())!r}]\n" + LOAD
    result = json.loads(run_without_hf_tfm(code, tmp_path, python=str(python)).strip().splitlines()[-1])
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=1e-5, rtol=0)
    assert result["tokens"] == tokens.tolist()
