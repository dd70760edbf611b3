"""What an accepted plan needs on the machine before its engines start: the model's files and the
engine, each found or fetched; the engine plans rewritten to use them. Raises `ProvisionError`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from worker.config import Paths, Settings
from worker.hardware import Machine
from worker.plan import EnginePlan, Plan
from worker.provision.engine_install import accelerator_of, cuda_version, ensure_engine, library_env
from worker.provision.models import ensure_model
from worker.provision.progress import ProgressCallback


async def provision(current: Plan, machine: Machine, paths: Paths, settings: Settings, on_progress: ProgressCallback,
                    *, engine_bins: Mapping[str, str]) -> list[EnginePlan]:
    """Model files (and, where missing, the engine) in place; the plans rewritten to use them."""
    executable, env = await _engine_executable(current, machine, paths, on_progress, engine_bins)
    path = await ensure_model(current.engine_model, current.engine, paths, settings, on_progress)
    return [dataclasses.replace(ep, model=str(path), executable=executable, env={**ep.env, **env})
            for ep in current.engines]


async def _engine_executable(current: Plan, machine: Machine, paths: Paths, on_progress: ProgressCallback,
                             engine_bins: Mapping[str, str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The engine the user pointed at, the one found on the machine, or one installed now."""
    engine, wanted = current.engine, current.engine_model.engine_version
    given = engine_bins.get(engine)
    if given:
        return (given,), library_env(Path(given).parent)
    found = machine.engines.get(engine)
    if found and found.path and (wanted is None or found.version == wanted):
        return current.engines[0].executable, {}
    install = await ensure_engine(
        engine,
        wanted,
        paths,
        on_progress,
        accelerator=accelerator_of(machine),
        cuda_driver=cuda_version(machine.cuda_version),
    )
    return install.executable, library_env(install.library_dir) if install.library_dir else {}
