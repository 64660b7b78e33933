"""CTranslate2's side of a CTranslate2 export's verification (`hf_tfm.exporters.ctranslate2`): greedy tokens and the
logits of the reference sequences (a Generator or a Translator), or an Encoder's outputs on a batch. It imports neither
torch nor hf_tfm (two OpenMP runtimes in one process slow each other down).
"""

import json
import os

import ctranslate2
import numpy as np


def vocabulary(path: str, side: str) -> list[str]:
    """The token strings of a Translator's `side` ("source" or "target"): the shared vocabulary, else the side's."""
    shared = os.path.join(path, "shared_vocabulary.json")
    name = shared if os.path.exists(shared) else os.path.join(path, side + "_vocabulary.json")
    with open(name, encoding="utf-8") as file:
        return json.load(file)


def greedy(args: dict) -> dict:
    """Greedy decoding that stops at the end ids, which come back in the result."""
    return {"beam_size": 1, "sampling_topk": 1, "end_token": args["end_ids"], "return_end_token": True}


def run_encoder(args: dict) -> dict:
    """Each output of the Encoder on the prompts as one batch (CTranslate2 pads it): name -> (B, ...) lists."""
    encoder = ctranslate2.Encoder(args["path"], device="cpu", compute_type="default", intra_threads=2)
    prompts = args["prompts"]
    types = [[0] * len(p) for p in prompts] if args["token_types"] else None
    out = encoder.forward_batch(prompts, token_type_ids=types)
    result = {"compute_type": encoder.compute_type, "last_hidden_state": np.asarray(out.last_hidden_state).tolist()}
    if out.pooler_output is not None:
        result["pooler_output"] = np.asarray(out.pooler_output).tolist()
    return result


def run_generator(args: dict) -> dict:
    """A causal LM's greedy tokens after each prompt, and its logits on each reference sequence."""
    path, n = args["path"], args["max_new_tokens"]
    generator = ctranslate2.Generator(path, device="cpu", compute_type="default", intra_threads=2)
    with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as file:
        tokens = json.load(file)
    result = {"compute_type": generator.compute_type, "tokens": [], "logits": []}
    for prompt, reference in zip(args["prompts"], args["references"], strict=True):
        # min_length = max_length = n: the end tokens are disabled until the n-th token, as min_new_tokens does
        (out,) = generator.generate_batch(
            [[tokens[i] for i in prompt]], max_length=n, min_length=n, include_prompt_in_result=False, **greedy(args)
        )
        result["tokens"].append(out.sequences_ids[0])
        result["logits"].append(np.asarray(generator.forward_batch([reference]))[0].tolist())
    return result


def run_translator(args: dict) -> dict:
    """An encoder-decoder's greedy tokens from each prompt as the source, and the logits of each step with the
    reference forced as the target prefix."""
    path, n = args["path"], args["max_new_tokens"]
    translator = ctranslate2.Translator(path, device="cpu", compute_type="default", intra_threads=2)
    source, target = vocabulary(path, "source"), vocabulary(path, "target")
    ids = {token: i for i, token in enumerate(target)}
    result = {"compute_type": translator.compute_type, "tokens": [], "logits": []}
    for prompt, reference in zip(args["prompts"], args["references"], strict=True):
        source_tokens = [[source[i] for i in prompt]]
        (out,) = translator.translate_batch(
            source_tokens, max_decoding_length=n, min_decoding_length=n, **greedy(args)
        )
        result["tokens"].append([ids[token] for token in out.hypotheses[0]])
        # The raw logits of every step (no end token disabled)
        forced = [[target[i] for i in reference[1:]]]
        (out,) = translator.translate_batch(
            source_tokens,
            forced,
            max_decoding_length=len(reference) - 1,
            min_decoding_length=0,
            return_logits_vocab=True,
            **greedy(args),
        )
        result["logits"].append([np.asarray(step).tolist() for step in out.logits[0]])
    return result


def run(args: dict) -> dict:
    if args.get("encoder"):
        return run_encoder(args)
    return run_translator(args) if args["seq2seq"] else run_generator(args)
