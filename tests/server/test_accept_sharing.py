"""How the children of ``serve --processes`` share connections
(:mod:`meshkit.server.accept`, :mod:`meshkit.server.h1.acceptor`): the rule, the
shared counts, and one child's acceptor on a real loop with real sockets, its
siblings played by the test (their slots written, their inboxes read)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshkit.server.accept import ABSENT, SLACK, Shares, hand_to
from meshkit.server.h1.acceptor import Acceptor, Inboxes, Sharing
from meshkit.server.runner import new_event_loop


def test_a_child_keeps_connections_until_it_holds_more_than_the_slack_above_a_sibling() -> None:
    assert SLACK == 1
    assert hand_to([0, 0], 0) == 0
    assert hand_to([1, 0], 0) == 0
    assert hand_to([2, 0], 0) == 1
    assert hand_to([5, 3, 1], 0) == 2  # the least loaded
    assert hand_to([5, 3, 3], 0) == 1  # ties: the first
    assert hand_to([9, ABSENT], 0) == 0  # a sibling not accepting takes nothing
    assert hand_to([ABSENT, 9, 0], 1) == 2
    assert hand_to([3, 0], 0, slack=3) == 0


def test_the_counts_are_shared_through_the_file_and_count_what_is_on_its_way(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "connections")
    parent = Shares.create(path, 3)
    child = Shares(path, 3)
    try:
        assert parent.held() == [ABSENT, ABSENT, ABSENT]
        child.set_open(0, 4)
        child.set_open(1, 1)
        assert parent.held() == [4, 1, ABSENT]
        child.sent(0, 1)
        child.sent(0, 1)
        child.sent(2, 1)
        assert parent.held() == [4, 4, ABSENT]  # three on their way to child 1
        child.received(1)
        assert parent.held() == [4, 3, ABSENT]
        assert parent.handed() == 3
        parent.set_open(1, ABSENT)  # reaped: what was on its way waits for its successor
        assert child.held() == [4, ABSENT, ABSENT]
        assert (tmp_path / "connections").stat().st_mode & 0o777 == 0o600
    finally:
        child.close()
        parent.close()


class _Recorder(asyncio.Protocol):
    """Answers every read with ``ok`` and records its connection."""

    made: list[_Recorder]
    acceptor: Acceptor

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.made.append(self)
        self.acceptor.counted(len(self.made))  # as H1Server.attach does

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"ok:" + data)  # type: ignore[attr-defined]


class _Child:
    """Child 0 of ``count`` on a real loop and listening socket; the siblings are
    played by the test."""

    def __init__(self, tmp_path: Path, count: int) -> None:
        self.loop = new_event_loop()
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.shares = Shares.create(str(tmp_path / "connections"), count)
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(count)]
        self.inboxes = Inboxes(
            socket.socket(fileno=socket.dup(self.pairs[0][0].fileno())),
            [socket.socket(fileno=socket.dup(p[1].fileno())) for p in self.pairs],
        )
        self.made: list[_Recorder] = []

        def protocol() -> _Recorder:
            p = _Recorder()
            p.made = self.made
            p.acceptor = self.acceptor
            return p

        self.acceptor = Acceptor(
            self.loop, self.listener, protocol, Sharing(self.shares, self.inboxes, 0)
        )
        self.clients: list[socket.socket] = []

    def connect(self, n: int) -> None:
        for _ in range(n):
            self.clients.append(socket.create_connection(("127.0.0.1", self.port)))

    def turn(self, until: int, rounds: int = 400) -> None:
        """Run the loop until ``until`` connections are made here (bounded)."""
        for _ in range(rounds):
            if len(self.made) >= until:
                return
            self.loop.run_until_complete(asyncio.sleep(0.005))

    def handed_to(self, index: int) -> list[socket.socket]:
        """The connections waiting in child ``index``'s inbox."""
        inbox = self.pairs[index][0]
        inbox.setblocking(False)
        out: list[socket.socket] = []
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(inbox, 1, 1)
            except BlockingIOError:
                return out
            out += [socket.socket(fileno=fd) for fd in fds]

    def close(self) -> None:
        self.acceptor.close()
        for p in self.made:
            p.transport.close()
        self.loop.run_until_complete(asyncio.sleep(0.01))
        self.loop.close()
        for c in self.clients:
            c.close()
        self.listener.close()
        self.inboxes.close()
        for pair in self.pairs:
            for end in pair:
                end.close()
        self.shares.close()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[_Child]:
    c = _Child(tmp_path, 2)
    yield c
    c.close()


