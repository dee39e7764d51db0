"""Work for one HTTP request that stops when its client leaves: the body has been read, so the next
message the server gets for the request is its disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

Result = TypeVar("Result")


class ClientGone(Exception):
    """The client disconnected before the work was done; the work has been cancelled."""


async def unless_disconnected(work: Awaitable[Result], http: Request) -> Result:
    """What `work` gives; ClientGone as soon as the client disconnects first, `work` cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
