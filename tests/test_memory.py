"""The one host-memory meter (ds_inference_integration.run.memory): a block's own peak, not the process's."""

from ds_inference_integration.run.memory import PeakRss, memory_mb


def test_peak_of_a_block_is_its_own():
    big = bytearray(400 * 2**20)  # an earlier, higher peak of this process
    del big
    assert memory_mb("VmHWM") >= memory_mb("VmRSS") + 300
    with PeakRss() as peak:
        block = bytearray(100 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        del block
    now = memory_mb("VmRSS")
    assert now + 80 <= peak.mb <= now + 250, (peak.mb, now)
