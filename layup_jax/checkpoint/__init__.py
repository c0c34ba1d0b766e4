"""Checkpoints of a whole run with Orbax, in `WORKDIR/checkpoints/<step>`.

Owns: the arrays' packed layout and the rows each device (and each process) writes
(`layout`), whether checkpoints fit and whether a saved one can resume this config (`checks`),
and the Orbax manager with its background saves, fallbacks and given-up saves (`manager`).
What a runtime saves is its own (`runtime/state.py`); this package only writes and reads it.
Imports `multiprocess`, `platform` and `errors`.
"""
