"""What every replica must agree on for one set of chunk keys to describe them all (pure)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.namespace import Namespace


class ReplicasDisagree(ValueError):
    """Replicas key their chunks differently: one router cannot score them with one set of keys."""


@dataclass(slots=True, frozen=True)
class ModelIdentity:
    """A replica's model as ModelInfo reports it. The namespace digests weights, config, dtype, tokenizer,
    chunk size, K/V bits and the service's tenant salt: equal namespaces and chunk sizes give equal keys."""

    model: str
    namespace: Namespace
    chunk_size: int
    kv_cache_bits: int
    weights_id: str

    def __post_init__(self) -> None:
        assert len(self.namespace) == 32, f"a namespace is 32 bytes, got {len(self.namespace)}"
        assert self.chunk_size > 0, f"chunk_size must be positive, got {self.chunk_size}"

    @classmethod
    def from_reply(cls, reply: pb.ModelInfoReply) -> ModelIdentity:
        return cls(reply.model, Namespace(bytes.fromhex(reply.namespace_hex)), reply.chunk_size, reply.kv_cache_bits,
                   reply.weights_id)

    def describe(self) -> str:
        return (f"model {self.model!r}, weights {self.weights_id}, chunk_size {self.chunk_size}, "
                f"kv_cache_bits {self.kv_cache_bits}, namespace {self.namespace.hex()[:16]}…")

    def differs_from(self, other: ModelIdentity) -> bool:
        return self.namespace != other.namespace or self.chunk_size != other.chunk_size


def agreed_identity(identities: Sequence[tuple[str, ModelIdentity]]) -> ModelIdentity:
    """The one identity every (replica name, identity) shares.

    Raises:
        ReplicasDisagree: naming each replica that differs from the first, and what to align.
    """
    assert identities, "at least one replica"
    first_name, first = identities[0]
    odd = [f"{name}: {identity.describe()}" for name, identity in identities[1:] if identity.differs_from(first)]
    if odd:
        raise ReplicasDisagree(
            f"replicas differ in namespace or chunk size, so their chunk keys differ: {first_name}: "
            f"{first.describe()}; " + "; ".join(odd) + ". Run every replica with the same --model, --dtype, "
            "--chunk-size, --kv-cache-bits and --tenant-salt")
    return first
