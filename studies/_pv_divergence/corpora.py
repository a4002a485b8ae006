"""The study's data, built deterministically from nothing but the Python installation.

Two tasks, each a source of (inputs, targets) batches of token ids, targets -1 where no loss
is taken:

- ``text``: byte-level language modelling of text that ships with Python: the help topics
  of ``pydoc_data.topics`` (sorted by name), then the standard library's ``*.py`` sources in
  sorted path order (``sysconfig``'s stdlib folder, site-packages excluded), each document
  followed by a NUL byte, up to `TextCorpus`'s byte budget. A document goes to validation
  when the first byte of sha256(its name) falls below 256 x the validation fraction, so the
  split does not depend on the budget's cut. The sha256 of both byte streams is recorded: a
  different Python version gives a different corpus, and the hash says so.
- ``recall``: multi-query associative recall (Zoology, Arora et al. 2023, arXiv 2312.04927):
  `pairs` distinct keys each followed by a random value, filler, then every key again in a
  random order, each followed by its value; the loss is taken on the values after the
  queries only, so the model must retrieve them across the sequence, where attention's
  errors show.

Batches are functions of (seed, stream, step): the batch of step s is drawn from a generator
seeded by a hash of the run's seed and s, so a resumed run continues the data order from its
step alone, and the ranks of a data-parallel run each take their slice of one global batch.
"""

from __future__ import annotations

import hashlib
import pydoc_data.topics
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TextCorpus", "text_corpus", "RecallTask", "stream_seed"]

IGNORE = -1


def stream_seed(seed: int, stream: str, step: int) -> int:
    """A 63-bit seed for batch `step` of `stream` ("train", "val", ...)."""
    digest = hashlib.sha256(f"{seed}|{stream}|{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _documents():
    """(name, bytes) of the help topics, then the stdlib sources, in sorted order."""
    topics = pydoc_data.topics.topics
    for name in sorted(topics):
        yield f"pydoc_data.topics/{name}", topics[name].encode()
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        yield f"stdlib/{path.relative_to(root).as_posix()}", path.read_bytes()


@dataclass(frozen=True)
class TextCorpus:
    """The byte streams, their hashes and sizes."""

    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    train_sha256: str
    val_sha256: str
    documents: int

    vocab_size = 256

    def batch(self, split: str, seed: int, step: int, batch: int, seq_len: int):
        """(x, y) of `batch` random windows of `split`, (batch, seq_len) int64 each."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"corpus_bytes: the {split} split holds {len(data)} bytes, fewer "
                             f"than seq_len + 2 = {seq_len + 2}; raise corpus_bytes")
        gen = torch.Generator().manual_seed(stream_seed(seed, split, step))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


_CORPORA: dict[tuple[int, float], TextCorpus] = {}


def text_corpus(budget: int, val_fraction: float) -> TextCorpus:
    """The first `budget` bytes of the documents (each ending in a NUL), split by the hash
    of their names."""
    key = (budget, val_fraction)
    if key not in _CORPORA:
        parts = {"train": [], "val": []}
        used = documents = 0
        for name, data in _documents():
            if used >= budget:
                break
            data = data[: budget - used - 1] + b"\0"  # the budget counts the NULs
            used += len(data)
            documents += 1
            first = hashlib.sha256(name.encode()).digest()[0]
            parts["val" if first < 256 * val_fraction else "train"].append(data)
        train, val = (b"".join(parts[s]) for s in ("train", "val"))
        _CORPORA[key] = TextCorpus(
            train=_bytes_tensor(train), val=_bytes_tensor(val),
            train_sha256=hashlib.sha256(train).hexdigest(),
            val_sha256=hashlib.sha256(val).hexdigest(),
            documents=documents,
        )
    return _CORPORA[key]


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall over `keys` key tokens and `values` value tokens."""

    keys: int = 64  # key tokens 0 .. keys-1
    values: int = 64  # value tokens keys .. keys+values-1
    pairs: int = 16  # key-value pairs per sequence, each queried once

    @property
    def vocab_size(self) -> int:
        return self.keys + self.values + 1  # and one filler token

    def batch(self, split: str, seed: int, step: int, batch: int, seq_len: int):
        """(x, y): pairs, filler, then the queries at the end; y set on the answers only."""
        n = self.pairs
        if self.keys < n or seq_len + 1 < 4 * n:
            raise ValueError(f"recall_pairs: {n} pairs need at least {n} keys (have "
                             f"{self.keys}) and seq_len + 1 >= {4 * n} (have {seq_len + 1})")
        gen = torch.Generator().manual_seed(stream_seed(seed, f"recall-{split}", step))
        keys = torch.argsort(torch.rand(batch, self.keys, generator=gen), dim=1)[:, :n]
        values = self.keys + torch.randint(0, self.values, (batch, n), generator=gen)
        order = torch.argsort(torch.rand(batch, n, generator=gen), dim=1)
        seq = torch.full((batch, seq_len + 1), self.keys + self.values, dtype=torch.long)
        seq[:, 0 : 2 * n : 2], seq[:, 1 : 2 * n : 2] = keys, values
        tail = seq_len + 1 - 2 * n  # queries: (key, value) pairs ending the sequence
        seq[:, tail::2] = keys.gather(1, order)
        seq[:, tail + 1 :: 2] = values.gather(1, order)
        x, y = seq[:, :-1], seq[:, 1:].clone()
        answer = torch.zeros(seq_len, dtype=torch.bool)
        answer[tail::2] = True  # y at position tail + 2i is the value after query i
        y[:, ~answer] = IGNORE
        return x, y
