"""ONNX Runtime's side of an ONNX export (`hf_tfm.exporters.onnx`), with onnxruntime and numpy alone (no torch): a
causal LM's or an encoder-decoder's greedy decoding, an encoder's outputs on a padded batch.

Written beside a generating model's graphs as `ort_generate.py` (`OnnxGenerator(folder).generate(prompts,
max_new_tokens)`), and run as verification's program: `run(args)`.
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime


def padded(prompts: list[list[int]], pad: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """`prompts` as one batch of ids padded with `pad` on the left or the right, and its attention mask."""
    length = max(len(p) for p in prompts)
    ids, mask = [], []
    for prompt in prompts:
        fill = length - len(prompt)
        ids.append([pad] * fill + list(prompt) if left else list(prompt) + [pad] * fill)
        mask.append([0] * fill + [1] * len(prompt) if left else [1] * len(prompt) + [0] * fill)
    return np.array(ids, dtype=np.int64), np.array(mask, dtype=np.int64)


def session_options(threads: int | None = None) -> onnxruntime.SessionOptions:
    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return options


class OnnxGenerator:
    """Greedy decoding over an hf_tfm ONNX export, with onnxruntime and numpy alone: a causal LM's prefill.onnx and
    decode.onnx, or an encoder-decoder's encoder.onnx, prefill.onnx and decode.onnx."""

    def __init__(self, folder, threads=None):
        folder = Path(folder)
        self.manifest = json.loads((folder / "onnx_export.json").read_text())
        options = session_options(threads)
        self.sessions = {
            name: onnxruntime.InferenceSession(str(folder / part["file"]), options, providers=["CPUExecutionProvider"])
            for name, part in self.manifest["components"].items()
        }
        self.seq2seq = "encoder" in self.sessions

    def _feed(self, name, values, cache=()):
        """Run one graph on `values` (by input name) and the cache; its logits and the new cache, layer by layer."""
        part = self.manifest["components"][name]
        constants = part.get("constants", {})  # what an empty cache holds (a sliding layer's window)
        cached = [n for n in part["inputs"] if n not in values and n not in constants]
        feed = {n: values[n] for n in part["inputs"] if n in values}
        feed.update({n: np.array(v, dtype=np.int64) for n, v in constants.items()})
        feed.update(zip(cached, cache, strict=True))
        outputs = dict(zip(part["outputs"], self.sessions[name].run(None, feed), strict=True))
        return outputs["logits"], [x for n, x in outputs.items() if ".layers." in n]

    def prefill(self, prompts, decoder=None):
        """`prompts` (lists of ids) as one padded batch: the logits (B, T, V), the cache and the state decoding needs.
        An encoder-decoder encodes them and reads `decoder` (the start token when None)."""
        if self.seq2seq:
            ids, mask = padded(prompts, self.manifest["pad_token_id"] or 0, left=False)
            (hidden,) = self.sessions["encoder"].run(None, {"input_ids": ids, "attention_mask": mask})
            start = [[self.manifest["decoder_start_token_id"]]] * len(prompts)
            state = {"attention_mask": mask, "encoder_outputs.last_hidden_state": hidden}
            logits, cache = self._feed("prefill", {**state, "decoder_input_ids": np.array(decoder or start)}, ())
            return logits, cache, state
        ids, mask = padded(prompts, self.manifest["pad_token_id"] or 0, left=True)
        positions = np.where(mask == 0, 1, mask.cumsum(-1) - 1)  # as generate() numbers them
        logits, cache = self._feed("prefill", {"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        return logits, cache, {"attention_mask": mask}

    def generate(self, prompts, max_new_tokens, suppress=(), on_token=None):
        """Greedy continuations of `prompts`, `max_new_tokens` each (`suppress`: ids never chosen, e.g. EOS);
        `on_token(tokens)`, when given, receives each step's (B,) ids as they are chosen (streaming)."""
        logits, cache, state = self.prefill(prompts)
        new = []
        for _ in range(max_new_tokens):
            step = logits[:, -1].copy()
            step[:, list(suppress)] = -np.inf
            token = step.argmax(-1)[:, None].astype(np.int64)  # (B, 1)
            new.append(token)
            if on_token is not None:
                on_token(token[:, 0].tolist())
            if self.seq2seq:  # the encoder's states and mask stay; the decoder's positions come from its cache
                values = {**state, "decoder_input_ids": token}
            else:
                mask = state["attention_mask"]
                positions = mask.sum(-1, keepdims=True)  # the next position of each sequence, padding not counted
                state = {"attention_mask": np.concatenate([mask, np.ones_like(token)], axis=1)}
                values = {**state, "input_ids": token, "position_ids": positions}
            logits, cache = self._feed("decode", values, cache)
        return np.concatenate(new, axis=1).tolist()


def run_encoder(args: dict) -> dict:
    """The export's outputs on `prompts` as one right-padded batch: name -> (B, ...) nested lists."""
    folder = Path(args["path"])
    manifest = json.loads((folder / "onnx_export.json").read_text())
    options = session_options(args.get("threads"))
    session = onnxruntime.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ids, mask = padded(args["prompts"], manifest["pad_token_id"] or 0, left=False)
    values = {"input_ids": ids, "attention_mask": mask}
    outputs = session.run(None, {i.name: values[i.name] for i in session.get_inputs()})
    return {o.name: x.tolist() for o, x in zip(session.get_outputs(), outputs, strict=True)}


def run(args: dict) -> dict:
    """Verification's program: an encoder's outputs (`run_encoder`), or greedy tokens of all prompts decoded as one
    batch and the prefill logits of each reference sequence."""
    if args.get("encoder"):
        return run_encoder(args)
    generator = OnnxGenerator(args["path"], threads=args.get("threads"))
    tokens = generator.generate(args["prompts"], args["max_new_tokens"], args["suppress"])
    if generator.seq2seq:  # the reference decoder sequences after each source
        pairs = zip(args["prompts"], args["references"], strict=True)
        logits = [generator.prefill([prompt], decoder=[reference])[0][0] for prompt, reference in pairs]
    else:
        logits = [generator.prefill([reference])[0][0] for reference in args["references"]]
    return {"tokens": tokens, "logits": [x.tolist() for x in logits]}
