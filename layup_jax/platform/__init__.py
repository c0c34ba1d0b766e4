"""What the project needs from the machine and from jax beyond jax's public API.

Owns: jax internals in one module (`compat`, with a checked public fallback wherever one
exists), the persistent compilation cache (`compile_cache`) and the host's memory allocator
(`allocator`, which may start the command again under TCMalloc). Imports nothing of the project
but `layup_jax.errors`; every other package may import it.
"""
