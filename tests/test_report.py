"""The sweep runner's configs and the report's tables and figures, from real (tiny) runs."""

import importlib.util
import json
import pathlib
import shutil

import pytest

from layup_jax.measure import provenance
from layup_jax.run import runner

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
  diloco = sweep.run_config(module, [], "diloco", 0, 0)  # no paper column: the config's values
  assert diloco.optimizer.name == "adamw" and diloco.baselines.out_freq == 0  # follows tau
  module.PAPER = {**module.PAPER, "diloco": {"optimizer.learning_rate": 0.01}}
  searched = sweep.run_config(module, [], "diloco", 0, 0)  # the column's searched lr wins
  assert (searched.optimizer.name, searched.optimizer.learning_rate) == ("adamw", 0.01)
  with pytest.raises(SystemExit, match="the config has no key optimizer.lr"):
    sweep.run_config(module, [("optimizer.lr", 0.1)], "ddp", 0, 0)
  assert sweep.run_config(module, [], "layup", 0, 2.0, "device").straggler.mode == "device"


def test_a_sweep_keeps_device_side_stragglers_and_variants_apart():
  sweep = _script("sweep")
  root = pathlib.Path("w")
  assert sweep.run_dir(root, "layup", 1, 2.0) == root / "delay2" / "layup-seed1"
  assert sweep.run_dir(root, "layup", 1, 2.0, "device") == root / "delay2-device" / "layup-seed1"
  assert sweep.run_dir(root, "ddp", 0, 0.0, "device") == root / "delay0" / "ddp-seed0"  # shared
  assert (sweep.run_dir(root, "layup", 0, 0.0, variant="per_layer")
          == root / "delay0" / "layup@per_layer-seed0")


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
  claims = text.split("### The paper's claims here")[1].split("###")[0]
  layup, ddp = (summaries[a, 0.0]["final_eval_accuracy"] for a in ("layup", "ddp"))
  assert f"| {layup:.4f} vs {ddp:.4f} (1 and 1 seeds) |" in claims
  assert ("| holds (one seed) |" if layup > ddp else "| does not hold (one seed) |"
          if layup < ddp else "| within noise (one seed) |") in claims.split("\n")[6]

  # A device-side straggler's runs and an ablation's get their own tables and figure (here
  # copies of the runs above under those names: the report reads what the folders hold).
  shutil.copytree(workdir / "delay1", workdir / "delay1-device")
  shutil.copytree(workdir / "delay0" / "layup-seed0", workdir / "delay0" / "layup@fine-seed0")
  meta = json.loads((workdir / "sweep.json").read_text())
  meta["variants"] = {"fine": ["model.granularity=per_layer"]}
  (workdir / "sweep.json").write_text(json.dumps(meta))
  text = report.render({"tiny": report.collect(workdir)}, results, out)
  device = text.split("### Straggler on the device: device 0 runs a delay program of 1")[1]
  assert f"| DDP | {summaries['ddp', 1.0]['final_eval_accuracy']:.4g} |" in device.split("###")[0]
  ablations = text.split("### Ablations (no straggler)")[1].split("###")[0]
  assert f"| LayUp (config) | {layup:.4g} |" in ablations
  assert f"| LayUp fine (`model.granularity=per_layer`) | {layup:.4g} |" in ablations
  no_straggler = text.split("### No straggler")[1].split("###")[0]
  assert no_straggler.count("| LayUp |") == 1  # the variant is not a row of the main table
  assert (results / "figures" / "tiny_straggler_device.png").exists()

  # A note recorded in sweep.json is printed with the sweep.
  noted = report.collect(workdir)
  noted["meta"]["note"] = "other work ran beside these runs"
  text = report.render({"noted": noted}, results, tmp_path / "noted.md")
  assert "**Note**: other work ran beside these runs" in text

  # A sweep of variants only is a search: its table says so, the best is marked, no figures.
  search = report.collect(workdir)
  search["runs"] = [r for r in search["runs"] if r["variant"]]
  text = report.render({"search": search}, results, tmp_path / "search.md")
  section = text.split("## search")[1].split("\n## ")[0]
  assert "### Search (no straggler)" in section and "### Ablations" not in section
  assert "### Figures" not in section


