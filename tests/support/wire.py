"""Raw pool-protocol sockets for the pool tests: exact reads, reads to EOF, and a HELLO said
by hand (receiving the arena's file descriptor)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from kvflow.pool import protocol as p

__all__ = ["Greeted", "greet", "read_to_eof", "recv_exact"]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; EOFError if the peer closes first (the socket's timeout applies)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_to_eof(sock: socket.socket, limit: int = 1 << 27) -> bytes:
    """Everything the peer sends until it closes (a reset counts as a close). The socket's
    timeout bounds every wait: a peer that neither answers nor closes raises TimeoutError."""
    out = bytearray()
    while len(out) < limit:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


class Greeted:
    """A raw connection that has said HELLO: the reply (its header's ``flags`` too), and the
    file descriptors that came with it (closed by ``close()``)."""

    def __init__(
        self, sock: socket.socket, code: int, body: bytes, fds: list[int], flags: int = 0
    ) -> None:
        self.sock = sock
        self.code = code
        self.body = body
        self.fds = fds
        self.flags = flags

    @property
    def hello(self) -> p.Hello:
        return p.parse_hello(self.body)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.sock.close()


@contextlib.contextmanager
def greet(path: str, timeout: float = 60.0) -> Iterator[Greeted]:
    """Connect to ``path`` and say HELLO by hand (receiving the arena fd with SCM_RIGHTS)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(p.frame(p.Op.HELLO, 1, p.hello_body(os.getpid())))
        header, fds, _, _ = socket.recv_fds(sock, p.HEADER.size, 4)
        if not header:
            raise EOFError("the server closed the connection instead of answering HELLO")
        header += recv_exact(sock, p.HEADER.size - len(header))
        length, version, code, flags, rid = p.HEADER.unpack(header)
        assert (version, rid) == (p.VERSION, 1)
        body = recv_exact(sock, length)
    except BaseException:
        Greeted(sock, -1, b"", list(fds)).close()
        raise
    greeted = Greeted(sock, code, body, list(fds), flags)
    try:
        yield greeted
    finally:
        greeted.close()
