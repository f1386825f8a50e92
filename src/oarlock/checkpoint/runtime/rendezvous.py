"""The authenticated rendezvous under :func:`~oarlock.checkpoint.join_group` (``docs/live-resharding.md``,
"Who may join").

Rank 0 listens on the address it is given (not on every interface) and admits the other ranks one connection at
a time with a challenge-response over a shared secret (``token=``, else the environment variable
:data:`TOKEN_ENV`):

1. rank 0 sends ``HELLO``: a magic line, the group id (16 random bytes drawn once per group), a challenge (32
   random bytes drawn per connection) and the world size;
2. the joiner answers ``CLAIM``: its rank, the world size it was given, a nonce of its own and
   ``HMAC-SHA256(secret, "join" | group id | challenge | nonce | rank | world size)``;
3. rank 0 refuses a wrong proof, a rank out of range or a claim that does not speak this protocol (``R`` and a
   reason; the address it came from is recorded and reported), or accepts with a proof of its own
   (``HMAC(secret, "accept" | group id | challenge | nonce | rank)``), which the joiner checks: a process that
   does not hold the secret can neither join nor pose as rank 0;
4. once every rank ``1..world_size - 1`` holds an accepted claim, rank 0 stops listening and sends each member
   ``GO`` (with the addresses it refused) or, when two processes that both hold the secret claim one rank,
   ``FAIL`` naming both addresses, to every member.

The accepted connections then carry the group's key-value store (what gloo and NCCL use to find each other): a
:class:`torch.distributed.Store` whose rank-0 side is a table in rank 0's process and whose other ranks send their
requests over their admitted connection. Every message on a connection carries
``HMAC(session key, direction | sequence number | payload)`` (the session key is derived from the secret, the
group id, the challenge and the joiner's nonce), so nobody else can write into the store, replay or reorder a
message; no port stays open once the group is formed. The messages are authenticated, not encrypted.

Without a secret the same protocol runs with an empty key: it keeps rank claims apart and gives clear errors when
one side has a secret and the other has none, but anyone who reaches the port can join.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import queue
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from oarlock.checkpoint.errors import CheckpointError, RendezvousError

#: The environment variable :func:`~oarlock.checkpoint.join_group` reads the group's secret from when ``token`` is
#: not given.
TOKEN_ENV = "OARLOCK_SYNC_TOKEN"

_HELLO = b"OARLOCK-JOIN/1\n"
_CLAIM = b"OARLOCK-RANK/1\n"
_HELLO_LEN = len(_HELLO) + 16 + 32 + 4
_CLAIM_LEN = len(_CLAIM) + 4 + 4 + 32 + 32
_TAG = 16
_MAX_FRAME = 64 << 20  # store values are addresses and ids: far below this
_ADMIT_S = 20.0  # the most one joiner may take to answer the challenge
_warned_open = False


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The group's secret: ``token``, else ``$OARLOCK_SYNC_TOKEN``; None when neither is set (or both are empty)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    if token is None or token in ("", b""):
        return None
    if isinstance(token, bytes):
        return token
    if not isinstance(token, str):
        raise CheckpointError(f"join_group: token must be a str or bytes, got {type(token).__name__}")
    return token.encode()


def warn_if_open(host: str) -> None:
    """Warn once per process that a group without a secret listens on a non-loopback address."""
    global _warned_open
    if _warned_open or is_loopback(host):
        return
    _warned_open = True
    warnings.warn(f"join_group: no token (token= or ${TOKEN_ENV}) for a group meeting at {host}, which is not a "
                  "loopback address: any process that reaches it can join the group and write into its targets; "
                  f"give every member the same secret", RuntimeWarning, stacklevel=3)


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    try:
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
    except ValueError:
        return False


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:  # length-prefixed: no two different part lists give the same bytes
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.digest()


def derived_key(secret: bytes | None, group_id: bytes, purpose: bytes) -> bytes | None:
    """A key for ``purpose`` within one group (None without a secret)."""
    return None if secret is None else _mac(secret, b"derive", group_id, purpose)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("the peer closed the connection")
        out += got
    return bytes(out)


def _fmt(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Channel:
    """Length-prefixed messages over one admitted connection, each with a truncated HMAC over its direction and
    sequence number."""

    def __init__(self, sock: socket.socket, key: bytes, out_dir: bytes, in_dir: bytes):
        self.sock, self.key, self.out_dir, self.in_dir = sock, key, out_dir, in_dir
        self.out_seq = self.in_seq = 0
        self.peer = ""

    def send(self, payload: bytes) -> None:
        tag = _mac(self.key, self.out_dir, struct.pack(">Q", self.out_seq), payload)[:_TAG]
        self.out_seq += 1
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + tag)

    def recv(self) -> bytes:
        n = struct.unpack(">I", _recv_exact(self.sock, 4))[0]
        if n > _MAX_FRAME:
            raise RendezvousError(f"join_group: a message of {n} bytes from {self.peer}: not this protocol")
        payload = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, _TAG)
        want = _mac(self.key, self.in_dir, struct.pack(">Q", self.in_seq), payload)[:_TAG]
        if not hmac.compare_digest(tag, want):
            raise RendezvousError(f"join_group: a message on the connection with {self.peer} does not carry the "
                                  "group's authentication: it was written or altered by a process without the secret")
        self.in_seq += 1
        return payload

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _pack(op: bytes, fields: list[bytes]) -> bytes:
    return op + struct.pack(">H", len(fields)) + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(payload: bytes) -> tuple[bytes, list[bytes]]:
    op, (n,) = payload[:1], struct.unpack(">H", payload[1:3])
    out, i = [], 3
    for _ in range(n):
        (k,) = struct.unpack(">I", payload[i:i + 4])
        out.append(payload[i + 4:i + 4 + k])
        i += 4 + k
    if i != len(payload) or len(out) != n:
        raise RendezvousError("join_group: a malformed store message")
    return op, out


# ---------------------------------------------------------------- the key-value store

class _Table:
    """Rank 0's key-value state, with the blocking ``get``/``wait`` of a ``torch.distributed`` store."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cv = threading.Condition()
        self.closed = False

    def _until(self, ready: Callable[[], bool], seconds: float, what: str) -> None:
        if not self.cv.wait_for(lambda: ready() or self.closed, timeout=seconds):
            raise TimeoutError(f"join_group store: timed out after {seconds:.0f} s waiting for {what}")
        if not ready():
            raise RendezvousError("join_group store: the group was closed")

    def apply(self, op: bytes, f: list[bytes]) -> list[bytes]:
        with self.cv:
            d = self.data
            if op == b"S":
                d[f[0]] = f[1]
            elif op == b"G":
                self._until(lambda: f[0] in d, float(f[1]), f"key {f[0]!r}")
                return [d[f[0]]]
            elif op == b"W":
                keys = f[1:]
                self._until(lambda: all(k in d for k in keys), float(f[0]), f"keys {keys!r}")
            elif op == b"C":
                return [b"1" if all(k in d for k in f) else b"0"]
            elif op == b"A":
                v = int(d.get(f[0], b"0")) + int(f[1])
                d[f[0]] = str(v).encode()
                out = [d[f[0]]]
                self.cv.notify_all()
                return out
            elif op == b"X":  # compare and set, as TCPStore
                cur = d.get(f[0])
                if (cur is None and f[1] == b"") or cur == f[1]:
                    d[f[0]] = f[2]
                    self.cv.notify_all()
                    return [f[2]]
                return [f[1] if cur is None else cur]
            elif op == b"D":
                return [b"1" if d.pop(f[0], None) is not None else b"0"]
            elif op == b"N":
                return [str(len(d)).encode()]
            elif op == b"P":
                d[f[0]] = d.get(f[0], b"") + f[1]
            else:
                raise RendezvousError(f"join_group store: unknown operation {op!r}")
            self.cv.notify_all()
            return []

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()


