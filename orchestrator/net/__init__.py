"""Socket I/O below every layer that owns a connection: both the client side (the workers' HTTP/2
connections, transport/h2_channel.py) and the server side (the frontend's HTTP/1.1 connections,
frontend/http_server.py) read and write trio socket streams through these. A leaf: it imports nothing of
the orchestrator.

- eager_send: writes that skip trio's scheduler when the kernel takes every byte at once
- eager_receive: reads without trio's per-call wrapping, with the same checkpoint rule
"""
