"""The one backend-call layer under every stage: pooled HTTP/1.1 connections, timeouts, SSE framing."""
