"""The epilogue IR: an immutable DAG of nodes, plus the program that names its outputs.

Nodes are hash-consed (structurally equal nodes are the same object), so a subexpression
written twice is one node: common-subexpression elimination falls out of construction.

Leaves:   acc, load(kind, name), prior_d (D's contents before the kernel, for D += ...), scalar(name),
          const(value), const_param(name), reduced (the statistic inside a finishing expression),
          onehot(name) (1 at the column a vec_m operand of int64 indices names, per row: cd.take's derivative)
Compute:  an op name of ir/ops.py with its inputs; cast(dtype) rounds through a storable dtype
Pairwise: pair(x, 0 | 1) the even / odd columns of x; interleave(a, b) their inverse
Reduce:   reduce(kind, axis) over one input (kind: sum | max | min | amax | logsumexp), or
          reduce("take", "n") over x and a vec_m load of int64 column indices (x at index[m])
Finish:   finish(reduce) applies attr, an expression over the leaf `reduced` (plus scalars and
          constants), to the complete statistic after the GEMM
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterator

from .ops import NODE_OPS, REDUCTIONS, OpDef

LOAD_KINDS = ("tensor", "vec_m", "vec_n")  # [M, N], one value per row m, one per column n
REDUCE_AXES = ("n", "m", None)


class Node:
    __slots__ = ("op", "inputs", "attr")
    _interned: dict = {}

    def __new__(cls, op: str, inputs: tuple = (), attr=None):
        # repr keeps -0.0 apart from 0.0 (they compare equal)
        key = (op, tuple(id(i) for i in inputs), repr(attr) if isinstance(attr, float) else attr)
        node = cls._interned.get(key)
        if node is None:
            node = super().__new__(cls)
            node.op, node.inputs, node.attr = op, tuple(inputs), attr
            cls._interned[key] = node
        return node

    def __reduce__(self):  # interned again where unpickled
        return Node, (self.op, self.inputs, self.attr)

    def __copy__(self):  # immutable and interned: a copy is the node itself
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.attr!r}, {len(self.inputs)} inputs)"

    @property
    def definition(self) -> OpDef | None:
        """The op's OpDef (ir/ops.py), or None for an unknown op name (passes.validate rejects those)."""
        return NODE_OPS.get(self.op)

    @property
    def kind(self) -> str | None:
        """leaf | elementwise | structural | reduction (None: an unknown op)."""
        d = NODE_OPS.get(self.op)
        return d.kind if d else None

    @property
    def leaf_value(self) -> str | None:
        """A leaf's "fetched" or "uniform" (ir/ops.py OpDef.leaf_value); None for other nodes."""
        d = NODE_OPS.get(self.op)
        return d.leaf_value if d else None

    @property
    def is_leaf(self) -> bool:
        return self.kind == "leaf"


def acc() -> Node:
    return Node("acc")


def load(kind: str, name: str) -> Node:
    assert kind in LOAD_KINDS, kind
    return Node("load", (), (kind, name))


def prior_d() -> Node:
    """The contents of D before the kernel writes it, for in-place accumulation (D += ...)."""
    return Node("prior_d")


def onehot(index: Node) -> Node:
    """1.0 at column index[m] of each row m, else 0.0 (index: a vec_m load of int64 column indices)."""
    assert index.op == "load" and index.attr[0] == "vec_m", index
    return Node("onehot", (), index.attr[1])


def scalar(name: str) -> Node:
    return Node("scalar", (), name)


def const(value: float) -> Node:
    return Node("const", (), float(value))


def const_param(name: str) -> Node:
    return Node("const_param", (), name)


def compute(op: str, *inputs: Node) -> Node:
    return Node(op, inputs)


def cast(x: Node, dtype: str) -> Node:
    return Node("cast", (x,), dtype)


def pair(x: Node, which: int) -> Node:
    """Columns 2j + which of x: half x's width (which = 0: even columns, 1: odd)."""
    return Node("pair", (x,), which)


def interleave(a: Node, b: Node) -> Node:
    """Columns a0 b0 a1 b1 ...: twice the width of a and b."""
    return Node("interleave", (a, b))


def reduce(kind: str, axis, x: Node, index: Node | None = None) -> Node:
    """A statistic of x over an axis; kind "take" reads x at the column index[m] (a vec_m load)."""
    assert axis in REDUCTIONS[kind].axes and (index is not None) == REDUCTIONS[kind].indexed
    return Node("reduce", (x,) if index is None else (x, index), (kind, axis))


def reduced() -> Node:
    """Stands for the complete statistic inside a finishing expression."""
    return Node("reduced")


def finish(r: Node, expression: Node) -> Node:
    assert r.op == "reduce"
    return Node("finish", (r,), expression)


def index_operands(nodes) -> frozenset[str]:
    """The operands read as int64 column indices: cd.take's, and those a onehot compares columns with."""
    return frozenset(n.attr if n.op == "onehot" else n.inputs[1].attr[1] for n in nodes
                     if n.op == "onehot" or (n.op == "reduce" and REDUCTIONS[n.attr[0]].indexed))


