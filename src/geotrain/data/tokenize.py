"""Text tokenized once with the model's own tokenizer, cached next to the data as token ids.

``--tokenizer PATH`` (a ``tokenizers`` JSON file, or a directory holding ``tokenizer.json``, as
Hugging Face models ship it) with ``--data`` naming text: a ``.txt`` file, a ``.jsonl``/``.json``
file of records with a ``text`` field, a ``.parquet`` file (read with ``datasets``), or a
directory of such files. The documents are encoded in a fixed order, each followed by the
tokenizer's end-of-text token where it has one, and written once as nanoGPT's layout (uint16
ids; uint32 where the vocabulary is larger, named ``*.u32.bin``) beside the data, keyed by the
tokenizer and the files' sizes and times: a later run, and every worker of this one, reads the
cache. The launcher tokenizes before any worker starts, with a progress bar.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from geotrain.data.corpus import DataError

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BATCH = 256  # pieces encoded at a time (the tokenizer's Rust side runs them in parallel)
TXT_PIECE = 1 << 20  # characters of a text file encoded as one piece


def _tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the tokenizers package: pip install 'geotrain[hf]'") from None
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"--tokenizer {path}: no tokenizer.json there (give a tokenizers JSON file or its directory)"
        )
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust side's parse errors
        raise DataError(
            f"--tokenizer {file}: not a tokenizers JSON file ({str(e).splitlines()[0]})"
        ) from None


def _files(data: Path) -> list[Path]:
    if data.is_file():
        files = [data]
    elif data.is_dir():
        files = sorted(p for p in data.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    else:
        raise DataError(f"--data {data}: no such file or directory")
    bad = [f for f in files if f.suffix not in SUFFIXES]
    if bad or not files:
        raise DataError(
            f"--data {data}: with --tokenizer give text: {', '.join(SUFFIXES)} files or a folder of them"
        )
    return files


def _documents(path: Path) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) pieces: a text file in pieces of about TXT_PIECE characters cut
    at line ends (encoded in parallel, with no end-of-text token between them), records whole."""
    if path.suffix == ".txt":
        piece: list[str] = []
        size = 0
        with path.open(errors="replace") as f:
            for line in f:
                piece.append(line)
                size += len(line)
                if size >= TXT_PIECE:
                    yield "".join(piece), False
                    piece, size = [], 0
        yield "".join(piece), True
        return
    elif path.suffix in (".jsonl", ".json"):
        with path.open(errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise DataError(f"{path}:{n}: not a JSON line") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f"{path}:{n}: a record needs a string field 'text'")
                yield record["text"], True
    else:  # parquet
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: parquet is read with datasets: pip install datasets") from None
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
        if "text" not in table.column_names:
            raise DataError(f"{path}: no 'text' column (it has {', '.join(table.column_names)})")
        for text in table["text"]:
            yield text, True


def _eos(tokenizer) -> int | None:
    for name in EOS_NAMES:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return i
    return None


def tokenized(data: str, tokenizer_path: str) -> Path:
    """The cached token file for ``data`` under ``tokenizer_path``, made if missing."""
    tokenizer, file = _tokenizer(Path(tokenizer_path))
    files = _files(Path(data))
    stamp = hashlib.sha1(file.read_bytes())
    for f in files:
        st = f.stat()
        stamp.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    vocab = tokenizer.get_vocab_size()
    wide = vocab > 65536
    root = Path(data) if Path(data).is_dir() else Path(data).parent
    name = Path(data).name if Path(data).is_file() else "corpus"
    leaf = f"{name}.{stamp.hexdigest()[:12]}{'.u32' if wide else ''}.bin"
    out = root / leaf
    if not os.access(root, os.W_OK):  # read-only data: the cache goes to geotrain's own
        from geotrain.data.corpus import _cache_dir

        out = _cache_dir() / f"{hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]}-{leaf}"
    if out.exists():
        return out
    from tqdm import tqdm

    eos = _eos(tokenizer)
    dtype = np.uint32 if wide else np.uint16
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    total = 0
    try:
        with tmp.open("wb") as sink, tqdm(desc=f"tokenizing {data}", unit="piece", file=sys.stderr) as bar:
            for f in files:
                batch: list[tuple[str, bool]] = []
                for piece in _documents(f):
                    batch.append(piece)
                    if len(batch) == BATCH:
                        total += _write(sink, tokenizer, batch, eos, dtype)
                        bar.update(len(batch))
                        batch = []
                if batch:
                    total += _write(sink, tokenizer, batch, eos, dtype)
                    bar.update(len(batch))
        if total == 0:
            raise DataError(f"--data {data}: no text to tokenize")
        os.replace(tmp, out)  # concurrent writers race safely: one file wins, both are the same
    finally:
        tmp.unlink(missing_ok=True)
    print(f"geotrain: {total:,} tokens of {data} cached in {out}", file=sys.stderr, flush=True)
    return out


def _write(sink, tokenizer, pieces: list[tuple[str, bool]], eos: int | None, dtype) -> int:
    texts = [text for text, _ in pieces]
    total = 0
    for encoding, (_, ends) in zip(
        tokenizer.encode_batch(texts, add_special_tokens=False), pieces, strict=True
    ):
        ids = np.asarray(encoding.ids, dtype=dtype)
        ids.tofile(sink)
        total += len(ids)
        if ends and eos is not None:
            np.asarray([eos], dtype=dtype).tofile(sink)
            total += 1
    return total


def vocab_size(tokenizer_path: str) -> int:
    return _tokenizer(Path(tokenizer_path))[0].get_vocab_size()
