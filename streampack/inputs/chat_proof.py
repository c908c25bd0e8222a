"""A proof, on a chat template's syntax tree, that the messages' contents are only printed.

Where it holds, a render is the render of the conversation's *shape* (its messages' roles and other fields,
with each content replaced by a marker) with each marker replaced by its content, as given or stripped
(``| trim``): nothing the template decides (a branch, a loop, a filter, a call) depends on a content. An
SFT build then renders once per shape instead of rendering each conversation and its prefixes
(:mod:`streampack.inputs.sft`).

The analysis is a conservative taint analysis. Every value a template computes is of one kind: derived from
no content (``clean``), a string that holds contents (``content``), a message or a list of messages. A kind
flows through names (every assignment of a name counts, wherever it is), and each use is allowed or not: a
content may be printed, concatenated, assigned, stripped where it is read (``message['content'] | trim``)
and tested for its type; a message may be read by a constant key, tested for a key (``'tool_calls' in
message``) or for its type; a list of messages may be iterated, indexed, sliced and counted. Anything else
(a content in a comparison, a filter or a call; a message printed, passed or serialised; a statement this
module does not know) leaves the template unproven, and every conversation is rendered as before.

One test of a content is allowed, with a condition: its truth (``{% if message.content %}``, as Qwen's
templates write it), in the test of an ``if``, a loop's filter or a conditional expression, alone or under
``not``, ``and``, ``or``. A marker is true, and so is every content that is not blank, stripped or not: the
proof then holds for the conversations whose contents are all not blank (:attr:`Proof.needs_non_blank`),
and the others are rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLEAN, CONTENT, MESSAGE, MESSAGES = "clean", "content", "message", "messages"
_CONTENT_KEY = "content"
# What a type test says of a content (always a string), a message (a dict) or the list of messages: the
# same for every conversation (``message.content is string or message.content is iterable``).
_TYPE_TESTS = {
    CONTENT: {"string", "iterable", "sequence", "mapping", "defined", "undefined", "none"},
    MESSAGE: {"mapping", "defined", "undefined", "none"},
    MESSAGES: {"iterable", "sequence", "defined", "undefined", "none"},
}
# ``loop.previtem`` and ``loop.nextitem`` are messages in a loop over messages.
_LOOP_ITEMS = {"previtem", "nextitem"}
_DICT_METHODS = set(dir(dict))


class Unproven(Exception):
    """Where the template may let a content decide what it renders (the message is the reason)."""


@dataclass(frozen=True)
class Proof:
    """What the analysis of a template found.

    Attributes:
        unproven: why the contents may decide what it renders; None where they are proven only printed.
        needs_non_blank: the proof holds only for conversations whose contents are all not blank (the
            template tests a content's truth).
    """

    unproven: str | None
    needs_non_blank: bool = False


def content_only_printed(source: str, environment: Any) -> Proof:
    """Whether the contents of the chat template ``source`` (parsed in the Jinja ``environment`` it renders
    in) are proven only printed (see the module docstring)."""
    analysis = _Analysis()
    try:
        analysis.run(environment.parse(source))
    except Unproven as e:
        return Proof(str(e))
    return Proof(None, analysis.tests_truth)


class _Analysis:
    """Each name's kinds, grown over passes until no assignment adds one."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {"messages": {MESSAGES}}
        self.grew = False
        self.tests_truth = False  # a content's truth is tested (see the module docstring)

    def run(self, tree: Any) -> None:
        for _ in range(20):
            self.grew = False
            self.statements(tree.body)
            if not self.grew:
                return
        raise Unproven("the names' kinds do not settle")

    # --- statements -------------------------------------------------------------------------------------

    def statements(self, nodes: list[Any]) -> bool:
        """Check ``nodes``; whether they print a content."""
        printed = False
        for node in nodes:
            printed |= self.statement(node)
        return printed

    def statement(self, node: Any) -> bool:
        kind = type(node).__name__
        if kind == "Output":
            return any(self.printed(n) for n in node.nodes)
        if kind == "If":
            self.truth(node.test, "an if's test")
            branches = [node.body, *(branch.body for branch in node.elif_), node.else_]
            for branch in node.elif_:
                self.truth(branch.test, "an elif's test")
            return any([self.statements(branch) for branch in branches])
        if kind == "For":
            return self.loop(node)
        if kind == "Assign":
            self.assign(node.target, self.kind(node.node))
            return False
        if kind == "AssignBlock":
            printed = self.statements(node.body)
            if printed and node.filter is not None:
                raise Unproven("a {% set %} block that holds a content is filtered")
            self.assign(node.target, CONTENT if printed else CLEAN)
            return False
        if kind == "Macro":
            for arg in node.args:
                self.assign(arg, CLEAN)
            for default in node.defaults:
                self.clean(default, "a macro's default")
            if self.statements(node.body):
                raise Unproven(f"macro {node.name!r} prints a content (its output could be tested)")
            self.assign_name(node.name, CLEAN)
            return False
        if kind in ("Break", "Continue"):
            return False
        raise Unproven(f"a {{% {kind.lower()} %}} statement is not analysed")

    def loop(self, node: Any) -> bool:
        if node.recursive:
            raise Unproven("a recursive loop")
        over = self.kind(node.iter)
        if over == MESSAGES and type(node.target).__name__ == "Name":
            self.assign_name(node.target.name, MESSAGE)
        elif over == CLEAN:
            self.assign(node.target, CLEAN)
        else:
            raise Unproven(f"a loop over {_what(over)}")
        if node.test is not None:
            self.truth(node.test, "a loop's filter")
        body = self.statements(node.body)
        return self.statements(node.else_) or body

    def printed(self, node: Any) -> bool:
        if type(node).__name__ == "TemplateData":
            return False
        kind = self.kind(node)
        if kind in (MESSAGE, MESSAGES):
            raise Unproven(f"{_what(kind)} printed whole")
        return kind == CONTENT

    def assign(self, target: Any, kind: str) -> None:
        target_kind = type(target).__name__
        if target_kind == "Name":
            self.assign_name(target.name, kind)
        elif target_kind == "Tuple" and kind == CLEAN:
            for item in target.items:
                self.assign(item, CLEAN)
        elif target_kind == "NSRef" and kind == CLEAN:
            pass  # a namespace's attribute: read back as clean, which it is
        else:
            raise Unproven(f"{_what(kind)} assigned to a {target_kind}")

    def assign_name(self, name: str, kind: str) -> None:
        kinds = self.names.setdefault(name, set())
        if kind not in kinds:
            kinds.add(kind)
            self.grew = True

    # --- expressions ------------------------------------------------------------------------------------

    def truth(self, node: Any, where: str) -> None:
        """A test, whose value counts only as true or false: a content's truth is allowed (and recorded)."""
        if type(node).__name__ in ("Not", "And", "Or"):
            for operand in node.iter_child_nodes():
                self.truth(operand, where)
            return
        kind = self.kind(node)
        if kind == CONTENT:
            self.tests_truth = True
        elif kind != CLEAN:
            raise Unproven(f"{_what(kind)} in {where}")

    def clean(self, node: Any, where: str) -> None:
        kind = self.kind(node)
        if kind != CLEAN:
            raise Unproven(f"{_what(kind)} in {where}")

    def kind(self, node: Any) -> str:
        """The kind of the value of expression ``node``; Unproven where a use is not allowed.

        An expression without a method here (a constant, a slice, a list) is clean where its parts are."""
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            for child in node.iter_child_nodes():
                self.clean(child, f"a {type(node).__name__} expression")
            return CLEAN
        kind: str = method(node)
        return kind

    def _Name(self, node: Any) -> str:
        kinds = self.names.get(node.name, {CLEAN})
        if kinds <= {CLEAN, CONTENT}:
            return CONTENT if CONTENT in kinds else CLEAN
        if len(kinds) == 1:
            (kind,) = kinds
            return kind
        raise Unproven(f"name {node.name!r} holds {' or '.join(sorted(map(_what, kinds)))}")

    def _Getattr(self, node: Any) -> str:
        if _is_loop(node.node) and node.attr in _LOOP_ITEMS:
            raise Unproven(f"loop.{node.attr}")
        return self.read(self.kind(node.node), node.attr, f".{node.attr}", attribute=True)

    def _Getitem(self, node: Any) -> str:
        owner = self.kind(node.node)
        if owner == MESSAGES:
            is_slice = type(node.arg).__name__ == "Slice"
            self.clean(node.arg, "an index of the messages")
            return MESSAGES if is_slice else MESSAGE
        if owner == MESSAGE and not _is_str_const(node.arg):
            raise Unproven("a message read by a computed key")
        key = node.arg.value if owner == MESSAGE else None
        if owner == CLEAN:
            self.clean(node.arg, "an index")
        return self.read(owner, key, "[...]", attribute=False)

    def read(self, owner: str, key: str | None, how: str, *, attribute: bool) -> str:
        if owner == CLEAN:
            return CLEAN
        if owner == MESSAGE and not (attribute and key in _DICT_METHODS):
            return CONTENT if key == _CONTENT_KEY else CLEAN
        raise Unproven(f"{_what(owner)} read as {how}")

    def _Add(self, node: Any) -> str:
        return self.joined([node.left, node.right])

    def _Concat(self, node: Any) -> str:
        return self.joined(node.nodes)

    def joined(self, nodes: list[Any]) -> str:
        kinds = {self.kind(n) for n in nodes}
        if kinds <= {CLEAN, CONTENT}:
            return CONTENT if CONTENT in kinds else CLEAN
        raise Unproven(f"{' and '.join(sorted(map(_what, kinds - {CLEAN, CONTENT})))} joined to text")

    def _Filter(self, node: Any) -> str:
        self.arguments(node, f"filter {node.name!r}")
        owner = CLEAN if node.node is None else self.kind(node.node)
        if owner == CLEAN:
            return CLEAN
        if owner == CONTENT and node.name == "trim" and not node.args and _is_content_read(node.node):
            return CONTENT  # stripped where it is read: the render holds the content or its strip()
        if owner == MESSAGES and node.name in ("length", "count"):
            return CLEAN
        raise Unproven(f"{_what(owner)} filtered by {node.name!r}")

    def _Test(self, node: Any) -> str:
        self.arguments(node, f"test {node.name!r}")
        owner = self.kind(node.node)
        if owner == CLEAN or node.name in _TYPE_TESTS.get(owner, set()):
            return CLEAN
        raise Unproven(f"{_what(owner)} tested by {node.name!r}")

    def _Compare(self, node: Any) -> str:
        if (
            _is_str_const(node.expr)
            and len(node.ops) == 1
            and node.ops[0].op in ("in", "notin")
            and self.kind(node.ops[0].expr) == MESSAGE
        ):
            return CLEAN  # whether a message has a key: its shape
        self.clean(node.expr, "a comparison")
        for operand in node.ops:
            self.clean(operand.expr, "a comparison")
        return CLEAN

    def _CondExpr(self, node: Any) -> str:
        self.truth(node.test, "a conditional expression's test")
        kinds = {self.kind(n) for n in (node.expr1, node.expr2) if n is not None}
        if kinds <= {CLEAN, CONTENT}:
            return CONTENT if CONTENT in kinds else CLEAN
        if len(kinds) == 1:
            (kind,) = kinds
            return kind
        raise Unproven("a conditional expression of mixed kinds")

    def _Call(self, node: Any) -> str:
        self.clean(node.node, "a call")
        self.arguments(node, "a call")
        return CLEAN

    def arguments(self, node: Any, where: str) -> None:
        for arg in [*node.args, *(k.value for k in node.kwargs), node.dyn_args, node.dyn_kwargs]:
            if arg is not None:
                self.clean(arg, f"the arguments of {where}")


def _is_loop(node: Any) -> bool:
    return type(node).__name__ == "Name" and node.name == "loop"


def _is_str_const(node: Any) -> bool:
    return type(node).__name__ == "Const" and isinstance(node.value, str)


def _is_content_read(node: Any) -> bool:
    """``message['content']`` or ``message.content`` itself (not a name or a concatenation holding it)."""
    kind = type(node).__name__
    if kind == "Getattr":
        return bool(node.attr == _CONTENT_KEY)
    return kind == "Getitem" and _is_str_const(node.arg) and node.arg.value == _CONTENT_KEY


def _what(kind: str) -> str:
    return {CLEAN: "a value", CONTENT: "a content", MESSAGE: "a message", MESSAGES: "the messages"}[kind]
