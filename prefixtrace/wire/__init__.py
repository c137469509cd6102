"""The wire model every package shares: one internal request and one stream of reply events.

Each wire protocol (chat completions, Anthropic Messages, OpenAI Responses, legacy completions) is a
thin adapter into and out of these types, so the proxy, the recorder (replay, HAR import), the analyzer's
loader and the engine see every protocol the same way. Nothing here imports the server (`proxy/`),
the engine or FastAPI.
"""
