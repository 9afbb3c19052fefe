"""The orchestrator: disaggregated LLM serving on TensorRT-LLM OpenEngine v1 workers, on trio."""

__version__ = "0.1.0"
