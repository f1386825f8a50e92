"""join_group's authenticated rendezvous with real processes (_live_auth_worker.py): a process without the group's
secret is refused with an error that says so, and the members form the group without it, naming its address;
two members claiming one rank fail naming both; rank 0 listens on the address it is given only; with a secret,
verify=True chunk hashes are keyed, so bytes forged by a process without the secret fail verification."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import CheckpointError, join_group
from oarlock.checkpoint.runtime import transfer
from oarlock.checkpoint.runtime import rendezvous

HERE = Path(__file__).parent
TOKEN = "s3cret-of-the-sync-group"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Procs:
    """Worker processes of one test; each writes its JSON result."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.procs, self.env = tmp_path, {}, {
            **os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent)])}
        self.env.pop(rendezvous.TOKEN_ENV, None)

    def start(self, name: str, **spec) -> None:
        spec.setdefault("timeout", 30)
        self.procs[name] = subprocess.Popen([sys.executable, str(HERE / "_live_auth_worker.py"), json.dumps(spec),
                                             str(self.tmp / f"{name}.json")], env=self.env,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def result(self, name: str, limit: float = 90) -> dict:
        p = self.procs[name]
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"{name} still running after {limit} s")
        f = self.tmp / f"{name}.json"
        assert f.exists(), (name, p.stdout.read().decode(errors="replace")[-3000:])
        return json.loads(f.read_text())

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


@pytest.mark.multiproc
def test_wrong_secret_refused_and_members_form_the_group_naming_it(procs):
    port = free_port()
    procs.start("r0", rank=0, world=2, port=port, token=TOKEN, mode="join")
    procs.start("intruder", rank=1, world=2, port=port, token="guessed", mode="join")
    bad = procs.result("intruder", 60)
    assert bad["ok"] is False
    assert bad["error"].startswith("RendezvousError: join_group: rank 0 at 127.0.0.1:") and \
        "refused this process (rank 1)" in bad["error"] and "does not prove the group's secret" in bad["error"], bad
    assert bad["seconds"] < 20, bad  # refused at once, not after the rendezvous timeout
    procs.start("r1", rank=1, world=2, port=port, token=TOKEN, mode="join")
    a, b = procs.result("r0"), procs.result("r1")
    assert a["ok"] and b["ok"], (a, b)
    assert a["sum"] == b["sum"] == 3.0  # ranks 0 and 1: 1 + 2
    assert a["authenticated"] and b["authenticated"] and a["keyed"] and b["keyed"]
    # every member learns which address was refused, and why
    for r in (a, b):
        assert len(r["refused"]) == 1 and r["refused"][0].startswith("127.0.0.1:"), r
        assert "claimed rank 1" in r["refused"][0] and "secret" in r["refused"][0], r


@pytest.mark.multiproc
def test_no_secret_and_plain_tcpstore_clients_are_refused(procs):
    port = free_port()
    procs.start("r0", rank=0, world=2, port=port, token=TOKEN, mode="join", timeout=40)
    procs.start("nosecret", rank=1, world=2, port=port, token=None, mode="join")
    bad = procs.result("nosecret", 60)
    assert not bad["ok"] and "refused this process (rank 1)" in bad["error"], bad
    procs.start("store", rank=1, world=2, port=port, token=None, mode="tcpstore", timeout=5)
    procs.result("store", 60)  # a torch TCPStore client does not get in (it times out or is reset)
    procs.start("r1", rank=1, world=2, port=port, token=TOKEN, mode="join")
    a, b = procs.result("r0"), procs.result("r1")
    assert a["ok"] and b["ok"] and a["sum"] == 3.0, (a, b)
    assert len(a["refused"]) >= 2 and "claimed rank 1: it does not prove the group's secret" in a["refused"][0], a
    # the TCPStore client (it reconnects a few times): refused at its first bytes, every time
    assert all(x.startswith("127.0.0.1:") and x.endswith("(claimed rank ?: it does not speak join_group's protocol)")
               for x in a["refused"][1:]), a["refused"]


@pytest.mark.multiproc
def test_a_rank_claimed_twice_fails_naming_both_addresses(procs):
    port = free_port()
    procs.start("r0", rank=0, world=3, port=port, token=TOKEN, mode="join")
    procs.start("a", rank=1, world=3, port=port, token=TOKEN, mode="join")
    procs.start("b", rank=1, world=3, port=port, token=TOKEN, mode="join")
    r0, a, b = procs.result("r0"), procs.result("a"), procs.result("b")
    for r in (r0, a, b):
        assert not r["ok"], r
        assert "rank 1 was claimed by two processes" in r["error"], r
        assert r["error"].count("127.0.0.1:") >= 3, r  # both claimants' addresses and rank 0's
        assert r["seconds"] < 25, r


