"""One request from planned to finished: the prompt's tokens, the plan, the legs and their migrations.

- prompt: chat template and tokenization, off the event loop when long
- coordinator: plan a request, then run it in one trio nursery
- request_flow: prefill, KV lease, decode and migration (a loop) for one planned request

The flow calls down only: into the stages (prefill/, decode/), the KV lease (kv/) and the pool (workers/).
"""
