"""GPT-2 medium pre-training on MiniPile, context 1024, 8 devices (paper Section 5).

Batch 48 per worker (Section 5; the table's 384 is the global batch), AdamW, cosine schedule.
The paper's LayUp column counts iterations summed over workers (T_max 138,972, warm-up 3,488,
from 0.00014011); steps here are per-device iterations, so both are scaled to DDP's T_max of
45,539 steps. DDP's learning rate is copied as printed in the table (0.76978), which looks like
a differently scaled parametrization: check it before a long run.
Needs `huggingface:jeankaddour__minipile` prepared in the TFDS data dir. For the paper's GPT-2
BPE set data.tokenizer to a folder with GPT-2's tokenizer.json; byte-level otherwise.
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from configs import base

PAPER = {
    "layup": {"optimizer.learning_rate": 0.00075249, "optimizer.warmup_steps": 1143,
              "optimizer.warmup_init_lr": 0.00014011, "optimizer.weight_decay": 0.0031235},
    "ddp": {"optimizer.learning_rate": 0.76978, "optimizer.weight_decay": 0.0},
    "gosgd": {"optimizer.learning_rate": 0.00075249, "optimizer.warmup_steps": 1143,
              "optimizer.warmup_init_lr": 0.00014011, "optimizer.weight_decay": 0.0031235},
    "slowmo": {"optimizer.learning_rate": 0.9645, "optimizer.weight_decay": 0.0,
               "baselines.tau": 5, "baselines.out_freq": 20},
    "co2": {"optimizer.learning_rate": 0.9645, "optimizer.weight_decay": 0.0,
            "baselines.tau": 5, "baselines.out_freq": 20},
}


def get_config(algorithm=None):
  config = base.get_config()
  base.set_values(config, {
      "model.name": "gpt2", "model.size": "gpt2-medium", "model.vocab_size": 50257,
      "model.max_len": 1024, "model.dtype": "bfloat16", "model.dropout": 0.0,
      "data.name": "minipile", "data.batch_size": 48, "data.seq_len": 1024,
      "data.eval_batch_size": 48, "data.max_eval_batches": 50,
      "optimizer.name": "adamw", "optimizer.schedule": "cosine",
      "num_steps": 45539, "eval_every": 1000,
  })
  return base.paper_config(config, PAPER, algorithm)
