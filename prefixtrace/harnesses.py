"""How each coding-agent harness is pointed at a prefixtrace proxy, without touching the user's
own configuration (docs/HARNESSES.md, `prefixtrace run`).

One function per harness: `(target, scratch, environ) -> Launch`: the arguments to put before the
user's own, the environment variables to set, and the files it wrote under `scratch` (a directory
that lives as long as the harness runs). Each uses the harness's own way of layering one setting
over the user's (a command-line override, an environment variable, a config directory of its
own), so the user's other settings, credentials and session history stay in force and no file of
theirs is written:

- pi: `PI_CODING_AGENT_DIR` at a directory that links every entry of the user's agent directory
  (auth.json, settings.json, ...) but models.json, which is theirs plus a `prefixtrace` provider;
  sessions stay in the user's session directory (`PI_CODING_AGENT_SESSION_DIR`).
- Claude Code: `ANTHROPIC_BASE_URL` (and the model variables when the model is pinned).
- Codex: `-c` overrides of `model_provider` / `model_providers.prefixtrace` (CODEX_HOME, its
  auth and its history stay the user's).
- opencode: `OPENCODE_CONFIG_CONTENT`, which opencode merges over the user's config files.
- qwen-code: `--auth-type openai --openai-base-url` (flags beat its settings files).
- aider: `AIDER_OPENAI_API_BASE` / `AIDER_MODEL` (its environment beats its config files).
- llm: `LLM_USER_PATH` at a directory that links every entry of the user's (keys, logs.db, ...)
  but extra-openai-models.yaml (theirs plus a `prefixtrace` model), keys.json and
  default_model.txt (`prefixtrace`, so `llm "..."` without `-m` goes through the proxy).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

PROVIDER = "prefixtrace"  # the provider / model id each harness is given
KEY_ENV = "PREFIXTRACE_API_KEY"  # Codex reads its provider's key from a variable of this name


@dataclass
class Target:
    """Where a harness is sent.

    Args:
        base_url: the proxy's URL with no `/v1` (with `prefixtrace run`, ending in `/s/<session>`).
        model: the model to ask for.
        pin_model: override the harness's own model choice with `model` (the embedded engine
            serves only its own; with an upstream the user's choice stands unless they name one).
        api_key: the key given to a harness when the user has none of their own for it (the
            embedded engine needs none; an upstream gets the user's own).
        context_tokens / max_output_tokens: the model's limits, where a harness wants them.
    """

    base_url: str
    model: str = "default"
    pin_model: bool = True
    api_key: str = "prefixtrace"
    context_tokens: int | None = None
    max_output_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        """The output cap to declare: the given one, else 4096, at most a quarter of a known context."""
        if self.max_output_tokens:
            return self.max_output_tokens
        return min(4096, self.context_tokens // 4) if self.context_tokens else 4096

    @property
    def v1(self) -> str:
        return self.base_url.rstrip("/") + "/v1"


@dataclass
class Launch:
    args: list[str] = field(default_factory=list)  # before the user's own arguments
    env: dict[str, str] = field(default_factory=dict)  # set in the harness's environment
    files: list[Path] = field(default_factory=list)  # written under the scratch directory


def home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


def overlay(user_dir: Path, into: Path, own: set[str]) -> None:
    """`into` as a view of `user_dir`: a symlink to each of its entries but those named in `own`
    (which the caller writes). The user's directory is only read."""
    into.mkdir(parents=True, exist_ok=True)
    if user_dir.is_dir():
        for entry in sorted(user_dir.iterdir()):
            if entry.name not in own:
                (into / entry.name).symlink_to(entry)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def pi(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    user_dir = Path(environ.get("PI_CODING_AGENT_DIR") or home(environ) / ".pi" / "agent").expanduser()
    agent = scratch / "pi-agent"
    overlay(user_dir, agent, {"models.json"})
    models = _read_json(user_dir / "models.json")
    providers = models.get("providers") if isinstance(models.get("providers"), dict) else {}
    max_out = target.output_tokens
    providers[PROVIDER] = {
        "baseUrl": target.v1, "api": "openai-completions", "apiKey": environ.get("OPENAI_API_KEY") or target.api_key,
        # the system role works on every server (the embedded engine's templates have no developer
        # role); max_tokens is the field every OpenAI-compatible server reads
        "compat": {"supportsDeveloperRole": False, "maxTokensField": "max_tokens"},
        "models": [{"id": target.model, "contextWindow": target.context_tokens or 128000, "maxTokens": max_out}],
    }
    models["providers"] = providers
    (agent / "models.json").write_text(json.dumps(models, indent=1))
    env = {"PI_CODING_AGENT_DIR": str(agent)}
    if not environ.get("PI_CODING_AGENT_SESSION_DIR"):
        env["PI_CODING_AGENT_SESSION_DIR"] = str(user_dir / "sessions")  # the user's session history
    return Launch(["--provider", PROVIDER, "--model", target.model], env, [agent / "models.json"])


def claude(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    env = {"ANTHROPIC_BASE_URL": target.base_url}
    if not (environ.get("ANTHROPIC_API_KEY") or environ.get("ANTHROPIC_AUTH_TOKEN")):
        env["ANTHROPIC_API_KEY"] = target.api_key
    if target.pin_model:
        env.update({"ANTHROPIC_MODEL": target.model, "ANTHROPIC_SMALL_FAST_MODEL": target.model,
                    **{f"ANTHROPIC_DEFAULT_{m}_MODEL": target.model for m in ("HAIKU", "SONNET", "OPUS")}})
    return Launch([], env)


def _toml_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


def codex(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    # key by key, so a `[model_providers.prefixtrace]` table in the user's config.toml (timeouts,
    # retries) still applies to what is not set here
    table = f"model_providers.{PROVIDER}"
    args = ["-c", f"model_provider={_toml_str(PROVIDER)}", "-c", f"{table}.name={_toml_str(PROVIDER)}",
            "-c", f"{table}.base_url={_toml_str(target.v1)}", "-c", f"{table}.env_key={_toml_str(KEY_ENV)}",
            "-c", f'{table}.wire_api="responses"']
    if target.pin_model:
        args += ["-c", f"model={_toml_str(target.model)}"]
    return Launch(args, {KEY_ENV: environ.get("OPENAI_API_KEY") or target.api_key})


def opencode(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    model = {"name": target.model}
    if target.context_tokens:
        model["limit"] = {"context": target.context_tokens, "output": target.output_tokens}
    config = {"provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": "prefixtrace",
                                      "options": {"baseURL": target.v1,
                                                  "apiKey": environ.get("OPENAI_API_KEY") or target.api_key},
                                      "models": {target.model: model}}}}
    if target.pin_model:
        config.update(model=f"{PROVIDER}/{target.model}", small_model=f"{PROVIDER}/{target.model}")
    try:  # the user's own inline config stays, ours over it
        theirs = json.loads(environ.get("OPENCODE_CONFIG_CONTENT") or "{}")
    except ValueError:
        theirs = {}
    if isinstance(theirs, dict):
        providers = {**(theirs.get("provider") or {}), **config["provider"]}
        config = {**theirs, **config, "provider": providers}
    return Launch([], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


def qwen(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    args = ["--auth-type", "openai", "--openai-base-url", target.v1]
    env = {}
    if not environ.get("OPENAI_API_KEY"):
        env["OPENAI_API_KEY"] = target.api_key
    if target.pin_model:
        args += ["--model", target.model]
    return Launch(args, env)


def aider(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    env = {"AIDER_OPENAI_API_BASE": target.v1}
    if not (environ.get("OPENAI_API_KEY") or environ.get("AIDER_OPENAI_API_KEY")):
        env["AIDER_OPENAI_API_KEY"] = target.api_key
    if target.pin_model:
        env["AIDER_MODEL"] = f"openai/{target.model}"  # litellm's prefix for an OpenAI-compatible server
    return Launch([], env)


def llm_user_dir(environ: Mapping[str, str]) -> Path:
    """Where `llm` keeps its files: $LLM_USER_PATH, else click's app dir for io.datasette.llm."""
    if environ.get("LLM_USER_PATH"):
        return Path(environ["LLM_USER_PATH"]).expanduser()
    if sys.platform == "darwin":
        return home(environ) / "Library" / "Application Support" / "io.datasette.llm"
    return Path(environ.get("XDG_CONFIG_HOME") or home(environ) / ".config") / "io.datasette.llm"


def llm(target: Target, scratch: Path, environ: Mapping[str, str]) -> Launch:
    user_dir = llm_user_dir(environ)
    own = {"extra-openai-models.yaml", "keys.json", "default_model.txt"}
    path = scratch / "llm"
    overlay(user_dir, path, own)
    models = user_dir / "extra-openai-models.yaml"
    theirs = models.read_text() if models.is_file() else ""
    if theirs and not theirs.endswith("\n"):
        theirs += "\n"
    ours = (f"- model_id: {PROVIDER}\n  model_name: {json.dumps(target.model)}\n  api_base: {json.dumps(target.v1)}\n"
            f"  api_key_name: {PROVIDER}\n  supports_tools: true\n  can_stream: true\n")
    (path / "extra-openai-models.yaml").write_text(theirs + ours)
    keys = _read_json(user_dir / "keys.json")
    keys[PROVIDER] = environ.get("OPENAI_API_KEY") or target.api_key
    (path / "keys.json").write_text(json.dumps(keys))
    (path / "keys.json").chmod(0o600)
    (path / "default_model.txt").write_text(PROVIDER)
    return Launch([], {"LLM_USER_PATH": str(path)},
                  [path / "extra-openai-models.yaml", path / "keys.json", path / "default_model.txt"])


# harness name -> (its executable's name, how it is pointed at the proxy)
HARNESSES: dict[str, tuple[str, Callable[[Target, Path, Mapping[str, str]], Launch]]] = {
    "pi": ("pi", pi),
    "claude": ("claude", claude),
    "codex": ("codex", codex),
    "opencode": ("opencode", opencode),
    "qwen": ("qwen", qwen),
    "aider": ("aider", aider),
    "llm": ("llm", llm),
}
ALIASES = {"claude-code": "claude", "qwen-code": "qwen"}


def configure(name: str, target: Target, scratch: Path, environ: Mapping[str, str] | None = None) -> Launch:
    """How to launch harness `name` against `target` (files go under `scratch`)."""
    name = ALIASES.get(name, name)
    if name not in HARNESSES:
        raise KeyError(name)
    scratch.mkdir(parents=True, exist_ok=True)
    return HARNESSES[name][1](target, scratch, os.environ if environ is None else environ)
