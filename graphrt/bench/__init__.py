"""``graphrt bench``: the step, kernel, runtime, capture, model and sampling benchmarks (JSON + PNG)."""

BENCHES = ("step", "kernels", "runtime", "host", "capture", "soak", "parallel", "model", "sampling", "speculative")
