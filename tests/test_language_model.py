"""The language-model benchmark (configs/stdlib_gpt2_mini.py): its corpus is every `.py` file of
the standard library, held out by document, and a few steps of it lower the test loss under
LayUp and DDP, with the time and tokens to a target loss in the summary."""

import pathlib

import pytest

import layup_jax
from layup_jax.data import text
from layup_jax.run import runner
from layup_jax.run.records import read_metrics

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "stdlib_gpt2_mini.py"


def benchmark_config(algorithm: str):
  return layup_jax.load_config(CONFIG, algorithm)


def test_the_corpus_is_the_standard_librarys_python_files_without_site_packages():
  config = benchmark_config("layup").data
  files = text.text_files(config.text_dir, config.text_glob, tuple(config.text_exclude))
  root = pathlib.Path(config.text_dir)
  assert len(files) > 1000 and not any("site-packages" in p.parts for p in files)
  assert {p.relative_to(root).parts[0] for p in files} >= {"asyncio", "json", "test"}
  held = text.held_out(files, root, config.test_fraction)
  assert len(held) == round(0.1 * len(files))
  assert len({p.relative_to(root).parts[0] for p in held}) > 20  # from every part of it


@pytest.mark.parametrize("algorithm", ["layup", "ddp"])
def test_a_few_steps_of_the_benchmark_lower_the_test_loss(tmp_path, algorithm):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(20):  # a corpus of the test's own: small functions, each file a document
    (corpus / f"m{i:02d}.py").write_text("".join(
        f"def f{j}(x):\n    return x + {j}\n\n" for j in range(i, i + 40)))
  config = benchmark_config(algorithm)
  config.data.text_dir, config.data.token_cache_dir = str(corpus), ""
  config.data.seq_len = config.model.max_len = 32
  # 4 devices x 8 x 32 tokens at 5e-3: under load, asynchronous LayUp's loss at each evaluation
  # varies by about 0.3 nats between runs; these settings leave each step well clear of that.
  config.data.batch_size, config.data.eval_batch_size = 8, 16
  config.num_devices, config.num_steps, config.eval_every = 4, 30, 15
  config.optimizer.learning_rate = 5e-3
  config.metrics.target_loss, config.checkpoint.enabled, config.progress_bar = 3.0, False, False
  summary = runner.run(config, tmp_path / "run")
  losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["split"] == "test"]
  assert len(losses) == 3 and losses[0] > 5.0  # about ln 257 at the start
  assert losses[2] < losses[1] < losses[0] and losses[2] < 3.0
  assert summary["final_eval_perplexity"] == pytest.approx(2.718281828 ** losses[2], rel=1e-6)
  assert summary["target_loss"] == 3.0 and summary["target_step"] in (15, 30)
  assert summary["tokens_to_target"] == summary["target_step"] * 4 * 8 * 32
