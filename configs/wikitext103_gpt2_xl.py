"""GPT-2 XL fine-tuning on Wikitext-103 from imported GPT-2 weights, context 1024, 4 devices
(paper Section 5, the paper's C3).

Batch 4 per worker (Section 5; the table's 16 is the global batch over 4 workers), AdamW, no
weight decay, cosine schedule, float32 as every model in the paper (`--config.model.dtype=
bfloat16` trains in bfloat16 instead). DDP, SlowMo and CO2: T_max 7,286 steps, no warm-up (the
table's warm-up lr 0.005 for them is kept and does nothing). LayUp and GoSGD count their
schedule in iterations summed over the 4 workers (T_max 29,144, warm-up 7,000 from 0.0002); a
step here is one iteration of every device, so both are divided by 4: 7,286 steps, 1,750 of
warm-up. DDP's learning rate is copied as printed in the table (0.31645): check it before a
long run.
Needs `huggingface:wikitext/wikitext-103-raw-v1` prepared in the TFDS data dir, GPT-2 XL's
`model.safetensors` in a local folder (--config.model.pretrained=DIR) and GPT-2's tokenizer.json
(--config.data.tokenizer=DIR; the same folder works).
`:ddp`, `:gosgd`, `:slowmo`, `:co2` take the other columns.
"""

from layup_jax import defaults

WORKERS = 4  # the paper's C3
LAYUP = {"optimizer.learning_rate": 0.0003, "num_steps": round(29_144 / WORKERS),
         "optimizer.warmup_steps": 7_000 // WORKERS, "optimizer.warmup_init_lr": 0.0002}
PAPER = {
    "layup": LAYUP,
    "gosgd": LAYUP,
    "ddp": {"optimizer.learning_rate": 0.31645, "optimizer.warmup_init_lr": 0.005},
    "slowmo": {"optimizer.learning_rate": 0.32855, "optimizer.warmup_init_lr": 0.005,
               "baselines.tau": 12, "baselines.out_freq": 48},
    "co2": {"optimizer.learning_rate": 0.38939, "optimizer.warmup_init_lr": 0.005,
            "baselines.tau": 12, "baselines.out_freq": 48},
}


def get_config(algorithm=None):
  config = defaults.get_config()
  defaults.set_values(config, {
      "num_devices": WORKERS, "model.dtype": "float32",
      "model.name": "gpt2", "model.size": "gpt2-xl", "model.vocab_size": 50257,
      "model.max_len": 1024, "model.dropout": 0.0,
      "data.name": "wikitext103", "data.batch_size": 16 // WORKERS, "data.seq_len": 1024,
      "data.eval_batch_size": 8, "data.max_eval_batches": 0,
      "optimizer.name": "adamw", "optimizer.weight_decay": 0.0, "optimizer.schedule": "cosine",
      "num_steps": 7_286, "eval_every": 500,
  })
  return defaults.paper_config(config, PAPER, algorithm)
