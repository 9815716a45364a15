"""Start-up checks: every replica serves the same keys, and the router tokenizes exactly as they do."""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import grpc

from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.prompts import tokenize_messages
from router.model_identity import ModelIdentity, agreed_identity
from router.replicas import Replica

_RETRY_S = 0.25
# Text that exercises what tokenizers disagree on: a special token written out, digits, accents, whitespace.
PROBE_TEXT = "Replica check: <|im_start|>12,345 naïve cafés\n\n  indented\tline — done."
PROBE_MESSAGES = (("system", "You are a router's probe."), ("user", "Which replica holds this document?"))


class StartupError(RuntimeError):
    """The router cannot serve these replicas; the message says why and what to change."""


async def model_identity(replica: Replica, deadline: float) -> ModelIdentity:
    """The replica's ModelInfo, waited for until `deadline` (time.monotonic) while it loads its model.

    Raises:
        StartupError: no answer by the deadline, or an answer other than UNAVAILABLE (auth, TLS, a bug).
    """
    while True:
        remaining = deadline - time.monotonic()
        try:
            reply = await replica.stub.ModelInfo(pb.ModelInfoRequest(), metadata=replica.own_metadata,
                                                 timeout=max(remaining, 0.01), wait_for_ready=True)
            replica.record_model_info(reply)
            return ModelIdentity.from_reply(reply)
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StartupError(f"{replica.name} refused ModelInfo: {error.code().name}: "
                                   f"{error.details()}") from None
            if time.monotonic() + _RETRY_S >= deadline:
                raise StartupError(f"{replica.name} did not answer ModelInfo in time ({error.code().name}: "
                                   f"{error.details()}); is it running? (--startup-timeout)") from None
        await asyncio.sleep(_RETRY_S)


async def agreed_model(replicas: Sequence[Replica], timeout_s: float) -> ModelIdentity:
    """The identity every replica reports; marks them healthy. Raises StartupError (ReplicasDisagree's text)."""
    deadline = time.monotonic() + timeout_s
    identities = await asyncio.gather(*(model_identity(replica, deadline) for replica in replicas))
    try:
        identity = agreed_identity([(replica.name, found) for replica, found in zip(replicas, identities)])
    except ValueError as error:
        raise StartupError(str(error)) from None
    for replica in replicas:
        replica.healthy = True
    return identity


def tokenize_probes(tokenizer) -> list[tuple[str, pb.TokenizeRequest, list[int]]]:
    """(what it probes, Tokenize request, the ids this tokenizer gives) for every way the service tokenizes: a
    prompt with and without special tokens (first and later segments), chat messages with and without the
    generation prompt (Generate and Warm)."""
    chat = [pb.ChatMessage(role=role, content=content) for role, content in PROBE_MESSAGES]
    return [
        ("a prompt", pb.TokenizeRequest(prompt=PROBE_TEXT), list(tokenizer(PROBE_TEXT)["input_ids"])),
        ("a later segment", pb.TokenizeRequest(prompt=PROBE_TEXT, add_special_tokens=False),
         list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])),
        ("chat messages", pb.TokenizeRequest(messages=chat), tokenize_messages(tokenizer, PROBE_MESSAGES)[0]),
        ("a chat prefix to warm", pb.TokenizeRequest(messages=chat, add_generation_prompt=False),
         tokenize_messages(tokenizer, PROBE_MESSAGES, add_generation_prompt=False)[0]),
    ]


async def check_tokenizer(tokenizer, source: str, replica: Replica, timeout_s: float = 30.0) -> None:
    """Raises StartupError when the replica's Tokenize differs from this tokenizer on any probe."""
    for label, request, expected in tokenize_probes(tokenizer):
        try:
            reply = await replica.stub.Tokenize(request, metadata=replica.own_metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise StartupError(f"{replica.name} refused Tokenize: {error.code().name}: {error.details()}") from None
        if list(reply.token_ids) != expected:
            raise StartupError(
                f"the tokenizer loaded from {source} does not tokenize as {replica.name} does "
                f"(on {label}: {len(expected)} ids here, {len(reply.token_ids)} there); pass --tokenizer with the "
                "folder of the replicas' tokenizer")
