"""deploy/children.py's ports for other processes to bind: below the kernel's ephemeral range, and free."""

from __future__ import annotations

import socket

from pagedserve.deploy.children import _ephemeral_low, free_tcp_port


def test_a_port_handed_to_another_process_comes_from_below_the_ephemeral_range_and_is_free():
    """The kernel never picks such a port for bind(0) or a connection, so it stays free until its owner binds it."""
    ports = {free_tcp_port() for _ in range(8)}
    assert all(20000 <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
