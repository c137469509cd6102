"""aider (`aider --message`, PyPI) over chat completions: no tools, aider's own whole-file edit format.

aider has no tool calls to round-trip: it reads the files it is given into the prompt itself and
parses the model's plain-text reply for edits. So what a user relies on here is that the file reached
the model (the request carries the scratch file's secret), that the reply aider printed and kept in
its chat history is the reply that was recorded, and that a follow-up request of the same run (a
reflection after a failed edit) extends the first, which `prefixtrace check` judges.
"""

from __future__ import annotations

import json

from harness import harness_support as hs

# What a user of a local OpenAI-compatible server gives aider (its docs, "OpenAI compatible APIs" and
# "Advanced model settings"): the model's context and zero cost, so aider neither warns about an
# unknown model nor fetches litellm's model-price list from GitHub to look it up.
MODEL_METADATA = {"openai/default": {"max_input_tokens": 8192, "max_output_tokens": 200, "max_tokens": 200,
                                     "input_cost_per_token": 0, "output_cost_per_token": 0,
                                     "litellm_provider": "openai", "mode": "chat"}}
# aider sends no max_tokens for a model it has no settings for; the whole-file format is its default
# for unknown models, named here so a change of default cannot change the test silently.
MODEL_SETTINGS = "- name: openai/default\n  edit_format: whole\n  extra_params:\n    max_tokens: 200\n"

QUESTION = "What is the secret word in hello.txt?"


def aider_command(aider_exe, scratch: hs.Scratch, base_url: str) -> list:
    metadata = scratch.home / "aider.model.metadata.json"
    settings = scratch.home / "aider.model.settings.yml"
    metadata.write_text(json.dumps(MODEL_METADATA))
    settings.write_text(MODEL_SETTINGS)
    return [aider_exe, "--model", "openai/default", "--openai-api-base", base_url + "/v1",
            "--openai-api-key", "unused", "--model-metadata-file", metadata, "--model-settings-file", settings,
            # offline and unattended: no analytics, no PyPI version check, no release-notes prompt,
            # no git (so no commit-message side request and no .gitignore prompt), no repo map, no URL
            # scraping; --yes-always answers aider's own questions (create a file the reply names)
            "--analytics-disable", "--no-check-update", "--no-show-release-notes", "--no-git",
            "--map-tokens", "0", "--no-detect-urls", "--yes-always", "--no-pretty", "--no-fancy-input",
            "--message", QUESTION, "hello.txt"]


def test_aider_answers_from_a_file_through_the_proxy(aider_exe, backend, scratch, drive, tmp_path):
    env = hs.harness_env(scratch, {
        # litellm fetches its model-cost map from GitHub on import unless told to use its bundled copy
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # --yes-always also says yes to "Open URL for more info?" (after a reply cut by max_tokens):
        # Python's webbrowser then runs this command, which opens nothing
        "BROWSER": "true",
    })
    result, records = drive("aider", aider_command(aider_exe, scratch, backend.url), env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert records, "aider sent nothing the proxy recorded:\n" + result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    assert {r["endpoint"] for r in records} == {"/v1/chat/completions"}
    assert not any(r["request"].get("tools") for r in records)

    # aider put the file it was given into the prompt (only the file holds the secret)
    first = records[0]["request"]
    assert QUESTION in json.dumps(first["messages"][-1])
    assert scratch.secret in json.dumps(first["messages"]), hs.describe(records)

    # what aider showed and kept is what was recorded: every reply, verbatim, in its chat history
    # (aider writes each reply stripped) and on its output
    history = (scratch.work / ".aider.chat.history.md").read_text()
    for rec in records:
        text = rec["response"]["text"].strip()
        assert text, hs.describe(records)
        assert text in history, f"recorded reply {text!r} is not in aider's chat history:\n{history[-3000:]}"
        assert text in result.output, f"recorded reply {text!r} is not what aider printed"

    # a follow-up of the run (a reflection after a failed edit) must extend the first request:
    # `prefixtrace check` passes the session only if every transition is append-only
    check = hs.run_check(records, tmp_path / "aider.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
