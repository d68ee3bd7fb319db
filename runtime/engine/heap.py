"""Keep Python's cyclic garbage collector off the serving loop's long-lived objects.

A serving process holds a few hundred thousand long-lived objects after startup (modules and their parameters,
CUDA graphs, the tokenizer, imported libraries). Every full collection walks all of them: 84 ms for the 220K
objects of the tiny demo engine on a CPU host, a pause inside whichever step it lands in. Python runs a full
collection whenever the survivors since the last one reach a quarter of the long-lived objects, which a server
committing tokens for hundreds of requests reaches every few hundred steps: a few percent of throughput and a
latency spike each time. (A 30-step timing window that holds one such pause reads tens of percent slower than its
neighbours: the likely cause of the bench's non-monotone step times per draft length in a trained-pair run,
smoother in one run with the freeze, on a noisier machine: not a controlled measurement.)

``freeze_long_lived`` collects once, then moves every object alive into the collector's permanent generation
(``gc.freeze``), so later collections walk only what the serving loop made since. The long-running drivers call
it when startup is done (``AsyncEngine``, the Ray worker actors, ``dspark bench`` per engine). Frozen objects are
still freed by reference counting; only reference cycles among them wait for ``unfreeze_long_lived``, which a
driver calls when it shuts its engine down (so a process that builds another engine frees the first one's).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_long_lived(owner: str) -> int:
    """Collect, then exempt everything alive from later collections; returns the number of frozen objects."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("dspark: %s froze %d long-lived objects out of the garbage collector's scans (%.0f ms)", owner, frozen,
             1e3 * (time.perf_counter() - start))
    return frozen


def unfreeze_long_lived() -> None:
    """Return the frozen objects to the collector (before an engine is dropped: its reference cycles can go)."""
    gc.unfreeze()
