"""lm-evaluation-harness (`lm_eval.models.huggingface.HFLM`) scoring hf_tfm causal LMs, dense and mixture-of-experts.

Oracles: the log-softmax sums computed by hand from the model's logits on the tokens the harness scores (the
tokenizer's own encoding, `<s>` included, as `HFLM.tok_encode` asks for it), and the same harness on the in-tree copy
of the same weights (`hf_tfm.to_hf`: Llama, Mixtral), itself checked against the hand numbers from its logits.
Requests go to the model API directly (`Instance`s): tasks would download data sets.

- `loglikelihood`: the continuation's summed log-probabilities given the context, and whether greedy decoding would
  produce it (one request is built to be greedy), in batches that pad;
- `loglikelihood_rolling`: a text's log-likelihood in windows of the model's context length (64, read from
  `max_position_embeddings`), each chunk of up to 64 tokens predicted from the 64 tokens before its end;
- `generate_until`: greedy continuations, left-padded in a batch, against a no-cache greedy loop per context.

The `slow` test repeats them where hf_tfm cannot be imported: the folder's own code (trust_remote_code).
"""

import inspect
import json
import textwrap

import pytest
import torch
from conftest import build, run_without_hf_tfm, tiny_config
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM

import hf_tfm
from hf_tfm import TfmForCausalLM
from hf_tfm.tokenization import train_bpe_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Sums of 1-500 float32 log-probabilities of size ~6 against float64 ones: 4e-5 apart at most (measured).
TOLERANCE = {"abs": 1e-4, "rel": 1e-7}
CONTEXT = 64  # max_position_embeddings: the harness's window
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 16}
MOE |= {"router_weights_fp32": True}  # what makes the config expressible as in-tree Mixtral
ARCHS = {"dense": ({}, "llama"), "moe": (MOE, "mixtral")}
PAIRS = [
    ("def dumps(obj", ", indent=None):"),
    ("import", " json"),
    ("The JSON", " encoder class, with a long continuation that spans more tokens than its context"),
    ("x = 1", "\n"),
]
GENERATE = ["def loads(s", "import", "class JSONDecoder(object):\n    "]  # three lengths: the batch is left-padded
GEN_TOKENS = 8


def source_lines() -> list[str]:
    return [line for line in inspect.getsource(json).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The tokenizer, each architecture saved as hf_tfm and as its in-tree copy, and the requests."""
    root = tmp_path_factory.mktemp("lm_eval")
    texts = source_lines()
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    folders = {}
    for arch, (overrides, in_tree_name) in ARCHS.items():
        sizes = {"vocab_size": len(tokenizer), "num_key_value_heads": 2, "max_position_embeddings": CONTEXT}
        model = build(TfmForCausalLM, tiny_config(**sizes, **overrides))
        for name, copy in ((arch, model), (in_tree_name, hf_tfm.to_hf(model))):
            copy.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            folders[name] = str(root / name)
    long_text = "\n".join(texts[:14])
    assert len(tokenizer(long_text).input_ids) > 2 * CONTEXT  # three windows
    rolling = [texts[3], long_text]
    return {"folders": folders, "tokenizer": tokenizer, "rolling": rolling}


def greedy_pair(model, tokenizer, contexts) -> tuple[str, str]:
    """A (context, continuation) whose 3 continuation tokens are the model's greedy choice and survive decoding and
    re-encoding unchanged (so the harness, which re-encodes the text, scores those very tokens)."""
    for context in contexts:
        ids = tokenizer(context).input_ids
        generated = greedy(model, ids, 3, stop=None)
        continuation = tokenizer.decode(generated)
        if tokenizer(context + continuation).input_ids == ids + generated:
            return context, continuation
    raise AssertionError("no context whose greedy continuation re-encodes to the same tokens")


def greedy(model, ids: list[int], steps: int, stop: int | None) -> list[int]:
    """A greedy loop without a cache: the whole sequence each step."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            token = model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax().item()
            out.append(token)
            if token == stop:
                break
    return out


def logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab) float64 log-softmax of the logits that predict ids[1:]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), -1)


def hand_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    whole, head = tokenizer(context + continuation).input_ids, tokenizer(context).input_ids
    assert whole[: len(head)] == head
    logp = logprobs(model, whole)[len(head) - 1 :]
    target = torch.tensor(whole[len(head) :])
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def hand_rolling(model, tokenizer, text: str) -> float:
    """Every token of the text (its `<s>` too) after the harness's prefix token (`<s>`): chunks of up to CONTEXT
    tokens, each predicted from the CONTEXT tokens (at most) before the chunk's end."""
    tokens = tokenizer(text).input_ids
    sequence = [tokenizer.bos_token_id, *tokens]
    total = 0.0
    for start in range(0, len(tokens), CONTEXT):
        end = min(start + CONTEXT, len(tokens))  # predicts sequence[start + 1 : end + 1]
        first = max(0, end - CONTEXT)
        logp = logprobs(model, sequence[first : end + 1])  # row j predicts sequence[first + j + 1]
        total += sum(logp[k - 1 - first, sequence[k]].item() for k in range(start + 1, end + 1))
    return total


