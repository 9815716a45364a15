"""The decode steps the engine can run (torch-free, so the service's configuration can name them)."""
from __future__ import annotations

# lean: the one layer loop (model/scripted_layers.py) over the model's own weights, bitwise the model's forward:
# scripted on a CPU, replayed from CUDA graphs on a GPU (the default). transformers: the model's own forward.
DECODE_STEPS = ("lean", "transformers")
DEFAULT_DECODE_STEP = "lean"
# Steps that left the service (docs/performance.md keeps their measured figures), with the step that runs instead:
# none of them won on a default path, and onednn and wide rounded differently from the model's forward.
RETIRED_DECODE_STEPS = {"split": "lean", "wide": "lean", "onednn": "lean"}


def current_decode_step(name: str) -> tuple[str, str]:
    """(the step to run for `name`, a warning to log when `name` is a retired step; '' otherwise)."""
    if name not in RETIRED_DECODE_STEPS:
        return name, ""
    replacement = RETIRED_DECODE_STEPS[name]
    return replacement, (f"--decode-step {name} was retired (docs/performance.md keeps its figures); "
                         f"running {replacement}, bitwise the model's forward")
