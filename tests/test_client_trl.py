"""TRL (SFTTrainer, DPOTrainer, GRPOTrainer) training hf_tfm models, dense and mixture-of-experts, from saved folders.

Oracles: the in-tree copy of the same weights (`hf_tfm.to_hf`: Llama, Mixtral) trained by the same trainer with the
same data and seed (every logged number of two steps equal: loss, gradient norm, router aux loss, DPO log-probs, GRPO
entropy and rewards, GRPO's sampled completions), and each first step's numbers computed by hand from the trained
model's logits (hf_tfm's for the hf_tfm run, the copy's for the copy's) on the batch the trainer used: the token-mean
cross-entropy (plus `router_aux_loss_coef` times the load-balancing loss of transformers' Mixtral for an MoE model), a
packed padding-free batch's loss as its sequences' run one by one, DPO's summed completion log-probs, GRPO's entropy
and loss.

TRL decides a model has experts when its config has `output_router_logits` (`trl/trainer/sft_trainer.py:1205`): then
it asks for router logits and adds their load-balancing loss. A dense config without that attribute trains as a dense
model; an MoE one adds the aux loss, as in-tree Mixtral does. Nothing here passes `router_aux_loss_coef`: TRL's
defaults must work.

The in-process runs load the folders into the registered hf_tfm classes; the `slow` test runs the same scenarios in one
subprocess where hf_tfm cannot be imported, so the folder's copied code trains (`trust_remote_code`), and compares.
"""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from client_trl_runs import SCENARIOS, lines, run_all
from conftest import build, run_without_hf_tfm, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import hf_tfm
from hf_tfm import TfmForCausalLM
from hf_tfm.tokenization import train_bpe_tokenizer

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # pin_memory without an accelerator, PEFT's notes
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # transformers' renamed knobs, as TRL still sets them
]

ATOL = 1e-5
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 16}
MOE |= {"router_weights_fp32": True}  # Mixtral's: what makes the config expressible as in-tree Mixtral
ARCHS = {"dense": ({}, "llama"), "moe": (MOE, "mixtral")}  # hf_tfm folder -> (config overrides, in-tree folder)
# PEFT's "all-linear" picks `nn.Linear` modules: hf_tfm's router and experts are parameters, so an hf_tfm MoE gets
# adapters on the attention projections only. In-tree Mixtral's are parameters too, but PEFT rewrites "all-linear"
# for model_type "mixtral" (its transformers v4 layout, `peft/utils/transformers_weight_conversion.py`) to reach the
# experts and router as well; the reference run names hf_tfm's targets instead.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FIRST_STEP = ("sft", "packing", "lora", "dpo", "grpo")  # the float32 scenarios whose first step is computed by hand
COMPARED = [(arch, name) for arch in ARCHS for name in SCENARIOS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer trained on the data's text; each architecture saved as hf_tfm and as its in-tree copy."""
    root = tmp_path_factory.mktemp("trl")
    tokenizer = train_bpe_tokenizer(lines(), vocab_size=300)
    saved = {}
    for arch, (overrides, in_tree_name) in ARCHS.items():
        model = build(TfmForCausalLM, tiny_config(vocab_size=len(tokenizer), num_key_value_heads=2, **overrides))
        for name, copy in ((arch, model), (in_tree_name, hf_tfm.to_hf(model))):
            copy.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            saved[name] = root / name
    return saved


@pytest.fixture(scope="module")
def runs(folders) -> dict:
    """Every scenario on every folder, in this process (hf_tfm's registered classes load the hf_tfm folders)."""
    return run_all({name: str(path) for name, path in folders.items()}, lora_targets={"mixtral": ATTENTION})


@pytest.fixture(scope="module")
def models(folders) -> dict:
    """Every folder's model (hf_tfm's classes, the in-tree ones), in float32, for the numbers computed by hand."""
    return {name: AutoModelForCausalLM.from_pretrained(path).eval() for name, path in folders.items()}


@pytest.fixture(scope="module")
def remote_runs(folders, tmp_path_factory) -> dict:
    """Every scenario on the hf_tfm folders, in one subprocess where hf_tfm cannot be imported."""
    hf_tfm_folders = {arch: str(folders[arch]) for arch in ARCHS}
    code = f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})  # for this helper, which imports nothing of hf_tfm
        from client_trl_runs import run_all
        print("RESULT", json.dumps(run_all({hf_tfm_folders!r})))
    """
    out = run_without_hf_tfm(code, tmp_path_factory.mktemp("remote"), timeout=600)
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])


# ---------------------------------------------------------------------------------------------------------------------
# The numbers by hand, from a model's logits on the batch the trainer used


def experts(config) -> int | None:
    """The experts of an MoE layer (hf_tfm's `num_experts`, Mixtral's `num_local_experts`); None: a dense model."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)