def hand_generate(model, tokenizer, context: str) -> str:
    ids = tokenizer(context).input_ids
    text = tokenizer.decode(greedy(model, ids, GEN_TOKENS, stop=tokenizer.eos_token_id), skip_special_tokens=True)
    return text.split("\n")[0]


def requests(pairs, rolling, contexts):
    until = {"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False}
    return (
        [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)],
        [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i) for i, t in enumerate(rolling)],
        [Instance(request_type="generate_until", doc={}, arguments=(c, until), idx=i) for i, c in enumerate(contexts)],
    )


def evaluate(folder: str, pairs, rolling) -> dict:
    """The harness on a folder: its three request types, in batches of 3."""
    lm = HFLM(pretrained=folder, trust_remote_code=True, batch_size=3, device="cpu")
    assert lm.max_length == CONTEXT
    loglikelihood, rolling_requests, generate = requests(pairs, rolling, GENERATE)
    return {
        "model_class": f"{type(lm.model).__module__}.{type(lm.model).__qualname__}",
        "loglikelihood": [list(r) for r in lm.loglikelihood(loglikelihood, disable_tqdm=True)],
        "rolling": lm.loglikelihood_rolling(rolling_requests, disable_tqdm=True),
        "generate": lm.generate_until(generate, disable_tqdm=True),
    }


@pytest.fixture(scope="module")
def results(built) -> dict:
    """Per architecture, for hf_tfm's folder and the in-tree copy's: the numbers by hand from that model's logits, and
    the harness on that folder, in this process (hf_tfm's registered class loads its folder)."""
    tokenizer, folders = built["tokenizer"], built["folders"]
    out = {}
    for arch, (_, in_tree_name) in ARCHS.items():
        models = {name: AutoModelForCausalLM.from_pretrained(folders[name]).eval() for name in (arch, in_tree_name)}
        pairs = [*PAIRS, greedy_pair(models[arch], tokenizer, source_lines()[20:40])]
        out[arch] = {"pairs": pairs, "hand": {}, "harness": {}}
        for name, model in models.items():
            out[arch]["hand"][name] = {
                "loglikelihood": [list(hand_loglikelihood(model, tokenizer, *pair)) for pair in pairs],
                "rolling": [hand_rolling(model, tokenizer, text) for text in built["rolling"]],
                "generate": [hand_generate(model, tokenizer, context) for context in GENERATE],
            }
            out[arch]["harness"][name] = evaluate(folders[name], pairs, built["rolling"])
    return out


def assert_matches(result: dict, hand: dict) -> None:
    for (value, is_greedy), (expected, expected_greedy) in zip(
        result["loglikelihood"], hand["loglikelihood"], strict=True
    ):
        assert value == pytest.approx(expected, **TOLERANCE) and is_greedy == expected_greedy
    assert result["rolling"] == pytest.approx(hand["rolling"], **TOLERANCE)
    assert result["generate"] == hand["generate"]


@pytest.mark.parametrize("arch", ARCHS)
def test_harness_equals_hand_and_in_tree(results, arch):
    """hf_tfm's and the in-tree copy's harness numbers, each against the hand numbers from its model; and equal."""
    hand = results[arch]["hand"][arch]
    assert [greedy for _, greedy in hand["loglikelihood"]] == [False] * len(PAIRS) + [True]
    assert any(hand["generate"])  # some generated text survives the cut at "\n"
    for name, result in results[arch]["harness"].items():
        assert_matches(result, results[arch]["hand"][name])
        package = "hf_tfm.modeling." if name == arch else "transformers.models."  # the installed package's class
        assert result["model_class"].startswith(package), result["model_class"]
    ours, theirs = results[arch]["harness"].values()
    assert ours == {**theirs, "model_class": ours["model_class"]}  # the in-tree copy's numbers, bit for bit


@pytest.mark.slow
def test_remote_code_harness(built, results, tmp_path):
    """The harness on the hf_tfm folders where hf_tfm cannot be imported: the folder's code, the same numbers."""
    arguments = {arch: (built["folders"][arch], results[arch]["pairs"]) for arch in ARCHS}
    code = f"""
        import json
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
        CONTEXT, GEN_TOKENS, GENERATE = {CONTEXT}, {GEN_TOKENS}, {GENERATE!r}
        {_source(requests)}
        {_source(evaluate)}
        print("RESULT", json.dumps({{arch: evaluate(folder, pairs, {built["rolling"]!r})
                                     for arch, (folder, pairs) in {arguments!r}.items()}}))
    """
    out = run_without_hf_tfm(code, tmp_path, timeout=300)
    remote = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    for arch in ARCHS:
        result = remote[arch]
        assert result["model_class"].startswith("transformers_modules.") and result["model_class"].endswith(
            ".TfmForCausalLM"
        )
        assert_matches(result, results[arch]["hand"][arch])
        local = results[arch]["harness"][arch]
        assert result == {**local, "model_class": result["model_class"]}


def _source(function) -> str:
    """A function's source, indented to sit in the subprocess program's dedented block."""
    return textwrap.indent(inspect.getsource(function), " " * 8).lstrip()
