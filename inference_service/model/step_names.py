"""The decode steps the engine can run (torch-free, so the service's configuration can name them)."""
from __future__ import annotations

# lean: LeanStep over the model's own weights, bitwise the model's forward (the default). split: LeanStep with each
# projection's weight halves read on two threads at once, bitwise too (opt-in: measured 1.05-1.18x one row, slower at
# 16 rows on two cores; lean where it cannot run). wide: lean for one row, and several rows through a transposed copy
# of each weight (faster CPU products of many rows, rounded differently: opt-in). onednn: the same step with oneDNN
# packed weights (faster on CPU, rounds differently: opt-in). transformers: the model's own forward.
DECODE_STEPS = ("split", "lean", "wide", "onednn", "transformers")
DEFAULT_DECODE_STEP = "lean"
