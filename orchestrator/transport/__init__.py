"""Bytes on sockets: how the orchestrator's calls reach the workers, below the OpenEngine protocol.

- calls: WorkerChannel, the one interface the engine client calls a worker through, and CallStream
- h2_channel: H2Channel, gRPC calls over our own HTTP/2 on a trio socket (the default transport), on
- http2: the client side of HTTP/2 for gRPC, I/O-free (frames in, callbacks out, bytes to send)
- grpcio_channel: GrpcioChannel, the same calls through grpc.aio (the `stream_transport: grpcio` fallback), on
- loop_thread: the asyncio (uvloop) thread grpc.aio runs on, with a batched handoff of messages to trio
- inbox: a call's responses handed to its one trio reader in batches, or to its direct handler
- errors: EngineError, what every call fails with, and the one mapping of a gRPC status to it
- keepalive: when a connection sends a PING; tls: TLS to the workers, for either channel
"""
