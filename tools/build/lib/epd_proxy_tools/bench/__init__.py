"""Re-runnable benchmark of the proxy against cost-modelled fake vLLM servers (`python -m epd_proxy_tools.bench`)."""
