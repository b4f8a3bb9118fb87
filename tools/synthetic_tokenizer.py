"""The synthetic packs' tokenizer: a byte-level BPE like Qwen's, trained on a fixed text, with
Qwen's special tokens at the real ids and a Qwen-style chat template (make_synthetic_pack
writes it into every pack; train_tiny_pair trains the demo pair's own)."""

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

# The tokenizer's trained byte-level BPE vocabulary; Qwen's special tokens follow it.
BPE_VOCAB_SIZE = 448


# Qwen's special tokens, in Qwen's id order. `False` marks tokens that decode as text
# (thinking and tool-call markers must survive detokenization for the parsers).
SPECIAL_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Fixed training text for the BPE merges: chat, code and tool-call shaped text, so common
# prompt words become single tokens and prompts stay short.
TOKENIZER_CORPUS = """
The quick brown fox jumps over the lazy dog. You are a helpful assistant.
Write a Python function that reverses a string. Explain what the code does.
def reverse(text):
    return text[::-1]
def add(a, b):
    return a + b
for i in range(10):
    print(i)
What is in this image? Describe the picture, the colors and the shapes you see.
Please think step by step before you answer the question about the weather today.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The user asked for the weather in Paris. The answer is sunny and warm.
Count the red circles and the blue squares. There are three of them.
Hello! How can I help you today? Thank you, that is a good question.
import json
import math
class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y
Speculative decoding drafts a block of tokens and the target model verifies them.
The answer is 42. One, two, three, four, five, six, seven, eight, nine, ten.
"""

CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type in ('image', 'image_url', 'input_image') -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ('video', 'video_url', 'input_video') -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.text is defined -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content and loop.index0 > ns.last_user -%}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- if message.content -%}
            {{- render_content(message.content) -}}
        {%- endif -%}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
            {%- if not loop.first or message.content -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {%- if call.arguments is string -%}
                {{- call.arguments -}}
            {%- else -%}
                {{- call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}"""


def build_tokenizer(special_base, corpus=TOKENIZER_CORPUS):
    """Byte-level BPE like Qwen's, trained on a fixed text; Qwen's specials start at
    `special_base`, ids between the BPE vocabulary and it are reserved fillers."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.NFC()
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator([corpus], trainer)

    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for token_id in range(len(vocab), special_base):
        vocab[f"<|reserved_{token_id}|>"] = token_id
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens(
        [
            AddedToken(text, special=special, normalized=False)
            for text, special in SPECIAL_TOKENS
        ]
    )
    return tokenizer


def special_token_ids(special_base):
    return {text: special_base + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}


def tokenizer_config(special_base, max_length):
    """tokenizer_config.json's content: Qwen2Tokenizer's settings, the specials, the chat template."""
    ids = special_token_ids(special_base)
    added = {
        str(ids[text]): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for text, special in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return tokenizer_config
