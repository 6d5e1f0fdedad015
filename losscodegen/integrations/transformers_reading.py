"""Recognising transformers' standard causal-LM loss path in a forward's code (``read``): the forward's
statements read from its syntax tree, in order, against the path docs/integrations-transformers.md lists
(the backbone called on the forward's arguments, the hidden states sliced by ``slice_logits_to_keep``, an
output layer, a final-logit transform of scales and one tanh, ``self.loss_function`` on those logits and the
labels, a router's load-balancing loss as transformers adds it, the output built from these). Nothing of the
forward is compiled or evaluated here: the patched forward runs the forward itself
(losscodegen.integrations.transformers_runtime); this module only says whether, and where not, its code is
that path, and what the runtime needs to know about it (the output layer's and the backbone's attributes).
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.transformers needs transformers>=5: pip install "losscodegen[hf]"') from e
try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # (earlier transformers 5 releases sliced inline, as this does)
    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


class NotStandard(Exception):
    """A forward that is not transformers' standard causal-LM loss path: the message says where."""


@dataclass(frozen=True)
class Forward:
    """A forward known to compute transformers' standard causal-LM loss: read from its code (``read``), or
    declared (``register_model_type``). ``function`` is the model's own forward (undecorated), run where
    there are no labels; ``run`` the one run with labels (the same, or the declared path's), under the
    runtime's output layer and loss."""

    where: str                                   # "Gemma2ForCausalLM.forward (gemma2/modeling_gemma2.py)"
    function: Callable[..., Any]
    run: Callable[..., Any]
    signature: inspect.Signature
    head: str                                    # the output layer: self.<head>
    backbone: tuple[str, ...]                    # the backbone: self.<a>.<b>...
    varkw: str                                   # the **kwargs parameter (num_items_in_batch, shift_labels)
    router: bool                                 # the router's load-balancing loss is added
    base_takes_labels: bool                      # (the labels reach the backbone)
    # the final-logit transform's scales as the forward writes them, by line: (op, text), for messages
    scales: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> Forward:
        return self       # (functions and text, the same for a copy of the model)


_TANH = (torch.tanh, torch.nn.functional.tanh)


def read(function: Callable[..., Any], where: str) -> Forward:
    """``function`` (a forward, undecorated) read as the standard path, ``NotStandard`` where it is not."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError) as e:
        raise NotStandard(f"{where}: its source cannot be read ({e})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise NotStandard(f"{where}: not a function")
    return _Reader(definition.body, function, where).read()


def where_of(cls: type) -> str:
    """``cls``'s forward and its file, for messages."""
    function = inspect.unwrap(cls.forward)
    module = sys.modules.get(function.__module__)
    short = "/".join((getattr(module, "__file__", None) or "?").split("/")[-2:])
    return f"{function.__qualname__} ({short})"


_PASSING = (ast.Name, ast.Attribute, ast.Constant, ast.Subscript, ast.Slice, ast.Tuple, ast.Compare, ast.IfExp,
            ast.BoolOp, ast.UnaryOp, ast.Call, ast.keyword, ast.Load, ast.Store, ast.NamedExpr, ast.cmpop, ast.boolop,
            ast.unaryop, ast.expr_context)


