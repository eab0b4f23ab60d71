"""``free_port`` draws below the kernel's ephemeral range, where no outgoing connection takes a port
between the pick and the store's listen."""

from __future__ import annotations

import socket

from deepshard.core.mesh import LOWEST_PORT, _ephemeral_low, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PORT <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
