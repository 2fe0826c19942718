from __future__ import annotations

from epd_proxy.calls.upstream import CONNECT_TIMEOUT, NoAnswer
from epd_proxy.fleet.backends import Instance


def test_a_timeout_without_a_limit_is_still_described():
    failure = NoAnswer(CONNECT_TIMEOUT, "", what="Encoder request", stage="encode", backend="http://e")
    assert failure.status == 504 and failure.message == "Encoder request timed out while connecting"


def test_dp_ranks_rotate_per_instance():
    inst = Instance("http://pd", "prefill_decode", dp_size=3)
    assert [inst.next_dp_rank() for _ in range(5)] == [0, 1, 2, 0, 1]
