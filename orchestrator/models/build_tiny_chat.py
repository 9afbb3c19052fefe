"""Build models/tiny-chat: a byte-level BPE tokenizer trained on a small built-in corpus.

    python -m orchestrator.models.build_tiny_chat

Byte-level, so any UTF-8 text (emoji, CJK) round-trips; small (about 2,000 tokens), so the files are
committed as data. The chat template is ChatML, rendered by the orchestrator with jinja2; like the
templates of vision-language models it takes structured content parts and writes the model's own
image placeholder, `<|image|>` (one special token, named as `image_token` in tokenizer_config.json),
where an image stood. The engine expands each placeholder into the image's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parent / "tiny-chat"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
IMAGE_TOKEN = "<|image|>"  # added after training, so the ids of every other token stay as they were

# ChatML, with tools and thinking the way Hugging Face templates take them (Qwen's conventions):
# - `tools` (a list of {"type": "function", "function": {name, description, parameters}}) is written into a
#   system turn, one JSON object per line between <tools> and </tools>, merged with the first system message;
# - `tool_choice` (optional, as the request has it: "none", "required" or {"type": "function", "function":
#   {"name": N}}) adds one sentence to that turn, which the simulated model obeys;
# - an assistant message's `tool_calls` are written as <tool_call>{"name", "arguments"}</tool_call> blocks,
#   a `tool` message as a turn of role tool;
# - `parallel_tool_calls` (optional) true adds a sentence allowing several calls in one answer;
# - `enable_thinking` false closes an empty <think></think> block after the generation prompt, as Qwen3 does.
# The simulator reads these back (orchestrator/sim/chat_prompt.py); docs/simulator.md is the contract.
_CONTENT = (
    "{% if message['content'] is defined and message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is defined and message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
_TOOL_CALLS = (
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or (message['content'] is defined and message['content']) %}{{ '\\n' }}{% endif %}"
    # each piece on its own: `tojson` returns Markup, and str + Markup would HTML-escape the str
    "{{ '<tool_call>\\n{\"name\": ' }}{{ function['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}"
    "{% endif %}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
)
_HAS_TOOLS = "tools is defined and tools"
CHAT_TEMPLATE = (
    "{% if " + _HAS_TOOLS + " %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call these functions, one JSON object per line:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\n\\nTo call a function, answer with <tool_call></tool_call> tags around its name and "
    "arguments as JSON.' }}"
    "{% if tool_choice is defined and tool_choice is string and tool_choice == 'none' %}"
    "{{ '\\nAnswer without calling a function.' }}"
    "{% elif tool_choice is defined and tool_choice is string and tool_choice == 'required' %}"
    "{{ '\\nCall at least one function.' }}"
    "{% elif tool_choice is defined and tool_choice is mapping %}"
    "{{ '\\nCall the function ' + tool_choice['function']['name'] + '.' }}{% endif %}"
    "{% if parallel_tool_calls is defined and parallel_tool_calls is true %}"
    "{{ '\\nYou may call several functions at once.' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and message['role'] == 'system' and " + _HAS_TOOLS + " and message['content'] is string) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}" + _CONTENT + _TOOL_CALLS +
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

CORPUS = """
The orchestrator splits every request into a prefill stage and a decode stage. The prefill worker
reads the prompt, fills the key value cache and hands the session to a decode worker, which streams
the answer one token at a time. Disaggregation keeps long prompts from slowing down the tokens of
everyone else. A cluster operator deploys workers from a file, watches them arrive and leave, and
reads the figures on a dashboard. Benchmarks compare aggregated and disaggregated serving on the
same hardware with the same workload, measuring time to first token, time per output token,
throughput and goodput under a service level objective.
Hello, how are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
Please describe the picture. The image shows a cat sitting on a red chair near a window, a small
dog sleeping on the floor, green trees, blue sky, white clouds, a river, mountains and a bridge.
Numbers: one two three four five six seven eight nine ten hundred thousand million 0 1 2 3 4 5 6 7 8 9.
Questions and answers, stories and poems, code and data, history and science, music and art.
def main(): return {"key": [1, 2, 3]}  # comments, (parentheses), [brackets], <tags>, 'quotes'.
Café, naïve, déjà vu, Straße, smörgåsbord, 東京, こんにちは, 你好, Привет, مرحبا, 😀 🚀 ✨
"""


def build(out: Path = OUT) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "image_token": IMAGE_TOKEN,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(
        {"model_type": "tiny-chat", "max_position_embeddings": 4096, "vocab_size": tokenizer.get_vocab_size()},
        indent=2) + "\n")


if __name__ == "__main__":
    build()
    print(f"wrote {OUT}")
