"""agreed_identity: replicas must share namespace and chunk size; the refusal names who differs and how."""
from __future__ import annotations

import pytest

from kvboost.v1 import inference_pb2 as pb
from router.model_identity import ModelIdentity, ReplicasDisagree, agreed_identity


def identity(namespace_byte: int = 0, chunk_size: int = 128, model: str = "m") -> ModelIdentity:
    return ModelIdentity.from_reply(pb.ModelInfoReply(model=model, namespace_hex=bytes([namespace_byte]).hex() * 32,
                                                      chunk_size=chunk_size, kv_cache_bits=16, weights_id="w"))


def test_replicas_that_agree_give_their_identity():
    assert agreed_identity([("a", identity()), ("b", identity(model="same weights, other name"))]) == identity()


@pytest.mark.parametrize("odd, what", [(identity(chunk_size=64), "chunk_size 64"),
                                       (identity(namespace_byte=7), "namespace 0707")])
def test_a_replica_with_other_keys_is_refused_by_name(odd, what):
    with pytest.raises(ReplicasDisagree) as refused:
        agreed_identity([("replica 0", identity()), ("replica 1", identity()), ("replica 2", odd)])
    message = str(refused.value)
    assert "replica 2:" in message and what in message and "replica 1:" not in message.split(";", 1)[1]
    assert "--chunk-size" in message
