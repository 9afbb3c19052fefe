"""Model directories shipped with the package (tokenizer + chat template), for the simulator and tests."""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
TINY_CHAT = MODELS_DIR / "tiny-chat"
