"""Keep secrets out of the recorder database.

Two mechanisms, because secrets arrive two ways:

* credential headers (`authorization`, `x-api-key`, ...) are dropped whole:
  their *name* is not secret but nothing useful survives redacting the value,
  and a dropped header cannot leak through a regex that missed a key format;
* secret-shaped strings anywhere else (bodies, other header values, the
  model's reply, which may echo a key pasted into the prompt) are replaced by
  `[REDACTED]` using configurable regexes.

Redaction is deterministic, so two requests that carried the same secret still
render identically and the prefix analysis is unaffected.

Redaction is linear-time on any input and cheap on ordinary bodies
(bench/bench_redact.py, docs/PERFORMANCE.md). Python's `re` backtracks, so each
default pattern is written to keep it so:

* it starts with a literal, so a text without it skips the pattern (`in`, a
  fast substring search) and `re` skips to candidates (a leading `\\b` made every
  position an attempt: ~50x slower per MB); the word boundary is a fixed-width
  look-behind right after the literal;
* no attempt can scan far and then fail from many overlapping starts: an
  unbounded run is never followed by something required, except in the JWT
  pattern, whose look-behind rules out a start inside a base64url run, and the
  PEM body, which is possessive and stops at the first `-----`;
* key-name patterns (`password: x`) are written in lower case and run over the
  lower-cased text (same length for ASCII, checked), because `(?i)` turns the
  substring search off too.

Every pattern's matches are collected first and replaced in one pass, so no
pattern sees another's `[REDACTED]`. A pattern with groups named `secret...` has
only those groups replaced (`password: [REDACTED]` still says what was there).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from prefixtrace.common.errors import InvalidRequest

REDACTED = "[REDACTED]"

DROPPED_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
     # Other services' key headers a client may send through (Azure APIM, Google, AWS STS, generic).
     "x-auth-token", "ocp-apim-subscription-key", "x-goog-api-key", "x-amz-security-token",
     "x-functions-key", "x-access-token", "private-token", "x-csrf-token", "x-xsrf-token"}
)
# Any other header whose name says it carries a credential is dropped too: a
# dropped header cannot leak through a value regex that missed its format.
# A name ending in `key` (X-Key, X-Master-Key, X-Access-Key, DD-Application-Key) or carrying a
# signature (Signature, X-Hub-Signature-256) is a credential header too.
CREDENTIAL_HEADER_NAME = re.compile(r"token|secret|passw|api-?key|auth|cookie|session-key|subscription-key|credential"
                                    r"|(?:^|[-_])key$|signature")
# Header names matched above that carry no secret and are worth keeping.
KEPT_HEADERS = frozenset({"x-session-id", "idempotency-key",
                          # a router's session affinity key (sglang-router, docs/FLEET.md): an id, no secret
                          "x-smg-routing-key", "x-routing-key", "x-session-affinity-key"})

DEFAULT_PATTERNS: tuple[str, ...] = (
    # OpenAI (sk-..., sk-proj-...) and Anthropic (sk-ant-api03-...) keys. The
    # length floor keeps prose such as "sk-learn" from being redacted.
    r"sk-(?<!\wsk-)[A-Za-z0-9_\-]{16,}",
    # Stripe secret and restricted keys.
    r"sk_(?:live|test)_(?<!\wsk_live_)(?<!\wsk_test_)[A-Za-z0-9]{16,}",
    r"rk_(?:live|test)_(?<!\wrk_live_)(?<!\wrk_test_)[A-Za-z0-9]{16,}",
    # AWS access key ids (long-term AKIA, temporary ASIA).
    r"AKIA(?<!\wAKIA)[0-9A-Z]{16}\b",
    r"ASIA(?<!\wASIA)[0-9A-Z]{16}\b",
    # GitHub tokens (classic ghp_/gho_/ghu_/ghs_/ghr_, fine-grained github_pat_): coding
    # agents meet them in remotes, CI logs and .env files they read.
    r"gh[pousr]_(?<!\wgh[pousr]_)[A-Za-z0-9]{36,}",
    r"github_pat_(?<!\wgithub_pat_)[A-Za-z0-9_]{22,}",
    # Hugging Face, npm and GitLab tokens.
    r"hf_(?<!\whf_)[A-Za-z0-9]{30,}",
    r"npm_(?<!\wnpm_)[A-Za-z0-9]{36,}",
    r"glpat-(?<!\wglpat-)[A-Za-z0-9_\-]{20,}",
    # Slack tokens and Google API keys.
    r"xox[abprs]-(?<!\wxox[abprs]-)[A-Za-z0-9\-]{10,}",
    r"AIza(?<!\wAIza)[0-9A-Za-z_\-]{35}",
    # JWTs: header.payload.signature, both JSON parts base64url of `{"`.
    r"eyJ(?<![\w\-]eyJ)[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    # Issue 25: credentials in URLs (postgres://, mysql://, mongodb+srv://, redis://:pw@, https://u:pw@):
    # the password between the user's `:` and the `@`. A port (`host:5432/db`) is followed by `/`, not `@`.
    r"://[^\s/:@\"'<>]*:(?P<secret_url>[^\s/@\"'<>]+)@",
    # Google OAuth access tokens.
    r"ya29\.(?<!\wya29\.)[0-9A-Za-z_\-]{20,}",
    # Azure SAS signatures (`...&sig=AbC%2B...`): the value only.
    r"sig=(?<!\wsig=)(?P<secret_sig>[A-Za-z0-9%+/]{16,}=*)",
    # Slack incoming webhooks and workflow triggers: the path is the credential.
    r"hooks\.slack\.com/(?:services|workflows|triggers)/(?P<secret_slack_hook>[A-Za-z0-9_/\-]{16,})",
    # SendGrid (SG.<id>.<secret>), Twilio API key SIDs (SK + 32 hex), PyPI upload tokens, Vault tokens.
    r"SG\.(?<!\wSG\.)[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}",
    r"SK(?<!\wSK)[0-9a-f]{32}(?![0-9A-Za-z])",
    r"pypi-(?<!\wpypi-)[A-Za-z0-9_\-]{50,}",
    r"hv[sbr]\.(?<!\whv[sbr]\.)[A-Za-z0-9_\-]{24,}",
    # Discord bot tokens, <base64 user id>.<6>.<27+>: from the first dot on (the id part is no secret).
    # The dot is the only literal, so the fixed-width look-behinds (one per id length) do the choosing.
    r"\.(?:(?<=[MNO][A-Za-z0-9]{23}\.)|(?<=[MNO][A-Za-z0-9]{24}\.)|(?<=[MNO][A-Za-z0-9]{25}\.))"
    r"[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27,}",
    # Telegram bot tokens, <bot id>:<35 characters>: the part after the colon.
    r":(?<=[0-9]{8}:)(?P<secret_telegram>[A-Za-z0-9_\-]{35})(?![A-Za-z0-9_\-])",
    # Docker's config.json, `"auth": "<base64 of user:password>"` (also inside a JSON string, escaped).
    r'auth(?<="auth)\\?"[ \t]*:[ \t]*\\?"(?P<secret_docker_auth>[A-Za-z0-9+/]{8,}={0,2})\\?"',
    # PEM private keys: the header, the base64 body (with Proc-Type/DEK-Info lines and
    # JSON's `\n` escapes) and the footer when there is one. A key cut off before its
    # footer (`head id_rsa`) is still a key. Issue 14: the old lazy `[\s\S]*?` to the
    # footer scanned the rest of the body from each of 10,000 unterminated headers.
    r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----(?:[A-Za-z0-9+/=\s\\:,]|-(?!----))*+"
    r"(?:-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----)?",
    # Prefixed service tokens a coding agent meets in .env files, CI settings and shell history, each
    # documented by its vendor with its prefix; the length floors sit below each format's real length
    # and above what prose or code identifiers (`gsk_test`, `key-value`) reach.
    r"whsec_(?<!\wwhsec_)[A-Za-z0-9+/=]{24,}",  # Stripe webhook signing secrets
    # GitLab runner, deploy, pipeline-trigger, CI-job, incoming-mail, OAuth-app, SCIM and feed tokens.
    *(rf"{p}-(?<![\w\-]{p}-)[A-Za-z0-9_\-]{{20,}}" for p in ("glrt", "gldt", "glptt", "glcbt", "glimt", "gloas", "glsoat", "glft")),
    # DigitalOcean personal, OAuth and refresh tokens; Shopify access tokens and shared secrets. One
    # pattern per prefix: a long leading literal lets a body without it skip the scan.
    *(rf"{p}_v1_(?<!\w{p}_v1_)[a-f0-9]{{64}}" for p in ("dop", "doo", "dor")),
    *(rf"{p}_(?<!\w{p}_)[a-fA-F0-9]{{32}}" for p in ("shpat", "shpss", "shpca", "shppa")),
    r"GOCSPX-(?<!\wGOCSPX-)[A-Za-z0-9_\-]{24,}",  # Google OAuth client secrets
    r"ATATT3(?<!\wATATT3)[A-Za-z0-9_\-=]{32,}",  # Atlassian API tokens
    r"ATCTT3(?<!\wATCTT3)[A-Za-z0-9_\-=]{32,}",  # Atlassian Connect tokens
    r"lin_api_(?<!\wlin_api_)[A-Za-z0-9]{32,}",  # Linear API keys
    r"gsk_(?<!\wgsk_)[A-Za-z0-9]{40,}",  # Groq API keys
    r"xai-(?<!\wxai-)[A-Za-z0-9]{64,}",  # xAI API keys
    r"r8_(?<!\wr8_)[A-Za-z0-9]{30,}",  # Replicate API tokens
    r"xapp-(?<!\wxapp-)[0-9]-[A-Za-z0-9\-]{20,}",  # Slack app-level tokens
    r"glsa_(?<!\wglsa_)[A-Za-z0-9]{32}_[A-Fa-f0-9]{8}",  # Grafana service-account tokens
    r"glc_(?<!\wglc_)[A-Za-z0-9+/=]{32,}",  # Grafana Cloud access-policy tokens
    r"dapi(?<!\wdapi)[a-f0-9]{32}(?:-[0-9]+)?(?![A-Za-z0-9])",  # Databricks personal access tokens
    r"PMAK-(?<!\wPMAK-)[a-f0-9]{24}-[a-f0-9]{34}",  # Postman API keys
    r"key-(?<!\wkey-)[a-f0-9]{32}(?![A-Za-z0-9])",  # Mailgun API keys (the old format)
    # AWS temporary session tokens have no prefix of their own but always open with the base64 of the
    # same serialised header (`\x17\n\x06zerr/aws...` before 2019, `!\n\torigin_ec...` since).
    r"FwoGZXIvYXdzE(?<!\wFwoGZXIvYXdzE)[A-Za-z0-9+/=]{40,}",
    r"IQoJb3JpZ2luX2Vj(?<!\wIQoJb3JpZ2luX2Vj)[A-Za-z0-9+/=]{40,}",
    # age secret keys: the bech32 alphabet, 58 characters after the human-readable part.
    r"AGE-SECRET-KEY-1(?<!\wAGE-SECRET-KEY-1)[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}",
    # Discord webhooks: the path after the id is the credential (discord.com and discordapp.com).
    r"discord(?:app)?\.com/api/webhooks/[0-9]{5,}/(?P<secret_discord_hook>[A-Za-z0-9_\-]{20,})",
    # Sentry DSNs, https://<public key>[:<secret key>]@o1.ingest.sentry.io/2: the key is what lets anyone send
    # events to the project. 32 hex characters are the only user part a DSN has.
    r"://(?P<secret_dsn>[a-f0-9]{32}(?::[a-f0-9]{32})?)@",
    # Firebase Cloud Messaging legacy server keys: AAAA<7>:APA91b<134>.
    r"AAAA(?<![\w\-]AAAA)[A-Za-z0-9_\-]{7}:APA91b[A-Za-z0-9_\-]{100,}",
    # Terraform Cloud / Enterprise API tokens, <14>.atlasv1.<60+>: from the marker on (a leading literal
    # keeps the scan cheap; the 14-character id before it is left, like Discord's user id).
    r"atlasv1\.(?<=[A-Za-z0-9]{14}\.atlasv1\.)[A-Za-z0-9_\-=]{60,}",
)



def _also_after_json_escapes(pattern: str) -> str:
    """`pattern` with each word-boundary look-behind (`(?<!\\wsk-)`: no word character right before the
    prefix) also accepting a JSON escape there: in a raw body a key at the start of a line reads
    `\\nsk-...`, and the `n` of the escape is a word character."""
    return re.sub(r"\(\?<!(\\w|\[\\w\\-\])([^()]*)\)",
                  lambda m: f"(?:(?<!{m.group(1)}{m.group(2)})|(?<=\\\\[nrtbf]{m.group(2)}))", pattern)


DEFAULT_PATTERNS = tuple(_also_after_json_escapes(p) for p in DEFAULT_PATTERNS)

# Key names whose value is a credential wherever they appear, lower case: `password: x`,
# `"apiKey": "x"`, `DB_PASSWORD=x`, `aws_secret_access_key = x` (an AWS secret key has
# no format of its own, only its name). One literal start each (see the module doc).
SECRET_KEY_NAMES: tuple[str, ...] = (
    r"pass(?:word|wd|phrase)",
    r"secret(?:[_-]?(?:access[_-]?)?key)?",
    r"api[_-]?key",
    r"access[_-]?token",
    r"auth[_-]?token",
    r"refresh[_-]?token",
    r"private[_-]?token",
    r"identity[_-]?token",  # Docker's config.json
    r"account[_-]?key",  # Azure storage connection strings: AccountKey=...
    r"shared[_-]?access[_-]?key",  # Azure Service Bus / Event Hubs: SharedAccessKey=...
    r"session[_-]?token",  # AWS_SESSION_TOKEN=..., aws_session_token = ... (any provider's, too)
    r"client[_-]?key[_-]?data",  # kubeconfig: client-key-data is the user's private key, base64
)
# After the name: its closing quote (JSON escapes it inside a string), `:` or `=`,
# then a quoted value up to its quote, or a bare one up to white space or punctuation.
# A type annotation (`api_key: str`, common in the code agents read) is not a value.
_KEY_VALUE = (r"\\?[\"']?[ \t]*[:=][ \t]*(?:\\?[\"'](?P<secret_quoted>[^\"'\\\r\n]+)"
              r"|(?!(?:str|int|bool|bytes|none|optional|any|string|number)\b)"
              r"(?P<secret_bare>[^\s\"'\\,;{}()\[\]<>]+))")
DEFAULT_FOLDED_PATTERNS: tuple[str, ...] = (
    *(name + _KEY_VALUE for name in SECRET_KEY_NAMES),
    # Bearer tokens in any case (`bearer`, `BEARER`) pasted into prompts or custom headers; the
    # length floor keeps the phrase "Bearer tokens" readable.
    r"bearer(?<!\wbearer)\s+[a-z0-9._~+/\-]{16,}=*",
    # HTTP Basic credentials after an Authorization header name (`curl -H "Authorization: Basic ..."`,
    # `{"Authorization": "Basic ..."}`); "basic" alone is a word, so the header name is required.
    r"authorization(?<!\wauthorization)[\\\"' \t]*[:=][\\\"' \t]*basic[ \t]+(?P<secret_basic>[a-z0-9+/]{6,}={0,2})",
    # netrc: `machine h login u password p` (one line, or login and password on lines of their own).
    r"login(?<!\wlogin)[ \t]+[^\s\\]+(?:[ \t\r\n]|\\[nrt])+password(?:[ \t]|\\t)+(?P<secret_netrc>[^\s\\\"']+)",
)
# A dict key ending in one of those names: its scalar value is redacted whole. So is the value of
# a key naming a credential header or Docker's `auth` inside structured JSON (a tool's input:
# `{"headers": {"Authorization": "Basic ..."}}`), where the text patterns, which need the key
# and the value side by side, do not see them together.
_SECRET_KEY = re.compile("(?:" + "|".join(SECRET_KEY_NAMES) + ")$"
                         r"|(?:^|[-_ ])(?:authorization|credentials?)$|^(?:x-)?auth$")


def _compile(patterns: Iterable[str | re.Pattern[str]], flags: int = 0) -> list[re.Pattern[str]]:
    compiled = []
    for p in patterns:
        try:
            compiled.append(p if isinstance(p, re.Pattern) else re.compile(p, flags))
        except re.error as exc:
            raise InvalidRequest(f"bad redaction pattern {p!r}: {exc}") from exc
    return compiled


class Redactor:
    """Drops credential headers and masks secret-shaped strings.

    Args:
        patterns: regexes (strings or compiled) whose matches are replaced by
            `[REDACTED]` (only their `secret...` groups, where they have any);
            defaults to `DEFAULT_PATTERNS`. Giving them also drops the default
            folded patterns unless `folded_patterns` is given too.
        folded_patterns: regexes written in lower case, matched against the
            lower-cased text (case-insensitive key names); defaults to
            `DEFAULT_FOLDED_PATTERNS`.
        drop_headers: header names (any case) removed entirely, besides any
            name that says it carries a credential (`CREDENTIAL_HEADER_NAME`).
    """

    def __init__(
        self,
        patterns: Iterable[str | re.Pattern[str]] | None = None,
        drop_headers: Iterable[str] = DROPPED_HEADERS,
        folded_patterns: Iterable[str | re.Pattern[str]] | None = None,
    ):
        self.patterns = _compile(DEFAULT_PATTERNS if patterns is None else patterns)
        if folded_patterns is None:
            folded_patterns = DEFAULT_FOLDED_PATTERNS if patterns is None else ()
        self.folded = _compile(folded_patterns)
        # For text whose lower-casing changes its length (a few non-ASCII letters,
        # e.g. U+0130): the same patterns, case-insensitive, over the text itself.
        self._folded_ci = [re.compile(p.pattern, p.flags | re.IGNORECASE) for p in self.folded]
        self._groups = {p: _secret_groups(p) for p in (*self.patterns, *self.folded, *self._folded_ci)}
        self._literals = {p: _leading_literal(p.pattern) if isinstance(p.pattern, str)
                          and not p.flags & re.IGNORECASE else ""
                          for p in (*self.patterns, *self.folded)}
        self.drop_headers = frozenset(h.lower() for h in drop_headers)
        self._header_verdicts: dict[str, bool] = {}

    def text(self, value: str) -> str:
        return self._text(value)

    def _text(self, value: str, skip: frozenset = frozenset(), absent: set | None = None) -> str:
        """`text`, leaving out the patterns in `skip` (their literal is known to be absent; see
        `skippable`), and adding to `absent` each pattern whose literal `value` does not hold."""
        spans: list[tuple[int, int]] = []
        literals = self._literals
        for pattern in self.patterns:
            if pattern in skip:
                continue
            # `in` is a fast substring search: a body without "sk-" skips that pattern's scan.
            if literals[pattern] in value:
                self._collect(pattern, value, spans)
            elif absent is not None:
                absent.add(pattern)
        folded = [p for p in self.folded if p not in skip] if skip else self.folded
        if folded:
            low = value.lower()
            if len(low) == len(value):
                for pattern in folded:
                    if literals[pattern] in low:
                        self._collect(pattern, low, spans)
                    elif absent is not None:
                        absent.add(pattern)
            else:  # no literal check here, so nothing is said absent (nor skipped)
                for pattern in self._folded_ci:
                    self._collect(pattern, value, spans)
        elif self.folded and not value.isascii() and len(value.lower()) != len(value):
            for pattern in self._folded_ci:
                self._collect(pattern, value, spans)
        if not spans:
            return value
        spans.sort()
        out, pos = [], 0
        for start, end in spans:
            if end <= pos:
                continue  # inside a span already replaced
            if start >= pos:
                out += [value[pos:start], REDACTED]
            pos = end
        out.append(value[pos:])
        return "".join(out)

    def _collect(self, pattern: re.Pattern[str], text: str, spans: list[tuple[int, int]]) -> None:
        groups = self._groups[pattern]
        for match in pattern.finditer(text):
            if not groups:
                spans.append(match.span())
            else:
                spans.extend(match.span(g) for g in groups if match.start(g) >= 0)

    def value(self, value: Any, skip: frozenset = frozenset()) -> Any:
        """Redacts every string inside a JSON-like value (keys included: some
        clients put keys in dict keys, e.g. `{"sk-...": "prod"}`); the scalar
        value of a key named like a credential (`"password": ...`) is replaced
        whole, as the folded patterns replace it in the raw body text. `skip`:
        patterns none of its strings can match (`skippable`)."""
        if isinstance(value, str):
            return self._text(value, skip)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if isinstance(k, str) and _is_secret_scalar(v) and self.folded and _SECRET_KEY.search(k.lower()):
                    out[self._text(k, skip)] = REDACTED
                else:
                    out[self._text(k, skip) if isinstance(k, str) else k] = self.value(v, skip)
            return out
        if isinstance(value, (list, tuple)):
            return [self.value(v, skip) for v in value]
        return value

    def json_text(self, raw: str) -> tuple[str, frozenset]:
        """The redacted text of a JSON document `raw`, and the patterns that cannot match any string
        of the value it parses to, for `value(parsed, skip)`: one scan of a 30 MB body's literals
        instead of two (its text and then its strings), ~0.7 s less on two cores.

        A pattern is left out only when its leading literal is not in `raw` and is spelled the same
        inside a JSON string as outside it, and `raw` has no `\\u` or `\\/` escape: then every string
        of the value appears in `raw` character for character except for the escaped `"`, `\\` and
        control characters, none of which such a literal holds, so a string holding the literal would
        have put it in `raw`. The caller must check that the value is `raw`'s own parse."""
        absent: set = set()
        text = self._text(raw, absent=absent)
        if text is not raw or "\\u" in raw or "\\/" in raw:
            return text, frozenset()
        return text, frozenset(p for p in absent if _spelled_alike_in_json(self._literals[p]))

    def drops_header(self, name: str) -> bool:
        lower = name.lower()
        verdict = self._header_verdicts.get(lower)
        if verdict is None:
            verdict = lower in self.drop_headers or (
                lower not in KEPT_HEADERS and CREDENTIAL_HEADER_NAME.search(lower) is not None)
            if len(self._header_verdicts) < 4096:
                self._header_verdicts[lower] = verdict
        return verdict

    def headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        if not headers:
            return {}
        return {name: self.text(str(val)) for name, val in headers.items() if not self.drops_header(name)}


