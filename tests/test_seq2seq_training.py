"""The encoder-decoder with the training stack: Seq2SeqTrainer, gradient accumulation, activation checkpointing,
DataCollatorForSeq2Seq, PEFT LoRA, saving, and the remote-code round trip.

Oracles: a plain PyTorch step on the token-mean loss, the model without checkpointing, the merged weights' logits,
the saved model's own logits, and the checkpoint loaded where hf_tfm cannot be imported.
"""

import copy
import json

import pytest
import torch
from conftest import (
    build,
    enable_activation_checkpointing,
    random_ids,
    run_doc_blocks,
    run_without_hf_tfm,
    tiny_config,
    tiny_seq2seq_config,
)
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import (
    AutoModel,
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from hf_tfm import TfmForCausalLM, TfmForConditionalGeneration, TfmModel, TfmSeq2SeqModel
from hf_tfm.modeling import SEQ2SEQ_AUTO_MAP
from hf_tfm.tokenization import train_bpe_tokenizer
from hf_tfm.training import PadCollator, seq2seq_from_causal_lm

EOS = 2


def copy_task(n: int, seed: int = 0) -> list[dict]:
    """Source: 3-6 random tokens; target: the same tokens, then EOS."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(3, 7, (1,), generator=generator))
        tokens = torch.randint(3, 20, (length,), generator=generator).tolist()
        examples.append({"input_ids": tokens, "labels": [*tokens, EOS]})
    return examples


def args(tmp_path, **overrides) -> Seq2SeqTrainingArguments:
    kwargs = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    return Seq2SeqTrainingArguments(**{**kwargs, **overrides})


def seeded(seed: int = 0, **overrides) -> TfmForConditionalGeneration:
    torch.manual_seed(seed)
    return TfmForConditionalGeneration(tiny_seq2seq_config(**overrides))


def max_param_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_save_load_is_bit_exact_and_names_the_seq2seq_classes(tmp_path):
    model = build(TfmForConditionalGeneration, tiny_seq2seq_config({"position_embedding_type": "alibi"}))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == SEQ2SEQ_AUTO_MAP and saved["model_type"] == "hf_tfm_seq2seq"
    assert {p.name for p in tmp_path.iterdir()} >= {"configuration.py", "modeling.py", "generation_config.json"}
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is TfmForConditionalGeneration
    assert loaded.lm_head.weight is loaded.model.encoder.embed_tokens.weight  # stored once, tied again
    src, tgt = random_ids(2, 7), random_ids(2, 5, seed=1)
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=src, decoder_input_ids=tgt).logits, model(input_ids=src, decoder_input_ids=tgt).logits
        )
    backbone = AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(backbone) is TfmSeq2SeqModel
    with torch.no_grad():
        hidden = backbone(input_ids=src, decoder_input_ids=tgt).last_hidden_state
    assert torch.equal(hidden, model.model(input_ids=src, decoder_input_ids=tgt).last_hidden_state)


@pytest.mark.slow
def test_seq2seq_trainer_learns_a_copy_task_and_its_checkpoint_loads(tmp_path):
    train, test = copy_task(32), copy_task(8, seed=1)
    model = seeded()

    def exact_match(prediction) -> dict:
        hits = []
        for generated, labels in zip(prediction.predictions, prediction.label_ids, strict=True):
            target = [t for t in labels if t not in (-100, 0)]  # Seq2SeqTrainer pads labels with pad (0) too
            hits.append(list(generated[1 : 1 + len(target)]) == target)  # after the decoder start token
        return {"exact_match": sum(hits) / len(hits)}

    trainer = Seq2SeqTrainer(
        model=model,
        args=args(
            tmp_path,
            per_device_train_batch_size=8,
            max_steps=150,
            learning_rate=1e-2,
            predict_with_generate=True,
            generation_max_length=10,
            save_strategy="steps",
            save_steps=150,
        ),
        train_dataset=train,
        eval_dataset=train,
        data_collator=PadCollator(),
        compute_metrics=exact_match,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_exact_match"] >= 0.9 > before["eval_exact_match"], (before, after)
    assert after["eval_loss"] < 0.2 < before["eval_loss"]
    checkpoint = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "checkpoint-150").eval()
    batch = PadCollator()(test)
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    assert torch.equal(checkpoint.generate(**inputs, **kwargs), model.eval().generate(**inputs, **kwargs))


def test_gradient_accumulation_is_exact(tmp_path):
    """Batch 1 x 4 accumulation steps == batch 4 x 1 step == a plain step on the mean over every target token."""
    data = [{"input_ids": e["input_ids"], "labels": e["labels"][: 2 + i * 2]} for i, e in enumerate(copy_task(4))]
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant"}
    base = seeded()
    runs = {}
    for name, batch_size, accumulation in (("accumulated", 1, 4), ("batched", 4, 1)):
        model = copy.deepcopy(base)
        training = args(
            tmp_path / name,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=0.0,
            **common,
        )
        Seq2SeqTrainer(model=model, args=training, train_dataset=data, data_collator=PadCollator()).train()
        runs[name] = model
    oracle, naive = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    oracle(**PadCollator()(data)).loss.backward()
    sum(naive(**PadCollator()([example])).loss / 4 for example in data).backward()  # a per-micro-batch mean
    with torch.no_grad():
        for model in (oracle, naive):
            for p in model.parameters():
                p -= p.grad
    assert max_param_diff(runs["accumulated"], runs["batched"]) < 1e-6
    assert max_param_diff(runs["batched"], oracle) < 1e-6
    assert max_param_diff(runs["accumulated"], naive) > 1e-3  # the data tell the two normalisations apart


def test_activation_checkpointing_gives_the_same_gradients():
    batch = PadCollator()(copy_task(3))
    grads = []
    for checkpointing in (False, True):
        model = seeded(encoder={"hidden_dropout": 0.0}).train()
        if checkpointing:
            enable_activation_checkpointing(model, {"use_reentrant": True})  # reentrant: only args carry gradients
        model(**batch).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert grads[1]["model.encoder.layers.0.self_attn.q_proj.weight"].abs().sum() > 0  # through cross-attention
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_data_collator_for_seq2seq_builds_the_decoder_inputs():
    tokenizer = train_bpe_tokenizer(["def read(path): return open(path).read()"] * 4, vocab_size=300)
    model = build(
        TfmForConditionalGeneration,
        tiny_seq2seq_config({"vocab_size": len(tokenizer)}, {"vocab_size": len(tokenizer)}),
    )
    features = [tokenizer(text, text_target=name) for text, name in (("open a file", "read"), ("close it", "close"))]
    batch = DataCollatorForSeq2Seq(tokenizer, model=model, return_tensors="pt")(features)
    assert torch.equal(batch["decoder_input_ids"], model.prepare_decoder_input_ids_from_labels(labels=batch["labels"]))
    assert (batch["labels"] == -100).any()  # the shorter target is padded with the ignored label
    with torch.no_grad():
        out = model(**batch)
    expected = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)


def test_lora_on_self_and_cross_attention_trains_saves_loads_and_merges(tmp_path):
    model = seeded().eval()
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=TaskType.SEQ_2_SEQ_LM))
    adapted = {name.split(".lora_A")[0] for name, _ in lora.named_parameters() if ".lora_A" in name}
    assert any(".encoder_attn.q_proj" in name for name in adapted) and any(
        ".self_attn.v_proj" in name for name in adapted
    )
    assert len(adapted) == 2 * 3 + 2 * 2 * 2  # encoder: 3 layers x (q, v); decoder: 2 layers x 2 attentions x (q, v)
    batch = PadCollator()(copy_task(8))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    losses = []
    for _ in range(10):
        loss = lora(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lora.eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = lora(**inputs, labels=batch["labels"]).logits
    generated = lora.generate(**inputs, max_new_tokens=6, do_sample=False)
    lora.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(seeded().eval(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs, labels=batch["labels"]).logits, expected, atol=0, rtol=0)
    assert torch.equal(reloaded.generate(**inputs, max_new_tokens=6, do_sample=False), generated)
    merged = reloaded.merge_and_unload()
    assert type(merged) is TfmForConditionalGeneration
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs, labels=batch["labels"]).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_remote_code_round_trip_without_hf_tfm(tmp_path):
    """Where hf_tfm cannot be imported, the folder's own code loads it: same logits, same beam search."""
    model = build(
        TfmForConditionalGeneration, tiny_seq2seq_config({"norm_position": "post"}, {"num_key_value_heads": 2})
    )
    model.save_pretrained(tmp_path / "s2s")
    src = random_ids(2, 6)
    torch.save(src, tmp_path / "src.pt")
    code = """
    import json, torch
    from transformers import AutoModel, AutoModelForSeq2SeqLM
    src = torch.load("src.pt")
    kwargs = {"trust_remote_code": True, "attn_implementation": "eager"}
    model = AutoModelForSeq2SeqLM.from_pretrained("s2s", **kwargs).eval()
    backbone = AutoModel.from_pretrained("s2s", **kwargs)
    with torch.no_grad():
        torch.save(model(input_ids=src, decoder_input_ids=src).logits, "logits.pt")
    beams = model.generate(input_ids=src, max_new_tokens=5, num_beams=2, do_sample=False)
    modules = [type(model).__module__, type(backbone).__name__]
    print("RESULT:" + json.dumps({"modules": modules, "beams": beams.tolist()}))
    """
    result = json.loads(run_without_hf_tfm(code, tmp_path).split("RESULT:")[-1])
    assert result["modules"][0].startswith("transformers_modules.") and result["modules"][1] == "TfmSeq2SeqModel"
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), model(input_ids=src, decoder_input_ids=src).logits)
    assert result["beams"] == model.generate(input_ids=src, max_new_tokens=5, num_beams=2, do_sample=False).tolist()


