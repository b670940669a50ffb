"""free_port hands out ports the kernel never gives to a bind(0) or connect(): a server's port picked
early cannot be taken by another process's ephemeral socket before the server binds it."""

from __future__ import annotations

import socket

from vllm_ling.launcher import local_server as L


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    low = L.ephemeral_low()
    ports = {L.free_port() for _ in range(20)}
    assert all(L.PORT_FLOOR <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # random, so two processes picking at once rarely agree
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, L.PORT_FLOOR + 7])
        monkeypatch.setattr(L.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        monkeypatch.setattr(L, "ephemeral_low", lambda: busy + 1 if busy + 1 - L.PORT_FLOOR >= 1000 else 32768)
        assert L.free_port() == L.PORT_FLOOR + 7


def test_an_empty_range_falls_back_to_the_os_choice(monkeypatch, tmp_path):
    kernels_low = L.ephemeral_low()
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text(f"{L.PORT_FLOOR + 10}\t60999\n")
    monkeypatch.setattr(L, "EPHEMERAL_RANGE", ranges)
    assert L.ephemeral_low() == L.PORT_FLOOR + 10
    port = L.free_port()
    assert port >= kernels_low  # the kernel's own pick, from its range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
