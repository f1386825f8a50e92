"""The PaddlePaddle 3.3.1 environment of the Paddle interop tests: ``.paddle-venv``, built by
``scripts/paddle_env.sh``, which ``make test`` runs through ``scripts/setup_tests.sh``. Tests never install it."""

from __future__ import annotations

from pathlib import Path

import pytest

VENV = Path(__file__).resolve().parents[1] / ".paddle-venv"
STAMP = ".oarlock-paddle"  # written by scripts/paddle_env.sh once `import paddle` worked


def paddle_python() -> str:
    """The venv's interpreter; skips the calling test when the venv was never completed (offline set-up, or no
    ``make test`` yet), naming how to build it."""
    if not (VENV / STAMP).is_file():
        pytest.skip(f"no complete {VENV.name} ({VENV / STAMP} is missing): `make test` builds it through "
                    "scripts/setup_tests.sh, or run `bash scripts/paddle_env.sh`")
    return str(VENV / "bin" / "python")
