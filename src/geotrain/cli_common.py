"""What every ``geotrain`` command shares: the one-line usage error and its exit code, the parser
that raises it, and the launcher's checks of a job's model, data and disk before anything starts.

Separate from ``cli.py`` so that the commands in modules of their own (``cli_plan.py``,
``cli_bench.py``) take them without importing the command table that imports them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from geotrain.compress.codec import ConfigError
from geotrain.data.corpus import DataError, load_corpus
from geotrain.models import ModelError, model_context, trainable_count

EXIT_USAGE = 2


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        # No abbreviations: `--ste 40` must not pass for `--steps` unseen (resume checks flags).
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):  # one line, not argparse's usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def attach_dash_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``--bandwidth -5mbit`` -> ``--bandwidth=-5mbit``, so the value reaches its own validation
    instead of argparse taking it for a flag."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if (
            argv[i] in flags
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1][1:2].isdigit()
        ):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def check_disk(run_dir: Path, cfg, workers: int) -> None:
    """Refuse (UsageError) a run whose files would not fit on its run directory's disk; warn where
    those of a run stopped unfinished would not (``geotrain.launch.disk``)."""
    from geotrain.launch.disk import NoRoom, check_room, disk_need
    from geotrain.models import parameter_count

    try:
        vocab = load_corpus(cfg.data or None, cfg.tokenizer).vocab_size
        n_params = parameter_count(cfg.model_spec(), vocab)
        need = disk_need(
            n_params, workers, cfg.algo, cfg.compress, bool(cfg.lora), bool(cfg.checkpoint_every), cfg.bits
        )
        warning = check_room(run_dir, need)
    except (NoRoom, DataError, ModelError) as e:
        raise UsageError(str(e)) from None
    if warning:
        print(warning, file=sys.stderr)


def check_model_and_data(cfg, workers: int) -> None:
    """The model and the data a job will train on, checked in the launcher before anything starts
    (text is tokenized here, once, and cached): raises ModelError, DataError or ConfigError."""
    corpus = load_corpus(cfg.data or None, cfg.tokenizer)
    context = model_context(cfg.model_spec(), corpus.vocab_size, cfg.block_size, corpus.tokens)
    corpus.check_fits(context, workers)
    if cfg.algo == "sparseloco":  # its chunks cut the trained values (with --lora, the adapters')
        from geotrain.sync.sparseloco import SparseLoCoConfig

        chunk = cfg.chunk or SparseLoCoConfig.chunk
        trained = trainable_count(cfg.model_spec(), corpus.vocab_size, corpus.tokens, context)
        if chunk > trained:
            raise ConfigError(
                f"--chunk {chunk} is larger than the whole model ({trained} trained values): "
                "use a smaller --chunk"
            )
