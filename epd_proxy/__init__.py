"""epd-proxy: the front door of encoder-disaggregated multimodal serving on vLLM."""

__version__ = "0.1.0"
