"""The training corpus: the running interpreter's standard library sources.

- Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except
  those under a ``site-packages`` directory, sorted by relative path (POSIX
  form). A file is **held out** when ``int(sha256(relative_path)) % 20 ==
  0`` (about 5%) and a **validation** file when it is ``1`` (another 5%,
  used only to choose the training step to keep: held-out files are never
  looked at during training); the rule reads only the path, so the split
  is the same on every machine with the same Python version. ``max_files``
  (tests) keeps the first ``max_files`` training files and the first
  ``max(1, max_files // 10)`` held-out and validation files.
- Documents: a file's text (UTF-8, undecodable bytes replaced) tokenised
  with the DeepSeek-V4 tokenizer (``encode_batch``, no special tokens
  added), preceded by the document-start token (id 0). Documents are
  concatenated into one stream per split; ``doc_starts [D+1]`` holds the
  boundaries.
- Row ids: every position's Engram row ids ``[T, L, C]``, computed once
  with the exact hasher, each document as its own request from position 0
  (so hashing restarts at every document, with pad history, as a new
  request would): :func:`corpus_row_ids`.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt.hashing import HashBatch, HashConstants, NgramHasher, hash_sequence
from engramrt.hashing.vectorized import hash_batch_torch
from engramrt.models.vocab import BOS_TOKEN_ID

__all__ = [
    "HELDOUT_MODULUS",
    "Corpus",
    "EvalSegments",
    "Split",
    "build_corpus",
    "corpus_row_ids",
    "eval_segments",
    "is_heldout",
    "split_of",
    "stdlib_files",
]

HELDOUT_MODULUS = 20
_HELDOUT_RESIDUE = 0
_VALIDATION_RESIDUE = 1
_MAX_TOKENS_PER_HASH_BATCH = 1 << 20  # bounds the hasher's temporaries, whole documents per batch


def split_of(relative_path: str) -> str:
    """``"heldout"``, ``"validation"`` or ``"train"`` for a file (POSIX path under the stdlib)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    residue = int.from_bytes(digest, "big") % HELDOUT_MODULUS
    if residue == _HELDOUT_RESIDUE:
        return "heldout"
    return "validation" if residue == _VALIDATION_RESIDUE else "train"


def is_heldout(relative_path: str) -> bool:
    """Whether a file (its POSIX path relative to the stdlib root) is held out."""
    return split_of(relative_path) == "heldout"


def stdlib_files(root: Path | None = None) -> tuple[Path, list[str]]:
    """The stdlib root and its ``*.py`` files (relative POSIX paths, sorted), no site-packages."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path.relative_to(base).as_posix()
        for path in base.rglob("*.py")
        if "site-packages" not in path.relative_to(base).parts and path.is_file()
    )
    return base, files


@dataclass
class Split:
    """One split: its files and their documents as one token stream.

    Attributes:
        files: relative paths, in order.
        tokens: ``[T]`` int64 tokenizer ids, every document starting with id 0.
        doc_starts: ``[D+1]`` int64 offsets of the documents in ``tokens``.
    """

    files: list[str]
    tokens: np.ndarray
    doc_starts: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self) -> np.ndarray:
        """``[T]`` position of every token in its document."""
        doc_of = np.repeat(np.arange(len(self.files)), np.diff(self.doc_starts))
        return np.arange(self.num_tokens) - self.doc_starts[doc_of]


@dataclass
class Corpus:
    root: str
    python_version: str
    train: Split
    heldout: Split
    validation: Split
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What the training record keeps about the corpus."""
        return {
            "source": "python stdlib *.py (no site-packages)",
            "python_version": self.python_version,
            "stdlib_root": self.root,
            "heldout_rule": f"int(sha256(relative_path)) % {HELDOUT_MODULUS} == {_HELDOUT_RESIDUE}",
            "validation_rule": f"int(sha256(relative_path)) % {HELDOUT_MODULUS} == "
            f"{_VALIDATION_RESIDUE}",
            "train_files": len(self.train.files),
            "heldout_files": len(self.heldout.files),
            "validation_files": len(self.validation.files),
            "train_tokens": self.train.num_tokens,
            "heldout_tokens": self.heldout.num_tokens,
            "validation_tokens": self.validation.num_tokens,
            "seconds": round(self.seconds, 2),
            **self.stats,
        }


