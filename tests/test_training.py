"""Training with the Hugging Face stack: Trainer, gradient accumulation, resume, checkpoints, checkpointing, packing.

Every comparison has an independent oracle: a plain PyTorch step, an uninterrupted run, the padded batch.
"""

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import enable_activation_checkpointing, random_ids, run_doc_blocks, run_without_hf_tfm, tiny_config
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from hf_tfm import AUTO_CLASSES, TfmForCausalLM, TfmForMaskedLM, TfmForSequenceClassification
from hf_tfm.training import CpuSample, FreeCoreThreads, PadCollator, cpu_sample, free_cores

EXPECTED_AUTO_MAP = {name: f"modeling.{cls.__name__}" for name, (_, cls) in AUTO_CLASSES.items()}
EXPECTED_AUTO_MAP["AutoConfig"] = "configuration.TfmConfig"


def lm_examples(lengths, seed=0, vocab_size=99):
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab_size, (n,), generator=generator).tolist()} for n in lengths]


def training_args(output_dir, **overrides):
    kwargs = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**kwargs, **overrides})


def seeded(model_class, seed=0, **config):
    torch.manual_seed(seed)
    return model_class(tiny_config(**config))


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_trainer_overfits_causal_lm(tmp_path):
    model = seeded(TfmForCausalLM)
    data = lm_examples([12] * 8)
    args = training_args(tmp_path, per_device_train_batch_size=8, max_steps=60, learning_rate=1e-2, warmup_steps=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PadCollator())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[0] > 4.0  # ~ln(99): an untrained model
    assert losses[-1] < 0.3, losses[-5:]
    # The trained model really memorised the set: greedy next tokens reproduce the sequences.
    batch = PadCollator()(data)
    with torch.no_grad():
        predicted = model.eval()(input_ids=batch["input_ids"]).logits.argmax(-1)
    accuracy = (predicted[:, :-1] == batch["input_ids"][:, 1:]).float().mean().item()
    assert accuracy > 0.95


def test_trainer_fine_tunes_encoder_classifier(tmp_path):
    model = seeded(TfmForSequenceClassification, is_causal=False, num_labels=2)
    data = lm_examples([4, 7, 10, 6] * 8, seed=1)
    for example in data:  # the label is a property of the whole sequence: does it contain a token below 20?
        example["labels"] = int(min(example["input_ids"]) < 20)
    assert 0.2 < sum(e["labels"] for e in data) / len(data) < 0.8

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    args = training_args(tmp_path, per_device_train_batch_size=8, max_steps=80, learning_rate=1e-2)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        data_collator=PadCollator(),
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < 0.2 < before["eval_loss"], (before, after)
    assert after["eval_accuracy"] == 1.0


def test_sequence_classifier_gradient_accumulation_is_exact(tmp_path):
    """Batch 1 x 4 accumulation steps == batch 4 x 1 step for the classifier, whose loss is a per-batch mean."""
    data = [{**example, "labels": i % 2} for i, example in enumerate(lm_examples([3, 11, 6, 15], seed=2))]
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant"}
    base = seeded(TfmForSequenceClassification, is_causal=False, num_labels=2)
    runs = {}
    for name, batch_size, accumulation in (("accumulated", 1, 4), ("batched", 4, 1)):
        model = copy.deepcopy(base)
        args = training_args(
            tmp_path / name,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=0.0,
            **common,
        )
        Trainer(model=model, args=args, train_dataset=data, data_collator=PadCollator()).train()
        runs[name] = model
    assert (
        max_param_diff(runs["accumulated"], runs["batched"]) < 2e-6
    )  # fp32 rounding of two summation orders: 1.07e-6 on an AMD EPYC
    assert max_param_diff(runs["batched"], base) > 1e-3  # it did train


def test_gradient_accumulation_is_exact(tmp_path):
    """Per-device batch 1 x 4 accumulation steps == batch 4 x 1 step == a plain step on the token-mean loss."""
    data = lm_examples([3, 11, 6, 15])  # variable lengths: padding and unequal token counts per micro-batch
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant"}
    common["max_grad_norm"] = 0.0
    base = seeded(TfmForCausalLM)
    runs = {}
    for name, batch_size, accumulation in (("accumulated", 1, 4), ("batched", 4, 1)):
        model = copy.deepcopy(base)
        args = training_args(
            tmp_path / name, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, **common
        )
        Trainer(model=model, args=args, train_dataset=data, data_collator=PadCollator()).train()
        runs[name] = model

    oracle = copy.deepcopy(base).train()
    oracle(**PadCollator()(data)).loss.backward()  # the mean over every real next-token of the 4 sequences
    naive = copy.deepcopy(base).train()  # what a per-micro-batch mean would do: average of per-sequence means
    sum(naive(**PadCollator()([example])).loss / 4 for example in data).backward()
    with torch.no_grad():
        for model in (oracle, naive):
            for p in model.parameters():
                p -= p.grad

    assert max_param_diff(runs["accumulated"], runs["batched"]) < 1e-6
    assert max_param_diff(runs["batched"], oracle) < 1e-6
    assert max_param_diff(runs["accumulated"], naive) > 1e-3  # the data tell the two normalisations apart