def test_docs_seq2seq_blocks(tmp_path, monkeypatch):
    """The docs' encoder-decoder blocks run as written (in one namespace, in a scratch directory)."""
    namespace = run_doc_blocks("seq2seq", 3, tmp_path, monkeypatch)
    assert namespace["model"].config.encoder.num_hidden_layers == 3
    assert namespace["beams"].shape[0] == 4 and namespace["greedy"].shape[0] == 2
    assert torch.equal(namespace["again"], namespace["greedy"]) and torch.equal(
        namespace["static"], namespace["greedy"]
    )


def test_seq2seq_warm_started_from_a_causal_lm(tmp_path):
    """Both sides get the LM's blocks and embeddings (the encoder bidirectional), the head stays; only the decoder's
    cross-attention is new (Rothe et al.). It saves and loads like any seq2seq model."""
    lm = build(TfmForCausalLM, tiny_config(num_key_value_heads=2, tie_word_embeddings=False, lm_head_bias=True))
    model = seq2seq_from_causal_lm(lm).eval()
    bidirectional = build(TfmModel, tiny_config(num_key_value_heads=2, is_causal=False))
    bidirectional.load_state_dict(lm.model.state_dict())
    ids = random_ids(2, 6)
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids).last_hidden_state
        torch.testing.assert_close(encoded, bidirectional(input_ids=ids).last_hidden_state, atol=0, rtol=0)
    decoder = model.model.decoder.state_dict()
    for name, tensor in lm.model.state_dict().items():
        assert torch.equal(decoder[name], tensor), name
    assert torch.equal(model.lm_head.weight, lm.lm_head.weight) and torch.equal(model.lm_head.bias, lm.lm_head.bias)
    assert model.config.share_encoder_decoder_embeddings and model.config.decoder.add_cross_attention
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.get_encoder()(input_ids=ids).last_hidden_state, encoded, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not an hf_tfm causal LM"):
        seq2seq_from_causal_lm(build(TfmModel, tiny_config(is_causal=False)))
