"""Bytes on sockets: how the orchestrator talks to workers and clients below the protocol level.

- http2: the client side of HTTP/2 for gRPC, I/O-free (frames in, callbacks out, bytes to send)
- h2_grpc: gRPC calls over that HTTP/2 on a trio socket (the default worker transport)
- loop_thread: the grpc.aio (asyncio) thread behind the `stream_transport: grpcio` fallback
- keepalive: the HTTP/2 PING schedule; inbox: a stream's messages handed to one trio reader in batches
- eager_send / eager_receive: socket writes and reads that skip trio's scheduler when they need not wait
"""
