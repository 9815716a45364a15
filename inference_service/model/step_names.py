"""The decode steps the engine can run (torch-free, so the service's configuration can name them)."""
from __future__ import annotations

# lean: LeanStep over the model's own weights, bitwise the model's forward (the default). onednn: the same step with
# oneDNN packed weights (faster on CPU, rounds differently: opt-in). transformers: the model's own forward.
DECODE_STEPS = ("lean", "onednn", "transformers")
DEFAULT_DECODE_STEP = "lean"
