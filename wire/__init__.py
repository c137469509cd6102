"""The wire model every package shares: one internal request and one stream of reply events.

Each wire protocol (chat completions, Anthropic Messages, OpenAI Responses, legacy completions) is a
thin adapter into and out of these types, so the proxy, the recorder (replay, HAR import), the analyzer's
loader and the engine see every protocol the same way. Nothing here imports the server (`proxy/`),
the engine or FastAPI.

- `request.normalize_request(endpoint, body)`: any protocol's body → `WireRequest` (chat-shaped
  messages, chat-shaped tools, system text, the chat body the engine renders)
- `events`: the reply-event contract (content, reasoning, tool-call starts and argument deltas, done)
- `messages`, `responses`, `completions`: each protocol's translation in and out
- `sse`: server-sent-event framing; `turn_builder`: a recorder `Turn` filled from what the client saw
- `http`: httpx errors into the error tree, base-URL spelling (any client of a server)
"""
