"""The scheduler composes parts that own their state (docs/ARCHITECTURE.md, "Running and paused
sequences"): no mixins, each part reads only the state it assigns itself, nothing but one adapter
module reads a private field of another object (mlx-lm's batch), and the product loop carries no
test hook (tests force pauses through testsupport/forced_pauses.py, around the steps)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from engine.admission import Admission
from engine.decode_batch import DecodeBatch
from engine.memory_pressure import MemoryPressure
from engine.scheduler import Scheduler
from engine.sequence import Sequence

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"engine/admission.py": "Admission", "engine/decode_batch.py": "DecodeBatch",
         "engine/memory_pressure.py": "MemoryPressure"}
SCHEDULER_MODULES = ["engine/scheduler.py", *PARTS]


def class_node(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((ROOT / path).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def self_attributes(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(attributes the class's methods read on self, those it assigns on self or defines)."""
    read, owned = set(), set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.Assign, ast.AnnAssign)):
            owned |= {node.name} if isinstance(node, ast.FunctionDef) else {
                t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (owned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, owned


def test_the_scheduler_is_no_mixin_and_its_parts_are_plain_classes():
    for cls in (Scheduler, Admission, DecodeBatch, MemoryPressure):
        assert cls.__bases__ == (object,), cls


def test_each_part_reads_only_the_state_it_owns():
    for path, name in PARTS.items():
        read, owned = self_attributes(class_node(path, name))
        assert read - owned == set(), f"{name} reads state it does not own"


def test_only_the_adapter_reads_another_objects_private_fields():
    found = []
    for path in SCHEDULER_MODULES:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path}:{node.lineno} .{node.attr}")
    assert found == []


def test_sequences_carry_no_test_hook():
    """The pause and park points the tests force live in testsupport/forced_pauses.py, not on the
    product's Sequence, which the decode and prefill loops would otherwise check at every step."""
    fields = {f.name for f in dataclasses.fields(Sequence)}
    assert not fields & {"pause_at", "park_at"}
    for path in SCHEDULER_MODULES:
        assert "test hook" not in (ROOT / path).read_text(), path
