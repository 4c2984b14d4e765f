"""Text corpora: which files a source names, how much of each is read, and their documents.

A source is ``"python-stdlib"`` (the ``.py`` files of the running Python's standard library,
there on every machine without a download) or a text file or a directory of text files.
Files are read in a fixed pseudo-random order (by a hash of their relative path), so that a
corpus capped by ``max_bytes`` samples the whole library or directory rather than its first
letters, and so that the validation split (the corpus's tail) is not one topic.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PYTHON_STDLIB", "TEXT_SUFFIXES", "CorpusFile", "read_documents", "select_files", "stdlib_files"]

PYTHON_STDLIB = "python-stdlib"
# What a directory source reads; a file named directly is read whatever its suffix.
TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".rs", ".go", ".java"}
    | {".html", ".xml", ".json", ".jsonl", ".csv", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".sh"}
)
# Long files are handed to the tokenizer in pieces of about this size, cut after a newline,
# so that tokenizing a big file needs no more memory than a piece.
PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus and how much of it is read.

    Attributes:
        path: the file.
        size: its size in bytes when selected.
        mtime_ns: its modification time then (part of the cache key).
        read_bytes: how many of its bytes the corpus takes (less than ``size`` for the last
            file under ``max_bytes``).
    """

    path: Path
    size: int
    mtime_ns: int
    read_bytes: int


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running Python's standard library, third-party packages excluded."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    # os.walk prunes site-packages, which can be many times the size of the library itself
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in skip]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return files


def _text_files(directory: Path, skip: Path | None = None) -> list[Path]:
    """Text files below ``directory``, hidden files and folders (.git) and anything under
    ``skip`` (the data cache, whose tokenizer files would otherwise join the corpus) left out."""
    skip = None if skip is None else skip.resolve()
    return [
        p
        for p in directory.rglob("*")
        if p.suffix.lower() in TEXT_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
        and not (skip is not None and p.resolve().is_relative_to(skip))
    ]


def _ordered(paths: list[Path], root: Path) -> list[Path]:
    """``paths`` in the fixed pseudo-random order of a hash of each path relative to ``root``."""
    return sorted(paths, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())


def select_files(source: str, max_bytes: int | None, skip: Path | None = None) -> list[CorpusFile]:
    """The files a text source reads, in reading order, capped at ``max_bytes`` in all.

    Args:
        source: ``"python-stdlib"``, a text file or a directory of text files.
        max_bytes: the most bytes read in all, or None for everything.
        skip: a folder whose files a directory source leaves out (the data cache).

    Returns:
        The files with their sizes; empty files are left out.

    Raises:
        FileNotFoundError: ``source`` is neither ``"python-stdlib"`` nor an existing path.
        ValueError: the source holds no text (no files, or only empty ones).
    """
    if source == PYTHON_STDLIB:
        paths = stdlib_files()
        root = Path(sysconfig.get_paths()["stdlib"])
        where = f"the Python standard library at {root}"
    else:
        root = Path(source).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"source: {source!r} does not exist (and is not {PYTHON_STDLIB!r})")
        paths = [root] if root.is_file() else _text_files(root, skip)
        where = f"source {source!r}"
        root = root.parent if root.is_file() else root
    selected, total = [], 0
    for path in _ordered(paths, root):
        if max_bytes is not None and total >= max_bytes:
            break
        stat = path.stat()
        if stat.st_size == 0:
            continue
        read = stat.st_size if max_bytes is None else min(stat.st_size, max_bytes - total)
        selected.append(CorpusFile(path, stat.st_size, stat.st_mtime_ns, read))
        total += read
    if not selected:
        suffixes = " ".join(sorted(TEXT_SUFFIXES))
        raise ValueError(f"empty corpus: {where} holds no non-empty text file (a directory reads {suffixes})")
    return selected


def read_documents(files: list[CorpusFile]) -> Iterator[list[str]]:
    """Each file's text as one document, in pieces of about ``PIECE_BYTES``.

    Invalid UTF-8 (a Latin-1 test file of the standard library, a cut through a character at
    ``max_bytes``) becomes U+FFFD rather than an error; a piece without a newline ends
    before a character, never inside one.

    Args:
        files: from ``select_files``.

    Yields:
        A document: its pieces, cut after a newline where the text has one.
    """
    for file in files:
        with open(file.path, "rb") as f:
            data = f.read(file.read_bytes)
        pieces, start = [], 0
        while start < len(data):
            end = start + PIECE_BYTES
            if end < len(data):
                newline = data.rfind(b"\n", start, end)
                if newline >= start:
                    end = newline + 1
                else:  # no newline: cut before a character, not inside one (continuation bytes 10xxxxxx)
                    while end > start + 1 and data[end] & 0xC0 == 0x80:
                        end -= 1
            pieces.append(data[start:end].decode("utf-8", errors="replace"))
            start = end
        yield pieces
