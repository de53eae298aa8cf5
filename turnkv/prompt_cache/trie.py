"""A radix tree over token ids: edges carry token tuples (split on insert, merged on remove), and
values sit at the node where their tokens end (several values may share one token sequence).

``walk(query)`` is what lookups need: every stored value grouped by the length of its common
prefix with the query, longest first. In a radix tree those groups follow the query's path:

* values under the partially matched edge at the bottom share the deepest match ``c_max``;
* values under path node ``n_i`` but not under the path's next node share ``depth(n_i)``
  (the values stored at ``n_i`` itself are prefixes of the query).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class _Node:
    __slots__ = ("label", "children", "values")

    def __init__(self, label: tuple[int, ...] = ()):
        self.label = label                       # tokens on the edge from the parent
        self.children: dict[int, _Node] = {}     # first token of the child's label -> child
        self.values: list[Any] = []


def _match(label: tuple[int, ...], tokens: tuple[int, ...], i: int) -> int:
    """How many leading tokens of ``label`` equal ``tokens[i:]``."""
    n = min(len(label), len(tokens) - i)
    k = 0
    while k < n and label[k] == tokens[i + k]:
        k += 1
    return k


def _subtree_values(node: _Node) -> list[Any]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.extend(n.values)
        stack.extend(n.children.values())
    return out


class RadixTrie:
    def __init__(self):
        self._root = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def insert(self, tokens: Sequence[int], value: Any) -> None:
        tokens = tuple(tokens)
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:])
                node.children[tokens[i]] = child
                node, i = child, len(tokens)
                break
            m = _match(child.label, tokens, i)
            if m < len(child.label):
                child = self._split(node, child, m)
            node, i = child, i + m
        node.values.append(value)
        self._count += 1

    @staticmethod
    def _split(parent: _Node, child: _Node, m: int) -> _Node:
        mid = _Node(child.label[:m])
        child.label = child.label[m:]
        mid.children[child.label[0]] = child
        parent.children[mid.label[0]] = mid
        return mid

    def _path(self, tokens: tuple[int, ...]) -> list[_Node] | None:
        """Nodes from the root to the node where ``tokens`` ends exactly, or None."""
        path, node, i = [self._root], self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or _match(child.label, tokens, i) < len(child.label):
                return None
            node, i = child, i + len(child.label)
            path.append(node)
        return path

    def get(self, tokens: Sequence[int]) -> list[Any]:
        path = self._path(tuple(tokens))
        return list(path[-1].values) if path else []

    def remove(self, tokens: Sequence[int], value: Any = None) -> None:
        """Remove ``value`` (compared by identity) stored at ``tokens``, or every value there when
        ``value`` is None. Raises KeyError when nothing matches."""
        path = self._path(tuple(tokens))
        if path is None or not path[-1].values:
            raise KeyError(tuple(tokens))
        node = path[-1]
        if value is None:
            removed = len(node.values)
            node.values = []
        else:
            kept = [v for v in node.values if v is not value]
            removed = len(node.values) - len(kept)
            if not removed:
                raise KeyError(tuple(tokens))
            node.values = kept
        self._count -= removed
        self._prune(path)

    @staticmethod
    def _prune(path: list[_Node]) -> None:
        # Keep the tree compressed: drop empty leaves, merge valueless single-child nodes.
        for depth in range(len(path) - 1, 0, -1):
            node, parent = path[depth], path[depth - 1]
            if node.values:
                return
            if not node.children:
                del parent.children[node.label[0]]
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                node.label += child.label
                node.children, node.values = child.children, child.values
            return

    def walk(self, query: Sequence[int]) -> Iterator[tuple[int, list[Any]]]:
        """Yield ``(common_prefix_len, values)`` for every non-empty group, longest prefix first."""
        query = tuple(query)
        path: list[tuple[_Node, int]] = [(self._root, 0)]   # (node, depth)
        node, depth, partial = self._root, 0, None
        while depth < len(query):
            child = node.children.get(query[depth])
            if child is None:
                break
            m = _match(child.label, query, depth)
            if m < len(child.label):
                partial = (child, depth + m)
                break
            node, depth = child, depth + m
            path.append((node, depth))
        below = None
        if partial is not None:
            values = _subtree_values(partial[0])
            if values:
                yield partial[1], values
            below = partial[0]
        for node, depth in reversed(path):
            values = list(node.values)
            for child in node.children.values():
                if child is not below:
                    values.extend(_subtree_values(child))
            if values:
                yield depth, values
            below = node

    def prefixes(self, tokens: Sequence[int]) -> list[Any]:
        """Values whose tokens are a prefix of ``tokens`` (``tokens`` itself included), shortest first."""
        tokens = tuple(tokens)
        node, i, out = self._root, 0, list(self._root.values)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or _match(child.label, tokens, i) < len(child.label):
                break
            node, i = child, i + len(child.label)
            out.extend(node.values)
        return out

    def extensions(self, tokens: Sequence[int]) -> list[Any]:
        """Values whose tokens start with ``tokens`` (``tokens`` itself included)."""
        tokens = tuple(tokens)
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return []
            m = _match(child.label, tokens, i)
            if i + m == len(tokens):
                return _subtree_values(child)
            if m < len(child.label):
                return []
            node, i = child, i + m
        return _subtree_values(node)

    def items(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        stack = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for value in node.values:
                yield prefix, value
            for child in node.children.values():
                stack.append((child, prefix + child.label))
