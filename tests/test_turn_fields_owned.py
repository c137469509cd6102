"""The turn record has two writers: the relay (proxy/relay.py), which feeds the builder what it learns of
the request and the reply, and the builder (recorder/turn_builder.py), which sets the fields. Everyone else
hands facts over (builder methods, reply events) or builds a `Turn` whole with keyword arguments.

Read from the source: an attribute assignment (`=`, `+=`, `x.f: T =`, `setattr(x, "f", ...)`) or an item
assignment inside a field (`turn.render["k"] = ...`) whose object is a turn is flagged. An object is a turn when it is
`<anything>.turn`, a name annotated `Turn` or bound to `Turn(...)` / `<anything>.turn` in the same
function, or, under proxy/, recorder/ and prefixtrace/ (where the word names the record), a name `turn`
(analyzer/ and engine/ call their own results `turn`; there only the typed bindings count)."""

import ast
from dataclasses import fields
from pathlib import Path

from recorder.turn import Turn

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("proxy", "recorder", "prefixtrace", "analyzer", "engine")
WORD_IS_THE_RECORD = ("proxy", "recorder", "prefixtrace")
OWNERS = {"proxy/relay.py", "recorder/turn_builder.py"}
# Writers not yet moved onto builder calls, as (path, field or None for all): none left.
NOT_YET: set[tuple[str, str | None]] = set()
FIELDS = {f.name for f in fields(Turn)}


def _is_turn_annotation(node: ast.expr | None) -> bool:
    return node is not None and any(isinstance(n, ast.Name) and n.id == "Turn" or
                                    isinstance(n, ast.Constant) and n.value == "Turn" for n in ast.walk(node))


def _binds_a_turn(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Turn":
        return True
    return isinstance(value, ast.Attribute) and value.attr == "turn"


def _turn_names(scope: ast.AST) -> set[str]:
    """The names a function (or module) binds to a turn, by annotation or by what it assigns."""
    names = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = scope.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if _is_turn_annotation(arg.annotation):
                names.add(arg.arg)
    for node in ast.walk(scope):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                _is_turn_annotation(node.annotation):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and _binds_a_turn(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _field_written(target: ast.expr) -> tuple[ast.expr, str] | None:
    """(object, field) when `target` writes a field (`o.f`) or inside one (`o.f[k]`, `o.f[k][j]`)."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and target.attr in FIELDS:
        return target.value, target.attr
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return [ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Store())]  # setattr(o, "f", v)
    if isinstance(node, ast.Assign):
        out = []
        for target in node.targets:
            out.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def turn_field_writes(path: Path, word_is_the_record: bool) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        turns = _turn_names(scope) | ({"turn"} if word_is_the_record else set())
        body = scope.body if scope is tree else [scope]
        for node in (n for part in body for n in ast.walk(part)):
            if scope is tree and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # a function's own walk covers it
            for target in _targets(node):
                written = _field_written(target)
                if written is None:
                    continue
                obj, name = written
                if isinstance(obj, ast.Attribute) and obj.attr == "turn" or \
                        isinstance(obj, ast.Name) and obj.id in turns:
                    found.append((node.lineno, name))
    return sorted(set(found))


def test_only_the_relay_and_the_builder_write_fields_of_the_turn():
    writes, allowed = [], set()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OWNERS:
                continue
            for line, name in turn_field_writes(path, folder in WORD_IS_THE_RECORD):
                exempt = {(rel, None), (rel, name)} & NOT_YET
                allowed |= exempt
                if not exempt:
                    writes.append(f"{rel}:{line} turn.{name}")
    assert writes == [], "fields of the turn written outside the relay and the builder:\n" + "\n".join(writes)
    assert allowed == NOT_YET, f"no longer written there, take them out of NOT_YET: {NOT_YET - allowed}"


def test_the_check_sees_each_way_of_writing_a_field(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "def a(builder):\n    builder.turn.usage = {}\n"
        "def b(t: Turn):\n    t.error += 'x'\n"
        "def c():\n    record = Turn(request_id='r')\n    record.render['k'] = 1\n"
        "def d(turn):\n    turn.session_id, turn.stream = 's', True\n"
        "def e(result):\n    result.error = 'not a turn'\n    result.turn_count = 2\n"
        "def f(self):\n    setattr(self.turn, 'status', 200)\n")
    assert turn_field_writes(source, True) == [(2, "usage"), (4, "error"), (7, "render"), (9, "session_id"),
                                                (9, "stream"), (14, "status")]
    assert turn_field_writes(source, False) == [(2, "usage"), (4, "error"), (7, "render"), (14, "status")]
