"""Grouping requests into sessions (one agent conversation each).

Requests recorded with a session id are grouped by it. The rest are
inferred online, in time order, at the payload level (canonical message
keys, which is what decides the rendered prefix, and cheap): a request joins
the session whose *latest* request shares the longest message prefix with
it, provided that prefix reaches past the leading system messages (which
unrelated conversations of one agent share) through the first conversation
message; otherwise it starts a new session. Interleaved orchestrator and
subagent traffic separates because each subagent's first task message
differs.

Fallback: agents that rewrite their system prompt every turn (the very
problem this tool exists to show) share nothing past message 0, so when no
session qualifies we compare again with the leading system messages set
aside and require the first conversation message to match.

A new conversation is not a break of an old one: a request that is only the
opening of a conversation (no assistant or tool message past the system
head) never continues a session that already got a reply (a conversation
cannot go back to its opening; the same opening again is the harness started
afresh, e.g. pi run twice with the same prompt), nor a session whose tools
differ (the same opening with another tool list is another client), nor one
with another system prompt; and it is not taken for a compaction of one
unless it says it is a summary (`_says_summary`), since a compaction
replaces the history with one. Two conversations that opened alike (the same
task run twice at once) part at their first reply: a request whose first
reply differs from a session's (beyond reasoning or serialisation) is not
that session's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from analyzer.canon import first_changed
from analyzer.causes import HEAD_ROLES, is_compaction
from analyzer.divergence import common_prefix_len

UNRENDERABLE_SESSION = "unrenderable"


@dataclass
class Session:
    id: str
    inferred: bool
    indices: list[int] = field(default_factory=list)  # into the request list
    latest_keys: list[str] | None = None
    latest_roles: list[str] | None = None
    latest_tools: str | None = None
    latest_chars: int = 0
    first_keys: list[str] | None = None  # of its first request: what a side request replaced
    first_tools: str | None = None
    family: str | None = None  # chains of one conversation (a session id, or a fork's origin)
    parent: str | None = None  # set on side requests when grouping ends: the main chain's id
    side_reason: str | None = None  # "replaces the system prompt", …
    spare_openings: list[int] = field(default_factory=list)  # requests that repeated its opening (see `add`)


def _head(roles: list[str]) -> int:
    n = 0
    while n < len(roles) and roles[n] in HEAD_ROLES:
        n += 1
    return n


_REPLY_ROLES = ("assistant", "tool", "function")
_SUMMARY_WORDS = ("summary", "summari", "compact", "continued from a previous conversation", "context was reset")


def _opening(roles: list[str]) -> bool:
    """Only the opening of a conversation: no reply (assistant or tool message) past the system head."""
    return not any(r in _REPLY_ROLES for r in roles[_head(roles):])


def _restarts(s: Session, keys: list[str], roles: list[str], tools_key: str | None) -> bool:
    """Whether this request starts a new conversation rather than continuing `s`: it is an opening,
    and `s` already got a reply or used other tools."""
    if not _opening(roles):
        return False
    return not _opening(s.latest_roles) or tools_key != s.latest_tools


def _first_reply(roles: list[str]) -> int | None:
    return next((i for i in range(_head(roles), len(roles)) if roles[i] in _REPLY_ROLES), None)


def _other_first_reply(s: Session, keys: list[str], roles: list[str]) -> bool:
    """Whether this request and `s` open alike but got different first replies: two conversations that
    started with the same prompt (a task run twice at once), not an edit of one. A reply that differs
    only by its reasoning or its serialisation (a client stripping past thinking) is the same reply."""
    k = first_changed(s.latest_keys, keys)
    r, rs = _first_reply(roles), _first_reply(s.latest_roles)
    if r is None or r != rs or k != r or k < max(_head(roles), 1):
        return False
    from analyzer.causes import _without_reasoning, normalize

    try:
        a, b = json.loads(s.latest_keys[k]), json.loads(keys[k])
    except ValueError:
        return True
    return normalize(_without_reasoning(a)) != normalize(_without_reasoning(b))


def _says_summary(keys: list[str], roles: list[str]) -> bool:
    """Whether the conversation part names itself a summary (pi: "…compacted into the following summary",
    Claude Code: "This session is being continued from a previous conversation…")."""
    text = " ".join(keys[_head(roles):]).lower()
    return any(w in text for w in _SUMMARY_WORDS)


def _score(s: Session, keys: list[str], roles: list[str]) -> tuple[int, int] | None:
    a_head, b_head = _head(s.latest_roles), _head(roles)
    shared = first_changed(s.latest_keys, keys)
    if shared > a_head and shared > b_head:
        return (1, shared)
    if a_head < len(s.latest_keys) and b_head < len(keys):
        shared = first_changed(s.latest_keys[a_head:], keys[b_head:])
        if shared >= 1:
            return (0, shared)
    return None


# A system prompt that says it is a harness's side request (analyzer/clients.py names the same ones).
_SIDE_HEAD = re.compile(r"title generator|generate a (?:short |brief )?title|summari[sz]ation assistant"
                        r"|summari[sz]e (?:this|the) conversation|(?:write|generate) a (?:short )?commit message", re.I)


def _related_head(s: Session, keys: list[str], roles: list[str], tools: str | None) -> bool:
    """Whether a request that shares the conversation but not the system prompt is the same agent
    rewriting its system prompt (same tools, or a system prompt that mostly starts the same) rather
    than a side request that replaces it (memory extraction, title generation, summaries)."""
    a = "".join(s.latest_keys[:_head(s.latest_roles)])
    b = "".join(keys[:_head(roles)])
    if _SIDE_HEAD.search(b) and not _SIDE_HEAD.search(a):  # a title, summary or commit-message call, even
        return False                                      # with the same (or no) tools
    if tools == s.latest_tools:
        return True
    if not a or not b:
        return False
    skip = a.find('"content": ') + len('"content": ') if '"content": ' in a else 0  # the key's fixed preamble
    return (common_prefix_len(a, b) - skip) * 2 >= min(len(a), len(b)) - skip


def _side_reason(side: Session, main: Session) -> str:
    head_a, head_b = side.first_keys[:1], main.first_keys[:1]
    what = [w for w, differs in (("the system prompt", head_a != head_b),
                                 ("the tools", side.first_tools != main.first_tools)) if differs]
    return "replaces " + " and ".join(what) if what else "does not extend the main chain's prefix"


side_reason = _side_reason  # the live dashboard names its side requests as `analyze` does


class SessionGrouper:
    """Feed requests in time order with `add`; `sessions` in order of first request.

    With `split_forks` (the analysis; the live dashboard groups online without it), a session's
    requests are further split into chains, and a chain that shares the conversation but replaces
    the system prompt or the tools (a harness's side request: title generation, summaries, memory
    extraction, subagents) is a fork, not a break of the main chain; `finish()` then names each
    family's main chain (the one with the most requests) and marks the others as its side
    requests. A request without a session id that shares nothing with the most recent chain but its
    system prompt and tools, and is much smaller (history replaced by a summary), continues that
    chain: a compaction, not a new session."""

    def __init__(self, split_forks: bool = False) -> None:
        self.sessions: list[Session] = []
        self._explicit: dict[str, Session] = {}
        self._inferred: list[Session] = []  # most recently active last
        self.split_forks = split_forks
        self._chains: dict[str, list[Session]] = {}  # family -> its chains, most recently active last
        self._last: Session | None = None

    def drop(self, ids: set[str]) -> None:
        """Forgets these sessions and their last prompts (the live dashboard's oldest, past its bound)."""
        self.sessions = [x for x in self.sessions if x.id not in ids]
        self._inferred = [x for x in self._inferred if x.id not in ids]
        self._explicit = {k: x for k, x in self._explicit.items() if x.id not in ids}
        self._chains = {k: kept for k, pool in self._chains.items() if (kept := [x for x in pool if x.id not in ids])}
        if self._last is not None and self._last.id in ids:
            self._last = None

    def _named(self, name: str, index: int, *, inferred: bool) -> Session:
        s = self._explicit.get(name)
        if s is None:
            s = self._explicit[name] = Session(name, inferred=inferred)
            self.sessions.append(s)
        s.indices.append(index)
        return s

    def add(self, index: int, session_id: str | None, keys: list[str] | None, roles: list[str] | None,
            tools_key: str | None = None, chars: int = 0) -> Session:
        if keys is None:
            return self._named(UNRENDERABLE_SESSION, index, inferred=True)
        if session_id is not None and not self.split_forks:
            return self._named(session_id, index, inferred=False)
        if session_id is not None:
            if roles is None:
                roles = [""] * len(keys)
            pool = self._chains.setdefault(session_id, [])
            best = self._pick(pool, keys, roles, tools_key, chars)
            if best is None:
                name = session_id if not pool else f"{session_id}/side-{len(pool)}"
                best = Session(name, inferred=False, family=session_id)
                self.sessions.append(best)
            else:
                pool.remove(best)
            pool.append(best)
            return self._joined(best, index, keys, roles, tools_key, chars)
        best, best_score = None, None
        fork_of = None
        parted: list[Session] = []  # sessions that opened as this request did but got another first reply
        for s in self._inferred:
            if _other_first_reply(s, keys, roles):
                parted.append(s)
                continue
            if _restarts(s, keys, roles, tools_key):
                continue  # a new conversation, not a turn (nor a side request) of this one
            score = _score(s, keys, roles)
            if score is not None and score[0] == 0 and _opening(roles):
                continue  # an opening has no conversation yet that another system prompt could continue
            if score is not None and score[0] == 0 and self.split_forks and not _related_head(s, keys, roles, tools_key):
                fork_of = s  # shares the conversation, replaces the system prompt or tools: a side request
                continue
            if score is not None:  # on equal shares, the session with the same tools (one client) wins
                score = (*score, int(tools_key == s.latest_tools))
            # `>=` so that on a tie the most recently active session wins.
            if score is not None and (best_score is None or score >= best_score):
                best, best_score = s, score
        if best is None and self.split_forks:  # the chain this compacts, if any
            compacts = [s for s in reversed(self._inferred) if self._compaction_of(s, keys, roles, tools_key, chars)]
            # The one whose recent messages the compaction kept (pi keeps the last ~20k tokens after its
            # summary), else the most recently active (`max` keeps the first of equals).
            kept = set(keys[_head(roles):])
            best = max(compacts, key=lambda s: len(kept.intersection(s.latest_keys[_head(s.latest_roles):])),
                       default=None)
        if best is None:
            if fork_of is not None:
                family = fork_of.family or fork_of.id
                siblings = sum(1 for s in self.sessions if s.family == family)
                best = Session(f"{family}/side-{siblings + 1}", inferred=True, family=family)
            else:
                best = Session(f"inferred-{sum(1 for s in self.sessions if s.inferred and s.family is None) + 1}",
                               inferred=True)
            self.sessions.append(best)
            if self.split_forks:
                self._claim_opening(best, parted, keys)
        else:
            self._inferred.remove(best)
            if self.split_forks and _opening(roles) and keys == best.latest_keys and _opening(best.latest_roles):
                best.spare_openings.append(index)  # the same opening again: a retry, or a parallel run's
        self._inferred.append(best)
        return self._joined(best, index, keys, roles, tools_key, chars)

    @staticmethod
    def _claim_opening(new: Session, parted: list[Session], keys: list[str]) -> None:
        """Two runs of one task at once send the same opening twice; the second joined the first as a
        retry. When a conversation that opened that way parts at its first reply, the repeated opening
        was its own: it moves to the new session, so the two get one opening each."""
        donor = next((d for d in reversed(parted) if d.spare_openings and d.first_keys is not None
                      and keys[:len(d.first_keys)] == d.first_keys), None)
        if donor is None:
            return
        moved = donor.spare_openings.pop(0)
        donor.indices.remove(moved)
        new.indices.append(moved)
        new.first_keys, new.first_tools = donor.first_keys, donor.first_tools

    def _joined(self, s: Session, index: int, keys, roles, tools_key, chars) -> Session:
        s.indices.append(index)
        if s.first_keys is None:
            s.first_keys, s.first_tools = keys, tools_key
        s.latest_keys, s.latest_roles, s.latest_tools, s.latest_chars = keys, roles, tools_key, chars
        self._last = s
        return s

    def _pick(self, pool: list[Session], keys, roles, tools_key, chars) -> Session | None:
        """The chain of an explicit session this request continues (None: a new chain)."""
        best, best_score = None, None
        for s in pool:
            score = _score(s, keys, roles)
            if score is not None and score[0] == 0 and not _related_head(s, keys, roles, tools_key):
                continue
            if score is not None and (best_score is None or score >= best_score):
                best, best_score = s, score
        if best is None:  # nothing shared: the same agent (whatever its history did) unless it replaced its head
            best = next((s for s in reversed(pool) if _related_head(s, keys, roles, tools_key)), None)
        return best

    @staticmethod
    def _compaction_of(s: Session, keys, roles, tools_key, chars) -> bool:
        head, prev_head = _head(roles), _head(s.latest_roles)
        if _opening(roles) and not _says_summary(keys, roles):
            return False  # a new conversation with this agent's system prompt and tools, not a summary
        return (head > 0 and s.latest_tools == tools_key and s.latest_keys[:prev_head] == keys[:head]
                and is_compaction(s.latest_keys, keys, prev_head, head))

    def finish(self) -> list[Session]:
        """Names the main chain of every family (most requests; the earliest on a tie) and marks the
        others as its side requests; returns the sessions, each main chain followed by its side requests."""
        families: dict[str, list[Session]] = {}
        for s in self.sessions:
            if s.family is not None:
                families.setdefault(s.family, []).append(s)
            else:
                families.setdefault(s.id, []).insert(0, s)
        ordered: list[Session] = []
        for chains in families.values():
            main = max(chains, key=lambda c: (len(c.indices), -c.indices[0]))
            first = chains[0]
            if main is not first and not main.inferred and first.id == first.family:
                main.id, first.id = first.id, main.id  # the session's id names its main chain
            ordered.append(main)
            for c in chains:
                if c is not main:
                    c.parent, c.side_reason = main.id, _side_reason(c, main)
                    ordered.append(c)
        return ordered