def test_a_claim_holds_only_beyond_the_noise():
  report = _script("report")
  assert report.verdict(0.02, 0.01) == "holds"
  assert report.verdict(-0.02, 0.01) == "does not hold"
  assert report.verdict(0.005, 0.01) == "within noise"
  assert report.verdict(-0.02, 0.01, better_if_positive=False) == "holds"  # lower is better


def test_samples_to_a_target_interpolate_the_mean_final_accuracy_between_budgets():
  report = _script("report")
  points = [(60e3, 0.86), (120e3, 0.89), (180e3, 0.91)]
  assert report.samples_to(points, 0.90) == "150 k"  # halfway from 0.89 to 0.91
  assert report.samples_to(points, 0.85) == "<= 60 k"
  assert report.samples_to(points, 0.92) == "> 180 k"


def test_the_budget_table_has_a_row_per_method_and_variant_with_its_settings_and_note():
  report = _script("report")
  runs = [{"algorithm": algorithm, "variant": variant, "seed": seed, "delay": 0.0,
           "num_steps": steps, "num_devices": 8, "final_accuracy": accuracy + 0.001 * seed,
           "code_version": "abc1234"}
          for algorithm, variant, rise in (("ddp", "", 0.0), ("layup", "", 0.01),
                                           ("layup", "one_peer", -0.01))
          for steps, base in ((234, 0.86), (468, 0.89))
          for seed in (0, 1, 2) for accuracy in [base + rise]]
  meta = {"config": "configs/fashion_mnist.py", "commands": ["python scripts/sweep.py ..."],
          "variants": {"one_peer": ["num_epochs=1", "layup.fanout=1"]},
          "note": "one_peer ran at an older commit"}
  lines = report.budget_tables("budgets", {"meta": meta, "runs": runs}, 32, None)
  rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
  assert set(rows) == {"| method", "| DDP", "| LayUp", "| LayUp `one_peer` (`layup.fanout=1`)"}
  assert "0.871 ± 0.001 (3)" in rows["| LayUp"] and "> 120 k" in rows["| LayUp `one_peer` (`layup.fanout=1`)"]
  assert lines[-1] == "**Note**: one_peer ran at an older commit"


def test_a_budget_sweep_collected_in_parts_keeps_the_earlier_runs_and_replaces_a_rerun():
  report = _script("report")

  def run(algorithm, seed, loss, version):
    return {"algorithm": algorithm, "variant": "", "seed": seed, "delay": 0.0, "num_steps": 100,
            "final_loss": loss, "code_version": version}

  before = {"meta": {"commands": ["sweep a"], "code_versions": {"sweep a": "old1234"},
                     "note": "written by hand", "date": "2026-12-07"},
            "runs": [run("ddp", 0, 3.0, "old1234"), run("layup", 0, 2.9, "old1234")]}
  now = {"meta": {"commands": ["sweep b"], "code_versions": {"sweep b": "new5678"},
                  "date": "2026-12-08"},
         "runs": [run("layup", 0, 2.8, "new5678"), run("gosgd", 0, 3.1, "new5678")]}
  merged = report.merge_budgets(before, now)
  by_key = {(r["algorithm"], r["seed"]): r for r in merged["runs"]}
  assert len(merged["runs"]) == 3
  assert by_key[("ddp", 0)]["code_version"] == "old1234"  # kept: its workdir is gone
  assert by_key[("layup", 0)]["final_loss"] == 2.8  # the rerun replaces the earlier run
  assert merged["meta"]["note"] == "written by hand"
  assert merged["meta"]["date"] == "2026-12-07 and 2026-12-08"  # each run's day is on the page
  assert merged["meta"]["commands"] == ["sweep a", "sweep b"]
  assert merged["meta"]["code_versions"] == {"sweep a": "old1234", "sweep b": "new5678"}


