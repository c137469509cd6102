"""The scripts the real harness runs of fixtures/transcripts/*/real/ were answered with (their
PROVENANCE.md names each): what the scripted model (testsupport/scripted_upstream.py) says to a
request, chosen from the request alone. Run one as the upstream of `prefixtrace serve`:

    python -m testsupport.scripted_replies claude_compact PORT [RECEIVED.jsonl]
"""

from __future__ import annotations

import re
import sys

from testsupport.scripted_upstream import (Reply, compaction_item, function_call, message_item, serve_forever,
                                           text_block, tool_use)

# Claude Code's compaction request ends with this instruction (its /compact and auto-compact prompt)
CLAUDE_COMPACT_ASK = "create a detailed summary of the conversation"
SUMMARY = ("<analysis>\nThe user asked to read hello.txt; the Read tool returned its one line.\n</analysis>\n\n"
           "<summary>\n1. Primary Request and Intent: read the file hello.txt in the working directory and say "
           "what it holds.\n2. Key Technical Concepts: none.\n3. Files and Code Sections: hello.txt (one line, "
           "a secret word).\n4. Errors and fixes: none.\n5. Problem Solving: the file was read once.\n"
           "6. All user messages: \"Read the file hello.txt\".\n7. Pending Tasks: none.\n8. Current Work: "
           "the file was read and its content reported.\n9. Optional Next Step: none.\n</summary>")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


def _tool_results(content) -> list[str]:
    if not isinstance(content, list):
        return []
    out = []
    for b in content:
        if isinstance(b, dict) and b.get("type") == "tool_result":
            c = b.get("content")
            out.append(c if isinstance(c, str) else _text(c))
    return out


def _workdir(body: dict) -> str:
    system = body.get("system")
    text = system if isinstance(system, str) else _text(system)
    found = re.search(r"Working directory: (\S+)", text + "\n" + _text(body["messages"][0].get("content")))
    return found.group(1) if found else "."


def _claude(body: dict, files: list[str], pause_s: float = 0.0) -> Reply:
    """Claude Code's loop: read `files` (all in one reply: parallel tool calls when more than one)
    after a user prompt, then report what the tool results said; a summary for a compaction request;
    a short text for a side request (no tools)."""
    last = body["messages"][-1]
    if CLAUDE_COMPACT_ASK in _text(last.get("content")):
        return Reply(blocks=[text_block(SUMMARY)])
    if not body.get("tools") or _text(last.get("content")).strip() == "Warmup":  # a side request, a sub-agent's warm-up
        return Reply(blocks=[text_block("Ready.")])
    results = _tool_results(last.get("content"))
    if results:
        return Reply(blocks=[text_block("The files say: " + " | ".join(r.strip()[:200] for r in results))])
    where = _workdir(body)
    calls = [tool_use("Read", file_path=f"{where}/{name}") for name in files]
    return Reply(blocks=[text_block(f"I will read {', '.join(files)}.")] + calls, pause_s=pause_s)


def claude_compact(endpoint: str, body: dict) -> Reply:
    return _claude(body, ["hello.txt"])


def claude_parallel(endpoint: str, body: dict) -> Reply:
    """Two Read calls in one reply, 2 s apart in the stream: Claude Code runs the first while the
    second is still coming, so its file interleaves the reply's lines with the results."""
    return _claude(body, ["hello.txt", "world.txt"], pause_s=2.0)


def codex_remote_compact(endpoint: str, body: dict) -> Reply:
    """Codex's loop (one exec_command, then a message); `/v1/responses/compact` answers as OpenAI's
    does: the conversation's user messages kept, then one opaque compaction item."""
    items = body.get("input") or []
    if endpoint == "/v1/responses/compact":
        kept = [i for i in items if i.get("type") == "message" and i.get("role") == "user"]
        return Reply(items=kept + [compaction_item()])
    last = items[-1] if items else {}
    if last.get("type") == "compaction_trigger":  # remote compaction v2: on /v1/responses, one item back
        return Reply(items=[compaction_item()])
    if last.get("type") == "function_call_output":
        return Reply(items=[message_item("The file says: " + str(last.get("output"))[:200])])
    if last.get("type") == "compaction":  # the turn goes on after a compaction mid-turn: its tool ran already
        return Reply(items=[message_item("The command ran; its output is summarised above.")])
    names = {tool.get("name") for tool in body.get("tools") or [] if isinstance(tool, dict)}
    if "exec_command" in names or "shell" not in names:
        return Reply(items=[function_call("exec_command", cmd="cat hello.txt")])
    return Reply(items=[function_call("shell", command=["bash", "-lc", "cat hello.txt"])])  # before exec_command


SCRIPTS = {"claude_compact": claude_compact, "claude_parallel": claude_parallel,
           "codex_remote_compact": codex_remote_compact}

if __name__ == "__main__":
    serve_forever(SCRIPTS[sys.argv[1]], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
