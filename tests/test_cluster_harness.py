"""benchmarks/cluster.py's two-node harness: root check, set-up and clean-up (even on failure)."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks import cluster


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _can_build_namespaces() -> bool:
    if os.geteuid() != 0:
        return False
    probe = subprocess.run(["ip", "netns", "add", "zpp_probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "zpp_probe"], capture_output=True)
    return probe.returncode == 0


needs_netns = pytest.mark.skipif(not _can_build_namespaces(), reason="needs root and network namespaces")


def test_refuses_to_run_without_root_and_says_how(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root: run it with sudo"):
        with cluster.two_node_cluster():
            pass


@needs_netns
def test_builds_a_shaped_link_and_removes_everything_even_when_the_run_fails():
    with pytest.raises(RuntimeError, match="a run failed"):
        with cluster.two_node_cluster():
            assert set(cluster.NAMESPACES) <= _namespaces()
            cluster.set_link_rate("100mbit")
            qdisc = cluster._ip("tc", "qdisc", "show", "dev", cluster.VETHS[1], namespace=cluster.NAMESPACES[1]).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            # The other node's address answers over the link (a TCP connect to a closed port is refused).
            probe = f"import socket; s = socket.socket(); s.settimeout(5); print(s.connect_ex(('{cluster.ADDRESSES[1]}', 9)))"
            reply = cluster._ip("python3", "-c", probe, namespace=cluster.NAMESPACES[0]).stdout.strip()
            assert reply == "111"  # ECONNREFUSED: reached the peer, nothing listens on port 9
            raise RuntimeError("a run failed")
    assert not set(cluster.NAMESPACES) & _namespaces()