def test_a_language_models_budget_table_gives_tokens_to_the_target_loss_and_the_claim():
  report = _script("report")
  finals = {"ddp": (2.40, 2.10, 1.95), "layup": (2.35, 2.08, 1.955)}
  runs = [{"algorithm": algorithm, "variant": "", "seed": seed, "delay": 0.0,
           "num_steps": steps, "num_devices": 8, "final_accuracy": 0.5,
           "final_loss": loss + 0.001 * seed, "tokens_per_sample": 128, "target_loss": 2.2,
           "curve": [[0, 5.5, 0.1], [steps, loss + 0.001 * seed, 0.5]], "code_version": "abc1234"}
          for algorithm, losses in finals.items()
          for steps, loss in zip((100, 200, 300), losses) for seed in (0, 1, 2)]
  meta = {"config": "configs/stdlib_gpt2_mini.py", "commands": ["python scripts/sweep.py ..."]}
  lines = report.budget_tables("lm", {"meta": meta, "runs": runs}, 16, None)
  rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
  assert "100 steps (1.64 M tokens)" in rows["| method"] and "tokens to 2.2" in rows["| method"]
  # DDP crosses 2.2 two thirds of the way from 2.401 to 2.101: 1.64 M + 0.67 x 1.64 M = 2.74 M
  assert rows["| DDP"].endswith("| 2.74 M |") and rows["| LayUp"].endswith("| 2.55 M |")
  claims = {line.split(" | ")[0]: line for line in lines if line.startswith("| ") and
            ("steps:" in line or "tokens to" in line.split(" | ")[0])}
  assert claims["| 300 steps: LayUp's mean final test loss <= DDP's + 0.01"].endswith(
      "| holds |")  # 1.956 against 1.951: within the margin
  assert claims["| LayUp's tokens to test loss 2.2 <= DDP's"].endswith("| holds |")
  finals["layup"] = (2.35, 2.08, 1.97)
  for run in runs:
    if run["algorithm"] == "layup" and run["num_steps"] == 300:
      run["final_loss"] = 1.97 + 0.001 * run["seed"]
  lines = report.budget_tables("lm", {"meta": meta, "runs": runs}, 16, None)
  assert any(line.startswith("| 300 steps: LayUp's mean") and line.endswith("| does not hold |")
             for line in lines)


def test_the_straggler_claim_compares_the_times_to_target_under_each_delay():
  # The paper's Figure 3 as a claim per (mode, delay): LayUp's time to the target against DDP's
  # under the same straggler; a method that never reaches it within its run loses.
  report = _script("report")

  def run(algorithm, delay, tta, seed=0, mode="host"):
    return {"algorithm": algorithm, "variant": "", "seed": seed, "delay": delay, "mode": mode,
            "summary": {"final_eval_accuracy": 0.9, "time_to_target_s": tta,
                        "device_samples_per_s": [100.0] * 4}, "records": []}

  runs = [run("layup", 0.0, 100.0), run("ddp", 0.0, 90.0),
          run("layup", 2.0, 110.0), run("layup", 2.0, 112.0, seed=1),
          run("ddp", 2.0, 260.0), run("ddp", 2.0, 250.0, seed=1),
          run("layup", 4.0, 120.0, mode="device"), run("ddp", 4.0, None, mode="device")]
  rows = "\n".join(report.claims_table(runs, "accuracy", True))
  assert ("| Under a delay-2 straggler (host-side) LayUp reaches the target sooner than DDP | "
          "LayUp 111 s vs DDP 255 s (seeds reaching it: 2/2, 2/2, in runs of the same steps) | "
          "holds |") in rows
  assert ("| Under a delay-4 straggler (device-side) LayUp reaches the target sooner than DDP | "
          "LayUp 120 s vs DDP not reached (seeds reaching it: 1/1, 0/1, in runs of the same "
          "steps) | holds |") in rows
  runs[-2]["summary"]["time_to_target_s"], runs[-1]["summary"]["time_to_target_s"] = None, 80.0
  assert "DDP 80 s (seeds reaching it: 0/1, 1/1, in runs of the same steps) | does not hold |" in (
      "\n".join(report.claims_table(runs, "accuracy", True)))
  # Runs that end at the target have no final accuracy to compare, and the claim says so.
  for r in runs:
    r["summary"]["stopped_at_target"] = r["summary"]["time_to_target_s"] is not None
  rows = "\n".join(report.claims_table(runs, "accuracy", True))
  assert "final test accuracy" not in rows
  assert ("DDP 80 s (seeds reaching it: 0/1, 1/1, runs ending at the target or at the "
          "schedule's end) | does not hold |") in rows


