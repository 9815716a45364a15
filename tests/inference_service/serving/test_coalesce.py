"""Token events coalesce when the reader falls behind, and stay one per token while it keeps up."""
import asyncio

from inference_service.serving.jobs import Job
from inference_service.serving.servicer import coalesce
from kvboost.v1 import inference_pb2 as pb


def _event(i: int, index: int = 0) -> pb.GenerateEvent:
    return pb.GenerateEvent(text=f"t{i} ", token_ids=[i], index=index,
                            logprobs=[pb.TokenLogprob(token_id=i, logprob=-float(i))])


def _concat(events):
    return ("".join(e.text for e in events), [t for e in events for t in e.token_ids],
            [(lp.token_id, lp.logprob) for e in events for lp in e.logprobs])


def test_coalesce_merges_in_order_and_keeps_completions_apart():
    events = [_event(1), _event(2), _event(3, index=1), _event(4, index=1), _event(5)]
    expected = _concat(events)  # taken before coalesce appends into the first events
    merged = coalesce(events)
    assert [e.index for e in merged] == [0, 1, 0]
    assert _concat(merged) == expected


def test_a_slow_reader_gets_fewer_messages_a_fast_one_one_per_token():
    async def run(slow: bool):
        job: Job = Job(asyncio.get_running_loop(), None, "test")
        sent = []

        async def produce():
            for i in range(20):
                job.emit(_event(i))
                await asyncio.sleep(0.002)
            job.finish(value=[])

        producer = asyncio.create_task(produce())
        async for batch in job.update_batches():
            sent.extend(coalesce(batch))
            if slow:
                await asyncio.sleep(0.02)
        await producer
        return sent

    fast = asyncio.run(run(slow=False))
    slow = asyncio.run(run(slow=True))
    reference = _concat([_event(i) for i in range(20)])
    assert len(fast) == 20 and _concat(fast) == reference
    assert len(slow) < 10 and _concat(slow) == reference
