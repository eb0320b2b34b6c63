"""The parts of `python -m bench`, one module each: `bench_<part>(path, plan, ...)` returns the part's JSON.

The moe part is `bench.moe.bench_moe`: it is also its own entry point (`python -m bench.moe`).
"""
