"""The OpenAPI document (http_gateway/openapi.py) and the parsing it describes: request bodies, error answers,
strict types, and the same neutral values in the schema and in the refusal of unsupported fields."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from http_gateway.app import build_app
from http_gateway.config import GatewayConfig
from http_gateway.request_mapping import json_equal, refuse_unsupported
from http_gateway.errors import GatewayError
from http_gateway.schemas import ChatCompletionRequest, UNSUPPORTED_NEUTRAL_VALUES
from tests.http_gateway.test_app import CHAT, send

POSTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/kvboost/warm",
         "/v1/kvboost/unpin"]


def document(**config) -> dict:
    return build_app(GatewayConfig(**config)).openapi()


def test_every_post_has_its_request_schema_and_error_answers():
    paths = document()["paths"]
    for path in POSTS:
        operation = paths[path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith(
            "#/components/schemas/"), path
        assert {"200", "400", "401", "413", "429", "503"} <= set(operation["responses"]), path
        assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]


def test_without_keys_there_is_no_bearer_scheme_and_no_tenant():
    plain = document()
    assert "securitySchemes" not in plain["components"]
    assert plain["components"]["schemas"]["WarmRequest"]["properties"]["tenant"]["type"] == "null"


def test_with_a_key_every_path_but_health_and_metrics_needs_the_bearer(tmp_path):
    key = tmp_path / "key"
    key.write_text("k\n")
    paths = document(api_key_file=str(key))["paths"]
    assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in paths["/health"]["get"] and "security" not in paths["/metrics"]["get"]


@pytest.mark.parametrize("fields", [{"max_tokens": "4"}, {"stream": 1}, {"n": True}, {"temperature": "0.5"},
                                    {"max_tokens": 2**31}, {"top_k": 2**31}])
def test_types_and_bounds_are_strict(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, **fields})


def test_an_integral_number_is_an_integer():
    assert ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user"}], "max_tokens": 4.0}').max_tokens == 4


@pytest.mark.parametrize("name, value, refused", [("presence_penalty", 0.0, False), ("presence_penalty", False, True),
                                                  ("use_beam_search", False, False), ("use_beam_search", 0, True),
                                                  ("best_of", True, True), ("response_format", {"type": "text"}, False)])
def test_neutral_values_compare_as_json(name, value, refused):
    body = ChatCompletionRequest.model_validate({**CHAT, name: value})
    if refused:
        with pytest.raises(GatewayError):
            refuse_unsupported(body)
    else:
        refuse_unsupported(body)
    assert any(json_equal(value, neutral) for neutral in UNSUPPORTED_NEUTRAL_VALUES[name]) != refused


def test_a_wrong_method_says_which_it_takes():
    response, _ = send([], "GET", "/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_counts_empty_messages_as_none_as_the_service_does():
    from http_gateway.request_mapping import tokenize_request
    from http_gateway.schemas import TokenizeRequest
    assert tokenize_request(TokenizeRequest(prompt="x", messages=[])).prompt == "x"
    with pytest.raises(GatewayError):
        tokenize_request(TokenizeRequest(prompt="", messages=[]))