def _as_bytes(v: Any) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def make_store(call: Callable[[bytes, list[bytes]], list[bytes]], timeout_s: float) -> Any:
    """A ``torch.distributed.Store`` whose operations go through ``call(op, fields)`` (the table on rank 0, the
    admitted connection elsewhere)."""
    import datetime

    import torch.distributed as dist

    class GroupStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.set_timeout(datetime.timedelta(seconds=timeout_s))

        def _secs(self, timeout: Any = None) -> bytes:
            t = timeout if timeout is not None else self.timeout
            s = t.total_seconds() if hasattr(t, "total_seconds") else float(t)
            return repr(s if s > 0 else timeout_s).encode()

        def set(self, key, value):  # noqa: A003 - the Store API
            call(b"S", [_as_bytes(key), _as_bytes(value)])

        def get(self, key):
            return call(b"G", [_as_bytes(key), self._secs()])[0]

        def wait(self, keys, timeout=None):
            call(b"W", [self._secs(timeout)] + [_as_bytes(k) for k in keys])

        def check(self, keys):
            return call(b"C", [_as_bytes(k) for k in keys])[0] == b"1"

        def add(self, key, value):
            return int(call(b"A", [_as_bytes(key), str(int(value)).encode()])[0])

        def compare_set(self, key, expected, desired):
            return call(b"X", [_as_bytes(key), _as_bytes(expected), _as_bytes(desired)])[0]

        def delete_key(self, key):
            return call(b"D", [_as_bytes(key)])[0] == b"1"

        def num_keys(self):
            return int(call(b"N", [])[0])

        def append(self, key, value):
            call(b"P", [_as_bytes(key), _as_bytes(value)])

        def multi_get(self, keys):
            return [self.get(k) for k in keys]

        def multi_set(self, keys, values):
            for k, v in zip(keys, values):
                self.set(k, v)

        def clone(self):  # one connection, its requests serialised: a clone can share it
            return self

    return GroupStore()


