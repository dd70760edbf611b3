"""Detect the machine: NVIDIA GPUs through NVML (replayable), runtime, Apple chip, CPU/RAM, engines."""

from __future__ import annotations

from worker.hardware.detect import build_machine, detect, group_gpus, usable_mib
from worker.hardware.host import AppleFacts, HostFacts, read_host
from worker.hardware.model import EngineInstall, Gpu, GpuGroup, Machine
from worker.hardware.nvml import (
    GpuProcess,
    GpuSample,
    NvmlError,
    NvmlSource,
    PynvmlSource,
    gpu_processes,
    sample_gpus,
)
from worker.hardware.replay import RecordingSource, ReplaySource, load_reading

__all__ = [
    "AppleFacts",
    "EngineInstall",
    "Gpu",
    "GpuGroup",
    "GpuProcess",
    "GpuSample",
    "HostFacts",
    "Machine",
    "NvmlError",
    "NvmlSource",
    "PynvmlSource",
    "RecordingSource",
    "ReplaySource",
    "build_machine",
    "detect",
    "gpu_processes",
    "group_gpus",
    "load_reading",
    "read_host",
    "sample_gpus",
    "usable_mib",
]
