"""One request from planned to finished: the prompt's tokens, the plan, the legs and their retries.

- prompt: chat template and tokenization, off the event loop when long
- coordinator: plan a request, then run it in one trio nursery
- request_flow: prefill, KV lease, decode and migration for one planned request
- retry: one retry rule for both stages
"""
