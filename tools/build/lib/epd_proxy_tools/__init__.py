"""Tooling that `epd-proxy serve` never imports: the benchmark, the local vLLM stack, the test fakes and daemons."""
