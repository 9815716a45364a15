"""The gRPC store checks each fetched blob once, tells the daemon it does, and reports a bad one."""
from __future__ import annotations

from kvboost.v1 import cache_pb2

from tests.inference_service.store.test_grpc_store import (
    FakeCacheService, connected_cache, make_item, make_key, running_daemon,
)


class RecordingService(FakeCacheService):
    def __init__(self) -> None:
        super().__init__()
        self.fetch_requests: list[cache_pb2.FetchRequest] = []
        self.deletes: list[cache_pb2.DeleteRequest] = []

    def Fetch(self, request, context):
        self.fetch_requests.append(request)
        yield from super().Fetch(request, context)

    def Delete(self, request, context):
        self.deletes.append(request)
        return cache_pb2.DeleteReply(deleted=len(request.keys))


def test_fetch_asks_the_daemon_to_skip_its_check_and_reports_what_fails_here() -> None:
    service = RecordingService()
    with running_daemon(service) as address, connected_cache(address) as cache:
        cache.store([make_item(1), make_item(2)])
        service.corrupt_keys.add(make_key(2))

        fetched = list(cache.fetch([make_key(1), make_key(2)]))

    assert fetched == [(make_key(1), make_item(1).blob), (make_key(2), None)]
    assert [request.reader_verifies for request in service.fetch_requests] == [True]
    assert [(list(d.keys), d.corrupted) for d in service.deletes] == [([make_key(2)], True)]