def _spelled_alike_in_json(literal: str) -> bool:
    """Whether `literal` reads the same inside a JSON string as outside it (no JSON escape is needed
    for, or `\\/` allowed on, any of its characters), lower-cased too (ASCII: no context-dependent
    lower case). "" (no literal) is never skipped."""
    return bool(literal) and literal.isascii() and not any(c in '"\\/' or c < " " for c in literal)


def _is_secret_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != ""


def _leading_literal(pattern: str) -> str:
    """The plain text every match of `pattern` starts with ("" if none can be read
    off simply), e.g. `sk-` for `sk-(?<!...)...`; a character followed by a
    quantifier is not part of it, and an alternation at the top level gives ""."""
    if "|" in pattern and not pattern.startswith("(?"):
        depth = 0
        for ch in pattern:  # a top-level `|` means no common start (escapes aside: rare, safe)
            depth += ch == "("
            depth -= ch == ")"
            if ch == "|" and depth == 0:
                return ""
    out = []
    for i, ch in enumerate(pattern):
        if not (ch.isalnum() or ch in "-_ :/@#%&~,;<>=!'\"") or ch == "\\":
            break
        if i + 1 < len(pattern) and pattern[i + 1] in "?*{+":
            break
        out.append(ch)
    return "".join(out)


def _secret_groups(pattern: re.Pattern[str]) -> list[int]:
    return [i for name, i in pattern.groupindex.items() if name.startswith("secret")]


DEFAULT_REDACTOR = Redactor()
