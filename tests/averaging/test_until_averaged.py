"""A contributor's wait for its averages, cancelled as the channel closes: nothing is left unretrieved."""

from __future__ import annotations

import asyncio
import gc

from swarmgrad.averaging.allreduce import GroupAllReduce


class ClosedChannel:
    peer_id = "12D3KooWpeer"

    async def recv_header(self, max_payload: int) -> tuple[dict, int]:
        raise EOFError("channel closed")


def test_a_wait_cancelled_as_its_channel_closes_retrieves_the_read_error():
    unretrieved: list[dict] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        handed = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(GroupAllReduce._until_averaged(None, ClosedChannel(), handed))
        await asyncio.sleep(0)  # the wait starts and reads
        await asyncio.sleep(0)  # the read fails: the wait is woken...
        waiting.cancel()  # ...and cancelled before it runs (the round failed at the same moment)
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled()
        del waiting
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert [c.get("message") for c in unretrieved] == []
