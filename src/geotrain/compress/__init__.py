"""Codecs with error feedback (``codec``: the interface and registry; ``quantize``, ``sparse``,
``lowrank``, ``chunked``: the codecs). This package's own module holds only what readers of the
``--compress`` option need without importing a codec (no dependencies: ``comm.guard`` uses it)."""

# fp32, spelled out where "" means an algorithm's default (dreamddp's is --compress auto)
NO_CODEC = "none"


def plain_spec(spec: str) -> str:
    """A ``--compress`` value with ``none`` read as "" (uncompressed): what every reader of the
    option takes, so that "none" is one spelling of fp32 and never a codec's name."""
    return "" if spec == NO_CODEC else spec


# The codec an algorithm sends in where --compress is not given ("": fp32). DiLoCo's
# pseudo-gradients go in 4 bits, as Streaming DiLoCo sends its outer gradients: on W1 int4 at
# H=10 scored as fp32 did over 2,000 steps (below it at 25 of 31 evaluations) at 0.90 of
# nosync's step at 100 Mbit/s where fp32 ran at 0.74 (docs/reaching-ddp-loss.md, "DiLoCo sends
# int4 by default").
# (dreamddp's default, --compress auto, is its planner's choice: sync/dreamddp.py.)
DEFAULT_CODECS = {"diloco": "int4"}


def run_codec(algo: str, spec: str) -> str:
    """The codec a run of ``algo`` sends in with ``--compress spec``: the spec as given ("none":
    fp32, ""), or where none was given (""), the algorithm's default (``DEFAULT_CODECS``)."""
    return DEFAULT_CODECS.get(algo, "") if spec == "" else plain_spec(spec)