def test_a_child_over_its_share_hands_connections_to_the_sibling_holding_fewer(
    child: _Child,
) -> None:
    child.shares.set_open(1, 0)  # a sibling accepting, holding none
    child.connect(6)
    child.turn(until=3)
    for _ in range(50):  # the rest are handed on, not kept
        child.loop.run_until_complete(asyncio.sleep(0.005))
    kept = len(child.made)
    handed = child.handed_to(1)
    assert kept + len(handed) == 6
    # It stops keeping once it holds more than SLACK above what the sibling holds
    # (received or on its way): an even split of six within the slack.
    assert abs(kept - len(handed)) <= SLACK + 1, (kept, len(handed))
    assert child.shares.handed() == len(handed) > 0
    assert child.shares.held()[0] == kept
    # A handed descriptor is the client's connection itself; the kept ones are served.
    by_port = {s.getpeername()[1]: s for s in handed}
    for c in child.clients:
        theirs = by_port.get(c.getsockname()[1])
        if theirs is None:
            assert _answers_via_loop(child, c) == b"ok:hi"
        else:
            c.sendall(b"hi")
            theirs.settimeout(10)
            assert theirs.recv(16) == b"hi"
    for h in handed:
        h.close()


def _answers_via_loop(child: _Child, client: socket.socket) -> bytes:
    client.sendall(b"hi")
    client.setblocking(False)
    for _ in range(400):
        child.loop.run_until_complete(asyncio.sleep(0.005))
        try:
            return client.recv(16)
        except BlockingIOError:
            continue
    raise AssertionError("no answer")


def test_a_child_keeps_everything_when_no_sibling_accepts(child: _Child) -> None:
    child.shares.set_open(1, ABSENT)  # restarting, or stopped
    child.connect(6)
    child.turn(until=6)
    assert len(child.made) == 6
    assert child.handed_to(1) == []
    assert child.shares.handed() == 0


def test_a_full_inbox_leaves_the_connection_with_the_child_that_accepted_it(
    child: _Child,
) -> None:
    child.shares.set_open(1, 0)
    sender = child.pairs[1][1]
    sender.setblocking(False)
    filled = 0
    try:  # the sibling stopped reading its inbox
        while filled < 100_000:
            sender.send(b"x")
            filled += 1
    except BlockingIOError:
        pass
    assert filled < 100_000
    child.connect(5)
    child.turn(until=5)
    assert len(child.made) == 5  # none lost, none waiting
    assert child.shares.handed() == 0
    assert filled > 0


def test_a_connection_handed_to_the_child_is_served_by_it(child: _Child) -> None:
    # A sibling accepted this one and handed it over: it arrives in child 0's inbox.
    outside = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(outside.getsockname())
        accepted, _ = outside.accept()
        socket.send_fds(child.pairs[0][1], [b"c"], [accepted.fileno()])
        child.shares.sent(1, 0)
        accepted.close()  # the sibling's copy; child 0 has its own now
        assert child.shares.held()[0] == 1  # on its way, counted for child 0
        child.turn(until=1)
        assert len(child.made) == 1
        assert _answers_via_loop(child, client) == b"ok:hi"
        assert child.shares.held()[0] == 1  # received and open
        client.close()
    finally:
        outside.close()


def test_a_closed_acceptor_is_absent_and_takes_nothing(child: _Child) -> None:
    child.acceptor.close()
    assert child.shares.held()[0] == ABSENT
    child.connect(2)
    for _ in range(20):
        child.loop.run_until_complete(asyncio.sleep(0.005))
    assert child.made == []


def test_the_parent_marks_a_dead_child_absent(tmp_path: Path) -> None:
    # Else its siblings keep handing it connections by its last count until it is
    # back (they would wait in its inbox for its successor).
    import subprocess
    import sys

    from meshkit.server.supervisor import Supervisor

    with socket.create_server(("127.0.0.1", 0)) as sock:
        sup = Supervisor(["serve"], sock, "http://x", 2, 1.0)
        try:
            child = sup.children[1]
            child.popen = subprocess.Popen([sys.executable, "-c", "pass"])
            child.popen.wait(30)
            sup.shares.set_open(1, 5)
            assert sup._reap(child) == 0
            assert sup.shares.held()[1] == ABSENT
        finally:
            sup.close()
        assert not Path(sup.run_dir).exists()


def test_a_connection_being_made_counts_once(child: _Child) -> None:
    """Between the protocol's connection_made (the server counts it open) and the
    end of the acceptor's connect, a connection was counted open and pending: a
    burst's connections counted twice, and siblings handed this child too few."""
    seen: list[int] = []
    counted = child.acceptor.counted

    def watched(connections: int) -> None:
        counted(connections)
        seen.append(child.shares.held()[0])  # what the siblings read right then

    child.acceptor.counted = watched  # type: ignore[method-assign]
    child.connect(5)
    child.turn(until=5)
    child.loop.run_until_complete(asyncio.sleep(0.01))  # every connect ended
    assert len(seen) == 5
    assert max(seen) <= 5  # never more than the connections there are
    assert child.shares.held()[0] == 5