def test_the_several_hosts_section_renders_the_cluster_runs_and_decides_its_claim(tmp_path):
  """Across hosts, LayUp's claim holds at <= 0.6x DDP's mean time to target, no later than
  DiLoCo's, with its mean final accuracy >= DDP's - 0.003, and not when one misses (or a seed
  never reaches the target)."""
  report = _script("report")

  def row(case, seconds, accuracy, tta=None, seed=0, rate="20mbit"):
    return {"case": case, "layout": "2x4", "rate": rate, "seed": seed, "training_s": seconds,
            "samples_per_s": 1000.0, "final_accuracy": accuracy, "time_to_target_s": tta,
            "counted_bytes_per_iteration": 12_500.0, "link_bytes_per_iteration": 25_000.0}

  stamp = {"measured": "2026-11-26, this machine", "code": "abc1234"}
  digits = {**stamp, "args": {"algorithms": ["ddp", "layup"], "layouts": ["2x4"],
                              "rates": ["unshaped", "20mbit"], "repeats": 1, "num_steps": 150,
                              "eval_every": 50},
            "table": [row("ddp", 39.1, 0.9805, rate="unshaped"), row("ddp", 64.6, 0.9805),
                      row("layup", 5.9, 0.9861, rate="unshaped"), row("layup", 6.3, 0.9833)]}
  fashion = {**stamp, "args": {"config": "configs/fashion_mnist.py", "num_steps": 0,
                               "eval_every": 0, "algorithms": ["ddp", "layup"],
                               "layouts": ["2x4"], "rates": ["20mbit"], "seeds": [0, 1],
                               "set": ["metrics.target_accuracy=0.88"]},
             "runs": [row("ddp", 600, 0.912, 500.0), row("ddp", 610, 0.914, 520.0, seed=1),
                      row("layup", 200, 0.910, 280.0), row("layup", 210, 0.911, 300.0, seed=1)]}
  (tmp_path / "hosts_digits.json").write_text(json.dumps(digits))
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert "## Several hosts" in text
  assert "| DDP | 39.1 / 0.9805 | 64.6 / 0.9805 | 12.5 | 25.0 |" in text
  assert "| LayUp | 5.9 / 0.9861 | 6.3 / 0.9833 | 12.5 | 25.0 |" in text
  assert "| LayUp | 2x4 | 20mbit | 290 ± 14 | 2/2 | 0.9105 ± 0.00071 |" in text
  assert "| 0.569 | - | 0.9105 vs 0.9130 | holds |" in text  # 290 / 510; 0.0025 below DDP
  fashion["runs"][2]["final_accuracy"] = 0.906  # 0.0045 below DDP's mean
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  assert "| 0.569 | - | 0.9085 vs 0.9130 | does not hold |" in "\n".join(
      report.several_hosts_tables(tmp_path))
  fashion["runs"][2]["final_accuracy"] = 0.910
  fashion["runs"][2]["time_to_target_s"] = 330.0  # 315 / 510 = 0.618: later than 0.6x
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  assert "| 0.618 | - | 0.9105 vs 0.9130 | does not hold |" in "\n".join(
      report.several_hosts_tables(tmp_path))
  # DiLoCo on the same layout and link reaching the target sooner than LayUp fails the claim.
  fashion["runs"][2]["time_to_target_s"] = 280.0
  fashion["runs"] += [row("diloco", 150, 0.899, 250.0), row("diloco", 150, 0.901, 270.0, seed=1)]
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  assert "| 0.569 | 260.0 s | 0.9105 vs 0.9130 | does not hold |" in "\n".join(
      report.several_hosts_tables(tmp_path))
  fashion["runs"] = fashion["runs"][:4]
  fashion["runs"][2].update(final_accuracy=0.910, time_to_target_s=None)
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  assert "does not hold (a seed did not reach the target)" in "\n".join(
      report.several_hosts_tables(tmp_path))
  assert report.several_hosts_tables(tmp_path / "nothing") == []
  # A variant run beside the plain algorithm (`--variant "int8 ..."`) has its own table row and
  # claim row, named after it, and the command shows it.
  fashion["args"]["variant"] = ["int8 distributed.compression=int8"]
  fashion["runs"] += [row("layup:int8", 200, 0.901, 300.0), row("layup:int8", 210, 0.903, 340.0,
                                                                  seed=1)]
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert '--variant "int8 distributed.compression=int8"' in text
  assert "| LayUp (int8) | 2x4 | 20mbit | 320 ± 28 | 2/2 | 0.902 ± 0.0014 |" in text
  assert ("| across hosts (2x4, 20mbit links) LayUp (int8) reaches the target first (time <= "
          "0.6x DDP's and <= DiLoCo's, accuracy >= DDP's - 0.003) | 0.627 | - | 0.9020 vs 0.9130 | "
          "does not hold |") in text
  fashion["args"].pop("variant")
  fashion["runs"] = fashion["runs"][:4]
  # A method none of whose runs finished keeps its row, saying why.
  fashion["runs"].append({**row("layup_paper", None, None), "failed": "status 2: error: no"})
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert ("| LayUp (paper's Algorithm 1) | 2x4 | 20mbit | failed: status 2: error: no | 0/1 | - | "
          "- | - |") in text
  assert "1 run(s) failed" in text
  fashion["runs"] = fashion["runs"][:4]
  # A note on the code or settings a table ran at (e.g. defaults changed since) is printed.
  digits["code_version_note"] = "gossip at the defaults of then: remote peers 1 in 20"
  (tmp_path / "hosts_digits.json").write_text(json.dumps(digits))
  assert "code abc1234 (gossip at the defaults of then: remote peers 1 in 20). Each cell" in (
      "\n".join(report.several_hosts_tables(tmp_path)))
  # A bench stopped with Ctrl-C: a run not made is "-", a failed one says so, and the text says
  # how many runs were made; one still being written (no table yet) is left out.
  digits.update(stopped=True, runs=[{}] * 3,
                table=[{**row("ddp", None, None, rate="unshaped"), "failed": ["status 1"]},
                       row("ddp", 64.6, 0.9805), row("layup", 5.9, 0.9861, rate="unshaped")])
  (tmp_path / "hosts_digits.json").write_text(json.dumps(digits))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert "| DDP | failed | 64.6 / 0.9805 |" in text
  assert "| LayUp | 5.9 / 0.9861 | - |" in text
  assert "Stopped (Ctrl-C) after 3 runs" in text
  digits["table"] = None
  (tmp_path / "hosts_digits.json").write_text(json.dumps(digits))
  assert "Every algorithm across hosts" not in "\n".join(report.several_hosts_tables(tmp_path))
  # The time-to-target bench stopped after seed 0, with one run failed: the text names the
  # seeds run and not run, the failed run is left out, and the table has seed 0's runs only.
  fashion.update(stopped=True, runs=[row("ddp", 600, 0.912, 500.0),
                                     row("layup", 200, 0.910, 300.0),
                                     {"case": "ddp", "layout": "2x4", "rate": "20mbit",
                                      "seed": 1, "failed": "status 1: error"}])
  fashion["args"]["seeds"] = [0, 1, 2]
  (tmp_path / "hosts_fashion_mnist.json").write_text(json.dumps(fashion))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert "--seeds 0 1 2" in text and "seeds 0; time to test accuracy" in text
  assert "Stopped (Ctrl-C) after 3 runs; no finished run for seed(s) 1, 2." in text
  assert "1 run(s) failed and are left out." in text
  assert "| DDP | 2x4 | 20mbit | 500 | 1/1 | 0.912 |" in text


