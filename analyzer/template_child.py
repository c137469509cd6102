"""The chat-template render loop, run as its own process (analyzer/template_worker.py starts it).

Run as a script (`python -I template_child.py LIMITS`), not imported: it needs only jinja2, so it
starts in a tenth of a second without the analyzer. A template is a program (nested loops, a string
multiplied by 10**9); rendered here, under an address-space rlimit and with its output counted as
it is produced, its cost is this process's, which the parent kills at its deadline.

Protocol, one JSON object per line each way: first {"template"} -> {"ok"} or {"error"}; then each
{"keep", "append", "set", "unset", "generations"} (the messages kept from the last job and those
added, the context keys changed and removed) -> {"replies"}, one per `add_generation_prompt` value asked, each {"text"} or
{"error", "raised"?} ("raised": the template's own raise_exception); or {"error", "bound"} when a
render broke the memory or output bound.
The environment is Hugging Face's: ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks,
loopcontrols, a tojson that keeps key order and escapes nothing, raise_exception, and a fixed
strftime_now (the analysis must be reproducible).
"""

import json
import resource
import sys


class TemplateRaised(Exception):
    """The template called raise_exception."""


_TOJSON_MEMO = {}


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' version: no key sorting, no HTML escaping (jinja's own tojson does both).
    if type(x) is dict or type(x) is list:
        # Messages stay the same objects from job to job (only new ones are sent), so a tool call's
        # arguments are dumped again every later turn: memoise by identity (the object is kept in
        # the memo, so its id cannot be reused while the entry lives).
        key = (id(x), ensure_ascii, indent, None if separators is None else tuple(separators), sort_keys)
        hit = _TOJSON_MEMO.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        if len(_TOJSON_MEMO) > 200_000:
            _TOJSON_MEMO.clear()
        _TOJSON_MEMO[key] = (x, text)
        return text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise TemplateRaised(message)


def make_env():
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    dict_attrs = frozenset(dir(dict))  # `m.items` etc. stay methods, checked by the sandbox

    class FastSandbox(ImmutableSandboxedEnvironment):
        """The sandbox's attribute check costs ~2 us per `message.role`; a plain key of a plain dict
        (our messages, parsed from JSON) is data, not code, so it skips the check."""

        def getattr(self, obj, attribute):
            t = type(obj)
            if t is dict and attribute not in dict_attrs:
                try:
                    return obj[attribute]
                except (KeyError, TypeError):
                    return self.undefined(obj=obj, name=attribute)
            if (t is LoopContext or t is Namespace) and type(attribute) is str and not attribute.startswith("_"):
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
            return super().getattr(obj, attribute)

    env = FastSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "1970-01-01"
    return env


def render(template, context, max_chars):
    out, size = [], 0
    for piece in template.generate(**context):
        out.append(piece)
        size += len(piece)
        if size > max_chars:
            raise MemoryError(f"its output passed {max_chars:,} characters")
    return "".join(out)


def answer(result):
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def main():
    limits = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
    env = make_env()
    try:
        template = env.from_string(json.loads(sys.stdin.readline())["template"])
    except Exception as exc:
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return
    answer({"ok": True})
    messages, context = [], {}  # what the parent sent so far; each job says what changed
    for line in sys.stdin:
        job = json.loads(line)
        messages = messages[:job["keep"]] + job["append"]
        context.update(job["set"])
        for key in job["unset"]:
            context.pop(key, None)
        try:
            answer({"replies": [one(template, {**context, "messages": messages, "add_generation_prompt": generation},
                                    limits) for generation in job["generations"]]})
        except MemoryError as exc:  # a bound broken: the same for every later render
            answer({"error": str(exc) or f"it needed more than {limits['memory'] >> 20} MiB", "bound": True})


def one(template, context, limits):
    try:
        return {"text": render(template, context, limits["chars"])}
    except TemplateRaised as exc:
        return {"error": str(exc), "raised": True}
    except RecursionError:
        return {"error": "it recursed too deeply"}
    except MemoryError:
        raise
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    main()
