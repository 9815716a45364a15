"""RequestKeys: the router keys a request exactly as the service's engine does (tiny Llama, byte tokenizer)."""
from __future__ import annotations

import pytest

from inference_service.engine.engine import Engine, EngineConfig
from inference_service.engine_parts.planning import plan_request, plan_warm, salted
from inference_service.serving import proto_convert
from inference_service.store.memory import InMemoryStore
from kvboost.v1 import inference_pb2 as pb
from router.model_identity import ModelIdentity
from router.request_keys import RequestKeys

CHAT = [pb.ChatMessage(role="system", content="You answer briefly. " * 3),
        pb.ChatMessage(role="user", content="Which ferry leaves first?")]
DOCUMENT = "The north pier ferry leaves at six; the island camp ferry at seven. " * 2


@pytest.fixture(scope="module")
def engine(tiny_llama):
    model, tokenizer = tiny_llama
    # A service salt too: ModelInfo's namespace already holds it, so the router must not add it again.
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, tenant_salt="service-salt"), InMemoryStore(),
                    model_id="tiny")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def keys(engine):
    reply = proto_convert.model_info_reply(engine.model_info())
    return RequestKeys(engine.tokenizer, ModelIdentity.from_reply(reply))


@pytest.mark.parametrize("request_", [
    pb.GenerateRequest(prompt=DOCUMENT),
    pb.GenerateRequest(prompt=DOCUMENT, cache_salt="tenant=alice;salt="),
    pb.GenerateRequest(messages=CHAT),
    pb.GenerateRequest(segments=["System: be brief.", DOCUMENT, "Question: when?"], cache_salt="x"),
], ids=["prompt", "salted", "chat", "segments"])
def test_generate_keys_are_the_engines(engine, keys, request_):
    params = proto_convert.generation_params(request_)
    # As Engine._sequence plans it: under the request's salted namespace.
    _, service_plan, _ = plan_request(salted(engine.parts, params.cache_salt), params)
    router_plan = keys.for_generate(request_)
    assert router_plan.token_ids == service_plan.token_ids
    assert router_plan.prefix_keys == service_plan.prefix_keys and len(router_plan.prefix_keys) >= 2
    assert router_plan.content_keys == service_plan.content_keys
    assert router_plan.tail_key == service_plan.tail_key


@pytest.mark.parametrize("request_", [
    pb.WarmRequest(text=DOCUMENT),
    pb.WarmRequest(text=DOCUMENT, content_addressed=True, cache_salt="s"),
    pb.WarmRequest(messages=CHAT),
], ids=["text", "document", "chat-prefix"])
def test_warm_keys_are_the_engines(engine, keys, request_):
    arguments = proto_convert.warm_arguments(request_)
    service_plan = plan_warm(salted(engine.parts, arguments["cache_salt"]), arguments["text"], arguments["messages"],
                             arguments["content_addressed"])
    router_plan = keys.for_warm(request_)
    assert router_plan.prefix_keys == service_plan.prefix_keys
    assert router_plan.content_keys == service_plan.content_keys


def test_a_salt_changes_every_key(keys):
    plain, salted_plan = keys.for_generate(pb.GenerateRequest(prompt=DOCUMENT)), \
        keys.for_generate(pb.GenerateRequest(prompt=DOCUMENT, cache_salt="alice"))
    assert not set(plain.prefix_keys) & set(salted_plan.prefix_keys)


def test_requests_with_nothing_to_key_are_left_to_the_replica(keys):
    assert keys.for_generate(pb.GenerateRequest()) is None
    assert keys.for_warm(pb.WarmRequest()) is None