def _serve(table: _Table, ch: _Channel) -> None:
    """Rank 0's side of one member's store requests, until the member or the group closes."""
    while True:
        try:
            op, fields = _unpack(ch.recv())
        except (OSError, ConnectionError, RendezvousError, struct.error):
            ch.close()
            return
        try:
            reply = _pack(b"K", table.apply(op, fields))
        except Exception as e:  # noqa: BLE001 - sent back to the member, raised there
            reply = _pack(b"E", [f"{type(e).__name__}: {e}".encode()])
        try:
            ch.send(reply)
        except OSError:
            ch.close()
            return


def _remote_call(ch: _Channel, lock: threading.Lock) -> Callable[[bytes, list[bytes]], list[bytes]]:
    def call(op: bytes, fields: list[bytes]) -> list[bytes]:
        with lock:
            wait = float(fields[0 if op == b"W" else 1]) if op in (b"G", b"W") else 0.0
            ch.sock.settimeout(wait + 60.0)
            ch.send(_pack(op, fields))
            status, out = _unpack(ch.recv())
        if status != b"K":
            raise RuntimeError(out[0].decode(errors="replace") if out else "join_group store: failed")
        return out
    return call


# ---------------------------------------------------------------- meeting

@dataclass
class Meeting:
    """What the rendezvous gives :func:`~oarlock.checkpoint.join_group`: the group's store, this process's address
    towards rank 0, the group id, the refused addresses, and what to close."""

    store: Any
    local_address: str
    group_id: bytes
    refused: list[str] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            try:
                c()
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to ``host`` only (its first address, IPv4 first)."""
    infos = sorted(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE),
                   key=lambda i: i[0] != socket.AF_INET)
    err: OSError | None = None
    for family, kind, proto, _, addr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(128)
            return s
        except OSError as e:
            s.close()
            err = e
    raise err or OSError(f"no address for {host!r}")


def meet(host: str, port: int, world_size: int, rank: int, secret: bytes | None, timeout: float) -> Meeting:
    """Run this process's part of the rendezvous (module docstring). Raises :class:`RendezvousError`."""
    if rank == 0:
        return _host(host, port, world_size, secret, timeout)
    return _join(host, port, world_size, rank, secret, timeout)


def _refusal(secret: bytes | None) -> str:
    if secret is None:
        return ("its proof was made with a secret, but rank 0 runs without one (give every member the same token=, "
                "or none)")
    return f"it does not prove the group's secret (token= or ${TOKEN_ENV} must equal rank 0's)"


