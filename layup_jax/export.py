"""The trained model out of a run: the consensus model in the model's own parameter tree.

  python -m layup_jax.export --workdir W --out DIR [--step N] [--huggingface]

Reads W's newest readable checkpoint (or step N), rebuilds the run's model and runtime from the
config the checkpoint holds, and writes the model the run's evaluations evaluate: the push-sum
consensus of the replicas (every replica's own under DDP), with its BatchNorm statistics
recomputed where `precise_bn_batches` asks. DIR then holds

  model.safetensors   stage k's params under `params/k/<path>`, its state under `state/k/<path>`
  config.json         the run's config; `load_model` rebuilds the model from its `model` keys

and, with `--huggingface` (GPT-2 only), DIR/huggingface/ in Hugging Face's GPT-2 layout
(`model.safetensors` and `config.json`), which `model.pretrained` reads back.
`load_model(DIR)` gives the model for inference. The checkpoint's folder is only read.

Only the standard library is imported at first, so that the command can give JAX the run's
device count before JAX starts.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any

from layup_jax.errors import UserError

PyTree = Any
HUGGINGFACE = "huggingface"


class ExportError(UserError):
  """An export that cannot be made: said in one line."""


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  """The steps of W's checkpoints whose metadata was written, oldest first."""
  folder = workdir / "checkpoints"
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir()
                if p.name.isdigit() and (p / "meta" / "metadata").is_file())


def saved_config(workdir: str | pathlib.Path, step: int | None = None) -> tuple[int, dict]:
  """`(step, config as a dict)` of W's newest checkpoint (or of `step`), read without JAX."""
  workdir = pathlib.Path(workdir)
  steps = checkpoint_steps(workdir)
  if not steps:
    raise ExportError(f"{workdir} holds no checkpoint (looked for {workdir}/checkpoints/<step>: "
                      f"a run with checkpoint.enabled writes them)")
  if step is not None and step not in steps:
    raise ExportError(f"{workdir} has no checkpoint at step {step} (it has {steps})")
  chosen = steps[-1] if step is None else step
  meta = json.loads((workdir / "checkpoints" / str(chosen) / "meta" / "metadata").read_text())
  return chosen, json.loads(meta["config"])


@contextlib.contextmanager
def restored_run(workdir: str | pathlib.Path, step: int | None = None):
  """The run of W rebuilt from its newest readable checkpoint (or `step`) in this process:
  yields `(config, model, runtime, dataset, step)`, the runtime holding every replica and its
  push-sum weights as saved; closed after. Needs the run's device count (fake CPU devices will
  do: `XLA_FLAGS=--xla_force_host_platform_device_count=N`), its data (for shapes and BatchNorm
  statistics) and any model or data the run registered."""
  import jax
  import ml_collections

  from layup_jax import algorithms, data, models, optim
  from layup_jax.checkpoint.manager import Checkpoints
  from layup_jax.run.validation import resolve_num_steps

  workdir = pathlib.Path(workdir)
  _, saved = saved_config(workdir, step)
  config = ml_collections.ConfigDict(saved)
  config.distributed.num_processes, config.distributed.coordinator_address = 1, ""
  if len(jax.devices()) < config.num_devices:
    raise ExportError(f"the run had {config.num_devices} devices and JAX sees "
                      f"{len(jax.devices())}; on CPU set XLA_FLAGS="
                      f"--xla_force_host_platform_device_count={config.num_devices}")
  devices = jax.devices()[:config.num_devices]
  dataset = data.make_dataset(config.data, config.num_devices, config.seed)
  runtime = checkpoints = None
  try:
    model = models.make_model(config.model)
    num_steps = resolve_num_steps(config, dataset.steps_per_epoch)
    tx = optim.make_optimizer(config.optimizer, num_steps, dataset.steps_per_epoch)
    runtime = algorithms.build_runtime(config, model, tx, devices, dataset)
    checkpoints = Checkpoints(workdir / "checkpoints", config.checkpoint.keep, async_save=False,
                              read_only=True)
    restored = checkpoints.restore(
        lambda meta: runtime.checkpoint.restore_template(meta["runtime"]), step,
        quarantine=False)
    if restored is None:
      raise ExportError(f"no readable checkpoint in {workdir}/checkpoints")
    chosen, arrays, meta = restored
    runtime.checkpoint.load_state_dict(arrays, meta["runtime"])
    yield config, model, runtime, dataset, chosen
  finally:
    if runtime is not None:
      runtime.close()
    if checkpoints is not None:
      checkpoints.close()
    dataset.close()


