"""Token corpora and per-worker batches.

The default corpus is real text on every machine, offline: the source files of the running
Python's standard library, read as bytes (vocabulary 256). ``--data DIR`` reads the text files
under DIR the same way; ``--data FILE.bin`` reads uint16 tokens in nanoGPT's layout (a
``train.bin``/``val.bin`` pair next to each other is used as given).

The last ``VAL_FRACTION`` of the stream is the validation split. The training split is cut into
``world_size`` contiguous shards and each worker samples windows only from its own shard, from a
generator seeded by (seed, rank): runs are deterministic and workers never see each other's data.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VAL_FRACTION = 0.05


class DataError(ValueError):
    """The data the user pointed at cannot be used (missing, empty, too short)."""


@dataclass
class TokenCorpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int  # rounded up (a multiple of 64): the embedding a model is built with
    source: str
    tokens: int = 0  # the largest token id + 1 (0: vocab_size), what a given model must cover

    def check_fits(self, block_size: int, world_size: int) -> None:
        shard = len(self.train) // world_size
        if shard < block_size + 2 or len(self.val) < block_size + 2:
            raise DataError(
                f"corpus {self.source} has {len(self.train) + len(self.val)} tokens: too few for "
                f"{world_size} worker shards of context {block_size}; give more text"
            )


def _cache_dir() -> Path:
    root = os.environ.get("GEOTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "geotrain"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _text_files(root: Path) -> list[Path]:
    """Regular text files under ``root`` in a fixed order (binary files, with a NUL, are skipped)."""
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        head = path.read_bytes()[:4096]
        if b"\0" not in head:
            files.append(path)
    return files


def _bytes_of(files: list[Path]) -> bytes:
    return b"\n".join(f.read_bytes() for f in files)


def stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def _cached_bytes(key: str, build) -> np.ndarray:
    """Build the byte stream once per machine; concurrent workers race safely via rename."""
    path = _cache_dir() / f"{key}.u8"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(build())
        os.replace(tmp, path)
    return np.memmap(path, dtype=np.uint8, mode="r")


def load_corpus(data: str | None = None, tokenizer: str = "") -> TokenCorpus:
    """The corpus named by ``--data`` (None: the standard library's sources), tokenized with
    ``--tokenizer`` where one is given (``data/tokenize.py``; bytes otherwise)."""
    if tokenizer:
        from geotrain.data.tokenize import tokenized, vocab_size

        if data is None:
            raise DataError("--tokenizer needs --data: the text files to tokenize")
        corpus = _load_bin(tokenized(data, tokenizer))
        vocab = vocab_size(tokenizer)
        corpus.tokens = vocab  # any id the tokenizer can give, which a model must cover
        corpus.vocab_size = _round_vocab(vocab)
        return corpus
    if data is None:
        # Keyed by the interpreter and where its library lies, not by listing it: the walk takes
        # 0.8 s, and every worker of every run loads the corpus.
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        where = f"{sys.version}:{stdlib}:{stdlib.stat().st_mtime_ns}"
        key = f"stdlib-{sys.version.split()[0]}-{hashlib.sha1(where.encode()).hexdigest()[:10]}"
        tokens = _cached_bytes(key, lambda: _bytes_of(stdlib_files()))
        return _split(tokens, 256, f"the standard library of Python {sys.version.split()[0]}")

    path = Path(data)
    if not path.exists():
        raise DataError(
            f"--data {data}: no such file or directory (give a folder of text files or a .bin file)"
        )
    if path.is_file() and path.suffix == ".bin":
        return _load_bin(path)
    if path.is_file():
        raise DataError(
            f"--data {data}: a file must be uint16 tokens named *.bin; pass a folder for text, or "
            "--tokenizer PATH to tokenize .txt, .jsonl or .parquet files"
        )
    files = _text_files(path)
    stat = [f.stat() for f in files]
    key = (
        "dir-"
        + hashlib.sha1(
            "\n".join(f"{f}:{s.st_size}:{s.st_mtime_ns}" for f, s in zip(files, stat, strict=True)).encode()
        ).hexdigest()[:16]
    )
    if sum(s.st_size for s in stat) == 0:
        raise DataError(f"--data {data}: no text found (the folder has no non-empty text files)")
    return _split(_cached_bytes(key, lambda: _bytes_of(files)), 256, f"{path} ({len(files)} files)")


def _load_bin(path: Path) -> TokenCorpus:
    width, dtype = (4, np.uint32) if path.name.endswith(".u32.bin") else (2, np.uint16)
    if path.stat().st_size < width:
        raise DataError(f"--data {path}: the file is empty")
    if path.stat().st_size % width:
        raise DataError(
            f"--data {path}: its size is not a multiple of {width}, so it is not {dtype.__name__} tokens"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    pair = path.with_name("val.bin") if path.name == "train.bin" else None
    if pair is not None and pair.exists() and pair.stat().st_size >= 2:
        val = np.memmap(pair, dtype=dtype, mode="r")
        vocab = int(max(tokens.max(), val.max())) + 1
        return TokenCorpus(tokens, val, _round_vocab(vocab), str(path), vocab)
    corpus = _split(tokens, _round_vocab(int(tokens.max()) + 1), str(path))
    corpus.tokens = int(tokens.max()) + 1
    return corpus


def _round_vocab(vocab: int) -> int:
    return max(256, -(-vocab // 64) * 64)  # a multiple of 64, as nanoGPT pads GPT-2's 50257 to 50304


def _split(tokens: np.ndarray, vocab_size: int, source: str) -> TokenCorpus:
    if len(tokens) == 0:
        raise DataError(f"corpus {source} is empty")
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return TokenCorpus(tokens[:cut], tokens[cut:], vocab_size, source)


class BatchSampler:
    """Random windows from this worker's shard of the training split, and fixed validation batches."""

    def __init__(
        self, corpus: TokenCorpus, block_size: int, batch_size: int, rank: int, world_size: int, seed: int
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        corpus.check_fits(block_size, world_size)
        self._train, self._world = corpus.train, world_size
        self.shards = [rank]
        shard = len(corpus.train) // world_size
        self.shard = corpus.train[rank * shard : (rank + 1) * shard]
        self.val = corpus.val
        self.block_size = block_size
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed * 100_003 + rank)
        self.seed = seed

    @staticmethod
    def _windows(tokens: np.ndarray, starts: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(tokens[s : s + block + 1], dtype=np.int64) for s in starts.tolist()])
        xy = torch.from_numpy(rows)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

    def fresh_stream(self, seed: int, rank: int, salt: int) -> None:
        """New windows for a worker that takes a place in a running job (a joiner, or a host a
        resume rebuilds from another's state): its predecessor's stream from the start would
        repeat batches already seen."""
        self.gen.manual_seed(seed * 100_003 + rank + salt)

    def read_shards(self, shards: list[int]) -> None:
        """Sample from these shards from now on (a worker that left hands its shard to the
        survivors, so its part of the data is still seen). The generator goes on as it was."""
        if not shards:
            raise ValueError("a worker needs at least one shard")
        size = len(self._train) // self._world
        self.shards = list(shards)
        self.shard = np.concatenate([self._train[s * size : (s + 1) * size] for s in shards])

    def next_train(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.shards) == 1:
            starts = torch.randint(
                0, len(self.shard) - self.block_size - 1, (self.batch_size,), generator=self.gen
            )
            return self._windows(self.shard, starts, self.block_size)
        # A window never straddles two shards: a shard, then a start inside it.
        size = len(self.shard) // len(self.shards)
        which = torch.randint(0, len(self.shards), (self.batch_size,), generator=self.gen)
        offset = torch.randint(0, size - self.block_size - 1, (self.batch_size,), generator=self.gen)
        return self._windows(self.shard, which * size + offset, self.block_size)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same validation batches on every worker and at every evaluation."""
        gen = torch.Generator().manual_seed(self.seed + 7)
        high = len(self.val) - self.block_size - 1
        return [
            self._windows(
                self.val, torch.randint(0, high, (self.batch_size,), generator=gen), self.block_size
            )
            for _ in range(n_batches)
        ]
