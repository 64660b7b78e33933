"""The three job pages, followed as a reader follows them, to the end of the job.

- docs/share-on-hub.md: a LoRA classifier fine-tuned from a base loaded by its Hub id and uploaded, against the suite's
  fake Hub (tests/fake_hub.py); the "load it anywhere" block runs in a process where hf_tfm cannot be imported, and the
  shell path (`hf-tfm finetune --base-model --license`, `hf-tfm push`) uploads a folder whose card and adapter name the
  base by its Hub id.
- docs/llama-cpp.md: a small LM pretrained and exported to GGUF with the page's commands, then run in llama.cpp
  itself (llama-cpp-python, `.venv-llama-cpp`) by the page's Python block. Without that environment the commands run
  with `q8_0`, which needs no llama.cpp to write, and the file is checked through transformers' GGUF loader.
- docs/own-architecture.md: the hand-written nanoGPT and Llama modules mapped onto a `TfmConfig` and checked equal by
  the page itself; here, the check is shown to catch a missing q/k reordering, and the saved folder to load without
  hf_tfm with the same logits.

Python blocks run as written; ```bash blocks are the page's shell commands (run with `hf-tfm` on the PATH), ```sh
blocks other programs' (llama.cpp's, Ollama's), which are not installed here.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, doc_blocks, run_doc_blocks, run_without_hf_tfm
from fake_hub import FakeHub

LLAMA_CPP_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"


def page_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment, with `hf-tfm` (this Python's) first on the PATH and a Hugging Face home of the test's own."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false", **extra}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout's hf_tfm
    return env


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command[:3]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def run_python(code: str, cwd: Path, env: dict[str, str], python: str = sys.executable) -> str:
    return run([python, "-c", code], cwd, env)


def run_bash(block: str, cwd: Path, env: dict[str, str]) -> str:
    return run(["bash", "-euo", "pipefail", "-c", block], cwd, env)


def front_matter(card: str) -> dict[str, str]:
    """The `key: value` lines of a model card's YAML metadata."""
    head = card.split("---\n")[1]
    return dict(line.split(": ", 1) for line in head.splitlines() if ": " in line and not line.startswith(" "))


# ---------------------------------------------------------------------------------------------------------------------
# Share on the Hub


@pytest.fixture
def hub():
    server = FakeHub().start()
    yield server
    server.stop()