def test_resume_equals_uninterrupted_run_and_checkpoints_carry_code(tmp_path):
    data = lm_examples([5, 9, 12, 7, 6, 10, 8, 11] * 2)
    overrides = {
        "per_device_train_batch_size": 2,
        "max_steps": 8,
        "learning_rate": 1e-3,
        "save_strategy": "steps",
        "save_steps": 4,
    }
    full = seeded(TfmForCausalLM, hidden_dropout=0.1)  # dropout: the restored RNG state matters too
    Trainer(
        full, training_args(tmp_path / "full", **overrides), train_dataset=data, data_collator=PadCollator()
    ).train()

    resumed = seeded(TfmForCausalLM, seed=1, hidden_dropout=0.1)  # other init: the checkpoint must overwrite it
    trainer = Trainer(
        resumed, training_args(tmp_path / "resumed", **overrides), train_dataset=data, data_collator=PadCollator()
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    midway = TfmForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint-4")
    assert max_param_diff(midway, full) > 1e-4  # steps 5-8 did change the weights
    for p, q in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight

    checkpoints = sorted((tmp_path / "full").glob("checkpoint-*")) + sorted(
        (tmp_path / "resumed").glob("checkpoint-*")
    )
    assert [c.name for c in checkpoints] == ["checkpoint-4", "checkpoint-8", "checkpoint-8"]
    for checkpoint in checkpoints:
        assert (checkpoint / "configuration.py").is_file() and (checkpoint / "modeling.py").is_file()
        assert json.loads((checkpoint / "config.json").read_text())["auto_map"] == EXPECTED_AUTO_MAP

    probe = random_ids(2, 10).tolist()
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        out = {{}}
        for path in {[str(c) for c in checkpoints]!r}:
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            with torch.no_grad():
                out[path] = model(torch.tensor({probe})).logits.tolist()
        print(json.dumps(out))
    """
    logits = json.loads(run_without_hf_tfm(code, tmp_path).strip().splitlines()[-1])
    expected = {checkpoints[0]: midway, checkpoints[1]: full.eval(), checkpoints[2]: resumed.eval()}
    for checkpoint, model in expected.items():
        with torch.no_grad():
            reference = model(torch.tensor(probe)).logits
        assert torch.allclose(torch.tensor(logits[str(checkpoint)]), reference, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_gives_same_gradients(use_reentrant):
    base = seeded(TfmForCausalLM, hidden_dropout=0.1).train()  # dropout: checkpointing must replay the same masks
    batch = PadCollator()(lm_examples([6, 10, 8]))
    checkpointed = copy.deepcopy(base)
    enable_activation_checkpointing(checkpointed, {"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)

    calls = []
    checkpointed.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    grads = []
    for model in (base, checkpointed):
        torch.manual_seed(123)
        model(**batch).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert len(calls) == 2  # forward, then the recomputation in backward: checkpointing really happened
    for name, grad in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


POSITION_TYPES = ["rope", "alibi", "learned", "sinusoidal"]


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["decoder", "encoder"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_packing_matches_padding(position_embedding_type, is_causal, attn_implementation):
    """DataCollatorWithFlattening (one row, position_ids restarting per sequence) == the padded batch, per token."""
    model_class = TfmForCausalLM if is_causal else TfmForMaskedLM
    model = seeded(model_class, position_embedding_type=position_embedding_type, is_causal=is_causal)
    model.config._attn_implementation = attn_implementation
    model.train()  # as under Trainer: no cache is built (dropout is 0, so the forward is deterministic)
    lengths = [5, 9, 7]
    data = lm_examples(lengths, seed=3)

    packed = DataCollatorWithFlattening(return_tensors="pt")(data)
    assert packed["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in packed
    assert packed["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    padded = PadCollator()(data)
    with torch.no_grad():
        packed_out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"])
        padded_out = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])

    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    shift = 1 if is_causal else 0  # decoder: token t predicts t + 1; encoder (MLM-style): token t predicts itself
    for i, n in enumerate(lengths):
        ids = torch.tensor(data[i]["input_ids"])
        packed_logits = packed_out.logits[0, offsets[i] : offsets[i + 1]]
        padded_logits = padded_out.logits[i, :n]
        torch.testing.assert_close(packed_logits, padded_logits, rtol=0, atol=1e-5)
        targets = ids[shift:]
        packed_loss = torch.nn.functional.cross_entropy(packed_logits[: n - shift], targets, reduction="none")
        padded_loss = torch.nn.functional.cross_entropy(padded_logits[: n - shift], targets, reduction="none")
        torch.testing.assert_close(packed_loss, padded_loss, rtol=0, atol=1e-5)
    if is_causal:  # the model's own loss over the packed labels (-100 at every sequence start) == the padded loss
        with torch.no_grad():
            packed_model_loss = model(**packed).loss
            padded_model_loss = model(**padded).loss
        torch.testing.assert_close(packed_model_loss, padded_model_loss, rtol=0, atol=1e-6)


def test_trainer_step_with_packing_equals_padded_step(tmp_path):
    data = lm_examples([4, 13, 7, 9], seed=5)
    common = {"per_device_train_batch_size": 4, "max_steps": 1, "optim": "sgd", "learning_rate": 1.0}
    common["max_grad_norm"] = 0.0
    base = seeded(TfmForCausalLM, position_embedding_type="learned")
    models = {}
    for name, collator in (("packed", DataCollatorWithFlattening()), ("padded", PadCollator())):
        models[name] = copy.deepcopy(base)
        args = training_args(tmp_path / name, **common)
        Trainer(models[name], args, train_dataset=data, data_collator=collator).train()
    assert max_param_diff(models["packed"], base) > 1e-3
    assert max_param_diff(models["packed"], models["padded"]) < 1e-6


def test_docs_training_blocks(tmp_path, monkeypatch):
    """The docs' Trainer and LoRA blocks run as written (in one namespace, in a scratch directory)."""
    threads = torch.get_num_threads()
    namespace = run_doc_blocks("training", 4, tmp_path, monkeypatch)
    assert torch.get_num_threads() == threads  # FreeCoreThreads' block restored it
    final = tmp_path / "out" / "finetune" / "final"
    assert json.loads((final / "config.json").read_text())["auto_map"] == EXPECTED_AUTO_MAP
    assert (final / "modeling.py").is_file() and (tmp_path / "out" / "lora" / "adapter_config.json").is_file()
    train_loss = namespace["trainer"].state.log_history[-1]["train_loss"]
    assert train_loss < 4.0, train_loss  # ln(99) = 4.6 untrained; the mean over 20 steps is 3.5
    assert type(namespace["merged"]) is TfmForCausalLM


def test_free_cores_leaves_out_what_other_processes_used():
    start = CpuSample(cores=2, wall=10.0, busy_s=100.0, own_s=50.0)
    at = lambda busy, own, cores=2: CpuSample(cores, 11.0, 100.0 + busy, 50.0 + own)  # noqa: E731 (1 s later)
    assert free_cores(start, at(busy=1.3, own=1.3)) == 2  # only this process ran
    assert free_cores(start, at(busy=1.7, own=1.3)) == 2  # others used 0.4 of a core: not taken
    assert free_cores(start, at(busy=2.0, own=1.3)) == 1  # another process had 0.7 of a core
    assert free_cores(start, at(busy=2.0, own=0.0)) == 1  # both cores taken: still one thread
    assert free_cores(CpuSample(4, 10.0, 100.0, 50.0), at(busy=3.6, own=2.0, cores=4)) == 2


def test_cpu_sample_reads_the_cores_this_process_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    hz = os.sysconf("SC_CLK_TCK")
    lines = ["cpu  9 9 9 9 9 9 9 9 9 9"]  # the machine's total: not counted again
    lines += [f"cpu{c} 10 1 5 1000 7 2 3 4 6 0" for c in allowed]  # busy 10+1+5+2+3+4; guest 6 is inside user
    lines += [f"cpu{allowed[-1] + 1} 500 0 0 0 0 0 0 0 0 0", "intr 123 4 5", "ctxt 99"]
    sample = cpu_sample("\n".join(lines))
    assert sample.cores == len(allowed)
    assert sample.busy_s == pytest.approx(25 * len(allowed) / hz)


def test_free_core_threads_restores_the_thread_count():
    before = torch.get_num_threads()
    with FreeCoreThreads() as threads:
        torch.set_num_threads(1)
        assert threads.max_threads == before
    assert torch.get_num_threads() == before


@pytest.mark.slow  # the lanes that deselect slow tests run beside another one: a busy machine
@pytest.mark.solo
def test_free_core_threads_gives_a_busy_process_its_core_and_takes_it_back():
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores")
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # the other process is running
            with FreeCoreThreads() as threads:
                threads.adapt()
                time.sleep(0.5)
                threads.adapt()
                assert torch.get_num_threads() == cores - 1
                hog.kill()
                hog.wait()
                threads.adapt()
                time.sleep(0.5)
                threads.adapt()
                assert torch.get_num_threads() == cores
                torch.set_num_threads(1)
            assert torch.get_num_threads() == cores  # as the block found it
        finally:
            hog.kill()
    finally:
        torch.set_num_threads(before)
