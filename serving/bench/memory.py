"""Peak resident memory, as every bench result records it: this process's, and a running child
process's (llama-server), both the kernel's high-water mark of resident pages.

`getrusage`'s `ru_maxrss` is the peak of this process so far (kilobytes on Linux, bytes on
macOS), so it is read right after meshserve's own runs and before a peer runs in this process
(the HF peer does). A child's is `VmHWM` in `/proc/<pid>/status`, read while it still runs;
where there is no `/proc`, None.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def own_peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def process_peak_rss_bytes(pid: int) -> int | None:
    """The peak resident memory of the running process `pid`, in bytes; None where the system
    does not say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None
