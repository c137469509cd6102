"""The wire model every package shares: the chat-completions body as the one internal request, and
one stream of reply events.

Each wire protocol (chat completions, Anthropic Messages, OpenAI Responses, legacy completions) is a
thin translation into and out of these, so the proxy, the recorder (replay, HAR import), the analyzer's
loader and the engine see every protocol the same way. It stands on `prefixtrace/common/` alone (and httpx):
nothing here imports the recorder, the server (`proxy/`), the engine or FastAPI (docs/ARCHITECTURE.md,
"Package graph").

- `request`: which protocol an endpoint speaks, the session a request belongs to, a message's text
- `events`: the reply-event contract (content, reasoning, tool-call starts and argument deltas, done)
- `messages`, `responses`, `completions`: each protocol's translation in and out
- `sampling`: a request's sampling settings and their valid ranges, in plain Python
- `sse`: server-sent-event framing (a recorder `Turn` is filled from what the client saw by
  recorder/turn_builder.py)
- `http`: httpx errors into the error tree, base-URL spelling (any client of a server)
"""
