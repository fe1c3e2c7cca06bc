"""The SIMT CUDA schedule (``schedules/simt.py``), cross-compiled: no GPU needed."""

import tvmflash


def test_float32_uses_the_simt_schedule():
    kernel = tvmflash.compile(head_dim=64, dtype="float32", target="sm90")
    assert kernel.info()["schedule"] == "simt"
    assert "mma.sync" not in kernel.source(heads_q=4, heads_kv=2)  # (test_generated_cuda's module)
