"""Test helpers: ``free_port`` leaves a cluster node room for its bus port; a server that
cannot start says why."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from celery_redislock.testing import CLUSTER_BUS_OFFSET, RedisServer, free_port


def test_a_cluster_node_s_port_has_a_bus_port_in_range_and_free() -> None:
    for _ in range(200):
        port = free_port(cluster=True)
        assert 0 < port <= 65535 - CLUSTER_BUS_OFFSET
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
            bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))  # free a moment ago, as a rule
    assert 0 < free_port() <= 65535


def test_a_server_that_cannot_start_says_what_its_log_ends_with(tmp_path: Path) -> None:
    """A redis-server that exits at start (here: its directory is a file) fails ``start``
    with the end of its log in the error (or why there is none), not just a path."""
    server = RedisServer(directory=str(tmp_path))
    (tmp_path / "redis.log").write_text("".join(f"line {i}\n" for i in range(30)))
    assert server._log_tail(3) == "line 27\nline 28\nline 29"
    broken = RedisServer(directory=str(tmp_path / "not-a-dir"))
    (tmp_path / "not-a-dir").write_text("a file")
    with pytest.raises(RuntimeError, match="did not start; its log ends:\n"):
        broken.start()
    assert broken.process is None  # stopped by pid, nothing left running
