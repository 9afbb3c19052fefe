"""The decode stage (stage.py: attempts, retries, the KV rule on cancellation, abort on exit), its output
side (output.py: detokenized deltas for the client) and its leg codec (legs.py, pure)."""

from orchestrator.decode.legs import continuation_leg, generation_leg, release_leg
from orchestrator.decode.output import OutputSink, ReplayedStream, StreamState, finish_reason, stream_output

__all__ = ["OutputSink", "ReplayedStream", "StreamState", "continuation_leg", "finish_reason", "generation_leg",
           "release_leg", "stream_output"]