class _Reader:
    """Reads a forward's statements in order against transformers' standard causal-LM loss path (the
    forward ``LlamaForCausalLM`` has, and the variations transformers' families write), raising
    ``NotStandard`` at the first statement that is not part of it."""

    def __init__(self, body: list[ast.stmt], function: Callable[..., Any], where: str):
        self.function, self.names, self.where = function, function.__globals__, where
        self.signature = inspect.signature(function)
        params = self.signature.parameters
        self.varkw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
        self.params = {p for p in params if params[p].kind != params[p].VAR_POSITIONAL}
        self.known = set(self.params)    # the locals a statement run as written may read
        self.body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        self.at = 0

    # -- messages
    def fail(self, node: ast.AST, why: str) -> None:
        text = ast.unparse(node).splitlines()[0]
        line = getattr(node, "lineno", None)
        raise NotStandard(f"{self.where}{'' if line is None else f', line {line}'}: `{text}`: {why}")

    # -- expressions
    def resolve(self, node: ast.expr) -> Any:
        """The object a dotted global name (``torch.tanh``) is in the forward's module, or None."""
        if isinstance(node, ast.Name):
            return self.names[node.id] if node.id in self.names else getattr(builtins, node.id, None)
        if isinstance(node, ast.Attribute):
            return getattr(self.resolve(node.value), node.attr, None)
        return None

    def passing(self, node: ast.AST, names: set[str], why: str) -> None:
        """``node`` only reads ``names`` and their attributes, items and comparisons (and the config's
        ``get_text_config()``, ``getattr``): nothing it runs can touch the logits or the loss."""
        allowed_calls = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                config = isinstance(sub.func, ast.Attribute) and sub.func.attr == "get_text_config"
                attribute = isinstance(sub.func, ast.Name) and sub.func.id not in self.known \
                    and self.resolve(sub.func) is getattr and len(sub.args) in (2, 3)
                if not (config and not sub.args or attribute) or sub.keywords:
                    self.fail(node, why)
                allowed_calls.add(id(sub.func))
            elif not isinstance(sub, _PASSING):
                self.fail(node, why)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in names \
                    and id(sub) not in allowed_calls:
                self.fail(node, f"{why} (it reads {sub.id})")

    def value(self, node: ast.expr, local: set[str]) -> str:
        """A value the final-logit transform reads from the model: its text."""
        self.passing(node, {"self"} | local, "the logits are transformed by a value that is not an attribute "
                                              "of the model or its config")
        return ast.unparse(node)

    @staticmethod
    def is_name(node: ast.AST, name: str | None = None) -> bool:
        return isinstance(node, ast.Name) and (name is None or node.id == name)

    @staticmethod
    def assigned(stmt: ast.stmt) -> tuple[str, ast.expr] | None:
        """``name = value`` (annotated or not): (name, value)."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            return stmt.targets[0].id, stmt.value
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            return stmt.target.id, stmt.value
        return None

    def labels_test(self, node: ast.expr) -> bool:
        return (isinstance(node, ast.Compare) and self.is_name(node.left, "labels") and len(node.ops) == 1
                and isinstance(node.ops[0], ast.IsNot) and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value is None)

    def next(self) -> ast.stmt | None:
        return self.body[self.at] if self.at < len(self.body) else None

    # -- the path, in order
    def read(self) -> Forward:
        if self.varkw is None or "labels" not in self.params:
            raise NotStandard(f"{self.where}: takes no labels and **kwargs: not a causal LM's forward")
        self.scales: dict[int, list[tuple[str, str]]] = {}
        backbone = self.read_backbone()
        hidden = self.read_hidden()
        head, logits, loss = self.read_logits(hidden)
        loss = self.read_loss(logits, loss)
        aux = self.read_router(loss)
        self.read_result(logits, loss, aux)
        return Forward(self.where, self.function, self.function, self.signature, head, backbone, self.varkw,
                       aux is not None, self.base_takes_labels, {k: tuple(v) for k, v in self.scales.items()})

    def read_backbone(self) -> tuple[str, ...]:
        # `x = x if x is not None else self.config.x`: an argument's default from the config
        while (stmt := self.next()) is not None and (got := self.assigned(stmt)) and isinstance(got[1], ast.IfExp) \
                and got[0] in self.params and self.is_name(got[1].body, got[0]):
            self.passing(got[1].test, self.known, "not an argument's default")
            self.passing(got[1].orelse, {"self"}, "an argument's default that is not read from the model")
            self.at += 1
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not got or not isinstance(got[1], ast.Call) or not isinstance(got[1].func, ast.Attribute):
            self.fail(stmt or ast.Pass(), "expected the backbone's call, `outputs = self.model(...)`")
        call = got[1]
        chain, path = call.func, []
        while isinstance(chain, ast.Attribute):
            chain, path = chain.value, [chain.attr, *path]
        if not self.is_name(chain, "self"):
            self.fail(stmt, "expected the backbone's call, `outputs = self.model(...)`")
        for arg in [*call.args, *(k.value for k in call.keywords if k.arg is not None)]:
            self.passing(arg, self.known, "the backbone is given something other than the forward's arguments")
        if any(k.arg is None and not self.is_name(k.value, self.varkw) for k in call.keywords):
            self.fail(stmt, f"the backbone is given ** of something other than **{self.varkw}")
        self.base_takes_labels = any(self.is_name(n, "labels") for n in ast.walk(call))
        self.outputs = got[0]
        self.known.add(got[0])
        self.at += 1
        return tuple(path)

    def hidden_step(self, stmt: ast.stmt, hidden: set[str]) -> str | None:
        """``stmt`` takes or slices the backbone's hidden states: the local it assigns (None if it does not)."""
        got = self.assigned(stmt)
        if not got:
            return None

        def taken(node: ast.expr) -> bool:   # outputs.last_hidden_state, outputs[0], or a local holding them
            return (isinstance(node, ast.Attribute) and self.is_name(node.value, self.outputs)
                    and node.attr == "last_hidden_state") or (
                isinstance(node, ast.Subscript) and self.is_name(node.value, self.outputs)
                and isinstance(node.slice, ast.Constant) and node.slice.value == 0) or (
                isinstance(node, ast.Name) and node.id in hidden)
        value = got[1]
        if taken(value) and not isinstance(value, ast.Name):
            return got[0]
        if isinstance(value, ast.Call) and self.resolve(value.func) is slice_logits_to_keep \
                and len(value.args) == 2 and not value.keywords and taken(value.args[0]):
            self.passing(value.args[1], self.known, "the hidden states are sliced by something other than an argument")
            return got[0]
        return None

    def read_hidden(self) -> set[str]:
        hidden: set[str] = set()
        while (stmt := self.next()) is not None:
            if isinstance(stmt, ast.If) and not stmt.orelse and stmt.body and all(
                    self.hidden_step(s, hidden) for s in stmt.body):
                self.passing(stmt.test, self.known | hidden, "the hidden states are sliced under a condition that "
                                                             "reads something other than the arguments")
                hidden |= {self.assigned(s)[0] for s in stmt.body}
            elif (name := self.hidden_step(stmt, hidden)) is not None:
                hidden.add(name)
            else:
                break
            self.known |= hidden
            self.at += 1
        return hidden

    def logits_expr(self, node: ast.expr, current: str | None, hidden: set[str], local: set[str]) -> list[tuple]:
        """The ops a logits expression applies, in order: ("head", attr, hidden) first (the output layer's
        call), then ("mul"/"div", text, line), ("tanh",), ("float",)."""
        if current is not None and self.is_name(node, current):
            return []
        if current is None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and self.is_name(node.func.value, "self") and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in hidden:
            return [("head", node.func.attr, node.args[0].id)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "float", "contiguous") and not node.args and not node.keywords:     # (the loss upcasts them anyway)
            ops = self.logits_expr(node.func.value, current, hidden, local)
            return ops + [("float",)] * (node.func.attr == "float")
        if isinstance(node, ast.Call) and self.resolve(node.func) in _TANH and len(node.args) == 1 \
                and not node.keywords:
            return [*self.logits_expr(node.args[0], current, hidden, local), ("tanh",)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            for logits, other in ((node.left, node.right), (node.right, node.left)):
                if other is node.left and isinstance(node.op, ast.Div):
                    break
                try:
                    ops = self.logits_expr(logits, current, hidden, local)
                except NotStandard:
                    continue
                return [*ops, ("mul" if isinstance(node.op, ast.Mult) else "div", self.value(other, local),
                               node.lineno)]
        self.fail(node, "the logits are computed or transformed in a way the head does not compute (it knows an "
                        "nn.Linear output layer, scales and a tanh softcap)")

    def scaled(self, ops: list[tuple]) -> None:
        """Note the scales of ``ops`` by line (the runtime names a value by the text that reads it)."""
        for op in ops:
            if op[0] in ("mul", "div"):
                self.scales.setdefault(op[2], []).append(op[:2])

    def read_logits(self, hidden: set[str]) -> tuple[str, str, str | None]:
        """The output layer's call and the final-logit transform: statements that apply scales, a tanh and
        ``.float()`` to the logits, assign values read from the model, or do these under conditions on it."""
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not got:
            self.fail(stmt or ast.Pass(), "expected the output layer's call, `logits = self.lm_head(hidden_states)`")
        try:
            ops = self.logits_expr(got[1], None, hidden, set())
        except NotStandard:
            ops = []
        if not ops or ops[0][0] != "head":
            self.fail(stmt, "expected the output layer applied to the hidden states the backbone returned, "
                            "`logits = self.lm_head(hidden_states)` (then scaled or softcapped)")
        (_, head, _), logits = ops[0], got[0]
        self.scaled(ops[1:])
        self.at += 1
        local, loss = set(), None

        def statement(stmt: ast.stmt) -> None:
            got = self.assigned(stmt)
            if got and got[0] == logits:
                self.scaled(self.logits_expr(got[1], logits, set(), local))
            elif got and got[0] not in self.known | {logits}:
                self.value(got[1], local)
                local.add(got[0])
            elif isinstance(stmt, ast.If) and not stmt.orelse:
                local.update(sub.target.id for sub in ast.walk(stmt.test) if isinstance(sub, ast.NamedExpr))
                self.value(stmt.test, local)
                for s in stmt.body:
                    statement(s)
            else:
                self.fail(stmt, "not part of the standard path between the output layer and the loss")
        while (stmt := self.next()) is not None and not (isinstance(stmt, ast.If) and self.labels_test(stmt.test)):
            got = self.assigned(stmt)
            if got and isinstance(got[1], ast.Constant) and got[1].value is None and got[0] not in self.known:
                loss = got[0]            # `loss = None`
            else:
                statement(stmt)
            self.at += 1
        return head, logits, loss

    def read_loss(self, logits: str, loss: str | None) -> str:
        stmt = self.next()
        if stmt is None or not isinstance(stmt, ast.If) or not self.labels_test(stmt.test) or stmt.orelse:
            self.fail(stmt or ast.Pass(), "expected `if labels is not None: loss = self.loss_function(logits, labels, "
                                          "...)`")
        got = self.assigned(stmt.body[0])
        call = got and got[1]
        if len(stmt.body) != 1 or not isinstance(call, ast.Call) or not (
                isinstance(call.func, ast.Attribute) and call.func.attr == "loss_function"
                and self.is_name(call.func.value, "self")):
            self.fail(stmt.body[-1] if len(stmt.body) > 1 else stmt.body[0],
                      "the loss is not `self.loss_function(logits, labels, ...)` alone")
        if loss is not None and got[0] != loss:
            self.fail(stmt.body[0], "the loss is assigned to another name than the one the forward returns")
        spread = [k for k in call.keywords if k.arg is None]
        if len(spread) != 1 or not self.is_name(spread[0].value, self.varkw):
            self.fail(call, f"the loss is not given the forward's **{self.varkw} (num_items_in_batch, shift_labels)")
        try:
            bound = inspect.signature(ForCausalLMLoss).bind(*call.args, **{k.arg: k.value for k in call.keywords
                                                                           if k.arg is not None})
        except TypeError as e:
            self.fail(call, f"not a call of transformers' ForCausalLMLoss ({e})")
        if not self.is_name(bound.arguments["logits"], logits) or not self.is_name(bound.arguments["labels"], "labels"):
            self.fail(call, f"the loss is not computed on the logits ({logits}) and the labels")
        named = set(bound.arguments) - {"logits", "labels", "vocab_size", "kwargs"}
        if named:
            self.fail(call, f"the loss is given {', '.join(sorted(named))} of its own")
        self.value(bound.arguments["vocab_size"], set())
        self.at += 1
        return got[0]

    def read_router(self, loss: str) -> str | None:
        """The local the router's load-balancing loss is assigned to (None where there is none)."""
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not (got and isinstance(got[1], ast.Constant) and got[1].value is None):
            return None
        aux = got[0]
        self.at += 1
        stmt = self.next()
        shape = "expected the router's load-balancing loss as transformers adds it (`if output_router_logits: " \
                "aux_loss = load_balancing_loss_func(...); if labels is not None: loss += coef * aux_loss.to(...)`)"
        if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 2:
            self.fail(stmt or ast.Pass(), shape)
        self.passing(stmt.test, self.known, shape)
        got = self.assigned(stmt.body[0])
        if not got or got[0] != aux or not isinstance(got[1], ast.Call) or not isinstance(got[1].func, ast.Name) \
                or not callable(self.resolve(got[1].func)):
            self.fail(stmt.body[0], shape)
        for arg in [*got[1].args, *(k.value for k in got[1].keywords)]:
            self.passing(arg, self.known, "the router's loss reads something other than the model, the "
                                                   "arguments and the backbone's outputs")
        inner = stmt.body[1]
        add = inner.body[0] if isinstance(inner, ast.If) and len(inner.body) == 1 and not inner.orelse else None
        if not (isinstance(inner, ast.If) and self.labels_test(inner.test) and isinstance(add, ast.AugAssign)
                and self.is_name(add.target, loss) and isinstance(add.op, ast.Add)
                and isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Mult)
                and ast.unparse(add.value.right) == f"{aux}.to({loss}.device)"):
            self.fail(inner, shape)
        self.passing(add.value.left, {"self"}, shape)
        self.at += 1
        self.known.add(aux)
        return aux

    def read_result(self, logits: str, loss: str, aux: str | None) -> None:
        stmt = self.next()
        if not isinstance(stmt, ast.Return) or not isinstance(stmt.value, ast.Call) or stmt.value.args \
                or not isinstance(self.resolve(stmt.value.func), type):
            self.fail(stmt or ast.Pass(), "expected `return <output class>(loss=loss, logits=logits, ...)`")
        owned = {"loss": loss, "logits": logits, "aux_loss": aux}
        for k in stmt.value.keywords:
            if k.arg in owned and owned[k.arg] is not None and self.is_name(k.value, owned[k.arg]):
                continue
            self.passing(k.value, self.known, "the output holds the logits or the loss in another "
                                                               "field, or something the backbone did not return")
        if self.at != len(self.body) - 1:
            self.fail(self.body[self.at + 1], "a statement after the return")



@functools.lru_cache(maxsize=None)
def read_class(cls: type) -> Forward:
    """``cls``'s forward (undecorated) read as the standard path (``NotStandard`` where it is not)."""
    return read(inspect.unwrap(cls.forward), where_of(cls))
