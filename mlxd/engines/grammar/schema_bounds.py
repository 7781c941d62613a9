"""What a JSON Schema costs to enforce, checked before its grammar is compiled.

llguidance accepts some schemas it cannot enforce, and finds out only while
a request is decoding, or crashes on them (measured with llguidance 1.9):

* a schema with **no finite instance** (an object that requires a property
  of its own type, an array of itself with ``minItems: 1``) compiles; the
  first ``{`` then forces ``"c":{"c":...`` forever, and the matcher fails with
  "Too many items" at the first token;
* a **deep chain of references** (``$defs`` ``d0 -> d1 -> ... -> d1000``, even with
  every property optional) makes building the matcher overflow its stack: a
  segmentation fault that ends the daemon;
* a **huge forced instance** (a ``const`` of 10,000 characters, or required
  keys nesting thousands deep) costs milliseconds per token, on the model's
  thread, for the whole batch;
* an object with **many optional properties** (more than about 500) gives the
  parser a row of more items than its limit at the first ``{`` ("Current row
  has 4007 items; max is 2000" for 1,000), and one of 10,000 takes 28 s to
  build.

:func:`check_enforceable` measures each statically, in time linear in the
schema (times the reference depth for recursive schemas): the optional
properties of each object, the nesting depth with references followed (a reference already being followed counts once),
and the size in bytes of the smallest instance (compact JSON), a least fixed
point over the references, infinite when none is finite. It raises
:class:`~mlxd.errors.InvalidRequest` naming the field: a 400 before the
request is admitted, never an error in the middle of a batch.

The sizes are lower bounds (``pattern``, ``not``, ``if`` are not followed; an
``allOf`` is at least its largest part): a schema passing here can still
prove unenforceable while decoding, which then ends that request alone
(:mod:`mlxd.engines.scheduling.guard`).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from mlxd.errors import InvalidRequest

#: subschemas nested inside each other, references followed, that llguidance can build
#: (its matcher crashes between 300 and 1,000; real schemas nest a few levels)
MAX_NESTING = 128
#: bytes of the smallest instance: forced output longer than this costs each token
#: milliseconds (a 10 KB ``const``: 6 ms a token on this machine's CPU)
MAX_SMALLEST_BYTES = 8192
#: optional properties of one object (each is about 4 items of the parser's row of 2,000)
MAX_OPTIONAL_PROPERTIES = 400

INF = float("inf")
#: keys whose value is one subschema, or a list / an object of subschemas
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "dependentSchemas")
_SCALAR = {"null": 4, "boolean": 4, "integer": 1, "number": 1, "string": 2}


_KINDS = ("object", "array", "string", "number", "boolean", "null")


class _Schema:
    """One schema document: its references resolved against its root, and their sizes."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._targets: dict[str, Any] = {}
        #: smallest size of each reference's target so far (the fixed point's state)
        self.sizes: dict[str, float] = {}
        self._memo: dict[int, float] = {}  # smallest() of each node, this round
        self._depths: dict[str, int] = {}  # nesting() of each reference's target

    def resolve(self, ref: str) -> Any:
        """The subschema a local reference (``#``, ``#/$defs/x``) names; None if not local."""
        if ref in self._targets:
            return self._targets[ref]
        node: Any = None
        if ref == "#" or ref.startswith("#/"):
            node = self.root
            for part in ref[2:].split("/") if ref != "#" else ():
                part = unquote(part).replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    node = None
                    break
        self._targets[ref] = node
        return node

    def reachable(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every subschema that can generate output (references followed), and the local
        references, leaves first."""
        nodes: list[dict[str, Any]] = []
        refs: list[str] = []
        stack: list[Any] = [self.root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            nodes.append(node)
            ref = node.get("$ref")
            if isinstance(ref, str) and self.resolve(ref) is not None and ref not in self.sizes:
                self.sizes[ref] = INF
                refs.append(ref)
                stack.append(self.resolve(ref))
            stack.extend(subschemas(node, generating=True))
        return nodes, refs[::-1]

    def nesting(self, node: Any, following: frozenset[str], limit: int) -> int:
        """How deep ``node`` nests, references followed (one already being followed counts
        once, each target is measured once); stops counting past ``limit``."""
        if not isinstance(node, dict) or limit < 0:
            return 0
        deepest = 0
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in following:
            if ref not in self._depths:
                self._depths[ref] = self.nesting(self.resolve(ref), following | {ref}, limit)
            deepest = self._depths[ref]
        for sub in subschemas(node):
            if deepest > limit:
                break
            deepest = max(deepest, 1 + self.nesting(sub, following, limit - 1))
        return deepest

    def settle(self, refs: list[str], rounds: int) -> bool:
        """The references' smallest sizes, a least fixed point from infinity down (False if
        they did not settle). A smallest instance passes a reference at most once along any
        path, so the sizes settle within (nesting depth + 1) rounds, most often in one."""
        for _ in range(rounds):
            self._memo.clear()
            changed = False
            for ref in refs:
                size = self.smallest(self.resolve(ref))
                changed = changed or size != self.sizes[ref]
                self.sizes[ref] = size
            if not changed:
                return True
        return False

    def smallest(self, node: Any) -> float:
        """Bytes of the smallest instance of ``node`` (compact JSON), references at their size so far."""
        if node is False:
            return INF
        if not isinstance(node, dict):
            return 4  # true, or not a schema: null
        if id(node) not in self._memo:
            self._memo[id(node)] = max(self._parts(node))
        return self._memo[id(node)]

    def worst_branch(self, node: dict[str, Any]) -> float:
        """The smallest instance of the largest alternative of ``node`` (a type of its
        ``type`` list, a branch of its ``anyOf``): one a model may start and never end."""
        worst = max(self._of_kind(node, k) for k in _kinds(node))
        for key in ("anyOf", "oneOf"):
            for branch in node.get(key) or ():
                worst = max(worst, self.smallest(branch))
        return worst

    def _parts(self, node: dict[str, Any]) -> list[float]:
        sizes: list[float] = [min(self._of_kind(node, k) for k in _kinds(node))]
        ref = node.get("$ref")
        if isinstance(ref, str):
            sizes.append(self.sizes.get(ref, INF) if self.resolve(ref) is not None else 1)
        for key in ("const", "enum"):
            values = [node[key]] if key == "const" and key in node else node.get(key)
            if key in node and isinstance(values, list):
                sizes.append(min((len(json.dumps(v, separators=(",", ":"))) for v in values),
                                 default=INF))
        for part in node.get("allOf") or ():
            sizes.append(self.smallest(part))
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                sizes.append(min(self.smallest(b) for b in branches))
        return sizes

    def _of_kind(self, node: dict[str, Any], kind: str) -> float:
        if kind == "object":
            return self._object(node)
        if kind == "array":
            return self._array(node)
        if kind == "string":
            min_length = node.get("minLength")
            return 2 + (min_length if isinstance(min_length, int) and min_length > 0 else 0)
        return _SCALAR.get(kind, 4)

    def _object(self, node: dict[str, Any]) -> float:
        required = node.get("required")
        if not isinstance(required, list):
            return 2
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = node.get("additionalProperties", True)
        total: float = 1 + max(1, len(required))  # braces and commas
        for key in required:
            if isinstance(key, str):
                total += len(json.dumps(key)) + 1 + self.smallest(props.get(key, extra))
        return total

    def _array(self, node: dict[str, Any]) -> float:
        need = node.get("minItems")
        need = need if isinstance(need, int) and need > 0 else 0
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        total: float = 1 + max(1, need)
        for i in range(min(need, MAX_SMALLEST_BYTES)):  # each item takes a byte at least
            total += self.smallest(prefix[i] if i < len(prefix) else items)
        return total


def _optional_properties(node: dict[str, Any]) -> int:
    props = node.get("properties")
    if not isinstance(props, dict):
        return 0
    required = node.get("required")
    return len(props.keys() - set(required if isinstance(required, list) else ()))


def _kinds(node: dict[str, Any]) -> list[str]:
    kinds = node.get("type")
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, list) and kinds:
        return [k for k in kinds if isinstance(k, str)] or list(_KINDS)
    return list(_KINDS)


def subschemas(node: dict[str, Any], *, generating: bool = False) -> list[Any]:
    """The subschemas directly inside ``node`` (``$defs`` are reached by reference only);
    ``generating``: only those that can shape output (not ``not`` and ``if``)."""
    out: list[Any] = []
    for key in _ONE:
        if generating and key in ("not", "if"):
            continue
        v = node.get(key)
        if isinstance(v, dict):
            out.append(v)
        elif key == "items" and isinstance(v, list):
            out.extend(v)
    for key in _MANY:
        v = node.get(key)
        if isinstance(v, list):
            out.extend(v)
    for key in _NAMED:
        v = node.get(key)
        if isinstance(v, dict):
            out.extend(v.values())
    return out


def check_enforceable(schema: Any, param: str, what: str = "the schema") -> None:
    """Refuse (400 naming ``param``) a schema the grammar library cannot enforce (module docstring)."""
    doc = _Schema(schema)
    if doc.nesting(schema, frozenset(), MAX_NESTING) > MAX_NESTING:
        raise InvalidRequest(
            f"{param}: {what} nests more than {MAX_NESTING} levels deep with its references "
            "followed; structured output cannot enforce it",
            param=param,
        )
    nodes, refs = doc.reachable()
    for node in nodes:
        optional = _optional_properties(node)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise InvalidRequest(
                f"{param}: {what} has an object of {optional:,} optional properties; structured "
                f"output enforces at most {MAX_OPTIONAL_PROPERTIES} (list more of them in "
                "'required', or split the object)",
                param=param,
            )
    settled = doc.settle(refs, MAX_NESTING + 2)
    if not settled or any(doc.worst_branch(n) == INF or doc.smallest(n) == INF for n in nodes):
        raise InvalidRequest(
            f"{param}: {what} has a part with no finite instance (an object, array or "
            "reference that requires itself again without end); structured output cannot "
            "enforce it",
            param=param,
        )
    size = doc.smallest(schema)
    if size > MAX_SMALLEST_BYTES:
        raise InvalidRequest(
            f"{param}: the smallest instance of {what} is {int(size):,} bytes, more than the "
            f"{MAX_SMALLEST_BYTES:,} structured output enforces",
            param=param,
        )