def _tokenize(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def _split(files: list[str], docs: list[np.ndarray]) -> Split:
    with_bos = [np.concatenate([[BOS_TOKEN_ID], d]) for d in docs]
    lengths = np.array([d.size for d in with_bos], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(with_bos) if with_bos else np.zeros(0, dtype=np.int64)
    return Split(files, tokens, starts)


def build_corpus(
    tokenizer: Any, *, max_files: int | None = None, root: Path | None = None
) -> Corpus:
    """Read, split and tokenise the stdlib sources (see the module docstring)."""
    import time

    began = time.perf_counter()
    base, files = stdlib_files(root)
    split = {f: split_of(f) for f in files}
    train_files = [f for f in files if split[f] == "train"]
    heldout_files = [f for f in files if split[f] == "heldout"]
    validation_files = [f for f in files if split[f] == "validation"]
    if max_files is not None:
        train_files = train_files[:max_files]
        heldout_files = heldout_files[: max(1, max_files // 10)]
        validation_files = validation_files[: max(1, max_files // 10)]
    splits = []
    for names in (train_files, heldout_files, validation_files):
        texts = [(base / name).read_text(encoding="utf-8", errors="replace") for name in names]
        splits.append(_split(names, _tokenize(tokenizer, texts)))
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Corpus(str(base), version, splits[0], splits[1], splits[2], time.perf_counter() - began)


def corpus_row_ids(
    split: Split,
    consts: HashConstants,
    token_map: np.ndarray,
    device: torch.device,
    *,
    check_docs: int = 2,
    check_tokens: int = 200,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Row ids ``[T, L, C]`` int32 on ``device`` of every position of ``split``.

    Documents are the requests of a ragged batch (whole documents per batch,
    at most about 1 M tokens each). On CUDA the hash kernel
    (:class:`NgramHasher`) computes them and the vectorised torch hashing
    of the same batches must agree bit for bit (else the torch ids are used
    and the mismatch is reported); on the CPU the torch hashing computes
    them (the reference hasher loops in Python). The first ``check_tokens``
    positions of the first ``check_docs`` documents are also compared with
    :func:`hash_sequence` (numpy, one token at a time). ``kernel`` forces the
    kernel on or off (default: on CUDA only; on a CPU it runs through
    Triton's interpreter, for tests).
    """
    num_tokens = split.num_tokens
    out = torch.empty(
        (num_tokens, consts.n_layers, consts.n_cols), dtype=torch.int32, device=device
    )
    positions = split.positions()
    token_map_dev = torch.as_tensor(np.array(token_map, dtype=np.int64), device=device)
    use_kernel = device.type == "cuda" if kernel is None else kernel
    hasher = NgramHasher(consts, token_map, device, backend="triton") if use_kernel else None
    report: dict[str, Any] = {"hasher": "triton kernel" if hasher is not None else "torch"}
    kernel_mismatch = 0
    starts = split.doc_starts
    first = 0
    while first < len(starts) - 1:
        last = first + 1
        while (
            last < len(starts) - 1
            and starts[last + 1] - starts[first] <= _MAX_TOKENS_PER_HASH_BATCH
        ):
            last += 1
        begin, end = int(starts[first]), int(starts[last])
        batch = HashBatch(
            input_ids=torch.as_tensor(split.tokens[begin:end], device=device),
            positions=torch.as_tensor(positions[begin:end], device=device),
            query_start_loc=torch.as_tensor(
                starts[first : last + 1] - begin, dtype=torch.int32, device=device
            ),
        )
        ids = hash_batch_torch(batch, consts, token_map_dev, out_dtype=torch.int32)
        if hasher is not None:
            try:
                kernel_ids = hasher(batch)
                kernel_mismatch += int((kernel_ids != ids).any(dim=(1, 2)).sum())
            except Exception as exc:  # keep training on the torch ids, and say so
                report["kernel_error"] = f"{type(exc).__name__}: {exc}"
                hasher = None
        out[begin:end] = ids
        first = last
    if hasher is not None or "kernel_error" in report:
        report["kernel_mismatched_tokens"] = kernel_mismatch
    checked = 0
    for doc in range(min(check_docs, len(starts) - 1)):
        begin = int(starts[doc])
        end = min(int(starts[doc + 1]), begin + check_tokens)
        want = hash_sequence(token_map[split.tokens[begin:end]], consts)
        got = out[begin:end].to(torch.int64).cpu().numpy()
        if not np.array_equal(got, want):
            raise AssertionError(
                f"row ids of document {doc} ({split.files[doc]}) differ from hash_sequence"
            )
        checked += end - begin
    report["checked_against_hash_sequence"] = checked
    return out, report


@dataclass
class EvalSegments:
    """Fixed held-out sequences, each inside one document.

    Attributes:
        tokens: ``[M, S]`` int64 tokenizer ids (padded with 0 after ``lengths``).
        lengths: ``[M]`` valid tokens of each sequence (>= 2).
        lookback: ``[M, N-1]`` int64: column j is the tokenizer id at
            position ``start - 1 - j`` of the document, -1 before its start
            (``HashBatch.lookback_token_ids``): hashing a sequence with these
            gives the ids it has inside its document.
        starts: ``[M]`` offset of each sequence in the split's token stream.
        positions: ``[M]`` position of each sequence's first token in its document.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    lookback: np.ndarray
    starts: np.ndarray
    positions: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_predictions(self) -> int:
        return int((self.lengths - 1).sum())

    def subset(self, index: np.ndarray | Sequence[int]) -> EvalSegments:
        idx = np.asarray(index, dtype=np.int64)
        return EvalSegments(
            self.tokens[idx],
            self.lengths[idx],
            self.lookback[idx],
            self.starts[idx],
            self.positions[idx],
        )


def eval_segments(
    split: Split, seq_len: int, max_sequences: int, max_ngram_size: int
) -> EvalSegments:
    """Held-out sequences: every document cut into pieces of ``seq_len`` tokens
    (pieces shorter than 2 dropped), then ``max_sequences`` of them evenly
    spaced over that list (all when fewer)."""
    pieces = []
    for doc in range(len(split.files)):
        begin, end = int(split.doc_starts[doc]), int(split.doc_starts[doc + 1])
        for start in range(begin, end, seq_len):
            if min(start + seq_len, end) - start >= 2:
                pieces.append((start, min(start + seq_len, end), begin))
    if len(pieces) > max_sequences:
        pick = np.unique(np.linspace(0, len(pieces) - 1, max_sequences).round().astype(np.int64))
        pieces = [pieces[i] for i in pick]
    count = len(pieces)
    tokens = np.zeros((count, seq_len), dtype=np.int64)
    lengths = np.zeros(count, dtype=np.int64)
    lookback = np.full((count, max_ngram_size - 1), -1, dtype=np.int64)
    starts = np.zeros(count, dtype=np.int64)
    positions = np.zeros(count, dtype=np.int64)
    for i, (start, end, doc_begin) in enumerate(pieces):
        tokens[i, : end - start] = split.tokens[start:end]
        lengths[i] = end - start
        starts[i] = start
        positions[i] = start - doc_begin
        for j in range(max_ngram_size - 1):
            if start - 1 - j >= doc_begin:
                lookback[i, j] = split.tokens[start - 1 - j]
    return EvalSegments(tokens, lengths, lookback, starts, positions)
