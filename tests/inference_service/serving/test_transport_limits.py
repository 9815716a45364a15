"""The inference service's transport limits: --max-message-bytes and --max-concurrent-streams."""
from __future__ import annotations

import grpc
import pytest

from inference_service.serving.config import parse_config
from kvboost.v1 import inference_pb2 as pb
from tests.inference_service.serving.test_servicer import engine, generate, run, serving  # noqa: F401  (engine is a fixture)


def test_flags_and_environment_set_the_limits() -> None:
    config = parse_config(["--max-message-bytes", "2097152"], environ={"KVBOOST_MAX_CONCURRENT_STREAMS": "3"})
    assert (config.max_message_bytes, config.max_concurrent_streams) == (2 << 20, 3)
    assert (parse_config([], environ={}).max_message_bytes, parse_config([], environ={}).max_concurrent_streams) == (
        64 << 20, 0)


@pytest.mark.parametrize("argv, message", [
    (["--max-message-bytes", "1000"], "--max-message-bytes must be at least 1048576"),
    (["--max-concurrent-streams", "-1"], "--max-concurrent-streams must be >= 0"),
])
def test_bad_limits_exit_with_a_usage_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert message in capsys.readouterr().err


def test_a_request_over_max_message_bytes_is_resource_exhausted_and_smaller_ones_still_work(engine) -> None:  # noqa: F811
    async def scenario():
        async with serving(engine, max_message_bytes=1 << 20) as (_, stub, _health):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await generate(stub, prompt="x" * (2 << 20), max_new_tokens=1)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            events = await generate(stub, prompt="Hello there", max_new_tokens=2, mode=pb.BASELINE)
            assert events[-1].result.generated_tokens == 2

    run(scenario())
