"""A small HTTP server for one read-only endpoint (gpumem's metrics): one thread serves every
connection through a selector, each bounded in time and in size.

Note [stalled clients]
  A thread per connection, as prometheus_client's own server has, is held for as long as a client
  keeps its connection open without finishing its request: 200 half-sent requests held 202 threads,
  for ever. Here one thread serves them all, and reads and writes only what a socket takes at once.
  Each connection has CONNECTION_SECONDS in all, from its accept to the last byte of its answer,
  and a request head of at most MAX_REQUEST bytes; at most MAX_CONNECTIONS are open at once (one
  more closes the oldest). A scrape is answered as soon as its request is in, whatever the others
  do: the answer is made on this thread, so its time is the endpoint's only wait.

Invariants: `connections` holds every open connection, oldest first; each is registered with the
selector: for reading until its answer is made, for writing until it is sent, for reading again
(what comes is dropped) until the client closes.
"""
from __future__ import annotations

import errno
import selectors
import socket
import sys
import threading
import time
from typing import Callable, Optional

from gpumem.settings.echo import bounded

BACKLOG = 128
CONNECTION_SECONDS = 10.0
MAX_CONNECTIONS = 512
MAX_REQUEST = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}

# path -> (status, content type, body); it must not raise (the server answers 500 if it does)
Answer = Callable[[str], tuple[int, str, bytes]]


class _Connection:
    __slots__ = ("sock", "deadline", "received", "answer", "answered")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.received = b""
        self.answer: Optional[memoryview] = None  # what is left to send, once made
        self.answered = False  # all sent: what the client still sends is read and dropped until it closes


class Server:
    """Listens on `addr`:`port` (0: any free port; `port` then says which) and answers each request
    with `answer(path)`, from a daemon thread named `name` once started. OSError if it cannot listen."""

    def __init__(self, addr: str, port: int, answer: Answer, name: str):
        self.listener = _listen(addr, port)
        self.port = self.listener.getsockname()[1]
        self._answer = answer
        self._connections: dict[socket.socket, _Connection] = {}
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()  # close() writes to the one, the loop wakes on the other
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops serving and closes every socket; returns once the thread has ended. Again: nothing."""
        if self._closing:
            return
        self._closing = True
        self._waker.send(b"\0")
        if self._thread.is_alive():
            self._thread.join()
        for sock in [*self._connections, self.listener, self._wake, self._waker]:
            sock.close()
        self._connections.clear()
        self._selector.close()

    def close_in_forked_child(self) -> None:
        """A forked child has no thread serving: it lets go of the port (and of the connections)."""
        for sock in [*self._connections, self.listener]:
            sock.close()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:  # noqa: BLE001: a daemon thread's traceback would reach nobody who can act on it
            if not self._closing:
                sys.stderr.write(f"gpumem: {self._thread.name} stopped serving ({type(error).__name__}: "
                                 f"{bounded(str(error))}); the program goes on.\n")

    def _serve(self) -> None:
        while not self._closing:
            for key, _ in self._selector.select(self._timeout()):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is not self._wake:
                    self._step(key.data)
            self._expire(time.monotonic())

    def _timeout(self) -> Optional[float]:
        oldest = next(iter(self._connections.values()), None)
        return None if oldest is None else max(0.0, oldest.deadline - time.monotonic())

    def _accept(self) -> None:
        for _ in range(MAX_CONNECTIONS):  # what is waiting, but not for ever
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as error:  # out of file descriptors: make room, or let the backlog wait
                if error.errno in (errno.EMFILE, errno.ENFILE) and self._connections:
                    self._close(next(iter(self._connections.values())))
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                self._close(next(iter(self._connections.values())))
            sock.setblocking(False)
            connection = _Connection(sock, time.monotonic() + CONNECTION_SECONDS)
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _step(self, connection: _Connection) -> None:
        if self._connections.get(connection.sock) is not connection:
            return  # closed earlier in this round (the oldest, to make room)
        try:
            if connection.answered:
                self._drain(connection)
            elif connection.answer is None:
                self._read(connection)
            else:
                self._write(connection)
        except OSError:  # the client went away
            self._close(connection)

    def _read(self, connection: _Connection) -> None:
        chunk = connection.sock.recv(MAX_REQUEST + 1 - len(connection.received))
        if not chunk:
            self._close(connection)
            return
        connection.received += chunk
        end = connection.received.find(b"\r\n\r\n")
        if end < 0 and len(connection.received) <= MAX_REQUEST:
            return
        head = connection.received[:end] if end >= 0 else None
        connection.answer = memoryview(self._response(head))
        self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)

    def _write(self, connection: _Connection) -> None:
        sent = connection.sock.send(connection.answer)
        connection.answer = connection.answer[sent:]
        if connection.answer:
            return
        # Closed now, with bytes of the request unread (a head past MAX_REQUEST), the connection would
        # be reset, and the client could lose the answer: it is closed once the client closes it.
        connection.answered = True
        connection.sock.shutdown(socket.SHUT_WR)
        self._selector.modify(connection.sock, selectors.EVENT_READ, connection)

    def _drain(self, connection: _Connection) -> None:
        if not connection.sock.recv(65536):
            self._close(connection)

    def _response(self, head: Optional[bytes]) -> bytes:
        """The whole answer to a request whose head (up to the blank line) is `head`; None: too long."""
        if head is None:
            return _message(431, "the request head is longer than 8192 bytes")
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _message(400, "not an HTTP request")
        method, target = parts[0], parts[1].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            return _message(405, "only GET and HEAD are served")
        try:
            status, content_type, body = self._answer(target.split("?", 1)[0])
        except Exception as error:  # noqa: BLE001: a bug in the answer must not end the endpoint
            status, content_type, body = 500, _TEXT, f"{type(error).__name__}\n".encode()
        return _head(status, content_type, len(body)) + (body if method == b"GET" else b"")

    def _expire(self, now: float) -> None:
        while self._connections:
            oldest = next(iter(self._connections.values()))
            if oldest.deadline > now:
                return
            self._close(oldest)

    def _close(self, connection: _Connection) -> None:
        del self._connections[connection.sock]
        self._selector.unregister(connection.sock)
        try:
            connection.sock.recv(65536)  # what has come unread, which closing would answer with a reset
        except OSError:
            pass
        connection.sock.close()


_TEXT = "text/plain; charset=utf-8"


def _listen(addr: str, port: int) -> socket.socket:
    family, kind, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted job takes its port back
        listener.bind(where)
        listener.listen(BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


def _head(status: int, content_type: str, length: int) -> bytes:
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode("latin-1")


def _message(status: int, text: str) -> bytes:
    body = f"{text}\n".encode()
    return _head(status, _TEXT, len(body)) + body
