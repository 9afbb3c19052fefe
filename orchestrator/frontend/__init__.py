"""The OpenAI-compatible HTTP API, on our own HTTP/1.1 server (httptools on trio).

- app: the ASGI application (routing, request lifecycle, streaming, disconnects)
- http_server, http_wire: the native server (connections, keep-alive, drain) and its pure framing rules
- server_extensions: the contract between the server and the app beyond ASGI (ServerExtensions)
- multiprocess: several frontend processes behind one port (http.processes)
- openai_format: pure rendering of responses, SSE chunks and logprobs
- errors: engine failures -> HTTP statuses in the OpenAI error format
"""
