"""The sweep runner's configs and the report's tables and figures, from real (tiny) runs."""

import importlib.util
import json
import pathlib

import pytest

from layup_jax import provenance, runner

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
  spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_sweep_config_takes_the_paper_column_the_overrides_and_the_delay():
  sweep = _script("sweep")
  module = sweep.load_config_module(str(SCRIPTS.parent / "configs" / "cifar100_resnet18.py"))
  overrides = [sweep.parse_assignment("num_epochs=2"), sweep.parse_assignment("data.name=digits")]
  ddp = sweep.run_config(module, overrides, "ddp", 3, 2.0)
  assert (ddp.algorithm, ddp.seed, ddp.optimizer.learning_rate) == ("ddp", 3, 0.045)
  assert (ddp.num_epochs, ddp.data.name) == (2, "digits")
  assert (ddp.straggler.device, ddp.straggler.delay_iters) == (0, 2.0)
  assert not ddp.checkpoint.enabled
  layup = sweep.run_config(module, overrides, "layup", 0, 0)
  assert layup.optimizer.learning_rate == 0.035 and layup.straggler.device == -1
  diloco = sweep.run_config(module, [], "diloco", 0, 0)  # no paper column: the default one
  assert diloco.optimizer.name == "adamw" and diloco.baselines.out_freq == diloco.baselines.tau
  with pytest.raises(SystemExit, match="the config has no key optimizer.lr"):
    sweep.run_config(module, [("optimizer.lr", 0.1)], "ddp", 0, 0)


def test_the_report_tables_and_figures_come_from_the_runs(tiny_config, tmp_path):
  report = _script("report")
  workdir = tmp_path / "sweep"
  summaries = {}
  for algorithm, delay in [("layup", 0.0), ("ddp", 0.0), ("layup", 1.0), ("ddp", 1.0)]:
    tiny_config.algorithm, tiny_config.num_devices = algorithm, 4
    tiny_config.straggler.device, tiny_config.straggler.delay_iters = (0 if delay else -1), delay
    tiny_config.checkpoint.enabled = False
    summaries[algorithm, delay] = runner.run(tiny_config, workdir / f"delay{delay:g}" /
                                             f"{algorithm}-seed0")
  (workdir / "sweep.json").write_text(json.dumps({
      "config": "configs/digits.py", "commands": ["python scripts/sweep.py ..."],
      "date": "2026-11-23", "machine": "test", "mock_tfds": 0}))

  sweep = report.collect(workdir)
  assert len(sweep["runs"]) == 4
  results, out = tmp_path / "docs" / "results", tmp_path / "docs" / "results.md"
  results.mkdir(parents=True)
  text = report.render({"tiny": sweep}, results, out)
  for (algorithm, delay), summary in summaries.items():  # each run's row, under its delay
    name = {"layup": "LayUp", "ddp": "DDP"}[algorithm]
    section = text.split("### Straggler")[1 if delay else 0]
    assert f"| {name} | {summary['final_eval_accuracy']:.4g} |" in section
  assert "### Straggler: device 0 idles 1 iterations" in text
  # Each run records the version of the code that made it, and the page says which.
  version = summaries["layup", 0.0]["code_version"]
  assert version == provenance.code_version()
  assert f"Python files changed) {version or 'not recorded'}. Made by:" in text
  for stem in ("learning_curves", "straggler", "consensus"):
    png = results / "figures" / f"tiny_{stem}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"(results/figures/tiny_{stem}.png)" in text
