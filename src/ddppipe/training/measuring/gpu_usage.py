"""How busy a process's GPU was while it trained: NVML utilisation and memory, sampled.

A daemon thread reads NVML (nvidia-ml-py, through ``torch.cuda.utilization`` and
``torch.cuda.device_memory_used``, which map CUDA_VISIBLE_DEVICES to NVML's numbering) every
:data:`INTERVAL_S`. Where NVML cannot answer (no driver library, a container without it, an
AMD GPU) the figures are absent: a training never fails for want of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # NVML's utilisation covers the last 1/6 to 1 s, depending on the GPU


class Sampler:
    """Samples ``read()`` -> (utilisation %, memory used MB) until :meth:`stop`."""

    def __init__(self, read: Callable[[], tuple[float, float]], interval: float = INTERVAL_S):
        self.read, self.interval = read, interval
        self.utilisation: list[float] = []
        self.memory_peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpu-usage", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                busy, memory_mb = self.read()
            except Exception as e:  # NVML missing or unsupported: no figures, no failure
                self.failed = f"{type(e).__name__}: {e}"
                return
            self.utilisation.append(float(busy))
            self.memory_peak_mb = max(self.memory_peak_mb, float(memory_mb))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> dict[str, float] | None:
        """The figures so far (the thread stops); None when NVML gave none."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.failed and not self.utilisation:
            log.info("no GPU utilisation figures: NVML unavailable (%s)", self.failed)
        if not self.utilisation:
            return None
        return {
            "gpu_utilisation": sum(self.utilisation) / len(self.utilisation) / 100,
            "gpu_memory_peak_mb": self.memory_peak_mb,
            "gpu_samples": len(self.utilisation),
        }


def nvml_reader(device: Any) -> Callable[[], tuple[float, float]]:
    """NVML's utilisation (%) and used memory (MB) of the CUDA ``device``."""
    import torch

    def read() -> tuple[float, float]:
        return (
            float(torch.cuda.utilization(device)),
            torch.cuda.device_memory_used(device) / 2**20,
        )

    return read


def describe(device: Any) -> dict[str, Any]:
    """The GPU's name and total memory (from the CUDA runtime: no NVML needed)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"gpu_name": props.name, "gpu_memory_total_mb": props.total_memory / 2**20}
