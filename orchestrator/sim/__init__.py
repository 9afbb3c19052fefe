"""The simulated TRT-LLM worker: an OpenEngine v1 server with roles, a GPU cost model, KV sessions,
media and fault injection. It runs on asyncio (uvloop) in its own process, like the C++ engine it
stands in for; the orchestrator talks to it through the same client it uses for real workers.

- profiles: GPU cost fits (DistServe's OPT-13B/A100, a Llama-3-8B/H100 roofline)
- scheduler: continuous batching with chunked prefill and KV-block admission
- kv_transfer: KV sessions held by prefill workers and pulled by decode workers
- media: image fetching/decoding and identities
- output: deterministic output tokens
- server: the gRPC servicers; cli: `orchestrator sim-worker`
"""
