"""Shared by the tests that spawn gloo ranks themselves."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A callable giving a free local TCP port for a process group's MASTER_PORT."""
    return _free_port
