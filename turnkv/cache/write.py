"""The caches' write API: where a step's new K/V rows go when a native call writes them.

``kernels.attention.write_attend``, the fused layer and the fused stack (models/fused.py) store a
batch's new K/V rows into the caches' blocks themselves and attend over them. The model layer
asks the caches for that here, for one layer (``write_plan``), for every layer of a stack
(``write_plans``) or from step to step (``KeptWrites``), and hands the answer to the kernels
unchanged: it never reads a cache's blocks, store or positions.

A plan is one layer's cache side, in the kernels' argument order, one entry per span: (K buffers,
V buffers, lengths, block tables, query positions, first key positions, kinds as ``KINDS``
codes, windows / chunks, int8 K scale buffers, V scale buffers), the scales None unless the
buffers are int8. A plain tuple: a decode step builds one per layer, and a named tuple costs
three times as much to make.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

from ..kernels.attention import KERNEL_BLOCK, KINDS, write_buffers_ok
from .kv import KVCache

_TABLES, _Q_POS, _K_POS, _KINDS, _SPANS, _K_SCALES = 3, 4, 5, 6, 7, 8     # a plan's fields
_FULL, _SLIDING = KINDS["full"], KINDS["sliding"]
# Plans kept by the spans' lengths (a decode step, a verified draft's 2, 4, 8 or 16 rows), and the
# most ``advance`` calls that bring one up to date: a speculating sequence goes from a draft's
# rows back to one row every few steps, and a plan built again each time costs about 5% of a
# small model's one-row step (docs/speculative.md)
KEPT_LENGTHS = 6
MAX_MOVES = 64


@functools.lru_cache(maxsize=None)
def _layout_of(store_type: type, parts_dtype: torch.dtype, block_size: int) -> str | None:
    if block_size != KERNEL_BLOCK or not write_buffers_ok({parts_dtype}):
        return None
    return store_type.native_layout


def _rule(cache) -> tuple[str, int, int] | None:
    """(layout, kind code, window / chunk) of how ``write_attend`` writes this layer cache's K/V
    buffers (layout "plain" or "int8"), or None when it does not: a function of its store's type
    and element type, its block size and its rule, all fixed for the cache's life (memoized in the
    cache: a step asks once per layer and sequence)."""
    if not isinstance(cache, KVCache):
        return None
    try:
        return cache._write_rule
    except AttributeError:
        layout = _layout_of(type(cache.store), cache.store.parts_dtype, cache.block_size)
        rule = None if layout is None else (layout, KINDS[cache.kind], int(cache.span or 0))
        cache._write_rule = rule
        return rule


def _common_layout(caches: Sequence) -> str | None:
    first = _rule(caches[0])
    if first is None:
        return None
    layout = first[0]
    for c in caches[1:]:
        rule = _rule(c)
        if rule is None or rule[0] != layout:
            return None
    return layout


def _reserve(caches: Sequence[KVCache], lens: list[int], int8: bool) -> tuple:
    if len(caches) == 1:        # one sequence: the lists built directly
        c = caches[0]
        first, q0 = c.reserve(lens[0])
        b = c.store.parts
        _, kind, span = c._write_rule
        return ([b["k"]], [b["v"]], lens, [c.table], [q0], [first], [kind], [span],
                [b["k_scale"]] if int8 else None, [b["v_scale"]] if int8 else None)
    return _plan_of(caches, lens, int8, [c.reserve(T) for c, T in zip(caches, lens)])


def _plan_of(caches: Sequence[KVCache], lens: list[int], int8: bool, reserved: list[tuple[int, int]]) -> tuple:
    """The plan of ``caches`` once they have reserved (``reserved``: what each ``reserve``
    returned, ``(first_pos, q_pos0)``)."""
    parts = [c.store.parts for c in caches]     # after every reserve: the pool may have grown
    rules = [c._write_rule for c in caches]
    return ([b["k"] for b in parts], [b["v"] for b in parts], lens,
            [c.table for c in caches], [p[1] for p in reserved], [p[0] for p in reserved],
            [r[1] for r in rules], [r[2] for r in rules],
            [b["k_scale"] for b in parts] if int8 else None, [b["v_scale"] for b in parts] if int8 else None)


def write_plan(caches: Sequence, lens: list[int]) -> tuple | None:
    """The plan of one layer's caches (one per span, ``lens[j]`` new rows in ``caches[j]``), after
    reserving room for the rows in each, or None (nothing reserved) unless every one keeps its
    K/V in blocks of the kernel's size (``KERNEL_BLOCK``) as plain float buffers the kernel
    writes, or every one as int8 with row scales. Runs once per layer of every step (a decode step
    of a small model: ~10 us a call is ~5% of the step), hence the one pass and the memoized
    layout."""
    layout = _common_layout(caches)
    return None if layout is None else _reserve(caches, lens, layout == "int8")


def write_plans(seqs: Sequence[Sequence], lens: list[int], layers: int) -> list[tuple] | None:
    """``write_plan`` for layers ``0 .. layers - 1`` of every sequence's caches (``seqs[j]``) in
    one pass, or None, with nothing reserved, unless every layer's caches take ``write_attend``:
    the layouts are checked for every layer before any layer reserves."""
    per_layer = list(zip(*[c[:layers] for c in seqs]))       # the sequences' caches, layer by layer
    layouts = [_common_layout(caches) for caches in per_layer]
    if len(per_layer) != layers or None in layouts:
        return None
    return [_reserve(caches, lens, layout == "int8") for caches, layout in zip(per_layer, layouts)]


_table_of = operator.attrgetter("_table")


def _same_tables(caches, tables) -> bool:
    """Each cache still holds the block table tensor in ``tables`` (identity, looped in C)."""
    return all(map(operator.is_, map(_table_of, caches), tables))


class _Kept:
    """The native plan of the last step and what it was built from: the spans' lengths, each
    layer's block tables (a cache's own tensor, made again whenever its blocks change: the same
    object means the same cache and the same blocks), what the caches' ``reserve`` returned, by
    rule (``rules``: one ``[kind, window, reserved]`` per rule, full attention or a sliding window
    of that size, ``reserved`` the (first, query) positions per span, the same for every layer of
    the rule: a plan is kept only then; ``rule_of``: each layer's rule), and the pools' stores
    with the parts they had (a pool that grows gets new parts). It holds no cache, so it keeps no
    sequence's blocks alive."""

    __slots__ = ("native", "lens", "tables", "rules", "rule_of", "int8", "stores", "others")

    def __init__(self, native, lens: list[int], plans: list[tuple], rules: list[list], rule_of: list[int],
                 per_layer: list[tuple]):
        self.native, self.lens, self.rules, self.rule_of = native, lens, rules, rule_of
        self.tables = [p[_TABLES] for p in plans]
        self.int8 = [p[_K_SCALES] is not None for p in plans]
        stores = {id(c.store): c.store for caches in per_layer for c in caches}
        self.stores = [(st, st.parts) for st in stores.values()]
        self.others: dict[tuple[int, ...], _Kept] = {}    # earlier steps' plans of other lengths

    def expected(self, moves: int = 1) -> list[list[tuple[int, int]]]:
        """Per rule, what each span's ``reserve`` returns this step if its cache only moved on by
        ``moves`` steps of this plan's lengths: the query position on by ``moves`` times the
        span's length; the first position the same (full attention) or ``max(first, query -
        window + 1)`` (sliding: the native plan's ``advance`` does the same at each move)."""
        out = []
        for kind, window, reserved in self.rules:
            if kind == _FULL:
                out.append([(f, q + moves * T) for (f, q), T in zip(reserved, self.lens)])
            else:
                out.append([(max(f, q + moves * T - window + 1), q + moves * T)
                            for (f, q), T in zip(reserved, self.lens)])
        return out

    def moves_to(self, reserved: list[list[tuple[int, int]]]) -> int:
        """How many of this plan's steps lie between its last step and the query positions the
        caches reserved now (``reserved``, per layer): the same whole number for every span, or 0.
        A plan kept from before a step of other lengths (a verified draft, cut back after it) is
        that many ``advance`` calls from the step, when each span moved on by as many of its own
        lengths."""
        first = self.rules[self.rule_of[0]][2] if self.rule_of else []
        moves = 0
        for (_, q_then), (_, q_now), T in zip(first, reserved[0] if reserved else [], self.lens):
            step, left = divmod(q_now - q_then, T) if T else (0, 1)
            if left or step <= 0 or (moves and step != moves):
                return 0
            moves = step
        return moves if moves <= MAX_MOVES else 0

    def moved_on(self, per_layer: list[tuple], reserved: list[list[tuple[int, int]]], expect: list) -> bool:
        """After every cache reserved this step's rows: whether each one returned what its rule
        expects (``expect``: ``expected()``), still holds the same blocks, and no pool grew, so
        the plan differs from the last step's by what the native plan's ``advance`` moves alone."""
        return (all(r == expect[g] for r, g in zip(reserved, self.rule_of))
                and all(map(_same_tables, per_layer, self.tables))
                and all(st.parts is parts for st, parts in self.stores))


class KeptWrites:
    """A stack's write plans, reserved for every layer at once and kept from step to step as one
    native plan (models/fused.py: the kernels' ``StackPlan``, made by ``build(plans)``; its
    ``advance()`` moves every span's query position on by its length and a sliding layer's first
    key position with it).

    When a step's sequences are the last step's caches with the same lengths and every one of them
    only moved on inside blocks it owns (most decode steps; a sliding-window cache until a block
    leaves its window), the kept native plan advances and nothing else is built or converted
    (``_Kept``). Plans of other lengths are kept too (``KEPT_LENGTHS``): a step of a length seen
    before (a decode step after a verified draft, the draft cut back) advances that plan by as
    many of its steps as every span moved on (``_Kept.moves_to``). Any other step builds and keeps
    a new one."""

    def __init__(self, build: Callable[[list[tuple]], object]):
        self.build = build
        self._kept: _Kept | None = None

    def plan(self, seqs: Sequence[Sequence], lens: list[int], layers: int):
        """The step's native plan for layers ``0 .. layers - 1`` of every sequence's caches
        (``seqs[j]``, ``lens[j]`` new rows), every cache's rows reserved; None, with nothing
        reserved, when some layer's caches do not take ``write_attend``."""
        kept = self._kept
        if kept is not None and kept.lens != lens:      # a plan of these lengths from before
            kept = kept.others.get(tuple(lens))
        if kept is not None:
            per_layer = list(zip(*[c[:layers] for c in seqs]))
            if len(per_layer) == layers and all(map(_same_tables, per_layer, kept.tables)):
                # the caches the kept plan was made for (their layouts took write_attend then)
                reserved = [[c.reserve(T) for c, T in zip(caches, lens)] for caches in per_layer]
                moves = kept.moves_to(reserved)
                expect = kept.expected(moves) if moves else None
                if moves and kept.moved_on(per_layer, reserved, expect):
                    for _ in range(moves):
                        kept.native.advance()
                    for rule, e in zip(kept.rules, expect):
                        rule[2] = e
                    self._kept = kept
                    return kept.native
                plans = [_plan_of(caches, lens, int8, r) for caches, int8, r in zip(per_layer, kept.int8, reserved)]
                return self._keep(plans, lens, per_layer)
        plans = write_plans(seqs, lens, layers)
        if plans is None:
            self._kept = None
            return None
        return self._keep(plans, lens, list(zip(*[c[:layers] for c in seqs])))

    def _keep(self, plans: list[tuple], lens: list[int], per_layer: list[tuple]):
        native = self.build(plans)
        # kept when every layer is full attention or sliding-window, one rule for all its spans,
        # and every layer of a rule reserved alike (the usual lockstep of a sequence's layers); a
        # chunked layer's plan (no fused family has one) is built every step
        rules: dict[tuple[int, int], list] = {}
        rule_of: list[int] = []
        keep = True
        for p in plans:
            kinds, spans = p[_KINDS], p[_SPANS]
            rule = (kinds[0], spans[0] if kinds[0] == _SLIDING else 0)
            reserved = list(zip(p[_K_POS], p[_Q_POS]))
            if (rule[0] not in (_FULL, _SLIDING) or any(k != kinds[0] for k in kinds)
                    or (rule[0] == _SLIDING and any(w != spans[0] for w in spans))):
                keep = False
                break
            got = rules.setdefault(rule, [rule[0], rule[1], reserved])
            if got[2] != reserved:
                keep = False
                break
            rule_of.append(list(rules).index(rule))
        if not keep:
            self._kept = None
            return native
        made = _Kept(native, lens, plans, list(rules.values()), rule_of, per_layer)
        if self._kept is not None:      # one table of plans by lengths, handed on to the newest
            made.others = self._kept.others
        made.others.pop(tuple(lens), None)
        made.others[tuple(lens)] = made
        while len(made.others) > KEPT_LENGTHS:
            del made.others[next(iter(made.others))]
        self._kept = made
        return native
