"""Grouped-query SDPA for the engine's own forward passes only, so plain model calls stay plain."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FORCE_GQA_VARIABLE = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers on every SDPA call

_lock = threading.Lock()
_num_open_scopes = 0
_we_set_it = False


@contextmanager
def engine_attention(device: torch.device) -> Iterator[None]:
    """On CPU, lets SDPA group query heads itself even when a mask is given (a prefill after a cache hit).

    Without it transformers copies every cached K/V head per query group first (repeat_kv), which is
    most of the attention cost of a short suffix over a long cached prefix. The result is bit-identical
    on CPU (tests/inference_service/engine/test_engine.py checks it); CUDA keeps the default, where masked
    GQA can be slower. An explicit TRANSFORMERS_SDPA_FORCE_GQA in the environment wins.

    transformers reads the variable at each call, so it is set only while an engine forward runs (counted
    across threads, removed when the last one ends): a plain `model.generate` outside these scopes, such as
    a test's reference, runs transformers' default attention (tests/inference_service/model/test_attention_scope.py).
    """
    global _num_open_scopes, _we_set_it
    if device.type != "cpu":
        yield
        return
    with _lock:
        if _num_open_scopes == 0 and FORCE_GQA_VARIABLE not in os.environ:
            os.environ[FORCE_GQA_VARIABLE] = "1"
            _we_set_it = True
        _num_open_scopes += 1
    try:
        yield
    finally:
        with _lock:
            _num_open_scopes -= 1
            if _num_open_scopes == 0 and _we_set_it:
                os.environ.pop(FORCE_GQA_VARIABLE, None)
                _we_set_it = False
