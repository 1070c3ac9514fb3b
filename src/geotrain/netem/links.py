"""Parsing link specifications: ``100mbit``, ``100mbit,20mbit,1gbit,1gbit``, ``50ms``.

Units follow ``tc``: ``kbit``, ``mbit``, ``gbit`` (bits per second, powers of 1000). ``tc`` reads
``mbps`` as megaBYTES per second, which users rarely mean, so byte units are refused rather than
guessed.
"""

from __future__ import annotations

import re

BANDWIDTH_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")
_LATENCY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$")
MIN_BPS = 8_000  # below 1 KB/s nothing useful trains and tc's tbf misbehaves
MAX_BPS = 100 * 10**9


class LinkSpecError(ValueError):
    pass


def parse_bandwidth(text: str) -> int:
    """``'100mbit'`` -> 100_000_000 (bits per second)."""
    m = _BANDWIDTH.match(text.lower())
    accepted = "a positive number with a unit of bit, kbit, mbit or gbit, e.g. 100mbit or 1.5gbit"
    if not m or m.group(2) not in BANDWIDTH_UNITS:
        raise LinkSpecError(f"bandwidth {text!r} is not understood; give {accepted}")
    bps = int(round(float(m.group(1)) * BANDWIDTH_UNITS[m.group(2)]))
    if not MIN_BPS <= bps <= MAX_BPS:
        raise LinkSpecError(f"bandwidth {text!r} is out of range; give 8kbit to 100gbit")
    return bps


def parse_bandwidths(text: str, workers: int) -> list[int]:
    """One rate for every host, or a comma-separated rate per host."""
    parts = [p for p in text.split(",")]
    if len(parts) == 1:
        return [parse_bandwidth(parts[0])] * workers
    if len(parts) != workers:
        raise LinkSpecError(
            f"--bandwidth lists {len(parts)} rates for {workers} workers; give one rate, or one per worker"
        )
    return [parse_bandwidth(p) for p in parts]


def parse_latency(text: str) -> float:
    """``'50ms'`` -> 0.05 (seconds)."""
    m = _LATENCY.match(text.lower())
    if not m:
        raise LinkSpecError(f"latency {text!r} is not understood; give a number with us, ms or s, e.g. 50ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def format_bandwidth(bps: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}"
    return f"{bps}bit"


def describe_links(rates: list[int]) -> str:
    if len(set(rates)) == 1:
        return format_bandwidth(rates[0])
    return ",".join(format_bandwidth(r) for r in rates)
