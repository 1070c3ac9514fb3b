"""Codecs with error feedback (``codec``: the interface and registry; ``quantize``, ``sparse``,
``lowrank``, ``chunked``: the codecs). This package's own module holds only what readers of the
``--compress`` option need without importing a codec (no dependencies: ``comm.guard`` uses it)."""

# fp32, spelled out where "" means an algorithm's default (dreamddp's is --compress auto)
NO_CODEC = "none"


def plain_spec(spec: str) -> str:
    """A ``--compress`` value with ``none`` read as "" (uncompressed): what every reader of the
    option takes, so that "none" is one spelling of fp32 and never a codec's name."""
    return "" if spec == NO_CODEC else spec
