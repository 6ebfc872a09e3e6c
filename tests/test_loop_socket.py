"""``proxy.ipc.LoopSocket``, the ZeroMQ socket every IPC call of a server travels on: every
message sent arrives once, in order per sender (to ``recv`` or to a ``listen`` callback),
including those that come in while the receiver is busy sending (ZeroMQ's FD signals an edge
that a send can consume), and a closed socket leaves nothing behind in the event loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq

from proxy.ipc import LoopSocket, RpcClient, RpcServer


def pair(tmp_path: Path, clients: int) -> tuple[LoopSocket, list[LoopSocket]]:
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/s.sock")
    dealers = []
    for i in range(clients):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, f"c{i}".encode())
        dealer.connect(f"ipc://{tmp_path}/s.sock")
        dealers.append(LoopSocket(dealer))
    return LoopSocket(router), dealers


def test_bursts_echoed_while_the_receiver_sends_all_arrive_in_order(tmp_path: Path) -> None:
    clients, each = 4, 500

    async def main() -> dict[bytes, list[int]]:
        server, dealers = pair(tmp_path, clients)
        seen: dict[bytes, list[int]] = {}

        async def echo() -> None:
            for _ in range(clients * each):
                peer, body = await server.recv()
                seen.setdefault(peer.bytes, []).append(int(body.bytes))
                server.send([peer, body])  # may take the FD's signal of the next message

        async def client(dealer: LoopSocket) -> list[int]:
            for i in range(each):
                dealer.send([b"%d" % i])
                if i % 50 == 0:
                    await asyncio.sleep(0)  # the server answers some while more are sent
            return [int((await dealer.recv())[0].bytes) for _ in range(each)]

        try:
            echoed = await asyncio.wait_for(
                asyncio.gather(echo(), *(client(d) for d in dealers)), timeout=20
            )
        finally:
            for sock in (server, *dealers):
                sock.close()
        assert all(answers == list(range(each)) for answers in echoed[1:])
        return seen

    seen = asyncio.run(main())
    assert sorted(seen) == [f"c{i}".encode() for i in range(clients)]
    assert all(bodies == list(range(each)) for bodies in seen.values())


def test_a_message_that_came_in_during_a_send_is_received(tmp_path: Path) -> None:
    async def main() -> None:
        server, [dealer, other] = pair(tmp_path, 2)
        dealer.send([b"hello"])
        peer, _ = await asyncio.wait_for(server.recv(), timeout=5)
        waiting = asyncio.create_task(server.recv())  # nothing waits: on the loop's reader
        await asyncio.sleep(0.05)
        dealer.send([b"during"])
        time.sleep(0.1)  # noqa: ASYNC251 (it arrives while the loop does not look at the FD)
        server.send([b"c1", b"to the other"])  # ZeroMQ takes the FD's signal here
        peer, body = await asyncio.wait_for(waiting, timeout=5)
        assert (peer.bytes, body.bytes) == (b"c0", b"during")
        assert (await asyncio.wait_for(other.recv(), timeout=5))[0].bytes == b"to the other"
        for sock in (server, dealer, other):
            sock.close()

    asyncio.run(main())


def test_a_receiver_waits_for_a_late_message_and_a_closed_socket_leaves_the_loop(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        server, [dealer] = pair(tmp_path, 1)
        waiting = asyncio.create_task(server.recv())
        await asyncio.sleep(0.2)
        assert not waiting.done()  # nothing came: it waits, it does not return empty
        dealer.send([b"late"])
        peer, body = await asyncio.wait_for(waiting, timeout=5)
        assert (peer.bytes, body.bytes) == (b"c0", b"late")
        fd = server.sock.FD
        server.close()
        dealer.close()
        loop = asyncio.get_running_loop()
        assert not loop.remove_reader(fd)  # close() took its reader off the loop
        await asyncio.sleep(0.05)  # and the loop runs on

    asyncio.run(main())


def test_a_listener_gets_every_burst_in_order_and_a_failing_handler_loses_one_message(
    tmp_path: Path,
) -> None:
    """``listen``: each message to the callback as the FD signals, those that come in while
    the callback itself sends included; a callback that raises loses that message only."""
    clients, each = 4, 500

    async def main() -> dict[bytes, list[int]]:
        server, dealers = pair(tmp_path, clients)
        seen: dict[bytes, list[int]] = {}

        def echo(frames: list[zmq.Frame]) -> None:
            peer, body = frames
            if body.bytes == b"boom":
                raise ValueError("a bad message")
            seen.setdefault(peer.bytes, []).append(int(body.bytes))
            server.send([peer, body])  # may take the FD's signal of the next message

        async def client(dealer: LoopSocket) -> list[int]:
            dealer.send([b"boom"])
            for i in range(each):
                dealer.send([b"%d" % i])
                if i % 50 == 0:
                    await asyncio.sleep(0)  # the server answers some while more are sent
            return [int((await dealer.recv())[0].bytes) for _ in range(each)]

        server.listen(echo)
        try:
            echoed = await asyncio.wait_for(
                asyncio.gather(*(client(d) for d in dealers)), timeout=20
            )
        finally:
            fd = server.sock.FD
            for sock in (server, *dealers):
                sock.close()
        assert not asyncio.get_running_loop().remove_reader(fd)  # close() took it off
        assert all(answers == list(range(each)) for answers in echoed)
        return seen

    seen = asyncio.run(main())
    assert sorted(seen) == [f"c{i}".encode() for i in range(clients)]
    assert all(bodies == list(range(each)) for bodies in seen.values())


def test_a_client_pings_its_server_as_soon_as_it_connects(tmp_path: Path) -> None:
    """A worker's client of an engine that binds its socket only once loaded (30-40 s on the
    H200) is up the moment the connection is made, not at its next scheduled ping: one
    worker answered /readyz 200 while another, still waiting to ping, answered a request
    503. Pings 60 s apart here, so only the connection can bring it up within seconds."""
    address = f"ipc://{tmp_path}/late.sock"

    async def ping(message: dict[str, Any], blobs: list[zmq.Frame]) -> tuple[dict[str, Any], ()]:
        return {"pid": 1}, ()

    async def run() -> tuple[bool, float]:
        client = await RpcClient(address, role="test", ping_s=60.0).start()
        try:
            await asyncio.sleep(1.0)  # its first ping failed: no server yet
            server = RpcServer(address, {"ping": ping})
            serving = asyncio.create_task(server.serve())
            started = time.monotonic()
            up = await client.wait_up(10.0)
            serving.cancel()
            server.close()
            return up, time.monotonic() - started
        finally:
            await client.close()

    up, took = asyncio.run(run())
    assert up and took < 10.0, took
    print(f"up {took * 1000:.0f} ms after the server bound")