def test_the_language_models_hosts_claim_compares_times_to_the_target_loss(tmp_path):
  """Across hosts the language model's claim is LayUp's time to the target loss <= 0.6x DDP's;
  DiLoCo's time is beside it and the first of the three is named, whichever it is."""
  report = _script("report")

  def row(case, tta, loss, seed):
    return {"case": case, "layout": "2x4", "rate": "20mbit", "seed": seed, "training_s": 300.0,
            "samples_per_s": 500.0, "final_accuracy": 0.5, "final_loss": loss,
            "time_to_target_s": tta, "counted_bytes_per_iteration": 9_000.0}

  bench = {"measured": "2026-12-07, this machine", "code": "abc1234",
           "args": {"config": "configs/stdlib_gpt2_mini.py", "num_steps": 0, "eval_every": 0,
                    "algorithms": ["layup", "ddp", "diloco"], "layouts": ["2x4"],
                    "rates": ["20mbit"], "seeds": [0, 1], "set": ["metrics.target_loss=2.3"]},
           "runs": [row("layup", 100.0, 2.10, 0), row("layup", 120.0, 2.12, 1),
                    row("ddp", 200.0, 2.08, 0), row("ddp", 200.0, 2.09, 1),
                    row("diloco", 90.0, 2.20, 0), row("diloco", 100.0, 2.21, 1)]}
  (tmp_path / "hosts_stdlib_gpt2_mini.json").write_text(json.dumps(bench))
  text = "\n".join(report.several_hosts_tables(tmp_path))
  assert "### Time to target across hosts (language model)" in text
  assert "time to test loss 2.3" in text and "| final loss |" in text
  assert "| LayUp | 2x4 | 20mbit | 110 ± 14 | 2/2 | 2.11 ± 0.014 |" in text
  assert "loss <= 0.6x DDP's | 0.550 | 95.0 s | DiLoCo | holds |" in text
  bench["runs"][1]["time_to_target_s"] = 160.0  # mean 130 of 200: 0.65
  (tmp_path / "hosts_stdlib_gpt2_mini.json").write_text(json.dumps(bench))
  assert "| 0.650 | 95.0 s | DiLoCo | does not hold |" in "\n".join(
      report.several_hosts_tables(tmp_path))


