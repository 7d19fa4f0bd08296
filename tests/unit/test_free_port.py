"""``testing.free_port``: a cluster node's port leaves room for its cluster bus port."""

from __future__ import annotations

import socket

from celery_redislock.testing import CLUSTER_BUS_OFFSET, free_port


def test_a_cluster_node_s_port_has_a_bus_port_in_range_and_free() -> None:
    for _ in range(200):
        port = free_port(cluster=True)
        assert 0 < port <= 65535 - CLUSTER_BUS_OFFSET
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
            bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))  # free a moment ago, as a rule
    assert 0 < free_port() <= 65535
