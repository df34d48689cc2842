"""The `gemmgen` command (python -m gemmgen): generate, list, run, profile, explain, tune."""
from gemmgen.cli.app import main

__all__ = ["main"]
