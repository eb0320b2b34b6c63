"""Every bench entry point at toy size, bench.gpu_check's CPU-side parts, and the soak's CLI and
verdict."""
