"""`minipaged download MODEL`: fetch a model now, so that later runs need no network.

    minipaged download stories260K                        ggml-org's GGUF, SHA-256 checked, converted
                                                          into ~/.cache/minipaged/models/stories260K/hf
    minipaged download stories260K --download-dir DIR     into DIR/stories260K/hf instead
    minipaged download Qwen/Qwen3-0.6B --revision main    a hub id, into the Hugging Face cache

What it does is `minipaged.models.loader.download_model` (the steps are in `models/hub.py`).
It prints where the model now lives; a failure is one `error:` line and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="minipaged download", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL", help="stories260K, or a Hugging Face hub id")
    ap.add_argument("--download-dir", default=None,
                    help="where to put it; default: $MINIPAGED_CACHE/models or "
                         "~/.cache/minipaged/models (a hub id: the Hugging Face cache)")
    ap.add_argument("--revision", default=None,
                    help="the hub revision (branch, tag or commit); default: main")
    return ap.parse_args(argv)


def not_fetched_message(model: str, cause: Exception, download_dir: Optional[str]) -> str:
    """One line for an offline machine: the cause, the URL, where the file goes."""
    from minipaged.models import hub
    spec = hub.HUB_MODELS[model.lower()]
    target = hub.models_dir(download_dir) / spec.name / spec.gguf_name
    return (f"could not fetch {spec.name} from the Hugging Face hub ({cause}); download "
            f"{' or '.join(spec.urls())} ({spec.size:,} bytes, SHA-256 {spec.sha256}) where you "
            f"are online and put it at {target}, then run this again: it checks and converts it offline")


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    from minipaged.models import hub
    from minipaged.models.loader import download_model
    try:
        path = download_model(a.model, a.download_dir, a.revision)
    except hub.HubUnavailableError as e:
        print(f"error: {not_fetched_message(a.model, e, a.download_dir)}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as e:  # checksum, unknown id, disk full ...
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"{a.model} is in {path}")
    if a.download_dir is not None and a.model.lower() in hub.HUB_MODELS:
        print(f"(outside the default search path: run with MINIPAGED_MODEL_PATH="
              f"{Path(a.download_dir).expanduser().resolve()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
