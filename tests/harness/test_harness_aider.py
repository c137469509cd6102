"""aider (`aider --message`, PyPI) over chat completions in a scratch git repository: no tools, aider's
own whole-file edit format, and its commit-message side request.

aider has no tool calls to round-trip: it reads the files it is given into the prompt itself, parses
the model's plain-text reply for edits, applies them and commits them with a message it asks the
model for in a second, separate request. So what a user relies on here is that the file reached the
model (the request carries the scratch file's secret), that the reply aider printed and kept in its
chat history is the reply that was recorded, that the commit aider made carries the recorded
commit-message reply, and that `prefixtrace check` passes the run with the commit-message request
kept out of the main chain.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
# Not the scratch fixture's random one: aider puts the file itself into the prompt, so the secret is part
# of what the greedy decode answers (a tool-using harness sees it only after its call), and one random
# secret made SmolLM2 answer with a listing of hello.txt (no change, no commit), another with prose.
# This one is in no other part of the prompt, so seeing it in a request still proves aider read the file.
SECRET = "pineapple-1234"
COMMIT_PROMPT = "generates concise, one-line Git commit messages"  # aider's commit-message system prompt


def make_repo(scratch: hs.Scratch, env: dict) -> None:
    """The scratch directory as a git repository with hello.txt committed (aider's usual setting)."""
    scratch.hello.write_text(f"The secret word is {SECRET}.\n")
    (scratch.home / ".gitconfig").write_text(
        "[user]\n\tname = prefixtrace test\n\temail = test@example.invalid\n[init]\n\tdefaultBranch = main\n")
    for cmd in (["git", "init", "-q", "."], ["git", "add", "hello.txt"], ["git", "commit", "-q", "-m", "hello"]):
        subprocess.run(cmd, cwd=scratch.work, env=env, check=True, timeout=60, capture_output=True)


def aider_command(aider_exe, scratch: hs.Scratch) -> list:
    """The model and server come from the product's environment (hs.point: AIDER_MODEL, AIDER_OPENAI_API_BASE)."""
    metadata = scratch.home / "aider.model.metadata.json"
    settings = scratch.home / "aider.model.settings.yml"
    metadata.write_text(json.dumps(MODEL_METADATA))
    settings.write_text(MODEL_SETTINGS)
    return [aider_exe, "--model-metadata-file", metadata, "--model-settings-file", settings,
            # offline and unattended: no analytics, no PyPI version check, no release-notes prompt, no
            # .gitignore prompt, no repo map, no URL scraping; --yes-always answers aider's own
            # questions (create the file a reply names)
            "--analytics-disable", "--no-check-update", "--no-show-release-notes", "--no-gitignore",
            "--map-tokens", "0", "--no-detect-urls", "--yes-always", "--no-pretty", "--no-fancy-input",
            "--message", QUESTION, "hello.txt"]


def sessions_of(records: list[dict], path) -> dict[str, str]:
    """request id -> the analyzer's session id for it (`prefixtrace analyze --format json`)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "analyze", str(path), "--format", "json"],
                          capture_output=True, text=True, env=hs.server_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    return {t["request_id"]: s["id"] for s in report["sessions"] for t in s["turns"]}


def test_aider_edits_and_commits_through_the_proxy(aider_exe, backend, scratch, drive, tmp_path):
    env = hs.harness_env(scratch, {
        # litellm fetches its model-cost map from GitHub on import unless told to use its bundled copy
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # --yes-always also says yes to "Open URL for more info?" (after a reply cut by max_tokens):
        # Python's webbrowser then runs this command, which opens nothing
        "BROWSER": "true",
    })
    make_repo(scratch, env)
    args, env = hs.point("aider", scratch, backend.url, env)
    assert args == []
    result, records = drive("aider", aider_command(aider_exe, scratch), env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert records, "aider sent nothing the proxy recorded:\n" + result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    assert {r["endpoint"] for r in records} == {"/v1/chat/completions"}
    assert not any(r["request"].get("tools") for r in records)
    commits = [r for r in records if COMMIT_PROMPT in r["request"]["messages"][0]["content"]]
    chat = [r for r in records if r not in commits]
    assert chat, hs.describe(records)

    # aider put the file it was given into the prompt (only the file holds the secret)
    first = chat[0]["request"]
    assert QUESTION in json.dumps(first["messages"][-1])
    assert SECRET in json.dumps(first["messages"]), hs.describe(records)

    # what aider showed and kept is what was recorded: every chat reply, verbatim, in its chat
    # history (aider writes each reply stripped) and on its output
    history = (scratch.work / ".aider.chat.history.md").read_text()
    for rec in chat:
        text = rec["response"]["text"].strip()
        assert text, hs.describe(records)
        assert text in history, f"recorded reply {text!r} is not in aider's chat history:\n{history[-3000:]}"
        assert text in result.output, f"recorded reply {text!r} is not what aider printed"

    # every commit aider made carries the message the model wrote for it in a request of its own.
    # Greedy SmolLM2 answers this prompt with the file's sentence, which the whole-file format reads as
    # a listing of a file of that name: aider creates it and commits it (a reply that edits nothing,
    # on another machine's arithmetic, makes no commit and asks for no message: then there is none)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=scratch.work, env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert len(log) - 1 == len(commits), (log, hs.describe(records))
    print(f"aider made {len(commits)} commit(s): {log[:-1]}")  # shown by pytest -rP
    if commits:
        message = commits[-1]["response"]["text"].strip().strip('"').strip()
        assert log[0] == message.splitlines()[0], f"aider committed {log[0]!r}, the model wrote {message!r}"

    # `prefixtrace check` passes the run: a follow-up of the chat (a reflection after a failed edit)
    # could only extend the first request, and the commit-message request, which quotes the chat as
    # text under its own system prompt, is a chain of its own, not a break of the chat's
    check = hs.run_check(records, tmp_path / "aider.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
    if commits:
        session = sessions_of(records, tmp_path / "aider-analyze.jsonl")
        assert session[commits[0]["id"]] not in {session[r["id"]] for r in chat}, session
