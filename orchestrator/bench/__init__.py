"""Benchmarking: a lean streaming HTTP client, the load generator, metrics and the agg-vs-disagg report.

- sse_client: HTTP/1.1 keep-alive streaming client on trio (TCP_NODELAY), SSE parsing
- metrics: TTFT / TPOT / ITL / goodput arithmetic over request timelines (pure)
- loadgen: concurrency and Poisson sweeps against any OpenAI-compatible endpoint
- compare: launch topologies, run the same workload, write results.json, markdown and plots
- cli: `orchestrator bench run` and `orchestrator bench compare`
"""
