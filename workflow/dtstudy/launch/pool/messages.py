"""The pool's wire format, for both sides: a message is a 4-byte big-endian length, then that many bytes of JSON."""

from __future__ import annotations

import json
import socket
import struct


def send(sock: socket.socket, message: dict) -> None:
    payload = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def receive(sock: socket.socket) -> dict | None:
    """The next message, or None when the other side closed the connection."""
    header = _read_exactly(sock, 4)
    if header is None:
        return None
    payload = _read_exactly(sock, struct.unpack("!I", header)[0])
    return None if payload is None else json.loads(payload)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
