"""Fetch a model's tokenizer (and optionally its config and weights) from the Hugging Face Hub into
assets/hf/<name>, the folder the shipped configs name in [model] hf_assets_path.

    .venv/bin/python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer
    .venv/bin/python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-0.6B --assets tokenizer config safetensors

--assets: tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
original/tokenizer.model where the repository has them), config (config.json,
generation_config.json), safetensors (the weights and their index), or all. Gated repositories (Meta's
Llama) need an accepted licence on the Hub and a token: --hf_token, or HF_TOKEN in the environment, or
`huggingface-cli login`. The files land in <local_dir>/<repository name> (default assets/hf), e.g.
assets/hf/Llama-3.1-8B. Errors (offline, gated, unknown repository) say what to do.
"""

import argparse
import os
import sys

PATTERNS = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "original/tokenizer.model", "vocab.json", "merges.txt"],
    "config": ["config.json", "generation_config.json"],
    "safetensors": ["*.safetensors", "model.safetensors.index.json"],
}


def fail(message):
    print(f"download_hf_assets: error: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", required=True, help="Hub repository, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument("--assets", nargs="+", default=["tokenizer"], choices=sorted(PATTERNS) + ["all"],
                        help="what to fetch (default: tokenizer)")
    parser.add_argument("--local_dir", default="assets/hf", help="parent folder (default assets/hf)")
    parser.add_argument("--hf_token", default=None, help="token for gated repositories (default: HF_TOKEN)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    args = parser.parse_args()
    if "/" not in args.repo_id:
        fail(f"--repo_id '{args.repo_id}' is not an organisation/name Hub repository (e.g. meta-llama/Llama-3.1-8B)")

    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:
        fail("the huggingface_hub package is missing: run ./scripts/setup.sh (it installs the project's Python "
             "environment) and use .venv/bin/python")

    kinds = sorted(PATTERNS) if "all" in args.assets else args.assets
    patterns = [p for k in kinds for p in PATTERNS[k]]
    target = os.path.join(args.local_dir, args.repo_id.split("/")[-1])
    token = args.hf_token or os.environ.get("HF_TOKEN")
    try:
        path = snapshot_download(repo_id=args.repo_id, allow_patterns=patterns, local_dir=target, token=token,
                                 revision=args.revision)
    except GatedRepoError:
        fail(f"{args.repo_id} is gated: accept its licence on https://huggingface.co/{args.repo_id}, then pass "
             "--hf_token (or set HF_TOKEN) with a token of that account")
    except RepositoryNotFoundError:
        fail(f"{args.repo_id} was not found on the Hub (or is private: pass --hf_token)")
    except RevisionNotFoundError:
        fail(f"revision '{args.revision}' of {args.repo_id} does not exist")
    except LocalEntryNotFoundError:
        fail(f"cannot reach the Hugging Face Hub (offline, HF_HUB_OFFLINE set, or blocked by a proxy) and "
             f"{target} has no copy: fetch the files on a machine with access and copy them to {target}")
    except OSError as e:  # connection errors, disk full
        fail(f"fetching {args.repo_id} failed: {e}")
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
                   if ".cache" not in d)
    if not files:
        fail(f"{args.repo_id} has none of the requested files ({', '.join(kinds)})")
    print(f"fetched {', '.join(kinds)} of {args.repo_id} into {path}: {', '.join(files)}")
    print(f"train with --model.hf_assets_path {path}")


if __name__ == "__main__":
    main()
