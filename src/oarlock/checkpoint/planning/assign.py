"""Who reads which file: visibility-aware, byte-balanced reader assignment (pure functions).

On clusters with node-local disks a rank sees only some checkpoint files. Every needed file is read exactly
once, by one rank that can see it, preferring a rank that needs its bytes itself (no transfer), and balancing
bytes read per rank; other consumers then receive their slices from that reader. Greedy rule (``docs/checkpoint-format.md``,
"Node-local disks"; bytes rather than file counts are the load): files with the fewest candidate readers first,
each to the least-loaded candidate, ties to the lower rank. Phase 1 considers only ranks that need the file;
phase 2 places files that no needing rank can see on any rank that sees them. Deterministic: every rank
computes the same answer from the same (all-gathered) inputs.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from oarlock.checkpoint.errors import CheckpointError


def assign_readers(needs: Mapping[int, Mapping[str, int]], visible: Mapping[int, Iterable[str]],
                   file_bytes: Mapping[str, int] | None = None) -> dict[str, int]:
    """Assign every needed file to exactly one reader rank.

    Args:
        needs: rank -> {file: bytes that rank needs from the file}.
        visible: rank -> files the rank can open (its directory listing).
        file_bytes: bytes that must be read from each file (default: the largest single need, i.e. needs
            overlap; pass the size of the union of needed ranges when known).

    Returns:
        file -> reader rank, for every file some rank needs.

    Raises:
        CheckpointError: naming the files that no rank can see ("checkpoint files are not complete").
    """
    vis = {r: set(fs) for r, fs in visible.items()}
    needed: dict[str, set[int]] = {}
    for r, files in needs.items():
        for f, nbytes in files.items():
            if nbytes > 0:
                needed.setdefault(f, set()).add(r)
    cost = {f: (file_bytes[f] if file_bytes and f in file_bytes else
                max(needs[r].get(f, 0) for r in needed[f])) for f in needed}
    unseen = sorted(f for f in needed if not any(f in fs for fs in vis.values()))
    if unseen:
        raise CheckpointError(f"checkpoint files are not complete: {', '.join(unseen[:5])}"
                              f"{' ...' if len(unseen) > 5 else ''} visible to no rank")
    load = {r: 0 for r in sorted(set(vis) | set(needs))}
    readers: dict[str, int] = {}

    def place(files: list[str], candidates_of) -> None:
        order = sorted(files, key=lambda f: (len(candidates_of(f)), -cost[f], f))
        for f in order:
            r = min(candidates_of(f), key=lambda c: (load[c], c))
            readers[f] = r
            load[r] += cost[f]

    local = [f for f in needed if any(f in vis.get(r, ()) for r in needed[f])]
    place(local, lambda f: [r for r in needed[f] if f in vis.get(r, ())])
    rest = [f for f in needed if f not in readers]
    place(rest, lambda f: [r for r, fs in vis.items() if f in fs])
    return readers