def test_a_cluster_run_row_says_what_the_run_trained_and_sent(tmp_path):
  """bench_cluster's row of one run: from the drill's summary.json and link counters, device
  0's own accuracy and the consensus distance beside the average's accuracy (to tell an
  average short of DDP's from every replica short of it), bytes per device-iteration, the test
  curve; a drill that fails is a row saying so, with its last line."""
  import argparse
  import subprocess

  bench = _script("bench_cluster")
  commands = []

  def drill(command, status=0):
    commands.append(command)
    (tmp_path / "summary.json").write_text(json.dumps({
        "num_steps": 10, "num_devices": 8, "wall_time_s": 4.0, "train_samples_per_s": 640.0,
        "final_eval_accuracy": 0.9, "final_eval_loss": 0.3, "final_device0_accuracy": 0.85,
        "consensus_distance": 2e-3,
        "time_to_target_s": None, "bytes_between_processes_per_device_iteration": 1000.0,
        "remote_send_latency_ms": {"median": 20.0, "p90": 50.0}}))
    (tmp_path / "links.json").write_text(json.dumps(
        {"links": [{"tx_bytes": 4000}, {"tx_bytes": 4000}]}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "time_s": 0.0, "split": "test", "accuracy": 0.1, "loss": 2.3},
        {"step": 10, "time_s": 4.0, "split": "train", "loss": 0.5, "samples_per_s": 640.0},
        {"step": 10, "time_s": 4.0, "split": "test", "accuracy": 0.9, "loss": 0.3,
         "running_statistics_accuracy": 0.8, "consensus_distance": 1e-4}]) + "\n")
    return subprocess.CompletedProcess(command, status, "", "" if not status else "x\nboom")

  bench.run_drill = drill
  args = argparse.Namespace(config="configs/digits.py", num_steps=10, eval_every=0,
                            set=["distributed.compression=int8"], cache=str(tmp_path / "cc"),
                            cpus_per_host=1, link=["1=5mbit"], slow_host=1, slow_mode="device")
  row = bench.run("2x4", "20mbit", "layup", ["distributed.remote_peer_probability=0.5"], 3,
                  args, str(tmp_path))
  command = commands[-1]
  assert command[command.index("--rate") + 1] == "20mbit"
  assert command[command.index("--cpus-per-host") + 1] == "1"  # before the train arguments
  assert command.index("--cpus-per-host") < command.index("--")
  assert "configs/digits.py:layup" in command and "--config.seed=3" in command
  assert command[-2:] == ["--config.distributed.compression=int8",
                          "--config.distributed.remote_peer_probability=0.5"]
  assert (row["final_accuracy"], row["device0_accuracy"], row["consensus_distance"]) == (
      0.9, 0.85, 2e-3)
  assert row["link_bytes_per_iteration"] == 100.0  # 8,000 bytes over 10 steps x 8 devices
  assert (row["send_latency_ms"], row["counted_bytes_per_iteration"]) == (20.0, 1000.0)
  # The test curve survives the run's temporary directory: where a target was crossed, under
  # either statistics.
  assert row["test_curve"] == [
      {"step": 0, "time_s": 0.0, "loss": 2.3, "accuracy": 0.1},
      {"step": 10, "time_s": 4.0, "loss": 0.3, "accuracy": 0.9,
       "running_statistics_accuracy": 0.8, "consensus_distance": 1e-4}]
  assert row["final_loss"] == 0.3
  # An uneven host and an uneven link: host 1's devices at 2x their iteration time (device
  # side), host 1's link at 5 Mbit/s, the others' at --rate.
  row = bench.run("2x4", "20mbit", "layup", [], 3, args, str(tmp_path), factor=2.0)
  command = commands[-1]
  assert command[command.index("--host-rate") + 1] == "1=5mbit"
  assert command.index("--host-rate") < command.index("--")
  assert command[-3:] == ["--config.straggler.process=1", "--config.straggler.delay_iters=1",
                          "--config.straggler.mode=device"]
  assert row["slow_factor"] == 2.0
  bench.run_drill = lambda command: drill(command, status=1)
  args.cpus_per_host = 0  # every process on every CPU: the drill's default
  row = bench.run("2x4", "unshaped", "ddp", [], 0, args, str(tmp_path))
  assert "--rate" not in commands[-1] and "--cpus-per-host" not in commands[-1]
  assert row["failed"] == "status 1: boom"
  # A process that said what went wrong is named, not the drill's last line (its link counters).
  bench.run_drill = lambda command: subprocess.CompletedProcess(
      command, 2, "[p1] error: data not found\nhost 1 sent 3 kB, received 4 kB over its link\n",
      "error: cluster_drill.sh: process 1 (host 1) ended with status 2\n")
  row = bench.run("2x4", "unshaped", "ddp", [], 0, args, str(tmp_path))
  assert row["failed"] == "status 2: [p1] error: data not found"
  # A drill that stopped before any process said why: its own line.
  bench.run_drill = lambda command: subprocess.CompletedProcess(
      command, 2, "", "error: cluster_drill.sh: line 140: \"ip link add\" failed with status 2\n")
  row = bench.run("2x4", "unshaped", "ddp", [], 0, args, str(tmp_path))
  assert row["failed"] == ('status 2: error: cluster_drill.sh: line 140: "ip link add" failed '
                           'with status 2')


