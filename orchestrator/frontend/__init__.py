"""The OpenAI-compatible HTTP API on hypercorn's trio worker.

- app: the ASGI application (routing, request lifecycle, streaming, disconnects)
- openai_format: pure rendering of responses, SSE chunks and logprobs
- errors: engine failures -> HTTP statuses in the OpenAI error format
"""