def reduction_of(node: Node) -> Node | None:
    """The reduce node behind an output (itself, or under its finishing step), else None."""
    return node if node.op == "reduce" else node.inputs[0] if node.op == "finish" else None


@dataclass(frozen=True)
class Output:
    name: str
    node: Node
    dtype: str | None  # a cast's, fp32 for every reduction (set here); None: A's, or an out= tensor's

    def __post_init__(self):
        if self.dtype is None and reduction_of(self.node) is not None:
            object.__setattr__(self, "dtype", "fp32")  # statistics accumulate and are stored in fp32


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # tensor | vec_m | vec_n | scalar | const
    # a tensor's or VecN's columns over N, where the program declares it (a derived backward's incoming
    # gradients have their outputs' widths); None: inferred from what it meets (passes/widths.py)
    width: Fraction | None = None


@dataclass
class Program:
    """A traced epilogue: its parameters (after acc) and named outputs."""

    name: str
    params: tuple[Param, ...]
    outputs: tuple[Output, ...]
    defined_at: str = ""  # "file.py:line" of the def, for messages
    locations: dict = field(default_factory=dict, compare=False)  # id(node) -> "file.py:line"
    # (name, the output it is): an output whose value and dtype are another output's, stored once and
    # returned as that output's tensor (a derived backward's residual gradient is its dacc)
    aliases: tuple[tuple[str, str], ...] = ()

    def output(self, name: str) -> Output | None:
        return next((o for o in self.outputs if o.name == name), None)

    def where(self, node: Node) -> str:
        return self.locations.get(id(node), self.defined_at)

    @property
    def title(self) -> str:
        """How messages name the epilogue: "epilogue 'f' (file.py:line)"."""
        return f"epilogue '{self.name}' ({self.defined_at})"


def topo_order(roots, inputs: Callable[[Node], tuple] = lambda n: n.inputs) -> list[Node]:
    """Every node reachable from roots through inputs(n) (its inputs, unless the caller stops early or adds a
    finishing expression), inputs before users, first input first (as a recursion visits them), on a stack
    of its own (a chain of thousands of ops meets no recursion limit)."""
    seen: set[int] = set()
    order: list[Node] = []

    def visit(n: Node) -> None:
        stack = [(n, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for i in reversed(inputs(node)):
                if id(i) not in seen:
                    stack.append((i, False))

    for r in roots:
        visit(r)
    return order


def walk(program: Program) -> Iterator[Node]:
    yield from topo_order([o.node for o in program.outputs])


_OPERAND_KIND = {"scalar": "scalar", "const_param": "const", "onehot": "vec_m"}  # a leaf's operand, but a load's


def operand_of(n: Node) -> tuple[str, str] | None:
    """(kind, name) of the operand a leaf reads (a load, a scalar, a cd.Const, a onehot's index); else None."""
    return n.attr if n.op == "load" else (_OPERAND_KIND[n.op], n.attr) if n.op in _OPERAND_KIND else None


def _leaf_name(n: Node) -> str:
    """How format_program spells a leaf: by its operand name, its value, or its kind."""
    if n.op in ("acc", "prior_d", "reduced"):
        return n.op
    if n.op == "const":
        return repr(n.attr)
    if n.op == "onehot":
        return f"onehot({n.attr})"
    return n.attr[1] if n.op == "load" else n.attr  # scalar, const_param


def format_program(program: Program) -> str:
    """A readable SSA listing of the program (used by `coda-dsl explain`)."""
    names: dict[int, str] = {}
    lines = [f"epilogue {program.name}({', '.join(f'{p.name}: {p.kind}' for p in program.params)})"]

    def name(n: Node) -> str:  # the leaves of finishing expressions are not in the main listing
        return names[id(n)] if id(n) in names else _leaf_name(n)

    for i, n in enumerate(walk(program)):
        if n.is_leaf:
            names[id(n)] = _leaf_name(n)
            continue
        args = ", ".join(names[id(x)] for x in n.inputs)
        attr = f"[{n.attr}]" if n.attr is not None and n.op != "finish" else ""
        if n.op == "finish":  # list the finishing expression first, over `reduced`
            for m in topo_order([n.attr]):
                if id(m) not in names and not m.is_leaf:
                    names[id(m)] = f"%f{len(names)}"
                    inner = f"[{m.attr}]" if m.attr is not None else ""
                    lines.append(f"  {names[id(m)]} = {m.op}{inner}({', '.join(name(x) for x in m.inputs)})")
            attr = f"[{name(n.attr)}]"
        names[id(n)] = f"%{i}"
        lines.append(f"  %{i} = {n.op}{attr}({args})")
    for o in program.outputs:
        lines.append(f"  out {o.name}: {o.dtype or 'default'} = {names[id(o.node)]}")
    lines += [f"  out {name} = out {same} (the same tensor)" for name, same in program.aliases]
    return "\n".join(lines)
