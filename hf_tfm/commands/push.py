"""`hf-tfm push`: a model folder uploaded to the Hugging Face Hub (`HF_ENDPOINT` is honoured)."""

import argparse

from .common import CliError, require_model_dir

DOC_PAGE = "docs/cli.md#subcommands"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`hf-tfm push` and its options."""
    p = subparsers.add_parser("push", help="upload a model folder to the Hugging Face Hub")
    p.add_argument("folder")
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

    folder = require_model_dir(args.folder)
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
