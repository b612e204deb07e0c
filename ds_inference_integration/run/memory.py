"""Host memory of this process: the one meter the examples, benchmarks and rank workers use.

Read from /proc/self/status, not `ru_maxrss`: Linux carries ru_maxrss over from the parent across exec, so a
rank started by a big launcher or benchmark process would report the parent's peak. The peak (VmHWM) of a
block of code is measured by resetting it first (`/proc/self/clear_refs`, Linux >= 4.0), not by sampling:
a sampler every 10 ms misses short peaks and costs a thread."""

from __future__ import annotations


def memory_mb(field: str = "VmHWM") -> float:
    """VmHWM (this process's peak resident memory, the default) or VmRSS (now), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> bool:
    """Start VmHWM again from the current resident size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak resident memory of this process while the block runs: `with PeakRss() as peak: ...; peak.mb`.
    Where the peak cannot be reset, the process's peak so far (an upper bound)."""

    def __enter__(self):
        reset_peak()
        self.mb = 0.0
        return self

    def __exit__(self, *exc):
        self.mb = round(memory_mb("VmHWM"), 1)
