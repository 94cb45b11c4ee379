"""What a worker process uses, sampled for its heartbeats: CPU and resident memory (psutil), and
the GPUs it may use (NVML through nvidia-ml-py) where a driver is present. The worker measures
itself, so the figures are the same on every backend."""

from __future__ import annotations

import logging
import os
import time

import psutil

from elastic_step.protocol import GpuSample, ResourceSample

log = logging.getLogger("elastic_step.worker")


def visible_gpu_indices(count: int) -> list[int]:
    """NVML indices of the GPUs this process may use: CUDA_VISIBLE_DEVICES where it names
    indices (UUIDs and MIG names are not mapped: then every GPU), else every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices = []
    for part in visible.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            return list(range(count))
        if int(part) < count:
            indices.append(int(part))
    return indices


class Nvml:
    """NVML, if a driver answers; otherwise nothing (a CPU-only machine is no error)."""

    def __init__(self):
        self.handles: list[tuple[int, object, str]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no library, no driver, no GPU
            self._nvml = None
            return
        self._nvml = pynvml
        for index in visible_gpu_indices(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            self.handles.append((index, handle, name.decode() if isinstance(name, bytes) else str(name)))

    def sample(self) -> list[GpuSample]:
        samples = []
        for index, handle, name in self.handles:
            try:
                utilization = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU that fell off the bus: report the others
                log.debug("NVML cannot read GPU %d: %s", index, exc)
                continue
            samples.append(GpuSample(index=index, name=name[:128], utilization_percent=float(min(max(utilization.gpu, 0), 100)),
                                     memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total)))
        return samples


class ResourceSampler:
    """Samples this process. CPU percent is over the time since the previous sample (psutil
    counts from the first call, so the first sample reads 0)."""

    def __init__(self, pid: int | None = None):
        self.process = psutil.Process(pid or os.getpid())
        self.process.cpu_percent(None)
        self.nvml = Nvml()

    def sample(self) -> ResourceSample | None:
        try:
            with self.process.oneshot():
                cpu = self.process.cpu_percent(None)
                rss = self.process.memory_info().rss
        except psutil.Error as exc:
            log.debug("cannot sample this process: %s", exc)
            return None
        return ResourceSample(time=time.time(), cpu_percent=float(cpu), rss_bytes=int(rss), gpus=self.nvml.sample())
