"""blockserve benchmarks: `python -m bench --quick` (a few minutes) or `python -m bench` (the full set).

Every figure is a ratio of the engine against a Hugging Face baseline measured side by side in the
same run, so the noise of a shared machine cancels out as far as it can. See docs/benchmarks.md.
"""
