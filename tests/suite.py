"""`make test`: the suite in two halves run at once.

The tests that launch emulated clusters (the CLI, torchrun, namespaces) run one after another,
as they must: each checks that it left no trainer, coordinator or namespace behind, and a
cluster of another test beside it would look like its leftovers. The rest (pure logic, gloo
groups of 2-4 processes) mostly waits on its groups' messages (746 tests in 170 s with 38 s of
CPU, once; 793 in 320-350 s on 2026-12-02), so it runs beside them, in a process of its own,
and its report is printed when it is done; the cluster half at a lower priority
(``CLUSTER_NICE``). The fault scenarios (generous deadlines) run while it does; the modules
that compare timings run after it has finished, alone.

    python tests/suite.py [PYTEST ARGS]   # both halves; exit 0 only if both pass

A Ctrl-C (or SIGTERM) is passed to both halves, which stop their clusters as a run does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Modules whose tests launch clusters, in the order they run: first beside the other half...
CLUSTER_MODULES = [
    "test_continue_cli", "test_broker_cli", "test_rollback_cli", "test_resume_cli", "test_spares",
    "test_cli", "test_admission", "test_guard", "test_models", "test_dreamddp_e2e", "test_devices",
]  # fmt: skip
# (test_api's torchrun runs start examples, no trainer or coordinator: they run beside these)
# ...then, once it is done, those that compare measured times (a straggler, shaped links)
TIMED_MODULES = ["test_netem", "test_pace", "test_topology", "test_bench"]

# The cluster half yields the cores to the other half, whose tests mostly wait on their groups'
# messages: at equal priority each of their wake-ups queues behind the clusters' interpreters
# (the other half took 170 s alone and 470-555 s beside them; at nice 5, 288-623 s: the
# machine's speed varied more than that, README "Tests").
CLUSTER_NICE = 5
HERE = Path(__file__).resolve().parent
NO_TESTS = 5  # pytest's exit code when a selection (-k) leaves a half nothing to run


def _run(cmd: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, **kwargs)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt  # a SIGTERM stops the halves as a Ctrl-C does


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C to each half still running, and time for it to stop its clusters."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    ours = {*CLUSTER_MODULES, *TIMED_MODULES}
    rest = [str(p) for p in sorted(HERE.glob("test_*.py")) if p.stem not in ours]
    started = time.monotonic()
    running: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupted)
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        try:
            beside = _run([*pytest, *rest], stdout=log, stderr=subprocess.STDOUT)
            running.append(beside)
            first = _run(
                [*pytest, *(str(HERE / f"{m}.py") for m in CLUSTER_MODULES)],
                preexec_fn=lambda: os.nice(CLUSTER_NICE),
            )
            running.append(first)
            codes = [first.wait(), beside.wait()]
            timed = _run([*pytest, *(str(HERE / f"{m}.py") for m in TIMED_MODULES)])
            running.append(timed)
            codes.append(timed.wait())
        except KeyboardInterrupt:
            _stop(running)
            print("\ngeotrain tests: interrupted; every half stopped", file=sys.stderr)
            return 130
        finally:
            log.seek(0)
            print(f"\n--- beside the clusters: {len(rest)} modules ---")
            print(log.read(), end="")
    print(f"--- all halves: {time.monotonic() - started:.0f} s ---")
    ran = [c for c in codes if c != NO_TESTS]
    return max(ran) if ran else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
