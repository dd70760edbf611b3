"""`gpu-provider detect --pretty`: the machine as a short table a person can read."""

from __future__ import annotations

from worker.hardware.model import Gpu, Machine


def machine_table(machine: Machine) -> str:
    lines = [
        f"Platform        {machine.os} / {machine.runtime} / {machine.arch}",
        f"CPU             {machine.cpu_model} ({machine.cpu_cores} cores)",
        f"RAM             {machine.ram_mib:,} MiB" + (" (unified with the GPU)" if machine.unified_memory else ""),
    ]
    if machine.chip:
        lines.append(f"Apple chip      {machine.chip}")
    if machine.wsl_distro:
        lines.append(f"WSL2            {machine.wsl_distro} (the engines that need Linux run inside it)")
    if machine.driver_version:
        lines.append(f"NVIDIA driver   {machine.driver_version} (CUDA {machine.cuda_version or '?'})")
    if machine.gpus:
        lines += ["", _row("GPU", "Name", "Free / total MiB", "Usable MiB", "CC", "PCIe", "P2P", "Power W", "GB/s")]
        lines += [_gpu_row(gpu) for gpu in machine.gpus]
    for group in machine.groups:
        members = ", ".join(str(i) for i in group.gpu_indices)
        lines.append(f"Group           GPUs {members}: {group.name}, {group.usable_mib_per_gpu:,} MiB usable each")
    lines.append(f"Effective VRAM  {machine.effective_vram_mib:,} MiB")
    engines = ", ".join(
        f"{name} {install.version or 'not installed'}" for name, install in sorted(machine.engines.items())
    )
    lines.append(f"Engines         {engines or 'none found'}")
    lines += [f"Note            {problem}" for problem in machine.problems]
    return "\n".join(lines)


def _gpu_row(gpu: Gpu) -> str:
    pcie = f"gen{gpu.pcie_gen} x{gpu.pcie_width}" if gpu.pcie_gen else "?"
    usable = f"{gpu.usable_mib:,}" if gpu.lent else "not lent"
    return _row(
        str(gpu.index),
        gpu.name,
        f"{gpu.memory_free_mib:,} / {gpu.memory_total_mib:,}",
        usable,
        gpu.compute_capability or "?",
        pcie,
        ",".join(str(p) for p in gpu.p2p_peers) or "no",
        _number(gpu.power_limit_w),
        _number(gpu.memory_bandwidth_gbps),
    )


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _row(*cells: str) -> str:
    widths = (4, 26, 18, 11, 5, 9, 9, 8, 6)
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
