"""The check that a folder hf_tfm has just written stands alone (`hf_tfm.training.generate_in_fresh_process`): loaded
with `AutoModelForCausalLM(trust_remote_code=True)` in a process where hf_tfm cannot be imported, so only the
folder's own copied code (`configuration.py`, `modeling.py`) can build the model, it samples a continuation of each
prompt. It runs that code: it is given only such a folder, never one from elsewhere.
"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def run(args: dict) -> dict:
    """`{"class": the loaded model's module and class, "generations": one continuation per prompt}` of the folder
    `args["path"]`, each sampled from `args["seed"]`, `args["max_new_tokens"]` long at most."""
    folder = args["path"]
    # our own folder, just written: its code is what is being tested
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    outputs = []
    for prompt in args["prompts"]:
        torch.manual_seed(args["seed"])
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**inputs, max_new_tokens=args["max_new_tokens"])
        outputs.append(tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return {"class": f"{type(model).__module__}.{type(model).__name__}", "generations": outputs}
