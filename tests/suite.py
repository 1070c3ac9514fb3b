"""`make test`: the suite in parts run at once.

The tests that launch emulated clusters (the CLI, torchrun, namespaces) run in two pytest
sessions at once: each test checks that it left no trainer, coordinator or namespace behind, and
each session looks only at what it made (its processes carry its pid in their environment, its
clusters' state files name their launcher: tests/conftest.py). Those tests spend much of their
time in start-ups and waits (a run of 2 hosts, 12 steps, took 18 s at 166% CPU, 2 cores), so two
go side by side; more would only queue for the cores. The rest (pure logic, gloo groups of 2-4
processes) mostly waits on its groups' timeouts and barriers (416 tests in 165 s with 40 s of
CPU), so it runs beside them, in a process of its own. The fault scenarios (generous deadlines)
run while they do; the modules that compare timings run after all of them have finished, alone.
The reports of the parts run beside the first cluster session are printed when they are done.

    python tests/suite.py [PYTEST ARGS]   # every part; exit 0 only if all pass

A Ctrl-C (or SIGTERM) is passed to every part, which stop their clusters as a run does.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Modules whose tests launch clusters, in two sessions of about equal time (measured: 378 s and
# 344 s one after the other, beside the gloo tests), run at once and beside the other tests...
CLUSTER_MODULES = [
    ["test_continue_cli", "test_cli", "test_guard", "test_models", "test_admission", "test_dreamddp_e2e"],
    ["test_rollback_cli", "test_resume_cli", "test_broker_cli", "test_spares", "test_api"],
]
# ...then, once they are done, those that compare measured times (a straggler, shaped links)
TIMED_MODULES = ["test_netem", "test_pace", "test_topology", "test_bench"]

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
    ours = {*(m for session in CLUSTER_MODULES for m in session), *TIMED_MODULES}
    rest = [str(p) for p in sorted(HERE.glob("test_*.py")) if p.stem not in ours]
    started = time.monotonic()
    running: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupted)
    with contextlib.ExitStack() as stack:
        logs = [
            stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
            for _ in range(2)
        ]
        titles = [
            f"beside the clusters: {len(rest)} modules",
            f"clusters, second session: {', '.join(CLUSTER_MODULES[1])}",
        ]
        try:
            beside = _run([*pytest, *rest], stdout=logs[0], stderr=subprocess.STDOUT)
            running.append(beside)
            second = _run([*pytest, *_paths(CLUSTER_MODULES[1])], stdout=logs[1], stderr=subprocess.STDOUT)
            running.append(second)
            first = _run([*pytest, *_paths(CLUSTER_MODULES[0])])
            running.append(first)
            codes = [first.wait(), second.wait(), beside.wait()]
            timed = _run([*pytest, *_paths(TIMED_MODULES)])
            running.append(timed)
            codes.append(timed.wait())
        except KeyboardInterrupt:
            _stop(running)
            print("\ngeotrain tests: interrupted; every part stopped", file=sys.stderr)
            return 130
        finally:
            for title, log in zip(titles, logs, strict=True):
                log.seek(0)
                print(f"\n--- {title} ---")
                print(log.read(), end="")
    print(f"--- all parts: {time.monotonic() - started:.0f} s ---")
    ran = [c for c in codes if c != NO_TESTS]
    return max(ran) if ran else NO_TESTS


def _paths(modules: list[str]) -> list[str]:
    return [str(HERE / f"{m}.py") for m in modules]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