def test_the_churn_section_gives_each_drills_latencies_samples_kept_and_accuracy(tmp_path):
  report = _script("report")
  drill = {"measured": "2026-12-08, x86_64", "code": "abc1234",
           "args": {"config": "configs/digits.py", "algorithm": "layup", "processes": 3,
                    "devices_per_process": 2, "num_steps": 10000, "mtbf_s": 4.5,
                    "set": ["eval_every=60"]},
           "summary": {"kills": 52, "kill_to_declared_s": {"p50": 5.0, "p95": 5.6, "n": 52},
                       "restart_to_contributing_s": {"p50": 9.1, "p95": 12.0, "n": 51},
                       "samples_per_s_kept": 0.97, "final_accuracy": 0.99164,
                       "uninterrupted_accuracy": 0.99443,
                       "weight_sums": [1 - 3e-16, 1 + 4e-16], "final_devices_in_average": 6}}
  (tmp_path / "churn_layup_mtbf4.5.json").write_text(json.dumps(drill))
  lines = report.churn_tables(tmp_path)
  row = next(line for line in lines if line.startswith("| layup_mtbf4.5 "))
  cells = [cell.strip() for cell in row.strip("|").split("|")]
  assert cells[2] == "configs/digits.py, 10000 steps, 3 processes x 2 devices, eval_every=60"
  assert cells[4:] == ["4.5", "52", "5.0 / 5.6", "9.1 / 12.0", "0.97", "0.9916 (0.9944)",
                       "4e-16", "6 of 6"]
  assert report.churn_tables(tmp_path / "none") == []  # no drill: no section
