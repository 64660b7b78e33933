"""transformers' side of a GGUF export's verification (`hf_tfm.exporters.gguf`): the in-tree model transformers builds
from the file alone, its greedy tokens, and its logits on the reference sequences. It imports nothing of hf_tfm.

llama files with experts are Mixtral's block, which transformers' GGUF loader does not read: an in-tree Mixtral is
built from the file's keys and tensors (dequantized by the gguf package, q/k rows permuted back), as its loader does
for Llama.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's adjacent pairs -> rotate-half rows, per head."""
    pairs = weight.reshape(heads, weight.shape[0] // heads // 2, 2, weight.shape[1])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def mixtral(path: str, overrides: dict):
    import gguf
    from transformers import MixtralConfig, MixtralForCausalLM

    reader = gguf.GGUFReader(path)

    def key(name: str):
        return reader.fields["llama." + name].parts[-1][0].item()

    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        tensors[t.name] = torch.from_numpy(data.copy()).float()
    heads, kv_heads = key("attention.head_count"), key("attention.head_count_kv")
    from_file = {
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": key("attention.key_length"),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base")},
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    config = MixtralConfig(**(from_file | overrides))  # what the file does not say (llama3 RoPE) as the caller read it
    state = {
        "model.embed_tokens.weight": tensors["token_embd.weight"],
        "model.norm.weight": tensors["output_norm.weight"],
        "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"]),
    }
    for i in range(config.num_hidden_layers):
        blk, layer = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            layer + "input_layernorm.weight": tensors[blk + "attn_norm.weight"],
            layer + "post_attention_layernorm.weight": tensors[blk + "ffn_norm.weight"],
            layer + "self_attn.q_proj.weight": unpermute(tensors[blk + "attn_q.weight"], heads),
            layer + "self_attn.k_proj.weight": unpermute(tensors[blk + "attn_k.weight"], kv_heads),
            layer + "self_attn.v_proj.weight": tensors[blk + "attn_v.weight"],
            layer + "self_attn.o_proj.weight": tensors[blk + "attn_output.weight"],
            layer + "mlp.gate.weight": tensors[blk + "ffn_gate_inp.weight"],
            layer + "mlp.experts.gate_up_proj": torch.cat(
                [tensors[blk + "ffn_gate_exps.weight"], tensors[blk + "ffn_up_exps.weight"]], dim=1
            ),
            layer + "mlp.experts.down_proj": tensors[blk + "ffn_down_exps.weight"],
        }
    model = MixtralForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model


def run(args: dict) -> dict:
    path = Path(args["path"])
    if args["mixtral"]:
        model = mixtral(str(path), args["overrides"])
    else:
        options = {"gguf_file": path.name, "dtype": torch.float32, **args["overrides"]}
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), **options)
    model.eval()
    result = {"class": type(model).__name__, "tokens": [], "logits": []}
    n = args["max_new_tokens"]  # exactly n new tokens, EOS suppressed until then, as hf_tfm's references
    greedy = {"do_sample": False, "max_new_tokens": n, "min_new_tokens": n, "pad_token_id": args["pad_token_id"]}
    with torch.no_grad():
        for prompt, reference in zip(args["prompts"], args["references"], strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
            result["tokens"].append(out[0, len(prompt) :].tolist())
            result["logits"].append(model(torch.tensor([reference])).logits[0])
    return result
