"""OpenAI's legacy completions API (`POST /v1/completions`): a raw prompt, no chat template.

`prompt` is a string or a list of one string (token-id prompts and several prompts at once are
refused with a reason: the engine returns one choice). The reply is `text_completion` objects.
"""

from __future__ import annotations

from typing import Any

from prefixtrace.common.errors import InvalidRequest

PATH = "/v1/completions"


def prompt_of(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequest("'prompt' as token ids is not supported here; send the text", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest("'prompt' must be one string here (the engine returns one choice)", param="prompt")
    raise InvalidRequest("'prompt' is required and must be a string (or a list of one string)", param="prompt")


def text_of_choice(choice: Any) -> str:
    return choice.get("text", "") if isinstance(choice, dict) and isinstance(choice.get("text"), str) else ""
