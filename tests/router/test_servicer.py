"""The router's API over scripted replicas: what reaches a replica, where it goes, and what a failure becomes."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvboost.v1 import cache_pb2
from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.namespace import Namespace
from router.model_identity import ModelIdentity
from router.request_keys import RequestKeys
from tests.factories import build_byte_tokenizer
from tests.router.factories import INCARNATION, lost
from tests.router.fake_replicas import NUM_TOKEN_EVENTS, router_in_front

pytestmark = pytest.mark.timeout(60)

CALLER_METADATA = (("authorization", "Bearer caller-token"), ("x-request-id", "req-7"), ("x-tenant", "alice"))


async def generate(stub, request: pb.GenerateRequest, metadata=()) -> list[pb.GenerateEvent]:
    return [event async for event in stub.Generate(request, metadata=metadata)]


def test_the_request_and_the_callers_metadata_reach_the_replica_unchanged():
    request = pb.GenerateRequest(prompt="hello", cache_salt="tenant=alice;salt=s1", request_id="req-7",
                                 max_new_tokens=3)

    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, _):
            events = await generate(stub, request, CALLER_METADATA)
            return events, fakes[0].calls

    events, calls = asyncio.run(scenario())
    assert events[-1].result.output_text == "fake-0" and len(events) == NUM_TOKEN_EVENTS + 1
    [(method, received, metadata)] = calls
    # Byte for byte: the tenant's salt is never dropped or rewritten on the way.
    assert method == "Generate" and received.SerializeToString() == request.SerializeToString()
    assert received.cache_salt == "tenant=alice;salt=s1"
    assert {key: metadata[key] for key, _ in CALLER_METADATA} == dict(CALLER_METADATA)


def test_a_router_token_is_checked_and_still_forwarded(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("caller-token\n")

    async def scenario():
        async with router_in_front(token_file=token_file) as (stub, fakes, _):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Tokenize(pb.TokenizeRequest(prompt="x"))
            await stub.Tokenize(pb.TokenizeRequest(prompt="x"), metadata=CALLER_METADATA)
            return refused.value.code(), [call for fake in fakes for call in fake.calls]

    code, calls = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    [(_, _, metadata)] = calls  # the refused call reached no replica
    assert metadata["authorization"] == "Bearer caller-token"


def test_a_replica_down_before_the_first_token_is_retried_once_elsewhere_and_then_skipped():
    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, router):
            fakes[0].fail = grpc.StatusCode.UNAVAILABLE
            first = await generate(stub, pb.GenerateRequest(prompt="a"))
            healthy = [replica.healthy for replica in router.replicas]
            second = await generate(stub, pb.GenerateRequest(prompt="b"))
            return first, second, healthy, fakes

    first, second, healthy, fakes = asyncio.run(scenario())
    assert first[-1].result.output_text == second[-1].result.output_text == "fake-1"
    assert healthy == [False, True]  # the monitor re-probes it; until then it is skipped
    assert fakes[0].methods() == ["Generate"] and fakes[1].methods() == ["Generate", "Generate"]


def test_a_replica_dying_mid_stream_fails_that_stream_naming_it_and_nothing_else():
    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, router):
            fakes[0].fail_after = 1
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for event in stub.Generate(pb.GenerateRequest(prompt="a")):
                    received.append(event)
            later = await generate(stub, pb.GenerateRequest(prompt="b"))
            return received, failed.value, later, fakes, router

    received, error, later, fakes, router = asyncio.run(scenario())
    assert [event.text for event in received] == ["fake-00 "]  # what it had sent arrived
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"replica 0 ({router.replicas[0].address.service}) failed after 1 events" in error.details()
    assert fakes[1].methods() == ["Generate"]  # no second try of a stream already under way
    assert later[-1].result.output_text == "fake-1"


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED])
def test_a_replicas_own_refusal_passes_through_unchanged_and_is_not_retried(code):
    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, _):
            fakes[0].fail = code
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, pb.GenerateRequest(prompt="a"))
            return refused.value, fakes

    error, fakes = asyncio.run(scenario())
    assert (error.code(), error.details()) == (code, "fake-0 says no")
    assert fakes[1].calls == []


def test_every_replica_down_fails_with_unavailable_naming_the_last_one_tried():
    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, router):
            for fake in fakes:
                fake.fail = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.ModelInfo(pb.ModelInfoRequest())
            return failed.value, router

    error, router = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith(f"replica 1 ({router.replicas[1].address.service}) failed: ")


@pytest.mark.parametrize("method", ["GenerateBatch", "GenerateMany"])
def test_a_batch_goes_whole_to_one_replica(method):
    batch = pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt=text) for text in ("a", "b", "c")])

    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, _):
            reply = await getattr(stub, method)(batch)
            return reply, fakes

    reply, fakes = asyncio.run(scenario())
    assert [result.output_text for result in reply.results] == ["fake-0"] * 3
    assert fakes[0].methods() == [method] and fakes[1].calls == []


def test_round_robin_alternates():
    async def scenario():
        async with router_in_front(num_replicas=3, policy="round-robin") as (stub, _, _):
            return [(await generate(stub, pb.GenerateRequest(prompt="a")))[-1].result.output_text for _ in range(4)]

    assert asyncio.run(scenario()) == ["fake-0", "fake-1", "fake-2", "fake-0"]


def test_warm_goes_to_the_picked_replica_or_everywhere_and_unpin_everywhere():
    async def scenario():
        async with router_in_front(policy="round-robin") as (stub, fakes, _):
            await stub.Warm(pb.WarmRequest(text="doc"))
            after_picked = [fake.methods() for fake in fakes]
            warmed = await stub.Warm(pb.WarmRequest(text="doc"), metadata=(("kvboost-warm", "all"),))
            unpinned = await stub.Unpin(pb.WarmRequest(text="doc"))
            return after_picked, warmed, unpinned, [fake.methods() for fake in fakes]

    after_picked, warmed, unpinned, methods = asyncio.run(scenario())
    assert after_picked == [["Warm"], []]
    assert warmed.token_count == 3
    assert methods == [["Warm", "Warm", "Unpin"], ["Warm", "Unpin"]]
    assert (unpinned.chunks_unpinned, unpinned.token_count) == (4, 3)  # both replicas' pins


def test_warm_everywhere_by_default_with_the_option():
    async def scenario():
        async with router_in_front(policy="round-robin", warm="all") as (stub, fakes, _):
            await stub.Warm(pb.WarmRequest(text="doc"))
            return [fake.methods() for fake in fakes]

    assert asyncio.run(scenario()) == [["Warm"], ["Warm"]]


def test_stats_add_up_the_replicas():
    async def scenario():
        async with router_in_front(num_replicas=3) as (stub, _, _):
            return await stub.Stats(pb.ServiceStatsRequest())

    stats = asyncio.run(scenario())
    assert (stats.requests, stats.cached_tokens, stats.cache_address) == (15, 30, "fake-0,fake-1,fake-2")


def test_the_prefix_policy_sends_a_prompt_where_its_chunks_are():
    identity = ModelIdentity("tiny", Namespace(bytes(32)), chunk_size=4, kv_cache_bits=16, weights_id="w")
    keys = RequestKeys(build_byte_tokenizer(), identity)
    document = "Ferries leave the pier at six. " * 4
    warmed = keys.for_generate(pb.GenerateRequest(prompt=document))

    async def scenario():
        async with router_in_front(num_replicas=3, policy="prefix", keys=keys) as (stub, _, router):
            # What replica 2's daemon would announce after a Warm of the document there.
            router.replicas[2].events.receive(lost(0))
            router.replicas[2].events.receive(snapshot_of(warmed.namespace, warmed.prefix_keys))
            question = pb.GenerateRequest(prompt=document + "When?")
            targets = [(await generate(stub, question))[-1].result.output_text for _ in range(3)]
            other = (await generate(stub, pb.GenerateRequest(prompt="Something else entirely.")))[-1]
            return targets, other.result.output_text, router

    targets, other, router = asyncio.run(scenario())
    assert targets == ["fake-2"] * 3
    assert other == "fake-0"  # cached nowhere, nothing running: the replicas sent fewer requests go first
    assert router.num_expected_exact_tokens == 3 * warmed.chunks.num_chunk_tokens


def snapshot_of(namespace: bytes, prefix_keys) -> cache_pb2.WatchEventsReply:
    return cache_pb2.WatchEventsReply(incarnation=INCARNATION, snapshot=cache_pb2.KvSnapshotPage(
        entries=[cache_pb2.KvSnapshotEntry(namespace=namespace, prefix_key=key, num_tokens=4) for key in prefix_keys],
        last=True))


def test_stats_leave_out_a_replica_that_fails_and_unpin_does_not():
    async def scenario():
        async with router_in_front() as (stub, fakes, _):
            fakes[1].fail = grpc.StatusCode.INTERNAL
            stats = await stub.Stats(pb.ServiceStatsRequest())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Unpin(pb.WarmRequest(text="doc"))
            return stats, refused.value

    stats, error = asyncio.run(scenario())
    assert stats.requests == 5 and stats.cache_address == "fake-0"
    assert (error.code(), error.details()) == (grpc.StatusCode.INTERNAL, "fake-1 says no")