def forward(model, input_ids, **kwargs):
    """float64 logits, and the router logits of an MoE model (None for a dense one)."""
    moe = experts(model.config) is not None
    with torch.no_grad():
        out = model(input_ids=input_ids, **kwargs, **({"output_router_logits": True} if moe else {}))
    return out.logits.double(), (out.router_logits if moe else None)


def token_logps(logits, input_ids):
    """log p(token t | tokens before t) for t >= 1: (batch, length - 1)."""
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def with_aux(model, numbers: dict, router_logits, attention_mask) -> dict:
    """An MoE model's numbers plus its load-balancing loss (transformers' Mixtral function) in the loss."""
    if router_logits is not None:
        c = model.config
        aux = load_balancing_loss_func(router_logits, experts(c), c.num_experts_per_tok, attention_mask)
        numbers = {**numbers, "aux_loss": aux.item(), "loss": numbers["loss"] + c.router_aux_loss_coef * aux.item()}
    return numbers


def hand_sft(model, batch) -> dict:
    ids, labels, mask = (torch.tensor(batch[k]) for k in ("input_ids", "labels", "attention_mask"))
    logits, router = forward(model, ids, attention_mask=mask)
    target = labels[:, 1:]
    nll = -token_logps(logits, ids)[target != -100]
    return with_aux(model, {"loss": nll.mean().item()}, router, mask)


def hand_packed(model, batch) -> dict:
    """A padding-free row of several sequences: each sequence run alone; the mean over all their predicted tokens."""
    assert "attention_mask" not in batch and len(batch["input_ids"]) == 1  # one row, told apart by position_ids alone
    ids, labels, positions = (torch.tensor(batch[k][0]) for k in ("input_ids", "labels", "position_ids"))
    starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
    assert len(starts) > 3  # several sequences in the row
    nll, routers = [], []
    for start, end in itertools.pairwise(starts):
        assert positions[start:end].tolist() == list(range(end - start))
        logits, router = forward(model, ids[None, start:end])
        target = labels[start + 1 : end]
        nll.append(-token_logps(logits, ids[None, start:end])[0][target != -100])
        routers.append(router)
    loss = torch.cat(nll).mean().item()
    router = None if routers[0] is None else tuple(torch.cat(layer) for layer in zip(*routers, strict=True))
    return with_aux(model, {"loss": loss}, router, None)  # every token of the row counts: no attention mask