def consensus_model(workdir: str | pathlib.Path, step: int | None = None):
  """`(config, model, params, state, step)`: the consensus model of W's newest readable
  checkpoint (or `step`), per stage, as the run's evaluation forms it (`restored_run`)."""
  import jax

  from layup_jax.run.evaluation import Evaluator

  with restored_run(workdir, step) as (config, model, runtime, dataset, chosen):
    statistics = dataset.statistics_inputs(config.precise_bn_batches,
                                           config.data.eval_batch_size, config.seed)
    evaluator = Evaluator(model, dataset.test, jax.devices()[0], statistics)
    params, state = jax.device_get(evaluator.consensus_model(runtime.stats.snapshot()))
  return config, model, list(params), list(state), chosen


def _flat(params: list, state: list) -> dict[str, Any]:
  from flax import traverse_util

  tree = {"params": {str(k): p for k, p in enumerate(params)},
          "state": {str(k): s for k, s in enumerate(state)}}
  return traverse_util.flatten_dict(tree, sep="/")


def save_model(directory: str | pathlib.Path, config_dict: dict, params: list,
               state: list) -> None:
  """Writes per-stage `params` and `state` and the run's config to `directory`."""
  import numpy as np
  from safetensors.numpy import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensors = {name: np.ascontiguousarray(np.asarray(value))
             for name, value in _flat(params, state).items()}
  save_file(tensors, str(directory / "model.safetensors"),
            metadata={"num_stages": str(len(params)), "format": "layup_jax/1"})
  (directory / "config.json").write_text(json.dumps(config_dict, indent=1, sort_keys=True))


@dataclasses.dataclass(frozen=True)
class ExportedModel:
  """A model read by `load_model`: `model(inputs)` gives its outputs (logits), evaluation mode,
  by one jitted program made once per model (compiled once per input shape)."""

  config: Any  # the run's ml_collections.ConfigDict
  model: Any  # the StagedModel
  params: list
  state: list

  def __post_init__(self):
    import jax

    model = self.model

    def apply(params, state, inputs):
      outputs, _ = model.apply(params, state, inputs, jax.random.key(0), 0, train=False)
      return outputs

    object.__setattr__(self, "_apply", jax.jit(apply))

  def __call__(self, inputs):
    return self._apply(self.params, self.state, inputs)


def load_model(directory: str | pathlib.Path) -> ExportedModel:
  """The model `export_model` (or the command) wrote to `directory`, for inference. A model or
  dataset registered by the training script must be registered here too."""
  import ml_collections
  from flax import traverse_util
  from safetensors import safe_open
  from safetensors.numpy import load_file

  from layup_jax import models

  directory = pathlib.Path(directory)
  file = directory / "model.safetensors"
  if not file.is_file():
    raise ExportError(f"no exported model at {file} (python -m layup_jax.export writes one)")
  with safe_open(str(file), "np") as opened:
    num_stages = int(opened.metadata()["num_stages"])
  tree = traverse_util.unflatten_dict(load_file(str(file)), sep="/")
  config = ml_collections.ConfigDict(json.loads((directory / "config.json").read_text()))
  params = [tree.get("params", {}).get(str(k), {}) for k in range(num_stages)]
  state = [tree.get("state", {}).get(str(k), {}) for k in range(num_stages)]
  return ExportedModel(config, models.make_model(config.model), params, state)


def export_model(workdir: str | pathlib.Path, out: str | pathlib.Path, step: int | None = None,
                 huggingface: bool = False) -> int:
  """Writes W's consensus model to `out` (and, for GPT-2, Hugging Face's layout to
  `out/huggingface`); returns the checkpoint's step."""
  from layup_jax.models import gpt2_import

  _, saved = saved_config(workdir, step)
  if huggingface and saved["model"]["name"] != "gpt2":
    raise ExportError(f"--huggingface writes GPT-2 only; this run's model is "
                      f"{saved['model']['name']!r}")
  config, model, params, state, chosen = consensus_model(workdir, step)
  save_model(out, saved, params, state)
  if huggingface:
    gpt2_import.save_gpt2_params(model, params, config.model,
                                 pathlib.Path(out) / HUGGINGFACE)
  return chosen


def _parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m layup_jax.export",
      description="Writes a run's consensus model (its newest checkpoint's) to a folder: "
                  "model.safetensors and config.json; layup_jax.export.load_model reads it.")
  parser.add_argument("--workdir", required=True, help="the run's folder (its checkpoints/)")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--step", type=int, default=None, help="a checkpoint's step (newest)")
  parser.add_argument("--huggingface", action="store_true",
                      help="GPT-2: also write out/huggingface in Hugging Face's layout")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  from absl import logging  # Orbax's notes on opening a folder read-only are not the user's

  logging.set_verbosity(logging.ERROR)
  try:
    _, saved = saved_config(args.workdir, args.step)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform"
                                 f"_device_count={saved['num_devices']}").strip()
    step = export_model(args.workdir, args.out, args.step, args.huggingface)
  except (UserError, OSError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(f"exported the consensus model of {args.workdir} at step {step} to {args.out}"
        + (f" (and {args.out}/{HUGGINGFACE} in Hugging Face's GPT-2 layout)"
           if args.huggingface else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
