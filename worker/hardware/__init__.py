"""Detect the machine: NVIDIA GPUs through NVML (replayable), runtime, Apple chip, CPU/RAM, and the
engines the caller's `EngineFinder` finds (`worker.engines.finding.Finder`)."""

from __future__ import annotations

from worker.hardware.detect import EngineFinder, build_machine, detect, group_gpus, usable_mib
from worker.hardware.host import AppleFacts, HostFacts, read_host
from worker.hardware.model import IN_WSL, EngineInstall, Gpu, GpuGroup, Machine
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
    "EngineFinder",
    "EngineInstall",
    "Gpu",
    "GpuGroup",
    "GpuProcess",
    "GpuSample",
    "HostFacts",
    "IN_WSL",
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