@pytest.mark.multiproc
def test_keyed_verify_rejects_bytes_forged_without_the_secret(procs):
    for forge in ("xxh3", "other-key"):
        port = free_port()
        procs.start(f"s-{forge}", rank=0, world=2, port=port, token=TOKEN, mode="sync", forge=forge)
        procs.start(f"r-{forge}", rank=1, world=2, port=port, token=TOKEN, mode="sync")
        s, r = procs.result(f"s-{forge}"), procs.result(f"r-{forge}")
        assert s["ok"] and r["ok"], (s, r)
        for x in (s, r):
            assert "do not match the hash" in x["raised"] and "'w'" in x["raised"], x
        assert r["torn"] is True and r["forged_elements"] == 0 and not r["equal"], r
    # a member (who holds the key) could: the hash is what the key protects
    port = free_port()
    procs.start("s-member", rank=0, world=2, port=port, token=TOKEN, mode="sync", forge="same-key")
    procs.start("r-member", rank=1, world=2, port=port, token=TOKEN, mode="sync")
    s, r = procs.result("s-member"), procs.result("r-member")
    assert "raised" not in r and r["torn"] is False and r["forged_elements"] == 256, r  # the 1 KiB first chunk
    # and without forging, verified bytes arrive whole
    port = free_port()
    procs.start("s-ok", rank=0, world=2, port=port, token=TOKEN, mode="sync")
    procs.start("r-ok", rank=1, world=2, port=port, token=TOKEN, mode="sync")
    s, r = procs.result("s-ok"), procs.result("r-ok")
    assert r["equal"] is True and r["bytes_received"] == 64 * 32 * 4 and r["torn"] is False, r


def test_rank_zero_listens_on_the_given_address_only():
    port = free_port()
    got: dict = {}

    def host():
        try:
            got["group"] = join_group("127.0.0.1", port, 2, 0, token=TOKEN, timeout=20)
        except Exception as e:  # noqa: BLE001
            got["error"] = e

    th = threading.Thread(target=host, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until it listens on 127.0.0.1
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise AssertionError("rank 0 never listened on 127.0.0.1")
    with pytest.raises(ConnectionRefusedError):  # another address of this machine: nobody listens there
        socket.create_connection(("127.0.0.2", port), timeout=2)
    # the same process as rank 1 with the secret completes the group
    g1 = join_group("127.0.0.1", port, 2, 1, token=TOKEN, timeout=20)
    th.join(20)
    g0 = got["group"]
    assert g0.authenticated and g1.authenticated and g0.verify_key == g1.verify_key and len(g0.verify_key) == 32
    assert g0.refused == [] or all("sent no claim" in x for x in g0.refused), g0.refused  # the probe above
    t0, t1 = torch.ones(2), torch.full((2,), 2.0)
    w = g1.pg.allreduce([t1])
    g0.pg.allreduce([t0]).wait()
    w.wait()
    assert t0.tolist() == t1.tolist() == [3.0, 3.0]
    g1.close()
    g0.close()


def test_token_from_environment_and_open_group_warning(monkeypatch):
    monkeypatch.setenv(rendezvous.TOKEN_ENV, "from-env")
    assert rendezvous.resolve_token(None) == b"from-env"
    assert rendezvous.resolve_token("given") == b"given"
    monkeypatch.setenv(rendezvous.TOKEN_ENV, "")
    assert rendezvous.resolve_token(None) is None
    with pytest.raises(CheckpointError, match="token must be a str or bytes"):
        rendezvous.resolve_token(1234)
    monkeypatch.setattr(rendezvous, "_warned_open", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rendezvous.warn_if_open("127.0.0.1")  # loopback: no warning
        rendezvous.warn_if_open("10.1.2.3")
        rendezvous.warn_if_open("10.1.2.4")  # once per process
    msgs = [str(w.message) for w in seen]
    assert len(msgs) == 1 and "10.1.2.3" in msgs[0] and "OARLOCK_SYNC_TOKEN" in msgs[0], msgs


def test_keyed_chunk_hash():
    buf = torch.arange(200, dtype=torch.uint8)
    plain, k1, k2 = transfer.chunk_hash(buf), transfer.chunk_hash(buf, b"a" * 32), transfer.chunk_hash(buf, b"b" * 32)
    assert len({plain, k1, k2}) == 3
    assert k1 == transfer.chunk_hash(buf.clone(), b"a" * 32)
    assert rendezvous.derived_key(None, b"g" * 16, b"verify") is None
    assert rendezvous.derived_key(b"t", b"g" * 16, b"verify") != rendezvous.derived_key(b"t", b"h" * 16, b"verify")
