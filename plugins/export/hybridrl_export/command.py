"""The ``hybridrl export CKPT OUT [--merged]`` command: its arguments, and one line for what it wrote."""

from __future__ import annotations

import sys
from pathlib import Path


def add_command(subparsers) -> None:
    p = subparsers.add_parser("export", help="Write a checkpoint's policy as a plain Hugging Face model folder.")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step-N")
    p.add_argument("out", help="New output directory.")
    p.add_argument("--merged", action="store_true", help="LoRA: the base model with the adapter merged in.")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from hybridrl_export.export import export

    try:
        out = export(Path(args.checkpoint), Path(args.out), merged=args.merged)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as e:  # a full disk, a folder that cannot be written: one line (export removed what it wrote)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}: load it with transformers' from_pretrained or serve it with vLLM")
    return 0
