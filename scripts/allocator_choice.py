"""The benchmarks' `--allocator` option: the host's malloc a benchmark runs under.

`use(choice)` starts the calling script again under `choice` (`layup_jax.allocator.use`, what
`python -m layup_jax.train` does with `host_allocator`) unless it already runs under it, and
returns the allocator in use, for the benchmark's JSON. An older checkout measured with this
tree's scripts (`scripts/bench_gpu.sh BEFORE`) has no `layup_jax.platform.allocator`: the script then
runs as it was started, and the allocator it reports is read from the libraries it mapped.
"""

import sys

CHOICES = ("auto", "tcmalloc", "jemalloc", "system")  # layup_jax.allocator.CHOICES, which an
# older checkout lacks (tests/test_allocator.py holds the two equal)


def use(choice: str) -> str:
  try:
    from layup_jax.platform import allocator
  except ImportError:
    with open("/proc/self/maps") as maps:
      text = maps.read()
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in text), "system")
  try:
    note = allocator.use(choice)
  except ValueError as error:  # a named allocator that is not installed: one line, as train's
    raise SystemExit(f"error: {error}") from None
  if note:
    print(note, file=sys.stderr)
  return allocator.in_use()


def add_option(parser) -> None:
  parser.add_argument("--allocator", default="auto", choices=CHOICES,
                      help="the host's malloc (config.tuning.host_allocator): the script starts again "
                           "under it (layup_jax/platform/allocator.py)")
