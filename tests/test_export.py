"""The trained model out of a run (`python -m layup_jax.export`): the consensus model a run's
evaluations evaluate, in the model's own parameter tree, read back for inference; GPT-2 also in
Hugging Face's layout, which the import reads back."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import layup_jax
from layup_jax import data, defaults, export, models
from layup_jax.models import gpt2_import
from layup_jax.run.evaluation import Evaluator

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_loss_and_accuracy(model, config) -> tuple[float, float]:
  """The exported model's mean cross-entropy and accuracy over the run's test split, in
  float64 on the host from its logits."""
  dataset = data.make_dataset(config.data, config.num_devices, config.seed)
  nll = correct = count = 0.0
  try:
    for batch in dataset.test:
      logits = np.asarray(model(batch.inputs), np.float64)
      shifted = logits - logits.max(-1, keepdims=True)
      log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
      nll += float((-np.take_along_axis(log_probs, batch.targets[:, None], -1)[:, 0]
                    * batch.mask).sum())
      correct += float(((logits.argmax(-1) == batch.targets) * batch.mask).sum())
      count += float(batch.mask.sum())
  finally:
    dataset.close()
  return nll / count, correct / count


@pytest.mark.parametrize("algorithm", ["layup", "ddp"])
def test_an_exported_digits_run_gives_the_runs_own_consensus_test_loss(tmp_path, algorithm):
  """A digits run trained through the API, exported by the command and loaded: its params are
  the checkpoint's replicas averaged with their push-sum weights, its logits the consensus
  model's to 1e-6, and on the test split they give the loss and accuracy the run's last
  evaluation reported (to 1e-6; a replica alone would not)."""
  config = layup_jax.load_config(ROOT / "configs" / "digits.py", algorithm)
  config.num_epochs, config.progress_bar, config.metrics.tensorboard = 2, False, False
  summary = layup_jax.train(config, tmp_path / "run")
  result = subprocess.run(
      [sys.executable, "-m", "layup_jax.export", "--workdir", str(tmp_path / "run"),
       "--out", str(tmp_path / "model")], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stderr == "" and "at step 22" in result.stdout
  model = layup_jax.load_model(tmp_path / "model")
  # The consensus by its definition, from the checkpoint's replicas and push-sum weights in
  # NumPy (float64): stage by stage sum_i w_is x_is / sum_i w_is. The exported params are it to
  # float32's rounding, and the exported model's logits are those of the consensus the run's
  # evaluation forms from the same checkpoint, to 1e-6.
  with export.restored_run(tmp_path / "run") as (_, _, runtime, dataset, _):
    snapshot = runtime.stats.snapshot()
    evaluated = Evaluator(model.model, dataset.test, jax.devices()[0]).consensus_model(snapshot)
    inputs = next(iter(dataset.test)).inputs
  def average(trees, weights):
    weights = np.asarray(weights, np.float64)
    return jax.tree.map(lambda *xs: sum(w * np.asarray(x, np.float64)
                                        for w, x in zip(weights, xs)) / weights.sum(), *trees)
  replicas, stages = range(len(snapshot.params)), range(len(snapshot.params[0]))
  for s in stages:
    want = average([snapshot.params[i][s] for i in replicas],
                   [snapshot.weights[i][s] for i in replicas])
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
                 model.params[s], want)
    want = average([snapshot.state[i][s] for i in replicas],
                   [snapshot.state_weights[i][s] for i in replicas])
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
                 model.state[s], want)
  live = export.ExportedModel(model.config, model.model, *jax.device_get(evaluated))
  np.testing.assert_allclose(model(inputs), live(inputs), rtol=1e-6, atol=1e-6)
  alone = export.ExportedModel(model.config, model.model, list(snapshot.params[0]),
                               list(snapshot.state[0]))
  assert algorithm == "ddp" or not np.allclose(model(inputs), alone(inputs), rtol=1e-6,
                                               atol=1e-6)  # one replica alone differs
  loss, accuracy = _test_loss_and_accuracy(model, model.config)
  assert loss == pytest.approx(summary["final_eval_loss"], rel=1e-6)
  # The summary's accuracy is a float32 mean: 1e-6 apart, still one sample in 359 is 2.8e-3.
  assert accuracy == pytest.approx(summary["final_eval_accuracy"], abs=1e-6)
  assert json.loads((tmp_path / "model" / "config.json").read_text())["algorithm"] == algorithm


def _gpt2_config(granularity: str, vocab_multiple: int):
  config = defaults.get_config().model
  config.name, config.size, config.vocab_size, config.max_len = "gpt2", "tiny", 257, 32
  config.granularity, config.vocab_multiple = granularity, vocab_multiple
  return config


@pytest.mark.parametrize("granularity,vocab_multiple",
                         [("per_block", 1), ("per_layer", 64)])
def test_a_gpt2_written_in_hugging_faces_layout_reads_back_to_the_same_logits(
    tmp_path, granularity, vocab_multiple):
  """GPT-2 (a stage per block, or per sub-layer with a padded vocabulary) written by
  `save_gpt2_params` and read by the import `model.pretrained` uses: the same logits to 1e-5."""
  config = _gpt2_config(granularity, vocab_multiple)
  model = models.make_model(config)
  tokens = np.random.default_rng(0).integers(0, 257, (3, 32)).astype(np.int32)
  params, state = model.init(jax.random.key(3), tokens)
  params = jax.tree.map(  # weights away from their initial values, the padding's rows zero
      lambda p: p + 0.02 * jax.random.normal(jax.random.key(p.size), p.shape, p.dtype), params)
  if vocab_multiple > 1:
    params[0]["wte"]["embedding"] = params[0]["wte"]["embedding"].at[257:].set(0.0)
  gpt2_import.save_gpt2_params(model, params, config, tmp_path / "hf")
  names = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert (names["n_layer"], names["n_embd"], names["vocab_size"]) == (2, 64, 257)
  loaded = gpt2_import.load_gpt2_params(model, tokens, tmp_path / "hf",
                                        per_layer=granularity == "per_layer", vocab_size=257)
  apply = lambda p: model.apply(p, state, tokens, jax.random.key(0), 0, train=False)[0]
  np.testing.assert_allclose(apply(loaded), apply(params), rtol=1e-5, atol=1e-5)
  assert not np.allclose(apply(model.init(jax.random.key(4), tokens)[0]), apply(params),
                         atol=1e-3)  # a different model gives different logits


def test_bad_exports_end_in_one_line_with_status_2(tmp_path):
  run = lambda *args: subprocess.run([sys.executable, "-m", "layup_jax.export", *args],
                                     capture_output=True, text=True, cwd=ROOT, timeout=120)
  missing = run("--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
  assert missing.returncode == 2 and missing.stderr.count("\n") == 1
  assert "holds no checkpoint" in missing.stderr
  help_text = run("--help")
  assert help_text.returncode == 0 and "--huggingface" in help_text.stdout


def test_huggingface_layout_is_refused_for_a_model_that_is_not_gpt2(tmp_path):
  step = tmp_path / "run" / "checkpoints" / "5" / "meta"
  step.mkdir(parents=True)
  config = defaults.get_config()
  (step / "metadata").write_text(json.dumps({"config": config.to_json_best_effort()}))
  with pytest.raises(export.ExportError, match="GPT-2 only"):
    export.export_model(tmp_path / "run", tmp_path / "out", huggingface=True)


def test_a_trained_gpt2_exported_in_hugging_faces_layout_reads_back_to_its_logits(tmp_path):
  """A few steps of the language-model benchmark's GPT-2 (a stage per sub-layer) on a corpus of
  the test's own, exported with `huggingface=True`: the Hugging Face folder read by the import
  `model.pretrained` uses gives the exported model's logits to 1e-5."""
  from tests.test_language_model import benchmark_config

  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(8):
    (corpus / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n"
                                             for j in range(i, i + 30)))
  config = benchmark_config("ddp")
  config.data.text_dir, config.data.token_cache_dir = str(corpus), ""
  config.data.seq_len = config.model.max_len = 32
  config.data.batch_size, config.data.eval_batch_size = 4, 16
  config.num_devices, config.num_steps, config.eval_every = 2, 4, 4
  config.progress_bar, config.metrics.tensorboard = False, False
  layup_jax.train(config, tmp_path / "run")
  layup_jax.export_model(tmp_path / "run", tmp_path / "model", huggingface=True)
  exported = layup_jax.load_model(tmp_path / "model")
  tokens = np.random.default_rng(1).integers(0, 257, (3, 32)).astype(np.int32)
  imported = gpt2_import.load_gpt2_params(
      exported.model, tokens, tmp_path / "model" / export.HUGGINGFACE, per_layer=True,
      vocab_size=257)
  again = export.ExportedModel(exported.config, exported.model, imported, exported.state)
  np.testing.assert_allclose(again(tokens), exported(tokens), rtol=1e-5, atol=1e-5)
  initial, _ = exported.model.init(jax.random.key(0), tokens)
  assert not np.allclose(export.ExportedModel(exported.config, exported.model, initial,
                                              exported.state)(tokens), exported(tokens),
                         atol=1e-3)  # another GPT-2 of the same shape gives other logits