class _Door:
    """Rank 0's admission of the other ranks (steps 1-3 of the module docstring), a thread per connection."""

    def __init__(self, world: int, secret: bytes | None, group_id: bytes):
        self.world, self.secret, self.key, self.group_id = world, secret, secret or b"", group_id
        self.admitted: "queue.Queue[tuple[int, _Channel]]" = queue.Queue()
        self.refused: list[str] = []
        self.lock = threading.Lock()
        self.formed = threading.Event()

    def _refuse(self, conn: socket.socket, who: str, claimed: str, why: str, tell: bool = True) -> None:
        with self.lock:
            self.refused.append(f"{who} (claimed rank {claimed}: {why})" if tell else f"{who} ({why})")
        if tell:
            try:
                msg = why.encode()[:4000]
                conn.sendall(b"R" + struct.pack(">H", len(msg)) + msg)
            except OSError:
                pass
        conn.close()

    def _read_claim(self, conn: socket.socket, challenge: bytes) -> bytes | None:
        """The claim's bytes; b"" when the peer speaks another protocol (told at its first bytes); None when it
        sent nothing that could be judged."""
        got = b""
        try:
            conn.settimeout(_ADMIT_S)
            conn.sendall(_HELLO + self.group_id + challenge + struct.pack(">I", self.world))
            while len(got) < len(_CLAIM) and _CLAIM.startswith(got):
                more = conn.recv(len(_CLAIM) - len(got))
                if not more:
                    break
                got += more
            if got == _CLAIM:
                return got + _recv_exact(conn, _CLAIM_LEN - len(got))
        except (OSError, ConnectionError):
            pass
        return None if _CLAIM.startswith(got) else b""

    def admit(self, conn: socket.socket, addr: Any) -> None:
        who, challenge = _fmt(addr), os.urandom(32)
        claim = self._read_claim(conn, challenge)
        if not claim:
            self._refuse(conn, who, "?", "it does not speak join_group's protocol" if claim == b"" else
                         "sent no claim", tell=claim == b"")
            return
        body = claim[len(_CLAIM):]
        r, w = struct.unpack(">II", body[:8])
        nonce, proof = body[8:40], body[40:72]
        if not hmac.compare_digest(proof, _mac(self.key, b"join", self.group_id, challenge, nonce, body[:4],
                                               body[4:8])):
            self._refuse(conn, who, str(r), _refusal(self.secret))
        elif w != self.world or not 1 <= r < self.world:
            self._refuse(conn, who, str(r), f"rank {r} of world size {w} does not fit this group of {self.world}")
        elif self.formed.is_set():
            self._refuse(conn, who, str(r), "the group is complete")
        else:
            try:
                conn.sendall(b"A" + _mac(self.key, b"accept", self.group_id, challenge, nonce, body[:4]))
            except OSError:
                conn.close()
                return
            ch = _Channel(conn, _mac(self.key, b"session", self.group_id, challenge, nonce), b"0", b"1")
            ch.peer = who
            self.admitted.put((r, ch))

    def gather(self, lsock: socket.socket, deadline: float, where: str, timeout: float
               ) -> tuple[dict[int, _Channel], tuple | None]:
        """Accept until every rank holds an admitted claim or one is claimed twice: ``(members, clash)``."""
        members: dict[int, _Channel] = {}
        clash = None
        lsock.settimeout(0.2)
        try:
            while len(members) < self.world - 1 and clash is None:
                if time.monotonic() > deadline:
                    missing = [r for r in range(1, self.world) if r not in members]
                    with self.lock:
                        extra = f"; refused: {'; '.join(self.refused)}" if self.refused else ""
                    raise RendezvousError(f"join_group: rendezvous of {self.world} processes at {where} timed out "
                                          f"after {timeout:.0f} s: ranks {missing} never joined{extra}")
                try:
                    conn, addr = lsock.accept()
                    threading.Thread(target=self.admit, args=(conn, addr), daemon=True).start()
                except (socket.timeout, BlockingIOError):
                    pass
                while not self.admitted.empty():
                    r, ch = self.admitted.get()
                    if r in members:
                        clash = (r, members[r].peer, ch.peer)
                        members[-r] = ch  # told and closed with the others
                    else:
                        members[r] = ch
        except BaseException:
            for ch in members.values():
                ch.close()
            raise
        finally:
            self.formed.set()
            lsock.close()
        return members, clash


