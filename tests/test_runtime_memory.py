"""A stage's freed host memory goes back to the system when it ends (runtime.collect_own_garbage)."""
import subprocess
import sys
import textwrap

import pytest

from vidax.core import runtime

# in a fresh interpreter: 400 MB of 100 KB arrays (below glibc's mmap threshold: heap chunks) made
# and dropped inside one unit of work, each followed by a 2 KB array that is kept (fragmentation:
# the freed chunks never merge into the heap's top, so free() alone cannot shrink it); prints the
# resident growth in MB once the unit has ended
_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from vidax.core import runtime

    if sys.argv[1] == "off":
        runtime.release_free_memory = lambda: False
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
    base = rss()
    with runtime.collect_own_garbage():
        big, kept = [], []
        for _ in range(4000):
            big.append(np.ones(12_500))
            kept.append(np.ones(256))
        del big
    print(round(rss() - base))
""")


def _growth(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or runtime._malloc_trim() is None,
                    reason="glibc's malloc_trim and /proc: Linux")
def test_a_unit_of_work_hands_its_freed_heap_back():
    kept = _growth("off")
    released = _growth("on")
    assert kept > 300, f"control: without the release the 400 MB freed stay resident (grew {kept} MB)"
    assert released < 50, f"after the unit ended the process still held {released} MB of freed heap"


def test_release_free_memory_says_whether_it_could():
    assert runtime.release_free_memory() is (runtime._malloc_trim() is not None)
