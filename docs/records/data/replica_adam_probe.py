"""Exact-average simulation: 8 replicas of the LM benchmark, vmapped in one program.

variants:
  ddp        Adam on the mean gradient (one model)
  avg        per-replica Adam, params averaged after every step (Local SGD tau=1)
  avg_m      as avg, and Adam's first moment averaged too
  avg_m_n8   as avg_m, normalized by the mean gradient's second-moment estimate (adam_mean_of=8)
  avg_n8     as avg, with adam_mean_of=8
"""
import os, sys, json, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, "/work/main")
import importlib.util
import jax, jax.numpy as jnp, numpy as np, optax
from layup_jax import data, models, optim

variant, lr, warm, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
spec = importlib.util.spec_from_file_location("c", "/work/main/configs/stdlib_gpt2_mini.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
config = mod.get_config("ddp")
config.optimizer.learning_rate, config.optimizer.warmup_fraction = lr, warm
config.num_steps, config.seed = steps, seed
M = 8
if variant.endswith("n8"):
  config.optimizer.adam_mean_of = 8
ds = data.make_dataset(config.data, M, config.seed)
model = models.make_model(config.model)
tx = optim.make_optimizer(config.optimizer, steps, ds.steps_per_epoch)
params, state = model.init(jax.random.key(config.seed), ds.example_batch.inputs)

def loss_fn(p, x, y, key, it):
  return model.loss(p, state, x, y, key, it)[0]

grad_fn = jax.value_and_grad(loss_fn)
key = jax.random.key(1)

def is_adam(s):
  return isinstance(s, optax.ScaleByAdamState)

def average_mu(opt):
  return jax.tree.map(lambda s: s._replace(mu=jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0), a.shape), s.mu)) if is_adam(s) else s, opt, is_leaf=is_adam)

if variant == "ddp":
  opt = tx.init(params)
  @jax.jit
  def step(p, opt, xs, ys, t):
    losses, g = jax.vmap(grad_fn, in_axes=(None, 0, 0, None, None))(p, xs, ys, key, t)
    g = jax.tree.map(lambda a: a.mean(0), g)
    u, opt = tx.update(g, opt, p, step=t)
    return optax.apply_updates(p, u), opt, losses.mean()
  P = params
else:
  P = jax.tree.map(lambda a: jnp.broadcast_to(a, (M,) + a.shape), params)
  opt = jax.vmap(tx.init)(P)
  @jax.jit
  def step(P, opt, xs, ys, t):
    losses, g = jax.vmap(grad_fn, in_axes=(0, 0, 0, None, None))(P, xs, ys, key, t)
    u, opt = jax.vmap(lambda g, o, p: tx.update(g, o, p, step=t))(g, opt, P)
    P = optax.apply_updates(P, u)
    P = jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0), a.shape), P)
    if "avg_m" in variant:
      opt = average_mu(opt)
    return P, opt, losses.mean()

@jax.jit
def eval_sums(p, x, y, mask):
  logits, _ = model.apply(p, state, x, key, 0, train=False)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(lp, y[..., None], -1)[..., 0].mean(-1)
  return jnp.sum(nll * mask), jnp.sum(mask)

def test_loss(p):
  tot = n = 0.0
  for b in ds.test:
    a, c = eval_sums(p, b.inputs, b.targets, b.mask); tot += float(a); n += float(c)
  return tot / n

curve = []
t0 = time.time()
for t in range(steps):
  batches = [next(it) for it in ds.train]
  xs = np.stack([b.inputs for b in batches]); ys = np.stack([b.targets for b in batches])
  P, opt, l = step(P, opt, xs, ys, jnp.int32(t))
  if (t + 1) % 50 == 0 or t + 1 == steps:
    p0 = P if variant == "ddp" else jax.tree.map(lambda a: a[0], P)
    curve.append((t + 1, round(test_loss(p0), 4)))
ds.close()
print(json.dumps({"variant": variant, "lr": lr, "warmup": warm, "steps": steps, "seed": seed,
                  "final": curve[-1][1], "curve": curve, "s": round(time.time() - t0, 1)}), flush=True)
