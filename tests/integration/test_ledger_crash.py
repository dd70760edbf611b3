"""The ledger survives a SIGKILL of the app: nothing committed is lost, the file stays consistent."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from worker.measure.ledger import Ledger
from worker.contract.protocol import Price

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PRICE = Price(currency="USD", per_million_output_tokens=0.40, per_million_input_tokens=0.05)
ACKNOWLEDGED = 300

# Writes until killed (bounded, in case the test itself dies); prints each id once it is committed.
CHILD = """
import sys
from worker.measure.ledger import Ledger
from worker.contract.protocol import Price

price = Price(currency="USD", per_million_output_tokens=0.40, per_million_input_tokens=0.05)
ledger = Ledger(sys.argv[1], clock=lambda: 1_795_000_000.0)
for index in range(200_000):
    ledger.record_request(f"r-{index}", "run-1", "qwen", 9, 256, price, 1_795_000_000.0 + index)
    ledger.record_samples({"tokens_per_s": float(index), "gpu0.power_w": 300.0}, 1_795_000_000.0 + index)
    ledger.record_energy(300.0, 1_795_000_000.0 + index, 0.30, "USD")
    print(index, flush=True)
"""


def run_child_until_killed(path: Path) -> int:
    """Start the writer, let it commit ACKNOWLEDGED requests, SIGKILL it mid-stream."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    last = -1
    try:
        assert child.stdout is not None
        for line in child.stdout:
            last = int(line)
            if last + 1 >= ACKNOWLEDGED:
                break
    finally:
        child.kill()  # SIGKILL on POSIX, TerminateProcess on Windows: no cleanup runs
        child.wait(timeout=10)
    assert child.returncode not in (0, None)
    return last


def test_nothing_committed_is_lost_after_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"

    acknowledged = run_child_until_killed(path)

    assert acknowledged + 1 == ACKNOWLEDGED
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    ids = {row[0] for row in raw.execute("SELECT request_id FROM requests")}
    raw.close()
    stored = len(ids)
    # Every acknowledged write is there, and nothing beyond a contiguous prefix (no torn writes).
    assert stored >= ACKNOWLEDGED
    assert ids == {f"r-{index}" for index in range(stored)}

    with Ledger(path, clock=lambda: 1_795_000_000.0 + stored) as reopened:
        # The restarted app sees the last response.end again: it must not count twice.
        assert reopened.record_request(f"r-{acknowledged}", "run-2", "qwen", 9, 256, PRICE) is False
        snap = reopened.summary(currency="USD")
        samples = reopened.series("tokens_per_s", 1_795_000_000.0, now=1_795_000_000.0 + stored)

    per_request = (9 * 0.05 + 256 * 0.40) / 1e6
    assert snap.all_time == pytest.approx(stored * per_request)
    energy_cost_per_request = 300.0 / 3_600_000 * 0.30
    assert ACKNOWLEDGED * energy_cost_per_request <= snap.energy_cost_all_time * (1 + 1e-9)
    assert snap.energy_cost_all_time <= stored * energy_cost_per_request * (1 + 1e-9)
    assert [v for _, v in samples][:ACKNOWLEDGED] == [float(i) for i in range(ACKNOWLEDGED)]
