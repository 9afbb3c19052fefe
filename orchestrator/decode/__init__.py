"""The decode stage and its output side.

- stage: `DecodeLeg` (one leg to stream, a value) and the stage: attempts, retries, the KV rule on cancellation,
  abort on exit; a failure after tokens were streamed is the request flow's to migrate (MidStreamFailure)
- output: `stream_output`, engine events -> deltas for the client's sink
- progress: `StreamProgress`, what was streamed and how it ended, its methods the only writers; direct delivery
  from the engine connection's reader task, and its contract
- deltas: the `OutputSink` protocol (and its optional `DirectWriter`), tokens -> deltas
- legs: the continuation leg a migration sends, pure (the legs that pull a KV session are orchestrator.kv's)
"""

from orchestrator.decode.deltas import DirectWriter, OutputSink
from orchestrator.decode.legs import continuation_leg
from orchestrator.decode.output import ReplayedStream, stream_output
from orchestrator.decode.progress import StreamProgress

__all__ = ["DirectWriter", "OutputSink", "ReplayedStream", "StreamProgress", "continuation_leg", "stream_output"]
