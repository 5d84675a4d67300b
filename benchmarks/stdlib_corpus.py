"""A byte-level language-modelling corpus that ships with every Python: the standard library's own source.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (installed packages and test suites left out)
is read as raw bytes, so the vocabulary is the 256 byte values and no tokenizer is needed. Files are sorted
by path and split into train and validation *by file*, with a hash of the path, so no file contributes to
both and the split does not depend on how many files a Python version ships. Within a split, files are
concatenated with a zero byte (which never occurs in source text) between them.

For a model that would read the standard library several times over (about 11 MB of training bytes under
Python 3.11), ``packages`` adds the ``*.py`` sources of installed packages, by import name (``torch``: about 46 MB),
read from the package's directory without importing it. Their files follow the standard library's, each package's
sorted by its path relative to the package's parent directory (``torch/nn/modules/linear.py``), which is also the
path the split hashes. The corpus records a SHA-256 digest of its bytes, so runs made on different machines (another
Python, another torch) can tell that they did not read the same text.

Batches are windows of ``seq_len + 1`` bytes: training windows start at offsets drawn from a seeded
``torch.Generator`` (same seed, same batches, whatever the optimizer), validation windows at a fixed set of
evenly spaced offsets (the same for every run).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["StdlibCorpus", "load_stdlib_corpus", "package_root", "stdlib_source_files"]

# Directory names left out of the corpus: installed third-party packages, and the (large, repetitive)
# test suites.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
VOCAB_SIZE = 256
FILE_SEPARATOR = 0


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The ``*.py`` files under ``root`` (default: the standard library), sorted by their path relative to it."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]  # never descend into them
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def package_root(name: str) -> Path:
    """The directory of the installed package ``name`` (an import name), found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(f"corpus package {name!r} is not an installed package (a directory of modules)")
    return Path(locations[0])


def is_validation_file(relative_path: str, val_every: int) -> bool:
    """About one file in ``val_every`` is a validation file, chosen by a CRC-32 of its relative path."""
    return zlib.crc32(relative_path.encode("utf-8")) % val_every == 0


@dataclass
class StdlibCorpus:
    """The two splits as flat ``uint8`` tensors of bytes, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    root: str
    n_train_files: int
    n_val_files: int
    packages: dict[str, str] = field(default_factory=dict)  # import name -> directory read
    sha256: str = ""  # of the training bytes, then the validation bytes: equal digests, equal corpora and splits

    def describe(self) -> dict:
        """What the corpus holds, for a results file: its sources by name and version (not by this machine's
        directories: the digest says whether two runs read the same bytes), sizes and digest."""
        source = "Python standard library *.py files"
        if self.packages:
            source += " and the *.py files of " + ", ".join(self.packages)
        stdlib = f"Python {sys.version_info[0]}.{sys.version_info[1]} standard library"
        return {
            "source": source + " (byte level, vocab 256)",
            "stdlib": stdlib if Path(self.root) == Path(sysconfig.get_paths()["stdlib"]) else Path(self.root).name,
            "packages": {name: f"{name} {_version(name)} sources" for name in self.packages},
            "train_files": self.n_train_files,
            "val_files": self.n_val_files,
            "train_bytes": self.train.numel(),
            "val_bytes": self.val.numel(),
            "sha256": self.sha256,
        }

    def train_batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, both ``(batch_size, seq_len)`` int64, at random offsets."""
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (batch_size,), generator=generator)
        return _windows(self.train, starts, seq_len)

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` fixed validation batches: windows evenly spaced over the validation split."""
        n_windows = n_batches * batch_size
        last_start = self.val.numel() - seq_len - 1
        if last_start < n_windows:
            raise ValueError(f"the validation split ({self.val.numel()} bytes) is too small for {n_windows} windows")
        starts = torch.linspace(0, last_start, n_windows).long()
        return [_windows(self.val, chunk, seq_len) for chunk in starts.split(batch_size)]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def load_stdlib_corpus(
    root: Path | None = None, val_every: int = 10, packages: tuple[str, ...] | list[str] = ()
) -> StdlibCorpus:
    """Read the standard library's sources, then those of ``packages`` (import names), and split them by file,
    about 1 in ``val_every`` for validation."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if len(set(packages)) != len(packages):
        raise ValueError(f"corpus packages must be named once each, got {list(packages)}")
    sources = [(root, root)] + [(package_root(name), package_root(name).parent) for name in packages]
    splits = {True: [], False: []}
    for directory, relative_to in sources:
        for path in stdlib_source_files(directory):
            splits[is_validation_file(path.relative_to(relative_to).as_posix(), val_every)].append(path.read_bytes())
    if not splits[True] or not splits[False]:
        raise RuntimeError(f"found too few *.py files under {root} to build a train/validation split")

    digest = hashlib.sha256()

    def join(contents: list[bytes]) -> torch.Tensor:
        blob = bytes([FILE_SEPARATOR]).join(contents)
        digest.update(len(blob).to_bytes(8, "little") + blob)  # the length: where the training split ends
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    train, val = join(splits[False]), join(splits[True])
    return StdlibCorpus(
        train=train,
        val=val,
        root=str(root),
        n_train_files=len(splits[False]),
        n_val_files=len(splits[True]),
        packages={name: str(package_root(name)) for name in packages},
        sha256=digest.hexdigest(),
    )
