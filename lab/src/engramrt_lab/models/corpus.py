"""The training corpus: the standard library plus the installed packages' Python sources.

- Sources: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (none
  under a ``site-packages`` or ``dist-packages`` directory), then every
  ``*.py`` under each site directory (``site.getsitepackages()``, then the
  ``purelib`` and ``platlib`` paths; the first directory holding a path
  wins), files over :data:`MAX_FILE_BYTES` skipped (generated tables).
  Stdlib files are named by their path relative to the stdlib
  (``json/decoder.py``), package files ``pkg:<path relative to the site
  directory>``; names are sorted (POSIX form) within each source.
- Split, from the name alone (the same on every machine): a stdlib file is
  **held out** when ``int(sha256(name)) % 20 == 0`` and a **validation**
  file when it is ``1`` (the held-out set and the sample shipped before, so
  results stay comparable; validation only chooses the step each model
  keeps); a package file whose top-level name is in
  :data:`HELDOUT_PACKAGES` is **package held-out** (whole packages never
  trained on: the stricter held-out set); every other file trains.
- Near-duplicates are removed before training sees anything, in this
  priority: the held-out and validation files (all kept), then the package
  held-out files, then the training files (stdlib first). A file is
  dropped when its normalised text (lines stripped, blank lines removed)
  equals an earlier kept file's, or when it has at least
  :data:`NEAR_DUP_MIN_LINES` distinct long lines (:data:`LONG_LINE_CHARS`
  characters or more, stripped) and at least :data:`NEAR_DUP_FRACTION` of
  them already occur in earlier kept files. So no training file repeats a
  held-out file, and code trees' copies of one file train once.
- Manifest (:meth:`Corpus.record`): the roots (by name only), the distributions found in
  the site directories (name and version), the file counts and a SHA-256
  of the kept names and contents: :func:`manifest_differences` says
  whether another machine's corpus is the same.
- ``max_train_chars`` bounds the training text: every stdlib training file,
  then package training files in the order of ``sha256(name)`` while their
  characters fit (one pass over a larger corpus would not be used anyway;
  tokenising it costs minutes).
- ``max_files`` (tests) keeps the first ``max_files`` training files and
  the first ``max(1, max_files // 10)`` held-out, validation and package
  held-out files.
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
import site
import sys
import sysconfig
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engramrt.errors import ValidationError
from engramrt.hashing import HashBatch, HashConstants, NgramHasher, hash_sequence
from engramrt.hashing.vectorized import hash_batch_torch
from engramrt_lab.models.vocab import BOS_TOKEN_ID

__all__ = [
    "HELDOUT_MODULUS",
    "HELDOUT_PACKAGES",
    "Corpus",
    "EvalSegments",
    "SourceFile",
    "Split",
    "build_corpus",
    "corpus_row_ids",
    "deduplicate",
    "eval_segments",
    "is_heldout",
    "manifest_differences",
    "root_name",
    "site_dirs",
    "source_files",
    "split_of",
    "stdlib_files",
]

HELDOUT_MODULUS = 20
_HELDOUT_RESIDUE = 0
_VALIDATION_RESIDUE = 1
_MAX_TOKENS_PER_HASH_BATCH = 1 << 20  # bounds the hasher's temporaries, whole documents per batch
PACKAGE_PREFIX = "pkg:"
HELDOUT_PACKAGES = ("click", "rich", "typer")
"""Top-level packages never trained on (present with the demo's dependencies)."""
MAX_FILE_BYTES = 1_000_000
LONG_LINE_CHARS = 32
NEAR_DUP_MIN_LINES = 8
NEAR_DUP_FRACTION = 0.6
_TOKENIZE_CHUNK = 512  # files per encode_batch call
_SPLITS = ("train", "heldout", "validation", "package_heldout")


def split_of(name: str) -> str:
    """The split of a corpus file by its name: ``"heldout"``, ``"validation"``,
    ``"package_heldout"`` or ``"train"`` (see the module docstring)."""
    if name.startswith(PACKAGE_PREFIX):
        top = name[len(PACKAGE_PREFIX) :].split("/", 1)[0]
        top = top[:-3] if top.endswith(".py") else top
        return "package_heldout" if top in HELDOUT_PACKAGES else "train"
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    residue = int.from_bytes(digest, "big") % HELDOUT_MODULUS
    if residue == _HELDOUT_RESIDUE:
        return "heldout"
    return "validation" if residue == _VALIDATION_RESIDUE else "train"


def is_heldout(relative_path: str) -> bool:
    """Whether a stdlib file (its POSIX path relative to the stdlib root) is held out."""
    return split_of(relative_path) == "heldout"


def _skip(parts: Sequence[str]) -> bool:
    return "site-packages" in parts or "dist-packages" in parts or "__pycache__" in parts


def _py_files(base: Path) -> list[str]:
    names = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if _skip(rel.parts) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        names.append(rel.as_posix())
    return sorted(names)


def stdlib_files(root: Path | None = None) -> tuple[Path, list[str]]:
    """The stdlib root and its ``*.py`` files (relative POSIX paths, sorted), no site-packages."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    return base, _py_files(base)


def root_name(path: Path | str) -> str:
    """What a record keeps of a source directory: its name (``python3.12``,
    ``site-packages``), not where the machine that read it keeps it."""
    return Path(path).name or str(path)


def site_dirs() -> list[Path]:
    """The interpreter's site directories that exist, in lookup order, each once."""
    candidates = [*site.getsitepackages()]
    paths = sysconfig.get_paths()
    candidates += [paths["purelib"], paths["platlib"]]
    seen: list[Path] = []
    for name in candidates:
        path = Path(name)
        if path.is_dir() and path.resolve() not in [p.resolve() for p in seen]:
            seen.append(path)
    return seen


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus: its name (see the module docstring) and where it is read."""

    name: str
    path: Path


def source_files(
    stdlib_root: Path | None = None, sites: Iterable[Path] | None = None
) -> tuple[Path, list[Path], list[SourceFile]]:
    """The stdlib root, the site directories and every source file, stdlib first."""
    base, names = stdlib_files(stdlib_root)
    dirs = site_dirs() if sites is None else [Path(p) for p in sites]
    files = [SourceFile(name, base / name) for name in names]
    taken: set[str] = set()
    packaged: list[SourceFile] = []
    for directory in dirs:
        for rel in _py_files(directory):
            name = PACKAGE_PREFIX + rel
            if name not in taken:
                taken.add(name)
                packaged.append(SourceFile(name, directory / rel))
    files += sorted(packaged, key=lambda f: f.name)
    return base, dirs, files


def _normalised_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def deduplicate(
    texts: Sequence[str], order: Sequence[int], keep_all: Sequence[bool] | None = None
) -> tuple[list[bool], dict[str, int]]:
    """Which of ``texts`` to keep, visiting them in ``order`` (see the module docstring).

    ``keep_all[i]`` keeps text ``i`` whatever it repeats (its lines still count as
    seen). Returns the keep flags (by index) and the counts dropped as exact
    and near duplicates.
    """
    keep = [False] * len(texts)
    whole: set[str] = set()
    long_lines: set[str] = set()
    exact = near = 0
    for index in order:
        lines = _normalised_lines(texts[index])
        key = hashlib.blake2b("\n".join(lines).encode("utf-8"), digest_size=16).hexdigest()
        distinct = {line for line in lines if len(line) >= LONG_LINE_CHARS}
        forced = keep_all is not None and keep_all[index]
        if not forced:
            if key in whole:
                exact += 1
                continue
            if len(distinct) >= NEAR_DUP_MIN_LINES:
                repeated = sum(1 for line in distinct if line in long_lines)
                if repeated >= NEAR_DUP_FRACTION * len(distinct):
                    near += 1
                    continue
        keep[index] = True
        whole.add(key)
        long_lines.update(distinct)
    return keep, {"dropped_exact_duplicates": exact, "dropped_near_duplicates": near}


def _distributions(dirs: Sequence[Path]) -> list[list[str]]:
    from importlib import metadata

    found: dict[str, str] = {}
    for dist in metadata.distributions(path=[str(d) for d in dirs]):
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if name:
            found.setdefault(str(name).lower(), str(dist.version))
    return [[name, found[name]] for name in sorted(found)]


@dataclass
class Split:
    """One split: its files and their documents as one token stream.

    Attributes:
        files: file names, in order.
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
    package_heldout: Split = field(
        default_factory=lambda: Split([], np.zeros(0, np.int64), np.zeros(1, np.int64))
    )
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What the training record keeps about the corpus (its manifest included; the
        source directories by name, :func:`root_name`)."""
        return {
            "source": "python stdlib *.py plus the site directories' *.py, near-duplicates "
            "removed before the split",
            "python_version": self.python_version,
            "stdlib_root": root_name(self.root),
            "heldout_rule": f"stdlib: int(sha256(relative_path)) % {HELDOUT_MODULUS} == "
            f"{_HELDOUT_RESIDUE}",
            "validation_rule": f"stdlib: int(sha256(relative_path)) % {HELDOUT_MODULUS} == "
            f"{_VALIDATION_RESIDUE}",
            "package_heldout_rule": f"top-level package in {list(HELDOUT_PACKAGES)}",
            "dedup_rule": f"normalised text equal, or >= {NEAR_DUP_FRACTION:.0%} of >= "
            f"{NEAR_DUP_MIN_LINES} distinct lines of >= {LONG_LINE_CHARS} chars seen before "
            f"(held-out and validation first, then package held-out, then train)",
            "train_files": len(self.train.files),
            "heldout_files": len(self.heldout.files),
            "validation_files": len(self.validation.files),
            "package_heldout_files": len(self.package_heldout.files),
            "train_tokens": self.train.num_tokens,
            "heldout_tokens": self.heldout.num_tokens,
            "validation_tokens": self.validation.num_tokens,
            "package_heldout_tokens": self.package_heldout.num_tokens,
            "seconds": round(self.seconds, 2),
            **self.stats,
        }


_MANIFEST_KEYS = (
    "python_version",
    "distributions",
    "files_found",
    "file_list_sha256",
    "kept_sha256",
    "train_files",
    "train_tokens",
)


def manifest_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two corpus records (empty: the same corpus)."""
    out = []
    for key in _MANIFEST_KEYS:
        if recorded.get(key) != current.get(key):
            if key == "distributions":
                was = {tuple(d) for d in recorded.get(key) or []}
                now = {tuple(d) for d in current.get(key) or []}
                out.append(
                    f"distributions: {len(was - now)} recorded ones absent or of another "
                    f"version (e.g. {sorted(was - now)[:3]}), {len(now - was)} new"
                )
            else:
                out.append(f"{key}: recorded {recorded.get(key)!r}, here {current.get(key)!r}")
    return out


def _tokenize(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for begin in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = list(texts[begin : begin + _TOKENIZE_CHUNK])
        encodings = tokenizer.encode_batch(chunk, add_special_tokens=False)
        out.extend(np.asarray(e.ids, dtype=np.int64) for e in encodings)
    return out


def _split(files: list[str], docs: list[np.ndarray]) -> Split:
    with_bos = [np.concatenate([[BOS_TOKEN_ID], d]) for d in docs]
    lengths = np.array([d.size for d in with_bos], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(with_bos) if with_bos else np.zeros(0, dtype=np.int64)
    return Split(files, tokens, starts)


def build_corpus(
    tokenizer: Any,
    *,
    max_files: int | None = None,
    root: Path | None = None,
    sites: Iterable[Path] | None = None,
    max_train_chars: int | None = None,
    say: Any = None,
) -> Corpus:
    """Read, deduplicate, split and tokenise the sources (see the module docstring).

    ``root`` and ``sites`` replace the stdlib root and the site directories
    (tests); ``max_train_chars`` bounds the training text (see the module
    docstring); ``say`` prints progress lines.
    """
    began = time.perf_counter()
    base, dirs, files = source_files(root, sites)
    if max_files is not None and (
        isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1
    ):
        raise ValidationError(f"max_files={max_files!r} must be a positive integer")
    raw = [f.path.read_bytes() for f in files]
    texts = [b.decode("utf-8", errors="replace") for b in raw]
    list_digest = hashlib.sha256("\n".join(f.name for f in files).encode("utf-8")).hexdigest()
    split = [split_of(f.name) for f in files]
    rank = {"heldout": 0, "validation": 0, "package_heldout": 1, "train": 2}
    order = sorted(range(len(files)), key=lambda i: (rank[split[i]], i))
    forced = [split[i] in ("heldout", "validation") for i in range(len(files))]
    keep, dedup = deduplicate(texts, order, forced)
    if say is not None:
        say(
            f"corpus sources: {len(files):,} files ({sum(map(len, raw)) / 1e6:,.1f} MB), "
            f"{dedup}, {time.perf_counter() - began:.1f} s"
        )
    chosen: dict[str, list[int]] = {name: [] for name in _SPLITS}
    for index in range(len(files)):
        if keep[index]:
            chosen[split[index]].append(index)
    available = len(chosen["train"])
    if max_train_chars is not None:
        # The stdlib's training files all; then package files in the order of the
        # SHA-256 of their names while the characters fit (a sample that reads the
        # same on every machine with the same files); the kept ones in name order.
        budget = max_train_chars
        taken = []
        packaged = []
        for index in chosen["train"]:
            if files[index].name.startswith(PACKAGE_PREFIX):
                packaged.append(index)
            else:
                taken.append(index)
                budget -= len(texts[index])
        packaged.sort(key=lambda i: hashlib.sha256(files[i].name.encode("utf-8")).digest())
        for index in packaged:
            if len(texts[index]) <= budget:
                taken.append(index)
                budget -= len(texts[index])
        chosen["train"] = sorted(taken)
    if max_files is not None:
        chosen["train"] = chosen["train"][:max_files]
        for name in ("heldout", "validation", "package_heldout"):
            chosen[name] = chosen[name][: max(1, max_files // 10)]
    for name in ("train", "heldout", "validation"):
        if not chosen[name]:
            raise ValidationError(
                f"the sources under {str(base)!r} (and {len(dirs)} site directories) give no "
                f"{name} file ({len(files)} files found, {sum(keep)} after deduplication); "
                f"expected Python sources of every split (the split of a file is "
                f"sha256(name) % 20, see split_of)"
            )
    kept_digest = hashlib.sha256()
    for name in _SPLITS:
        for index in chosen[name]:
            kept_digest.update(files[index].name.encode("utf-8") + b"\0")
            kept_digest.update(hashlib.sha256(raw[index]).digest())
    splits = {}
    for name in _SPLITS:
        names = [files[i].name for i in chosen[name]]
        splits[name] = _split(names, _tokenize(tokenizer, [texts[i] for i in chosen[name]]))
    tops: dict[str, int] = {}
    for index in chosen["train"] + chosen["package_heldout"]:
        name = files[index].name
        if name.startswith(PACKAGE_PREFIX):
            top = name[len(PACKAGE_PREFIX) :].split("/", 1)[0]
            tops[top] = tops.get(top, 0) + 1
    version = ".".join(str(v) for v in sys.version_info[:3])
    stats = {
        "site_dirs": [root_name(d) for d in dirs],
        "distributions": _distributions(dirs),
        "files_found": len(files),
        "file_list_sha256": list_digest,
        "kept_sha256": kept_digest.hexdigest(),
        **dedup,
        "package_files": dict(sorted(tops.items())),
        "package_heldout_found": sorted(
            {
                files[i].name[len(PACKAGE_PREFIX) :].split("/", 1)[0].removesuffix(".py")
                for i in chosen["package_heldout"]
            }
        ),
        "max_file_bytes": MAX_FILE_BYTES,
        "max_train_chars": max_train_chars,
        "train_files_after_dedup": available,
        "train_chars": sum(len(texts[i]) for i in chosen["train"]),
    }
    return Corpus(
        str(base),
        version,
        splits["train"],
        splits["heldout"],
        splits["validation"],
        splits["package_heldout"],
        time.perf_counter() - began,
        stats,
    )


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

    def hash_batch(self, device: torch.device | str) -> HashBatch:
        """The sequences as one engine step on ``device``: each a request at its position
        in its document, with its lookback ids (hashing it gives the ids it has there)."""
        count, seq = self.tokens.shape
        return HashBatch(
            input_ids=torch.as_tensor(self.tokens.reshape(-1), device=device),
            positions=torch.as_tensor(
                (self.positions[:, None] + np.arange(seq)[None, :]).reshape(-1), device=device
            ),
            query_start_loc=torch.arange(
                0, (count + 1) * seq, seq, device=device, dtype=torch.int32
            ),
            lookback_token_ids=torch.as_tensor(self.lookback, device=device),
        )

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
