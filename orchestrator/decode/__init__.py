"""The decode stage and its output side.

- stage: attempts, retries, the KV rule on cancellation, abort on exit; a failure after tokens were
  streamed is the request flow's to migrate (MidStreamFailure)
- output: `stream_output`, engine events -> deltas for the client's sink
- deltas: the `OutputSink` protocol, the stream state, tokens -> deltas
- direct: direct delivery from the engine connection's reader task, and its contract
- legs: the continuation leg a migration sends, pure (the legs that pull a KV session are orchestrator.kv's)
"""

from orchestrator.decode.deltas import OutputSink, StreamState
from orchestrator.decode.legs import continuation_leg
from orchestrator.decode.output import ReplayedStream, finish_answer, finish_reason, stream_output

__all__ = ["OutputSink", "ReplayedStream", "StreamState", "continuation_leg", "finish_answer", "finish_reason",
           "stream_output"]
