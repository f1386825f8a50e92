"""Write a benchmark's table into its own section of ``benchmarks/RESULTS.md`` (which shows today's figures: one
section per benchmark, ``## <script>.py: <title>``), moving the section's previous text to
``benchmarks/history/<script>.md`` under the date it was replaced. Scripts call :func:`write_section` when run with
``--append-results`` / ``--record``."""

from __future__ import annotations

import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_section(script: str, title: str, body: str, *, results: Path = HERE / "RESULTS.md",
                  history: Path = HERE / "history") -> None:
    """Replace the body of benchmark ``script``'s section (the heading ``## <name>.py...`` stays; a benchmark with
    no section gets ``## <name>.py: <title>`` at the end) with ``body`` and a line giving the date and the load
    average now; the replaced body is appended to ``history/<name>.md``. Other sections are left byte-identical.

    Raises:
        OSError: RESULTS.md or the history file cannot be read or written.
    """
    name = Path(script).name
    lines = results.read_text().split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {name}")), None)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    new_body = ["", f"Recorded {stamp}; load average (1/5/15 min) at the end: {load}.", "", *body.strip("\n").split("\n"), ""]
    if start is None:
        lines += ["", f"## {name}: {title}", *new_body]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        old = lines[start + 1:end]
        history.mkdir(exist_ok=True)
        with open(history / f"{Path(name).stem}.md", "a") as f:
            f.write(f"\n## {lines[start][3:]} (replaced {stamp})\n" + "\n".join(old).rstrip() + "\n")
        lines[start + 1:end] = new_body
    results.write_text("\n".join(lines))