@pytest.mark.slow
def test_share_on_hub_page(hub, tmp_path):
    python, shell = doc_blocks("share-on-hub"), doc_blocks("share-on-hub", "bash")
    assert len(python) == 4 and len(shell) == 1
    author, anyone = tmp_path / "author", tmp_path / "anyone"
    author.mkdir()
    anyone.mkdir()
    env = page_env(tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_fake", HF_HUB_OFFLINE="0")
    run_python("\n".join(python[:3]), author, env)

    pushed = hub.files("you/my-lm-topics")
    adapter = json.loads(pushed["adapter/adapter_config.json"])
    assert adapter["base_model_name_or_path"] == "you/my-lm" and adapter["task_type"] == "SEQ_CLS"
    card = front_matter(pushed["README.md"].decode())
    assert card["base_model"] == "you/my-lm" and card["license"] == "apache-2.0"
    assert json.loads(pushed["config.json"])["id2label"] == {"0": "math", "1": "text"}

    # Someone else: a fresh Hugging Face home, hf_tfm not importable; the folder's own code builds the model
    other = {**env, "HF_HOME": str(tmp_path / "other-home"), "HF_MODULES_CACHE": str(tmp_path / "other-modules")}
    out = run_python('import sys; sys.modules["hf_tfm"] = None\n' + python[3], anyone, other)
    assert "'label': 'math'" in out or "'label': 'text'" in out

    # The shell path: the adapter and the card name the base's Hub id, not the local folder it was trained from
    run_bash(shell[0], author, env)
    cli = hub.files("you/my-lm-topics-cli")
    assert json.loads(cli["adapter/adapter_config.json"])["base_model_name_or_path"] == "you/my-lm"
    card = front_matter(cli["README.md"].decode())
    assert card["base_model"] == "you/my-lm" and card["license"] == "apache-2.0"
    assert card["pipeline_tag"] == "text-classification"
    assert front_matter(cli["adapter/README.md"].decode())["license"] == "apache-2.0"
    assert "from_pretrained('you/my-lm'" in cli["adapter/README.md"].decode()


# ---------------------------------------------------------------------------------------------------------------------
# Run it in llama.cpp


@pytest.mark.slow
def test_llama_cpp_page(tmp_path, monkeypatch):
    """The page's commands, as written, then its llama-cpp-python block in llama.cpp; without llama.cpp, the commands
    with q8_0 (its writer is hf_tfm's own) and the file loaded back by transformers."""
    python, shell = doc_blocks("llama-cpp"), doc_blocks("llama-cpp", "bash")
    assert len(python) == 2 and len(shell) == 3  # the corpus, the llama.cpp block; pretrain, the setup, export
    pretrain, export = shell[0], shell[2]
    assert "--max-steps 150" in pretrain and "--quantize q4_k_m" in export and "make llama-cpp-env" in shell[1]
    have_llama_cpp = LLAMA_CPP_PYTHON.is_file()
    env = page_env(tmp_path, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if have_llama_cpp:
        env["HF_TFM_LLAMA_CPP_PYTHON"] = str(LLAMA_CPP_PYTHON)  # what the setup block exports
    else:
        # and a fifth of the page's steps: they train a model whose greedy tokens q4_k_m mostly keeps, where q8_0's
        # check (every greedy token equal) holds after 30 (two of the test's 2.5 minutes)
        export, pretrain = export.replace("q4_k_m", "q8_0"), pretrain.replace("--max-steps 150", "--max-steps 30")
    run_python(python[0], tmp_path, env)
    run_bash(pretrain, tmp_path, env)
    verified = run_bash(export, tmp_path, env)
    assert "greedy tokens equal: yes" in verified and (tmp_path / "my-lm.gguf").stat().st_size > 1_000_000
    if not have_llama_cpp:
        pytest.skip("llama.cpp's environment is missing (make llama-cpp-env): the file was not run in llama.cpp")

    from hf_tfm.exporters.gguf import verify_gguf

    monkeypatch.setenv("HF_TFM_LLAMA_CPP_PYTHON", str(LLAMA_CPP_PYTHON))
    completion = run_python(python[1], tmp_path, {**env, "PYTHONPATH": ""}, python=str(LLAMA_CPP_PYTHON))
    assert completion.strip()  # llama.cpp continued the prompt
    report = verify_gguf(tmp_path / "my-lm.gguf", tmp_path / "my-lm", runtime="llama.cpp", max_new_tokens=16)
    assert report["runtime"] == "llama.cpp" and report["agreement"] >= 0.5, report  # q4_k_m: most greedy tokens kept
    assert report["tokenizer_agreement"] is not None and report["tokenizer_agreement"] >= 0.9, report


# ---------------------------------------------------------------------------------------------------------------------
# Bring your own architecture


def test_own_architecture_page(tmp_path, monkeypatch):
    namespace = run_doc_blocks("own-architecture", 6, tmp_path, monkeypatch)  # each block checks its own equality
    torch.manual_seed(1)
    tokens = torch.randint(0, 99, (2, 12))
    llama, state, config = namespace["llama"], dict(namespace["state"]), namespace["llama_config"]
    with torch.no_grad():
        expected = llama(tokens)
        # The check catches the one mapping that is not a rename: without the q/k reordering all loads, and differs
        for name, tensor in llama.state_dict().items():
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                layer = name.split(".")[1]
                state[f"model.layers.{layer}.self_attn.{'q' if '.wq.' in name else 'k'}_proj.weight"] = tensor
        unordered = namespace["TfmForCausalLM"](config).eval()
        unordered.load_state_dict(state, strict=True)
        assert (unordered(tokens).logits - expected).abs().max() > 1e-2
    # Where else each runs, as the page says: nanoGPT as in-tree GPT-2, the Llama as in-tree Llama and in llama.cpp
    from hf_tfm import in_tree_blockers
    from hf_tfm.exporters.registry import get_format

    assert in_tree_blockers(namespace["config"], "causal_lm")["gpt2"] == []
    assert in_tree_blockers(config, "causal_lm")["llama"] == []
    gguf = get_format("gguf")
    assert gguf.refusal(config, "TfmForCausalLM") is None
    assert "tanh GELU" in gguf.refusal(namespace["config"], "TfmForCausalLM")
    # The saved nanoGPT folder loads where hf_tfm is not installed, with nanoGPT's logits
    idx = namespace["idx"]
    out = run_without_hf_tfm(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("my-gpt", trust_remote_code=True).eval()
        with torch.no_grad():
            print(json.dumps(model(torch.tensor({idx.tolist()})).logits.tolist()))
        """,
        tmp_path,
    )
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(json.loads(out.splitlines()[-1])), namespace["gpt"](idx))


def test_job_pages_shell_blocks_are_commands_a_reader_runs():
    """```bash blocks hold hf-tfm's (or make's) commands, which the tests run; other programs' go in ```sh blocks."""
    for page in ("share-on-hub", "llama-cpp"):
        for block in doc_blocks(page, "bash"):
            for line in textwrap.dedent(block).splitlines():
                command = line.split()[0] if line.strip() and not line.startswith(" ") else None
                assert command in (None, "hf-tfm", "make", "export"), (page, line)
        for block in doc_blocks(page, "sh"):
            assert "hf-tfm" not in block, page
