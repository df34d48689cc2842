"""The attention backward kind of the selection engine: the forward's candidate rules, reasons, cost
model and buckets (gemmgen.select.attention_select), applied to the backward families' instances
through the problem's kind (BwdProblem); the fastest measured time wins a tuned bucket."""
from __future__ import annotations

import dataclasses

from gemmgen.select import attention_select

KIND = dataclasses.replace(attention_select.KIND, name="attention_bwd", noun="backward instance")
