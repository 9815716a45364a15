"""What the inference service calls on a KV-event publisher (pure protocols: the service never imports zmq)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ChunkListener(Protocol):
    """Told when a tier takes or lets go of a chunk (by prefix key); must only queue, never wait."""

    def chunk_added(self, key: bytes, parent: bytes | None = None) -> None: ...

    def chunk_removed(self, key: bytes) -> None: ...


class KvEventSink(ChunkListener, Protocol):
    """A listener that also hears each planned prompt's chunks (their tokens, which a tier's keys do not carry)."""

    def note_prompt(self, namespace: bytes, keys: Sequence[bytes], starts: Sequence[int],
                    token_ids: Sequence[Sequence[int]]) -> None: ...

    def close(self) -> None: ...
