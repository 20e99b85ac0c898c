"""ps_server.rounds.keep_heap_pages: a round's freed pages are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import resource, sys
from ps_server.rounds import keep_heap_pages
kept = keep_heap_pages() if sys.argv[1] == "keep" else None

def one_round():  # what a bench ps round allocates: 8 pushes' bytes and the aggregate
    pushes = [b"p" * (200 << 10) for _ in range(8)]
    aggregate = b"a" * (1600 << 10)
    return len(pushes) + len(aggregate)

one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(how: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_rounds_reuse_the_heap_pages_of_the_last_round():
    kept, with_keep = faults("keep")
    if kept != "True":
        pytest.skip("no glibc mallopt here")
    _, default = faults("default")
    # 20 rounds of 3.2 MB: glibc's defaults fault most pages in again each round (about
    # 15,000 faults); kept, the heap holds them.
    assert with_keep < 200 < default, (with_keep, default)
