"""The decode steps the engine can run (torch-free, so the service's configuration can name them)."""
from __future__ import annotations

# split: LeanStep with each projection's weight halves read on two threads at once, bitwise the model's forward (the
# default; lean where it cannot run). lean: LeanStep over the model's own weights on one thread, bitwise the model's
# forward. onednn: the same step with oneDNN packed weights (faster on CPU, rounds differently: opt-in).
# transformers: the model's own forward.
DECODE_STEPS = ("split", "lean", "onednn", "transformers")
DEFAULT_DECODE_STEP = "split"
