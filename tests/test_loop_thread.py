"""The test servers' loop thread ends its connection handlers before the loop closes (a handler left
pending surfaced as an unraisable "Task was destroyed but it is pending" in a later, unrelated test)."""

from __future__ import annotations

import asyncio
import socket

from tests import loop_thread


def test_a_handler_waiting_on_a_kept_connection_ends_before_the_loop_closes() -> None:
    ended: list[bool] = []
    reading = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reading.set()
            await reader.read()  # the client keeps its connection: this waits until cancelled
        finally:
            writer.close()
            ended.append(True)

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = loop_thread.start(loop)
    with socket.create_connection(server.sockets[0].getsockname()[:2]) as kept:
        asyncio.run_coroutine_threadsafe(reading.wait(), loop).result(10)
        loop_thread.stop(loop, thread, server)
        assert ended == [True], "the handler's finally ran while its loop still ran"
        assert kept.recv(1) == b"", "its connection was closed"
    assert loop.is_closed()
