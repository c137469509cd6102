"""The `prefixtrace` command: thin shells over library calls.

Each command builds a library object, makes one call, and turns a
`PrefixtraceError` into a `click.ClickException`; no SQL or model code here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click

from prefixtrace import cli_analyze, cli_compare, cli_recorder
from prefixtrace.cli_common import JSON_OPTION, FiniteFloatRange, echo_json, library_errors as _library_errors
from prefixtrace.config import CONFIG_ENV, find_config, load_default_map, mirror_env, resolved, user_config_path
from prefixtrace.config_trust import announcement, is_trusted, screen
from proxy.upstream_timeouts import UpstreamTimeouts
from prefixtrace.common.urls import display_url


@click.group()
@click.option("--config", "config_file", metavar="FILE", envvar=CONFIG_ENV, show_envvar=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="TOML file of option defaults, one table per command (default: ./prefixtrace.toml, else "
                   "~/.config/prefixtrace/prefixtrace.toml). A flag beats its environment variable, which beats "
                   "this file. See docs/CONFIG.md.")
@click.version_option(package_name="prefixtrace")
@click.pass_context
@_library_errors
def cli(ctx, config_file):
    """prefixtrace: a caching reverse proxy and prompt-stability analyzer for coding-agent traffic.

    Serve an OpenAI-compatible endpoint (embedded MLX engine or any upstream),
    record every turn to SQLite, and find where each prompt stopped extending
    the previous one.

    Example: prefixtrace serve && prefixtrace analyze prefixtrace.db
    """
    path = find_config(config_file)
    ctx.meta["prefixtrace.config_file"] = path
    ctx.meta["prefixtrace.config_trusted"] = path is not None and is_trusted(path, config_file is not None,
                                                                             user_config_path())
    if path is not None:
        ctx.default_map = load_default_map(path, cli)
        if not ctx.meta["prefixtrace.config_trusted"]:  # found in the working directory: docs/CONFIG.md "Trust"
            screened = screen(ctx.default_map, cli)
            ctx.default_map = screened.default_map
            ctx.meta["prefixtrace.config_withheld"] = screened.withheld
            for line in announcement(path, screened):
                click.echo(line, err=True)


def _layer_indices(value) -> tuple[int, ...]:
    """'-1' / '0,-1' / 'none' -> layer indices (a tuple passes through: defaults from a config file)."""
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value)
    text = str(value).strip().lower()
    if text in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer indices or 'none', got {value!r}") from None


def _fix_names(ctx, param, value) -> list[str]:
    """`--fix a,b --fix c` as known fix names; an unknown one is a one-line usage error listing them."""
    from analyzer.fixes import parse_fix_names
    from prefixtrace.common.errors import PrefixtraceError

    try:
        return parse_fix_names(list(value or ()))
    except PrefixtraceError as exc:
        raise click.BadParameter(exc.message) from None


def _upstream_urls(ctx, param, values):
    """Each --upstream must be an http(s) URL with a host: anything else would be accepted and then fail every request."""
    for value in values:
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0-65535
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # such a port, or an unclosed [IPv6 bracket
            ok = False
        if not ok:
            raise click.BadParameter(f"{display_url(value)!r} is not an http:// or https:// URL with a host.", ctx, param)
    return values


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind. Loopback unless you ask otherwise.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--db", default="prefixtrace.db", show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="SQLite database that records every turn (relative to the current directory).")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An mlx-lm model directory. Default: the bundled SmolLM2-135M-Instruct.")
@click.option("--upstream", "upstreams", metavar="URL", multiple=True, callback=_upstream_urls,
              help="Forward to this OpenAI/Anthropic-compatible server instead of the embedded engine. Repeat it "
                   "for several: each session sticks to one, with health checks and failover (docs/DASHBOARD.md).")
@click.option("--upstream-connect-timeout-s", default=UpstreamTimeouts.connect_s, show_default=True,
              type=FiniteFloatRange(min=0, min_open=True),
              help="With --upstream: seconds to open a connection to it; then a 504 (a pool tries its next upstream).")
@click.option("--upstream-first-byte-timeout-s", default=UpstreamTimeouts.first_byte_s, show_default=True,
              type=FiniteFloatRange(min=0, min_open=True),
              help="With --upstream: seconds from sending a request to the reply's first byte (a non-streamed "
                   "reply comes whole, after its generation); then a 504, recorded (docs/CONFIG.md).")
@click.option("--upstream-idle-timeout-s", default=UpstreamTimeouts.idle_s, show_default=True,
              type=FiniteFloatRange(min=0, min_open=True),
              help="With --upstream: the longest silence once a reply has started; then a 504, or an error event "
                   "in a stream already under way, recorded (docs/CONFIG.md).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
              help="Activation dtype of the embedded engine. Default: the fastest measured on this platform.")
@click.option("--cache-memory-gb", type=FiniteFloatRange(min=0),
              help="Byte budget of the in-memory prefix cache. Default: 30% of the memory the ceiling leaves after "
                   "the weights (accelerator memory, else RAM; docs/PERFORMANCE.md).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory of the prefix cache's disk tier; a restarted server reuses the prompts cached there.")
@click.option("--cache-disk-gb", default=16.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="Byte budget of the disk tier (with --cache-dir).")
@click.option("--block-size", type=click.IntRange(1), help="Tokens per prefix-cache block. Default: 256 (docs/CACHE.md).")
@click.option("--prefill-chunk", type=click.IntRange(1),
              help="Tokens per prefill chunk; decoding rows run between chunks. Default: measured per device "
                   "(512 on the CPU, 4096 on a GPU; docs/PERFORMANCE.md).")
@click.option("--memory-ceiling-gb", type=FiniteFloatRange(min=0, min_open=True),
              help="Memory for weights + KV + prefill peak. Default: 3/4 of this machine's (or the accelerator's) "
                   "memory, less the prefix cache's budget.")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1), help="Most requests decoding together.")
@click.option("--kv-quant", default="none", show_default=True, type=click.Choice(["none", "turboquant"]),
              help="KV cache storage of the embedded engine: dense, or TurboQuant codes (docs/TURBOQUANT.md).")
@click.option("--kv-bits", default=4, show_default=True, type=click.IntRange(1, 8), help="Bits per coordinate with --kv-quant turboquant.")
@click.option("--kv-dense-layers", default="-1", show_default=True, metavar="INDICES",
              callback=lambda ctx, param, value: _layer_indices(value),
              help="With --kv-quant turboquant: layers whose KV stays dense, comma-separated (negative counts from "
                   "the end), or 'none'.")
@click.option("--mid-system-policy", default="inline", show_default=True, type=click.Choice(["fold", "inline", "strict"]),
              help="Later system/developer messages: merge into the head (re-prefills), keep in place as a marked "
                   "note, or reject with a 400 (docs/RENDER_POLICIES.md).")
@click.option("--thinking-retention", default="loop", show_default=True, type=click.Choice(["loop", "template", "all"]),
              help="Past reasoning in the prompt: keep it through the agent loop (strip at real user messages), "
                   "as the chat template does, or all of it (preserve_thinking).")
@click.option("--thinking-retention-guard-tokens", default=30000, show_default=True, type=click.IntRange(1),
              help="With --thinking-retention loop: reasoning kept in one loop past this many tokens is cut once.")
@click.option("--notice-pattern", metavar="REGEX",
              help="A user message whose text matches this at its start is a harness notice, not a real user turn "
                   "(default: docs/RENDER_POLICIES.md).")
@click.option("--max-tokens-policy", default="clamp", show_default=True, type=click.Choice(["clamp", "reject"]),
              help="A max_tokens beyond what fits after the prompt: lower it to what fits (the reply ends with "
                   "length / max_tokens, as llama.cpp, Ollama and LM Studio do), or refuse with a 400.")
@click.option("--allow-client-templates", is_flag=True,
              help="Accept a request's own chat template (chat_template_kwargs.chat_template), rendered in a "
                   "bounded sandbox process. Default: refused with a 400 (docs/SECURITY.md).")
@click.option("--allowed-hosts", metavar="NAMES",
              help="Comma-separated host names the Host header may carry ('*': any). Default: 127.0.0.1, localhost, "
                   "::1 and the --host address, so a web page under another name cannot drive the proxy "
                   "(docs/SECURITY.md).")
@click.option("--max-request-mb", default=32.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="Largest request body accepted; a bigger one is answered 413 and recorded without its body "
                   "(a 100k-token prompt with tools is ~1 MB) (docs/SECURITY.md).")
@click.option("--request-body-timeout-s", default=60.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="A request body must arrive whole within this; a slower one is answered 408 and recorded, and its "
                   "connection closed (docs/SECURITY.md).")
@click.option("--max-header-kb", default=64, show_default=True, type=click.IntRange(min=1),
              help="Largest request head (request line and headers); past it 431, recorded without the rest of the "
                   "head, and the connection closed (docs/SECURITY.md).")
@click.option("--recorder-stuck-after-s", default=30.0, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="A recorder write taking longer than this makes /health answer 503, and responses stop waiting "
                   "for their commit (the turn stays queued) (docs/SECURITY.md).")
@click.option("--default-temperature", type=FiniteFloatRange(min=0, max=2), metavar="T",
              help="Temperature of requests that set none (default: 1.0, OpenAI's). 0 makes agent runs "
                   "reproducible (docs/HARNESSES.md).")
@click.option("--default-frequency-penalty", type=FiniteFloatRange(min=-2, max=2), metavar="F",
              help="frequency_penalty of requests that set none (default 0, OpenAI's); over the reply's own tokens. "
                   "0.5 ends a small model's greedy repetition (docs/HARNESSES.md).")
@click.option("--tool-choice-default", default="auto", show_default=True,
              type=click.Choice(["auto", "required-after-user", "required-until-tool-result"]),
              help="Test aid for small models that rarely call tools on their own: with required-after-user, a request "
                   "with tools and no tool_choice whose last message is a user turn must call one (grammar-"
                   "constrained; the model picks the tool and arguments); after a tool result it answers freely. "
                   "required-until-tool-result forces only until the conversation holds a tool result "
                   "(docs/TOOLS.md).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), metavar="N",
              help="Output cap of requests that set none (max_tokens, max_completion_tokens, max_output_tokens); "
                   "default: up to the context's end. Codex sends none (docs/HARNESSES.md).")
@click.option("--grammar-max-string", default=4096, show_default=True, type=click.IntRange(min=1), metavar="CHARS",
              help="Longest string a grammar-forced reply (tool_choice required or named, response_format "
                   "json_schema) may write where the schema sets no maxLength, so a model repeating itself "
                   "inside a value still closes it (docs/TOOLS.md).")
@click.option("--store", "store", default="full", show_default=True, type=click.Choice(["full", "hashes"]),
              help="hashes: record no text, only a keyed hash and token count of each text (message, tool, reply), "
                   "the structure and the parameters; the analysis still finds where prompts part and what it cost "
                   "(docs/SECURITY.md 'Hash-only recording').")
@click.option("--otlp-endpoint", metavar="URL",
              help="Export one OpenTelemetry span per turn (GenAI attributes, the cache break's cause, cost and fix) "
                   "over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (/v1/traces is added to a bare "
                   "host); needs pip install 'prefixtrace[otel]' (docs/OBSERVABILITY.md).")
@click.option("--worker-name", metavar="NAME", callback=lambda ctx, param, value: _worker_name(value),
              help="How this server names itself in the X-Prefixtrace-Worker header of every response, which a "
                   "prefixtrace in front of a router records as the worker that served each turn. Default: "
                   "host:port (docs/FLEET.md).")
@click.option("--fix", "fixes", metavar="NAME[,NAME...]", multiple=True, callback=_fix_names,
              help="Repair each request in flight with these fixes, each off unless named: volatile, tool-order, "
                   "tool-args, thinking, breakpoints, session-key (docs/FIXES.md). A request no fix changes goes on "
                   "byte for byte; each fix that fires is recorded with its turn.")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--print-config", is_flag=True,
              help="Print each option's value and where it came from (flag, env, config, default) as JSON; start nothing.")
@_library_errors
def serve(host, port, db, model, upstreams, upstream_connect_timeout_s, upstream_first_byte_timeout_s,
          upstream_idle_timeout_s, dtype, cache_memory_gb, cache_dir, cache_disk_gb, block_size,
          memory_ceiling_gb, prefill_chunk, max_batch, kv_quant, kv_bits, kv_dense_layers, mid_system_policy,
          thinking_retention,
          thinking_retention_guard_tokens, notice_pattern, max_tokens_policy, allow_client_templates, allowed_hosts,
          max_request_mb, request_body_timeout_s, max_header_kb, recorder_stuck_after_s, default_temperature, default_frequency_penalty, tool_choice_default,
          default_max_tokens, grammar_max_string, store, otlp_endpoint, worker_name, fixes, log_level, print_config):
    """Run the OpenAI-compatible proxy and record every turn.

    Endpoints: POST /v1/chat/completions, POST /v1/responses (OpenAI Responses),
    POST /v1/messages (Anthropic), POST /v1/completions (raw prompt), all
    streamed and not; POST /v1/messages/count_tokens, GET /v1/models, GET
    /health (200 once the model is loaded), GET /ui (live dashboard), GET
    /metrics (Prometheus). Every response reports its cached prompt tokens.

    Example: prefixtrace serve --port 8765 --db traffic.db
    """
    if print_config:
        ctx = click.get_current_context()
        options = resolved(ctx, skip=("print_config",))
        options["upstreams"]["value"] = [display_url(u) for u in options["upstreams"]["value"] or ()]
        if options["otlp_endpoint"]["value"]:
            options["otlp_endpoint"]["value"] = display_url(options["otlp_endpoint"]["value"])
        root = ctx.find_root().meta
        echo_json({"config_file": root.get("prefixtrace.config_file"), "options": options,
                   "withheld_from_config": root.get("prefixtrace.config_withheld", [])})
        return
    if model is not None and upstreams:
        raise click.UsageError("--model serves a model with the embedded engine and --upstream forwards to another "
                               "server instead: give one of them, not both.")
    if upstreams:
        _warn_engine_only(click.get_current_context())
    # Before MLX is imported or the process re-executes itself: a busy port or an
    # unwritable --db is refused at once (serve claims the port again to keep it).
    from prefixtrace.preflight import check_database_writable, claim_port

    claim_port(host, port).close()
    check_database_writable(db)
    if otlp_endpoint:  # a missing extra or a bad URL: one line now, not after the model loads
        from prefixtrace.otel import require_sdk, traces_url

        traces_url(otlp_endpoint)
        require_sdk()
    from prefixtrace.serve import ServeConfig, serve as run_serve

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not upstreams and sys.platform == "linux":
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
    if dtype is None and not upstreams:
        from engine.cpu_runtime import default_dtype

        dtype = default_dtype()
    run_serve(ServeConfig(host=host, port=port, db=db, model=model, upstreams=list(upstreams), dtype=dtype,
                          upstream_timeouts=UpstreamTimeouts(upstream_connect_timeout_s, upstream_first_byte_timeout_s,
                                                             upstream_idle_timeout_s),
                          cache_memory_gb=cache_memory_gb, memory_ceiling_gb=memory_ceiling_gb, prefill_chunk=prefill_chunk, max_batch=max_batch,
                          cache_dir=cache_dir, cache_disk_gb=cache_disk_gb, block_size=block_size,
                          kv_quant=kv_quant, kv_bits=kv_bits, kv_dense_layers=kv_dense_layers,
                          mid_system_policy=mid_system_policy,
                          thinking_retention=thinking_retention,
                          thinking_retention_guard_tokens=thinking_retention_guard_tokens,
                          notice_pattern=notice_pattern, max_tokens_policy=max_tokens_policy, log_level=log_level,
                          allow_client_templates=allow_client_templates, max_request_mb=max_request_mb,
                          request_body_timeout_s=request_body_timeout_s, max_header_kb=max_header_kb,
                          recorder_stuck_after_s=recorder_stuck_after_s,
                          default_temperature=default_temperature, default_frequency_penalty=default_frequency_penalty,
                          tool_choice_default=tool_choice_default,
                          grammar_max_string=grammar_max_string, default_max_tokens=default_max_tokens,
                          otlp_endpoint=otlp_endpoint, store=store,
                          worker_name=worker_name, fixes=fixes,
                          allowed_hosts=None if allowed_hosts is None else
                          [h.strip() for h in allowed_hosts.split(",") if h.strip()]))


def _worker_name(value: str | None) -> str | None:
    """A header value: printable ASCII, at most 200 characters."""
    if value is not None and not (0 < len(value) <= 200 and value.isascii() and value.isprintable()):
        raise click.BadParameter("must be 1 to 200 printable ASCII characters")
    return value


# Options only the embedded engine reads (with --upstream the upstream renders, caches and batches).
ENGINE_ONLY = ("dtype", "cache_memory_gb", "cache_dir", "cache_disk_gb", "block_size", "memory_ceiling_gb",
               "prefill_chunk", "max_batch", "kv_quant", "kv_bits", "kv_dense_layers", "mid_system_policy",
               "thinking_retention", "thinking_retention_guard_tokens", "notice_pattern", "max_tokens_policy",
               "allow_client_templates", "default_temperature", "default_frequency_penalty", "tool_choice_default",
               "grammar_max_string", "default_max_tokens")


def _warn_engine_only(ctx: click.Context) -> None:
    """Engine options given on the command line or in the environment do nothing with --upstream:
    say so instead of ignoring them silently (from a config file they may serve other runs)."""
    given = {click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT}
    ignored = [f"--{name.replace('_', '-')}" for name in ENGINE_ONLY if ctx.get_parameter_source(name) in given]
    if ignored:
        click.echo(f"Warning: {', '.join(ignored)} only apply to the embedded engine; with --upstream they are "
                   "ignored.", err=True)


@cli.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Describe this mlx-lm model directory instead of the bundled default.")
@JSON_OPTION
@_library_errors
def models(model, as_json):
    """List the model the embedded engine serves, converting the bundled default on first use.

    Prints JSON either way; --json is accepted so scripts can pass it to every command.

    Example: prefixtrace models --json
    """
    from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir

    path = model or default_model_dir()
    name = model.name if model else DEFAULT_MODEL_NAME
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"{path} is not a model directory: cannot read its config.json ({exc})") from exc
    click.echo(json.dumps({"name": name, "aliases": ["default"], "path": str(path),
                           "model_type": config.get("model_type"),
                           "context_length": config.get("max_position_embeddings")}, indent=2))


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--url", default="http://127.0.0.1:8765", show_default=True,
              help="Use the proxy answering /health here when it proves it is your own prefixtrace serve (a URL you "
                   "give is used even unproven); else start `prefixtrace serve` on a free port for the harness's "
                   "run (stopped when it exits). See docs/HARNESSES.md.")
@click.option("--db", default="prefixtrace.db", show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Database the started proxy records to, and where the summary reads the session back (a "
                   "running proxy that proves itself names its own; for an unproven one: the --db it was started with).")
@click.option("--upstream", "upstreams", metavar="URL", multiple=True, callback=_upstream_urls,
              help="A started proxy forwards to this server instead of the embedded engine (repeatable).")
@click.option("--serve-args", metavar="ARGS", default="",
              help="More options for the started `prefixtrace serve`, as one shell-quoted string.")
@click.option("--model", metavar="NAME",
              help="Model the harness asks for. Default: the embedded engine's; with an upstream, the harness's own.")
@click.option("--prefill-rate", type=FiniteFloatRange(min=0, min_open=True), metavar="TOK_PER_S",
              help="Price re-prefilled tokens in seconds in the summary.")
@click.option("--exe", "executable", metavar="PATH", help="The harness's executable (default: found on PATH).")
@click.option("--session", metavar="ID", help="The session id to record under (default: run-HARNESS-TIME-RANDOM).")
@click.option("--fix", "fixes", metavar="NAME[,NAME...]", multiple=True, callback=_fix_names,
              help="The started proxy repairs each request with these fixes (`serve --fix`, docs/FIXES.md); a proxy "
                   "already answering at --url keeps its own.")
@click.argument("harness", type=click.Choice(["pi", "claude", "codex", "opencode", "qwen", "aider", "llm",
                                              "claude-code", "qwen-code"]))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@_library_errors
def run(url, db, upstreams, serve_args, model, prefill_rate, executable, session, fixes, harness, args):
    """Launch a coding-agent harness through the proxy and summarise its session.

    Points HARNESS (pi, claude, codex, opencode, qwen, aider, llm) at the proxy through a
    configuration of its own: the user's config files are read, never written
    (docs/HARNESSES.md). Its requests are recorded under a session id of their own; ARGS go
    to the harness unchanged, on this terminal. When it exits, the session's cache breaks
    (cause, where, tokens and seconds lost) are printed on stderr and its exit code is
    passed through.

    Example: prefixtrace run --db traffic.db claude -p "fix the failing test"
    """
    import shlex

    from prefixtrace.run import run as run_harness

    extra = shlex.split(serve_args)
    for upstream in upstreams:
        extra += ["--upstream", upstream]
    if fixes:
        extra += ["--fix", ",".join(fixes)]
    root = click.get_current_context().find_root().meta
    if root.get("prefixtrace.config_trusted"):  # the started serve reads the same config file, trusted as here
        os.environ[CONFIG_ENV] = str(root["prefixtrace.config_file"])
    url_given = click.get_current_context().get_parameter_source("url") != click.core.ParameterSource.DEFAULT
    code = run_harness(harness, list(args), url=url, db=db, serve_args=extra, model=model,
                       prefill_rate=prefill_rate, executable=executable, session=session, url_given=url_given)
    sys.exit(code)


for _command in (cli_analyze.analyze, cli_analyze.check, cli_compare.compare, *cli_recorder.COMMANDS):
    cli.add_command(_command)
mirror_env(cli)  # PREFIXTRACE_<COMMAND>_<FLAG> for every option; serve's also PREFIXTRACE_<FLAG>


def main():
    cli()


if __name__ == "__main__":
    main()
