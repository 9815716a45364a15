"""OpenAI bodies -> GenerateRequest: defaults as OpenAI's, vLLM extras, kvboost options, refusals by name."""
from __future__ import annotations

import pytest

from pydantic import ValidationError

from http_gateway.errors import GatewayError, from_validation_error
from http_gateway.request_mapping import chat_request, completion_request, tokenize_request, warm_request
from http_gateway.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest, UnpinRequest, WarmRequest
from kvboost.v1 import inference_pb2 as pb

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> pb.GenerateRequest:
    """As the gateway maps it for a trusted caller (no tenants): the client's cache_salt is the scope."""
    return chat_request(ChatCompletionRequest(**{"messages": USER, **fields}), "rid-1", default_max_tokens=512,
                        cache_salt=fields.get("cache_salt", ""))


def complete(**fields) -> pb.GenerateRequest:
    return completion_request(CompletionRequest(**{"prompt": "Once", **fields}), "rid-2",
                              cache_salt=fields.get("cache_salt", ""))


def refusal(call, **fields) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        call(**fields)
    assert raised.value.status == 400
    return raised.value


def test_chat_defaults_are_openai_defaults():
    request = chat()
    assert request.temperature == 1.0  # OpenAI samples unless told otherwise
    assert request.max_new_tokens == 512  # the gateway's --default-max-tokens
    assert request.n == 1 and request.request_id == "rid-1"
    assert not request.HasField("top_p") and not request.HasField("top_k") and not request.HasField("seed")
    assert not request.logprobs and not request.HasField("prompt_logprobs")
    assert [(m.role, m.content) for m in request.messages] == [("user", "Hi")]


def test_completions_default_to_16_tokens():
    assert complete().max_new_tokens == 16 and complete().prompt == "Once"


def test_sampling_fields_and_vllm_extras_reach_the_request():
    request = chat(max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, top_k=40, seed=-1, stop="END",
                   n=3, min_tokens=2, ignore_eos=True, stop_token_ids=[5, 6], cache_salt="tenant", user="u-1")
    assert request.max_new_tokens == 7  # max_completion_tokens wins over the older max_tokens
    assert (request.temperature, request.top_p, request.top_k) == (0.0, 0.5, 40)
    assert request.seed == (1 << 64) - 1  # OpenAI's signed seeds fold into our unsigned ones
    assert list(request.stop) == ["END"] and request.n == 3
    assert (request.min_tokens, request.ignore_eos, list(request.stop_token_ids)) == (2, True, [5, 6])
    assert request.cache_salt == "tenant"


def test_top_k_minus_one_means_off():
    assert not chat(top_k=-1).HasField("top_k")


def test_kvboost_options_under_their_own_key():
    request = complete(kvboost={"mode": "prefix_cache", "recompute_strategy": "cacheblend", "recompute_ratio": 0.2,
                                "selective_tokens": 4, "sink_tokens": 1})
    assert request.mode == pb.PREFIX_CACHE and request.recompute_strategy == pb.CACHEBLEND
    assert request.recompute_ratio == pytest.approx(0.2) and (request.selective_tokens, request.sink_tokens) == (4, 1)


def test_kvboost_options_refuse_unknown_names():
    with pytest.raises(ValidationError) as raised:
        CompletionRequest(prompt="x", kvboost={"mdoe": "baseline"})
    error = from_validation_error(raised.value)
    assert error.status == 400 and "mdoe" in error.message and error.param == "kvboost.mdoe"


def test_segments_replace_an_empty_or_equal_prompt():
    assert list(complete(prompt="", kvboost={"segments": ["A ", "B"]}).segments) == ["A ", "B"]
    assert complete(prompt="A B", kvboost={"segments": ["A ", "B"]}).prompt == ""
    assert refusal(complete, prompt="other", kvboost={"segments": ["A ", "B"]}).param == "prompt"
    assert refusal(chat, kvboost={"segments": ["A"]}).param == "kvboost.segments"


def test_chat_logprobs_and_completion_echo_logprobs():
    request = chat(logprobs=True, top_logprobs=3)
    assert request.logprobs and request.top_logprobs == 3 and not request.HasField("prompt_logprobs")
    assert refusal(chat, top_logprobs=2).param == "top_logprobs"
    echoed = complete(logprobs=2, echo=True)
    assert echoed.logprobs and echoed.top_logprobs == 2 and echoed.prompt_logprobs == 2
    assert not complete(echo=True).HasField("prompt_logprobs")  # echo without logprobs needs no scoring


def test_developer_messages_are_system_messages_and_text_parts_join():
    request = chat(messages=[{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}])
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hello")]


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "x", "tool_call_id": "1"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls"),
])
def test_messages_the_model_cannot_take_are_refused(message, param):
    assert refusal(chat, messages=[message]).param == param


def test_known_unsupported_fields_are_named_and_neutral_values_pass():
    error = refusal(chat, tools=[{"type": "function"}], logit_bias={"1": 5}, presence_penalty=0.5)
    assert error.code == "unsupported_parameter" and error.param == "tools"
    assert all(name in error.message for name in ("tools", "logit_bias", "presence_penalty"))
    # What SDKs send by default changes nothing: accepted. Unknown fields are ignored, as OpenAI does.
    chat(tools=[], tool_choice="none", presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"},
         logit_bias={}, store=False, metadata={"a": "b"}, something_new=1)
    assert refusal(complete, suffix="!").param == "suffix"
    assert refusal(complete, best_of=2).param == "best_of"


def test_prompts_that_are_not_one_text_are_refused():
    assert refusal(complete, prompt=["a", "b"]).code == "unsupported_parameter"
    assert refusal(complete, prompt=[1, 2, 3]).code == "unsupported_parameter"
    assert complete(prompt=["only one"]).prompt == "only one"
    assert refusal(complete, prompt="").param == "prompt"


def test_min_tokens_over_max_tokens_and_empty_stops_are_refused():
    assert refusal(complete, min_tokens=20).param == "min_tokens"  # over the default 16
    assert refusal(chat, stop=["ok", ""]).param == "stop"


def test_tokenize_and_warm_take_exactly_one_input():
    assert tokenize_request(TokenizeRequest(prompt="x", add_special_tokens=False)).add_special_tokens is False
    assert tokenize_request(TokenizeRequest(messages=USER)).messages[0].content == "Hi"
    with pytest.raises(GatewayError):
        tokenize_request(TokenizeRequest(prompt="x", messages=USER))
    warm = warm_request(WarmRequest(text="doc", content_addressed=True, pin=True, cache_salt="s"), "scope")
    assert (warm.text, warm.content_addressed, warm.pin, warm.cache_salt) == ("doc", True, True, "scope")
    unpin = warm_request(UnpinRequest(text="doc", pin=True), "scope")  # an unpin never pins
    assert (unpin.text, unpin.pin) == ("doc", False)
    with pytest.raises(GatewayError):
        warm_request(WarmRequest(), "")