def hand_dpo(model, batch) -> dict:
    """Chosen rows first, then rejected; each row's completion log-prob summed; at step 1 the policy is the reference
    model, so the sigmoid loss is -log(sigmoid(0)) = log 2."""
    ids, mask, completion = (torch.tensor(batch[k]) for k in ("input_ids", "attention_mask", "completion_mask"))
    logits, router = forward(model, ids, attention_mask=mask)
    sums = (token_logps(logits, ids) * completion[:, 1:]).sum(-1)
    chosen, rejected = sums.chunk(2)
    numbers = {"loss": math.log(2), "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}
    return with_aux(model, numbers, router, mask)


def hand_grpo(model, batch) -> dict:
    """The completions' mean next-token entropy, and DAPO's loss at step 1 (ratio 1): -sum(advantage * tokens) / tokens
    (about 0: the advantages are normalised per group of completions)."""
    prompt, completion = torch.tensor(batch["prompt_ids"]), torch.tensor(batch["completion_ids"])
    mask = torch.cat([torch.tensor(batch["prompt_mask"]), torch.tensor(batch["completion_mask"])], 1)
    active = torch.tensor(batch["completion_mask"]).double()
    logits, router = forward(model, torch.cat([prompt, completion], 1), attention_mask=mask)
    logp = torch.log_softmax(logits[:, prompt.shape[1] - 1 : -1], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    advantages = torch.tensor(batch["advantages"]).double()
    loss = -(advantages[:, None] * active).sum() / active.sum()
    numbers = {"entropy": ((entropy * active).sum() / active.sum()).item(), "loss": loss.item()}
    return with_aux(model, numbers, router, mask)


HAND = {"sft": hand_sft, "packing": hand_packed, "lora": hand_sft, "dpo": hand_dpo, "grpo": hand_grpo}


def assert_first_step(run: dict, expected: dict) -> None:
    """The first step's loss (as the trainer computed it) and logged metrics equal `expected`."""
    assert run["steps"][0]["loss"] == pytest.approx(expected["loss"], abs=ATOL)
    for name, value in expected.items():
        assert run["logs"][0][name] == pytest.approx(value, abs=ATOL, rel=ATOL), name


# ---------------------------------------------------------------------------------------------------------------------
# Tests


def test_trl_tells_dense_from_moe(folders):
    """What TRL reads to decide whether to add a router loss: present on an MoE config, absent on a dense one."""
    dense, moe = (AutoConfig.from_pretrained(folders[arch]) for arch in ARCHS)
    assert not hasattr(dense, "output_router_logits") and not hasattr(dense, "router_aux_loss_coef")
    assert moe.output_router_logits is False and moe.router_aux_loss_coef > 0


@pytest.mark.parametrize("scenario", FIRST_STEP)
@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_equals_hand(runs, models, arch, scenario):
    """The first step's numbers of hf_tfm and of the in-tree copy, each against the hand computation with that model
    on its batch."""
    for name in (arch, ARCHS[arch][1]):
        run = runs[name][scenario]
        assert_first_step(run, HAND[scenario](models[name], run["steps"][0]["batch"]))
    if arch == "moe":  # TRL did add the router loss: its weight times a load-balancing loss near 1 or above
        assert runs[arch][scenario]["logs"][0]["aux_loss"] > 0.5


@pytest.mark.parametrize(("arch", "scenario"), COMPARED)
def test_training_equals_in_tree(runs, arch, scenario):
    """Two steps of each trainer: the same batches and every logged number of hf_tfm equal the in-tree copy's."""
    ours, theirs = runs[arch][scenario], runs[ARCHS[arch][1]][scenario]
    bf16 = ours["args"]["bf16"]
    tolerance = {"rel": 1e-3, "abs": 1e-3} if bf16 else {"rel": ATOL, "abs": ATOL}
    assert [s["batch"] for s in ours["steps"]] == [s["batch"] for s in theirs["steps"]]  # GRPO: same completions
    assert [s["loss"] for s in ours["steps"]] == pytest.approx([s["loss"] for s in theirs["steps"]], **tolerance)
    assert len(ours["logs"]) == len(theirs["logs"]) == 2
    for step, (mine, reference) in enumerate(zip(ours["logs"], theirs["logs"], strict=True)):
        assert mine.keys() == reference.keys(), step
        for name, value in mine.items():
            assert value == pytest.approx(reference[name], **tolerance), (step, name)
    assert ours["trainable"] == theirs["trainable"]
    assert ours["max_change"] > 0 and ours["finite"]  # it trained
    assert ours["max_change"] == pytest.approx(theirs["max_change"], rel=1e-2 if bf16 else 1e-4)


@pytest.mark.parametrize("scenario", ["sft_defaults", "dpo_defaults"])
@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_train(runs, models, arch, scenario):
    """TRL's defaults (bf16 autocast on CPU, activation checkpointing, float32 weights): the weights move, and the
    first loss is the float32 one by hand within bf16's precision."""
    run = runs[arch][scenario]
    assert run["args"]["bf16"] is True and run["args"]["gradient_checkpointing"] is True
    assert run["dtype"] == "torch.float32" and run["finite"]
    assert run["max_change"] > 0.1 * run["args"]["lr"]  # Adam's first steps move each weight by about the rate
    hand = (hand_sft if scenario == "sft_defaults" else hand_dpo)(models[arch], run["steps"][0]["batch"])
    assert run["steps"][0]["loss"] == pytest.approx(hand["loss"], rel=1e-2)
    for name in ("logps/chosen", "logps/rejected", "aux_loss"):
        if name in hand:
            assert run["logs"][0][name] == pytest.approx(hand[name], rel=1e-2), name


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_all_linear_targets(runs, arch):
    """`target_modules="all-linear"` wraps every projection of the blocks (not `lm_head`), as on the in-tree copy; an
    MoE model's router and experts are parameters, not `nn.Linear`, so its adapters sit on the attention."""
    run = runs[arch]["lora"]
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert run["lora_targets"] == (expected if arch == "dense" else sorted(ATTENTION))
    assert run["lora_targets"] == runs[ARCHS[arch][1]]["lora"]["lora_targets"]
    assert run["max_change"] > 1e-3  # the adapters trained


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "scenario"), COMPARED)
def test_remote_code_trains_as_in_process(runs, remote_runs, arch, scenario):
    """The folder's own code (trust_remote_code, hf_tfm not importable) trains exactly as the installed package."""
    remote, local = remote_runs[arch][scenario], runs[arch][scenario]
    assert remote["model_class"].startswith("transformers_modules."), remote["model_class"]
    assert remote["model_class"].endswith(".TfmForCausalLM")
    assert [s["batch"] for s in remote["steps"]] == [s["batch"] for s in local["steps"]]
    assert [s["loss"] for s in remote["steps"]] == pytest.approx([s["loss"] for s in local["steps"]], abs=ATOL)
    for mine, reference in zip(remote["logs"], local["logs"], strict=True):
        assert mine == pytest.approx(reference, abs=ATOL, rel=ATOL)
    assert remote["lora_targets"] == local["lora_targets"] and remote["trainable"] == local["trainable"]
