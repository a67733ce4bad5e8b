"""Helpers for tests that start real services on 127.0.0.1: a free port, and the team's admin credentials in
`os.environ` for the duration of a block (creating users at a fixture's start)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def as_admin(state: Any, also: tuple[str, ...] = ()) -> Iterator[None]:
    """`os.environ` updated with `pfactory.team.services.admin_env(state)` inside the block; every variable
    it sets (and those named in `also`) restored afterwards, an unset one unset again."""
    from pfactory.team.services import admin_env

    env = admin_env(state)
    saved = {k: os.environ.get(k) for k in (*env, *also)}
    try:
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
