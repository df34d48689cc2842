"""The one attention reference: float64 on the inputs' device (gemmgen.select.reference, where the
tuner's correctness checks read it, holds the code; this is its public name)."""
from __future__ import annotations

from gemmgen.select.reference import ALIGNMENTS, attention_reference, causal_offset

__all__ = ["ALIGNMENTS", "attention_reference", "causal_offset"]
