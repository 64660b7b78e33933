"""`hf-tfm push`: a model or PEFT adapter folder uploaded to the Hugging Face Hub (`HF_ENDPOINT` is honoured)."""

import argparse
import json
import logging
from pathlib import Path

from .common import CliError, require_model_dir

logger = logging.getLogger(__name__)

DOC_PAGE = "docs/cli.md#subcommands"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm push` and its options."""
    p = subparsers.add_parser("push", help="upload a model folder (or a LoRA adapter folder) to the Hugging Face Hub")
    p.add_argument("folder", help="a model folder (config.json) or a PEFT adapter folder (adapter_config.json)")
    p.add_argument("--repo-id", required=True, help="user/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to commit to (default: main)")
    p.add_argument("--commit-message", default="Upload hf_tfm model")
    p.add_argument("--token", help="default: HF_TOKEN or the cached login")
    return p


def run(args: argparse.Namespace) -> int:
    """Create the repository if needed and upload the folder as one commit; print the repository and the commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    folder = _adapter_folder(args.folder) or require_model_dir(args.folder)
    if "/" not in args.repo_id and not args.repo_id.strip():
        raise CliError("--repo-id must be a repository id such as user/name")
    api = HfApi(token=args.token)
    try:
        repo = api.create_repo(args.repo_id, private=args.private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=args.repo_id,
            repo_type="model",
            revision=args.revision,
            commit_message=args.commit_message,
            ignore_patterns=[".*", "__pycache__/*", "*.pyc"],
        )
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise CliError(f"upload to {args.repo_id} failed: {err}") from err
    except Exception as err:  # connection errors come from httpx, whose types huggingface_hub does not wrap
        raise CliError(f"upload to {args.repo_id} failed: {type(err).__name__}: {err}") from err
    print(f"pushed {folder} to {repo}")
    print(f"commit: {getattr(commit, 'commit_url', commit)}")
    return 0


def _adapter_folder(path: str) -> Path | None:
    """`path` when it is a PEFT adapter folder, with a warning when its base is a local path, which no one who loads
    the adapter from the Hub has (`hf-tfm finetune --base-model` names the base's Hub id)."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path") or ""
    if Path(base).is_absolute() or Path(base).exists():
        logger.warning(
            "%s names a local folder as its base (%s): others cannot load it from the Hub. Push the base, then "
            "fine-tune with --base-model REPO_ID (or set base_model_name_or_path in adapter_config.json)",
            path,
            base,
        )
    return Path(path)
