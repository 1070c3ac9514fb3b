"""`make test`: the suite in two halves run at once.

The tests that launch emulated clusters (the CLI, torchrun, namespaces) run one after another,
as they must: each checks that it left no trainer, coordinator or namespace behind, and a
cluster of another test beside it would look like its leftovers. The rest (pure logic, gloo
groups of 2-4 processes) mostly waits on its groups' timeouts and barriers (416 tests in 165 s
with 40 s of CPU), so it runs beside them, in a process of its own, and its report is printed
when it is done. The cluster modules run in the order below: the fault scenarios first (their
deadlines are generous), while the other half still runs, and the ones that compare two timings
(the straggler, the horizon bench) last, alone.

    python tests/suite.py [PYTEST ARGS]   # both halves; the exit code is 0 only if both pass
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLUSTER_MODULES = [
    "test_continue_cli", "test_broker_cli", "test_rollback_cli", "test_resume_cli", "test_spares",
    "test_cli", "test_admission", "test_guard", "test_api", "test_models", "test_dreamddp_e2e",
    "test_netem", "test_pace", "test_topology", "test_bench",
]  # fmt: skip

HERE = Path(__file__).resolve().parent
SELECT = "not timing and not long"  # pyproject's addopts, which -m replaces


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    clusters = [str(HERE / f"{m}.py") for m in CLUSTER_MODULES]
    rest = [str(p) for p in sorted(HERE.glob("test_*.py")) if p.stem not in CLUSTER_MODULES]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        beside = subprocess.Popen([*pytest, "-m", SELECT, *rest], stdout=log, stderr=subprocess.STDOUT)
        try:
            code = subprocess.call([*pytest, "-m", SELECT, *clusters])
        finally:
            other = beside.wait()
            log.seek(0)
            print(f"\n--- the other half ({len(rest)} modules, run beside the clusters) ---")
            print(log.read(), end="")
    print(f"--- both halves: {time.monotonic() - started:.0f} s ---")
    return code or other


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
