"""GPT-2 medium pre-training on MiniPile, context 1024, 8 devices (paper Section 5, the paper's C2).

Batch 48 per worker (Section 5; the table's 384 is the global batch over 8 workers), AdamW,
cosine schedule, float32 as every model in the paper (`--config.model.dtype=bfloat16` trains in
bfloat16 instead). DDP, SlowMo and CO2: T_max 45,539 steps, no warm-up.

LayUp and GoSGD count their schedule in iterations summed over the workers (the fine-tuning
table: T_max 29,144 = 4 x 7,286 on 4 workers); a step here is one iteration of every device,
so their T_max 138,972 and warm-up 3,488 (from 0.00014011) are divided by the 8 workers:
17,372 steps (138,972 / 8 = 17,371.5) with 436 warm-up steps, and the run ends with the
schedule. Unlike fine-tuning's, this T_max is not the workers times DDP's (8 x 45,539 =
364,312): read literally LayUp trains 38% of DDP's samples, while the paper's times (38,624 s
against 40,658 s) and MFUs (72% against 69%) suggest runs of about the same length. The table's
value is taken as printed; `--config.num_steps=45539 --config.optimizer.warmup_steps=1143`
gives DDP's length with the same shape of schedule.
DDP's learning rate is copied as printed in the table (0.76978), which looks like a differently
scaled parametrization: check it before a long run.
Needs `huggingface:jeankaddour__minipile` prepared in the TFDS data dir. For the paper's GPT-2
BPE set data.tokenizer to a folder with GPT-2's tokenizer.json; byte-level otherwise.
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from layup_jax import defaults

WORKERS = 8  # the paper's C2
LAYUP = {"optimizer.learning_rate": 0.00075249, "num_steps": round(138_972 / WORKERS),
         "optimizer.warmup_steps": 3_488 // WORKERS, "optimizer.warmup_init_lr": 0.00014011,
         "optimizer.weight_decay": 0.0031235}
PAPER = {
    "layup": LAYUP,
    "gosgd": LAYUP,
    "ddp": {"optimizer.learning_rate": 0.76978, "optimizer.weight_decay": 0.0},
    "slowmo": {"optimizer.learning_rate": 0.9645, "optimizer.weight_decay": 0.0,
               "baselines.tau": 5, "baselines.out_freq": 20},
    "co2": {"optimizer.learning_rate": 0.9645, "optimizer.weight_decay": 0.0,
            "baselines.tau": 5, "baselines.out_freq": 20},
}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": WORKERS, "model.dtype": "float32",
      "model.name": "gpt2", "model.size": "gpt2-medium", "model.vocab_size": 50257,
      "model.max_len": 1024, "model.dropout": 0.0,
      "data.name": "minipile", "data.batch_size": 384 // WORKERS, "data.seq_len": 1024,
      "data.eval_batch_size": 48, "data.max_eval_batches": 50,
      "optimizer.name": "adamw", "optimizer.schedule": "cosine",
      "num_steps": 45_539, "eval_every": 1000,
  })
  return defaults.paper_config(config, PAPER, algorithm)
