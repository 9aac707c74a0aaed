"""``graphrt bench``: the step, kernel, runtime and capture benchmarks (JSON + PNG)."""

BENCHES = ("step", "kernels", "runtime", "host", "capture", "soak", "parallel", "model")