def _host(host: str, port: int, world: int, secret: bytes | None, timeout: float) -> Meeting:
    group_id = os.urandom(16)
    table = _Table()
    meeting = Meeting(make_store(lambda op, f: table.apply(op, f), timeout), host, group_id)
    meeting.closers.append(table.close)
    if world == 1:
        return meeting
    door = _Door(world, secret, group_id)
    members, clash = door.gather(_listen(host, port), time.monotonic() + timeout, f"{host}:{port}", timeout)
    if clash is not None:
        r, a, b = clash
        msg = (f"join_group: rank {r} was claimed by two processes that both hold the group's secret, {a} and {b} "
               f"(two members were given the same rank); the group at {host}:{port} is not formed")
        for ch in members.values():
            try:
                ch.send(_pack(b"F", [msg.encode()]))
            except OSError:
                pass
            ch.close()
        raise RendezvousError(msg)
    with door.lock:  # a client that retries (a torch TCPStore) is refused at every try: the first ones are kept
        n = len(door.refused)
        meeting.refused = door.refused[:16] + ([f"... and {n - 16} more"] if n > 16 else [])
    go = _pack(b"G", [x.encode() for x in meeting.refused])
    for r, ch in sorted(members.items()):
        ch.sock.settimeout(None)
        ch.send(go)
        threading.Thread(target=_serve, args=(table, ch), daemon=True).start()
        meeting.closers.append(ch.close)
    if meeting.refused:
        warnings.warn(f"join_group: the group at {host}:{port} was formed without the processes it refused: "
                      f"{'; '.join(meeting.refused)}", RuntimeWarning, stacklevel=4)
    return meeting


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 10.0), 0.1))
        except OSError as e:  # rank 0 is not listening yet
            last = e
            time.sleep(0.1)
    raise RendezvousError(f"join_group: nobody listens at {host}:{port} (last error: {last})")


def _join(host: str, port: int, world: int, rank: int, secret: bytes | None, timeout: float) -> Meeting:
    key = secret or b""
    deadline = time.monotonic() + timeout
    where = f"{host}:{port}"
    sock = _connect(host, port, deadline)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 1.0))
        try:
            hello = _recv_exact(sock, _HELLO_LEN)
        except (OSError, ConnectionError) as e:
            raise RendezvousError(f"join_group: the process at {where} sent no join_group greeting ({e})") from e
        if not hello.startswith(_HELLO):
            raise RendezvousError(f"join_group: the process at {where} is not a join_group rank 0 (it greets with "
                                  f"{hello[:16]!r})")
        body = hello[len(_HELLO):]
        group_id, challenge, (w,) = body[:16], body[16:48], struct.unpack(">I", body[48:52])
        if w != world:
            raise RendezvousError(f"join_group: rank 0 at {where} forms a group of {w} processes, this process "
                                  f"(rank {rank}) was given world_size {world}")
        nonce = os.urandom(32)
        head = struct.pack(">II", rank, world)
        sock.sendall(_CLAIM + head + nonce + _mac(key, b"join", group_id, challenge, nonce, head[:4], head[4:]))
        status = _recv_exact(sock, 1)
        if status == b"R":
            (n,) = struct.unpack(">H", _recv_exact(sock, 2))
            why = _recv_exact(sock, n).decode(errors="replace")
            raise RendezvousError(f"join_group: rank 0 at {where} refused this process (rank {rank}): {why}")
        if status != b"A":
            raise RendezvousError(f"join_group: the process at {where} answered the claim with {status!r}")
        if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"accept", group_id, challenge, nonce, head[:4])):
            hint = "" if secret is not None else " (it holds a secret and this process none: pass the same token=)"
            raise RendezvousError(f"join_group: the process at {where} admitted rank {rank} without proving the "
                                  f"group's secret: it is not this group's rank 0{hint}")
        ch = _Channel(sock, _mac(key, b"session", group_id, challenge, nonce), b"1", b"0")
        ch.peer = where
        op, fields = _unpack(ch.recv())
    except (OSError, ConnectionError) as e:
        sock.close()
        raise RendezvousError(f"join_group: the rendezvous with rank 0 at {where} failed for rank {rank}: "
                              f"{type(e).__name__}: {e}") from e
    except BaseException:
        sock.close()
        raise
    if op == b"F":
        sock.close()
        raise RendezvousError(fields[0].decode(errors="replace"))
    if op != b"G":
        sock.close()
        raise RendezvousError(f"join_group: rank 0 at {where} sent {op!r} instead of the group's start")
    local = sock.getsockname()[0]
    meeting = Meeting(make_store(_remote_call(ch, threading.Lock()), timeout), local, group_id,
                      [f.decode(errors="replace") for f in fields])
    meeting.closers.append(ch.close)
    return meeting
