"""Suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding): the draft
follows the most frequent continuation of the longest suffix of the sequence that occurred before,
in its own tokens or in the outputs of earlier requests. No model: an agent that repeats its own
earlier answers, a rewrite of the prompt or a template output drafts the repeat.

Structure. A suffix trie of depth D (suffix_decoding_max_tree_depth): the first D tokens of every
suffix of every indexed sequence, merged into one trie whose node for a string w holds count(w),
the number of places w occurs (each a suffix passing through or ending at the node). Nodes live in
parallel int32 arrays (``_SuffixTrie``) indexed by node id; a node's first child is reached
through the arrays and its other children through one dict keyed ``node << 32 | token``, so a
chain (most of a suffix trie) costs no dict entry; each node keeps a suffix link (the node of w
without its first token) and its most frequent child (ties: the smaller token id), recomputed
lazily after a count fell. Two kinds of trie, as Arctic keeps them:

- per request (``_RequestIndex`` on ``Sequence.proposer_state``): the sequence's prompt and
  verified output so far, extended each call with only the tokens appended since the last call
  (rebuilt when token_ids is not a continuation, as ngram.TokenMirror does);
- global: the outputs (token_ids[num_prompt_tokens:]) of up to
  suffix_decoding_max_cached_requests earlier requests, one root per ``cache_salt`` (None is its
  own) so that tenants never draft each other's text, all of them in one node store and in one
  FIFO: the oldest request is evicted first, its contribution removed exactly (counts
  decremented, nodes reaching 0 freed), leaving the trie of the remaining requests.

A sequence's tokens are added with the suffix links: the suffixes still shorter than D end at the
``tip`` and its links, so a token extends that chain, O(D). A suffix is removed (eviction, a
sliding window) by walking its path from the root, O(D); the oldest first, which keeps every live
node's link live (count(link(x)) >= count(x)).

Proposing. The longest suffix of seq.token_ids that occurs with a continuation, at most
M = min(D - 1, max(1, D - num_speculative_tokens)) tokens long so that a full draft still fits
under depth D, is found by an Aho-Corasick walk over the last M tokens (a child step or a link
step each, at most 2M dictionary/array steps). From its node the draft follows the most frequent
child while the path's estimated probability (the product of count(child) / count(node), as
Arctic scores) stays at least suffix_decoding_min_token_prob, for at most min(max_tokens,
num_speculative_tokens, ceil(suffix_decoding_max_spec_factor * match length)) tokens. Both the
request's trie and its salt's global trie are asked; the draft whose score (the sum of its tokens'
probabilities) is higher wins, the request's own on a tie. A single path, no token trees. The
request's trie holds the sequence's own last occurrence too, so a pattern seen once before
drafts at probability 1/2 there (as in Arctic).

Bounds (a client controls prompt lengths, and a prompt's tokens are at most D nodes each): the
global store holds at most MAX_GLOBAL_NODES nodes (roots included) and its requests' tokens at most
MAX_GLOBAL_TOKENS (a repetitive output is many tokens in few nodes), a request's trie at most
MAX_REQUEST_NODES nodes, and either indexes at most the last MAX_INDEXED_TOKENS tokens of a sequence.
Inserting into a full global store evicts the oldest requests first; a single request that fills
it alone, and a request's trie over its limits, drop their oldest suffixes (a sliding window, so
only the last part is indexed). Token ids must lie in [0, 2**32).

Costs (CPython 3.11 on this project's shared 2-core dev machine, best of 3, D = 24, k = 4, 100
cached 500-token outputs; random tokens and word-split prose (docs/*.md) alike;
tests/engine/test_suffix_decoding.py ``test_costs`` prints the same figures): propose on a 2000-token
sequence whose trie is up to date 12-16 us (both tries asked); a decode step's propose, one token
appended to the request's trie first, about 36 us (most of it the D nodes a new token adds);
indexing a 2000-token prompt, 33-36 ms in all (O(L * D)), spread over the sequence's first decode
steps, INDEX_TOKENS_PER_CALL tokens (~2 ms) each; finished() of a 500-token output 8-10 ms, 11 ms
with the oldest request evicted."""
from __future__ import annotations

import math
from array import array
from collections import deque

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.config import SpeculativeConfig

# Measured (tracemalloc, 500-token outputs filling 2**20 nodes at D = 24, random tokens and
# word-split prose alike): 41 bytes per node (seven int32 arrays with their growth slack, a dict
# entry for each child that is not its parent's first, the requests' kept tokens), so the global
# store stays under about 175 MB and a request's trie under about 2.7 MB. A 500-token output takes
# 7,500 (prose) to 11,500 (random) nodes at D = 24: the global store holds some 360-550 of them,
# fewer than suffix_decoding_max_cached_requests' default of 10000 (the node cap binds first).
MAX_GLOBAL_NODES = 1 << 22
MAX_REQUEST_NODES = 1 << 16
MAX_INDEXED_TOKENS = 4096          # a request's tokens indexed at most (its last ones)
INDEX_TOKENS_PER_CALL = 128        # a request's tokens indexed per propose call at most (~2 ms at D = 24)
MAX_GLOBAL_TOKENS = 1 << 23        # the cached requests' tokens, kept (4 bytes each) to remove them later
_NO = -1                           # no node
_TOKEN_SHIFT = 32                  # children dict key: node << 32 | token


class _Indexed:
    """One sequence being indexed in a trie: its tokens, the oldest suffix still indexed, and the
    tip, the node of its last min(D - 1, window) tokens whose link chain the next token extends."""

    __slots__ = ("root", "salt", "tokens", "start", "tip", "tip_depth")

    def __init__(self, root: int, salt: str | None = None) -> None:
        self.root = root
        self.salt = salt
        self.tokens = array("I")   # tokens appended (those before start no longer indexed)
        self.start = 0             # tokens[start:] are indexed, each suffix to depth D
        self.tip = root
        self.tip_depth = 0

    @property
    def window(self) -> int:
        return len(self.tokens) - self.start


class _SuffixTrie:
    """Depth-bounded suffix tries (one or more roots) in one node store of parallel int32 arrays.

    count[x]: occurrences of x's string; token[x]: its last token; link[x]: the node of its string
    without the first token (a root for depth 1); best[x]: its most frequent child (_NO: none, or
    not known since a count fell); first/next/prev: its children as a doubly linked list."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.count = array("i")
        self.token = array("I")
        self.link = array("i")
        self.best = array("i")
        self.first = array("i")
        self.next = array("i")
        self.prev = array("i")
        self.kids: dict[int, int] = {}     # node << 32 | token -> child, all but the first child
        self.free: list[int] = []          # ids below high not in use
        self.high = 0                      # ids from here on never used
        self.size = 0                      # live nodes, roots included

    # ---- nodes ----------------------------------------------------------------------------------
    def _grow(self) -> None:
        """Room for more node ids in every column (by an eighth, as a list grows)."""
        more = array("i", [_NO]) * max(1024, len(self.count) >> 3)
        for column in (self.count, self.link, self.best, self.first, self.next, self.prev):
            column.extend(more)
        self.token.extend(array("I", [0]) * len(more))

    def new_root(self) -> int:
        """A node with no parent (one per trie), from the free list or a fresh id."""
        if self.free:
            x = self.free.pop()
        else:
            x = self.high
            if x == len(self.count):
                self._grow()
            self.high = x + 1
        self.size += 1
        self.count[x] = self.token[x] = 0
        self.link[x] = self.best[x] = self.first[x] = self.next[x] = self.prev[x] = _NO
        return x

    def free_root(self, root: int) -> None:
        if self.first[root] != _NO:
            raise RuntimeError("suffix trie: a root freed with children left")
        self.size -= 1
        self.free.append(root)

    def child(self, node: int, token: int) -> int:
        c = self.first[node]
        if c == _NO or self.token[c] == token:
            return c
        return self.kids.get(node << _TOKEN_SHIFT | token, _NO)

    def best_child(self, node: int) -> int:
        """The child with the highest count, the smaller token on a tie (_NO: a leaf)."""
        b = self.best[node]
        if b != _NO:
            return b
        count, token, nxt = self.count, self.token, self.next
        c = self.first[node]
        while c != _NO:
            if b == _NO or count[c] > count[b] or (count[c] == count[b] and token[c] < token[b]):
                b = c
            c = nxt[c]
        self.best[node] = b
        return b

    def _detach(self, node: int, c: int) -> None:
        """c leaves node's children (its successor, if c was first, leaves kids to become first)."""
        nxt, prv = self.next[c], self.prev[c]
        if self.first[node] == c:
            self.first[node] = nxt
            if nxt != _NO:
                self.prev[nxt] = _NO
                del self.kids[node << _TOKEN_SHIFT | self.token[nxt]]
        else:
            self.next[prv] = nxt
            if nxt != _NO:
                self.prev[nxt] = prv
            del self.kids[node << _TOKEN_SHIFT | self.token[c]]
        if self.best[node] == c:
            self.best[node] = _NO

    # ---- sequences ------------------------------------------------------------------------------
    def extend(self, seq: _Indexed, token: int) -> None:
        """Index seq's next token: each suffix shorter than D (the tip's link chain) gains it, its
        node's count one higher (created if absent, at most seq.tip_depth + 1 of them: the caller
        makes room). Inlined, as it runs for every token of every sequence."""
        count, tok, link, best, first, nxt, prv, kids, free = (
            self.count, self.token, self.link, self.best, self.first, self.next, self.prev, self.kids, self.free)
        seq.tokens.append(token)             # first: a token outside [0, 2**32) raises here, before any change
        x, root = seq.tip, seq.root
        longest = second = previous = _NO    # the chain's first two children, and the last one
        while True:
            c = first[x]
            if c != _NO and tok[c] != token:
                c = kids.get(x << _TOKEN_SHIFT | token, _NO)
            if c == _NO:                                  # a new node: x's child for token
                if free:
                    c = free.pop()
                else:
                    c = self.high
                    if c == len(count):
                        self._grow()
                    self.high = c + 1
                self.size += 1
                count[c], tok[c], best[c], first[c] = 1, token, _NO, _NO
                f = first[x]
                if f == _NO:
                    first[x] = best[x] = c                # its only child
                    nxt[c] = prv[c] = _NO
                else:                                     # second in the list, and in kids
                    after = nxt[f]
                    nxt[c], prv[c], nxt[f] = after, f, c
                    if after != _NO:
                        prv[after] = c
                    kids[x << _TOKEN_SHIFT | token] = c
                    b = best[x]
                    if b != _NO and count[b] == 1 and token < tok[b]:
                        best[x] = c
            else:
                n = count[c] + 1
                count[c] = n
                b = best[x]
                if b != _NO and b != c and (n > count[b] or (n == count[b] and token < tok[b])):
                    best[x] = c
            if previous == _NO:
                longest = c
            else:
                link[previous] = c
                if second == _NO:
                    second = c
            previous = c
            if x == root:
                break
            x = link[x]
        link[previous] = root
        depth = min(seq.tip_depth + 1, self.depth - 1)
        seq.tip = root if not depth else longest if depth > seq.tip_depth else second
        seq.tip_depth = depth

    def drop_oldest(self, seq: _Indexed) -> None:
        """Unindex seq's oldest indexed suffix (its first D tokens)."""
        s, n = seq.start, len(seq.tokens)
        if seq.tip_depth and seq.tip_depth == n - s:     # the tip is that suffix: step to its link
            seq.tip = self.link[seq.tip]
            seq.tip_depth -= 1
        self._drop_path(seq.root, seq.tokens[s:s + min(self.depth, n - s)])
        seq.start = s + 1

    def remove(self, seq: _Indexed) -> None:
        """Unindex all of seq (oldest suffix first, so that live nodes' links stay live)."""
        while seq.start < len(seq.tokens):
            self.drop_oldest(seq)

    def _drop_path(self, root: int, path: array) -> None:
        count, best = self.count, self.best
        node = root
        for t in path:
            c = self.child(node, t)
            count[c] -= 1
            if best[node] == c:
                best[node] = _NO
            if count[c] == 0:
                # c occurred only here: so did all below it on the path, a chain of only children
                self._detach(node, c)
                while c != _NO:
                    below = self.first[c]
                    self.size -= 1
                    self.free.append(c)
                    c = below
                return
            node = c

    # ---- proposing ------------------------------------------------------------------------------
    def match(self, root: int, context: list[int], max_len: int) -> tuple[int, int]:
        """(node, length) of the longest suffix of context, at most max_len tokens, that occurs
        with a continuation ((root, 0): none). An Aho-Corasick walk over its last max_len tokens."""
        first, token, link, kids = self.first, self.token, self.link, self.kids
        node, depth = root, 0
        for i in range(max(0, len(context) - max_len), len(context)):
            t = context[i]
            while True:
                if depth < max_len:
                    c = first[node]
                    if c != _NO and token[c] != t:
                        c = kids.get(node << _TOKEN_SHIFT | t, _NO)
                    if c != _NO:
                        node, depth = c, depth + 1
                        break
                if not depth:
                    break
                node, depth = link[node], depth - 1
        while depth and first[node] == _NO:       # has a continuation: so do all its suffixes
            node, depth = link[node], depth - 1
        return node, depth

    def draft(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Up to max_tokens tokens down node's most frequent children while the path's probability
        stays >= min_prob; with their score, the sum of those probabilities."""
        count, token = self.count, self.token
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < max_tokens:
            c = self.best_child(node)
            if c == _NO:
                break
            p = prob * count[c] / count[node]
            if p < min_prob:
                break
            out.append(token[c])
            score += p
            prob, node = p, c
        return out, score


class _RequestIndex:
    """A sequence's own trie (Sequence.proposer_state): its last tokens, kept in step with token_ids."""

    def __init__(self, depth: int, max_nodes: int, max_tokens: int) -> None:
        self.trie = _SuffixTrie(depth)
        self.seq = _Indexed(self.trie.new_root())
        self.max_nodes = max_nodes
        self.max_tokens = max_tokens
        self.synced = 0      # token_ids[:synced] seen
        self.last = 0        # token_ids[synced - 1]

    def continues(self, token_ids: list[int]) -> bool:
        n = self.synced
        return n <= len(token_ids) and (not n or token_ids[n - 1] == self.last)

    def sync(self, token_ids: list[int]) -> None:
        """Index the tokens appended since the last call (the last max_tokens of a long first one),
        at most INDEX_TOKENS_PER_CALL of them: a long prompt is indexed over several decode steps
        (each costs about D dictionary/array steps per token), never in one step's stall; the
        draft meanwhile comes from what is indexed."""
        n = len(token_ids)
        if n == self.synced:
            return
        trie, seq = self.trie, self.seq
        start = max(self.synced, n - self.max_tokens)
        n = min(n, start + INDEX_TOKENS_PER_CALL)
        new = array("I", token_ids[start:n])   # raises before any change
        for token in new:
            while trie.size + seq.tip_depth + 1 > self.max_nodes and seq.window:
                trie.drop_oldest(seq)
            trie.extend(seq, token)
            if seq.window > self.max_tokens:
                trie.drop_oldest(seq)
        self.synced, self.last = n, token_ids[n - 1]


class SuffixProposer:
    """Drafts from the sequence's own tokens and the outputs of earlier requests of its cache_salt."""

    def __init__(self, config: SpeculativeConfig, max_global_nodes: int = MAX_GLOBAL_NODES,
                 max_request_nodes: int = MAX_REQUEST_NODES, max_indexed_tokens: int = MAX_INDEXED_TOKENS,
                 max_global_tokens: int = MAX_GLOBAL_TOKENS) -> None:
        """max_*: the bounds (module constants; smaller in tests)."""
        depth = config.suffix_decoding_max_tree_depth
        for name, value in (("max_global_nodes", max_global_nodes), ("max_request_nodes", max_request_nodes)):
            if value < depth + 2:
                raise ValueError(f"{name} must be at least suffix_decoding_max_tree_depth + 2 = {depth + 2}, "
                                 f"got {value}")
        if max_indexed_tokens < 1:
            raise ValueError(f"max_indexed_tokens must be at least 1, got {max_indexed_tokens}")
        if max_global_tokens < max_indexed_tokens:
            raise ValueError(f"max_global_tokens must be at least max_indexed_tokens = {max_indexed_tokens}, "
                             f"got {max_global_tokens}")
        self.config = config
        self.depth = depth
        self.k = config.num_speculative_tokens
        self.max_match = min(depth - 1, max(1, depth - self.k))   # a full draft fits under depth D
        self.max_global_nodes = max_global_nodes
        self.max_request_nodes = max_request_nodes
        self.max_indexed_tokens = max_indexed_tokens
        self.max_global_tokens = max_global_tokens
        self._trie = _SuffixTrie(depth)
        self._roots: dict[str | None, int] = {}          # cache_salt -> its root in _trie
        self._salt_requests: dict[str | None, int] = {}  # cache_salt -> requests indexed (cached or being added)
        self._cached: deque[_Indexed] = deque()          # oldest first
        self._cached_tokens = 0                          # their tokens, kept to remove them

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    @property
    def num_global_nodes(self) -> int:
        return self._trie.size

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most min(max_tokens, num_speculative_tokens) draft tokens ([]: no match)."""
        budget = min(max_tokens, self.k)
        if budget <= 0 or not seq.token_ids:
            return []
        state = seq.proposer_state
        if not isinstance(state, _RequestIndex) or not state.continues(seq.token_ids):
            state = seq.proposer_state = _RequestIndex(self.depth, self.max_request_nodes, self.max_indexed_tokens)
        state.sync(seq.token_ids)
        draft, score = self._draft(state.trie, state.seq.root, seq.token_ids, budget)
        root = self._roots.get(seq.params.cache_salt)
        if root is not None:
            other, other_score = self._draft(self._trie, root, seq.token_ids, budget)
            if other_score > score:
                draft = other
        return draft

    def _draft(self, trie: _SuffixTrie, root: int, context: list[int], budget: int) -> tuple[list[int], float]:
        node, length = trie.match(root, context, self.max_match)
        if not length:
            return [], 0.0
        # ceil, less a hair so that 0.28 * 25 (7.000000000000001) allows 7
        limit = min(budget, math.ceil(self.config.suffix_decoding_max_spec_factor * length - 1e-9))
        return trie.draft(node, limit, self.config.suffix_decoding_min_token_prob)

    def finished(self, seq: Sequence) -> None:
        """Index seq's output (its last max_indexed_tokens tokens) for the requests of its salt."""
        if isinstance(seq.proposer_state, _RequestIndex):
            seq.proposer_state = None
        output = array("I", seq.token_ids[seq.num_prompt_tokens:][-self.max_indexed_tokens:])   # raises first
        if not output:
            return
        max_requests = self.config.suffix_decoding_max_cached_requests
        while self._cached and (len(self._cached) >= max_requests
                                or self._cached_tokens + len(output) > self.max_global_tokens):
            self._evict_oldest()
        salt = seq.params.cache_salt
        self._salt_requests[salt] = self._salt_requests.get(salt, 0) + 1   # keeps its root while adding
        root = self._roots.get(salt)
        if root is None:
            self._make_room(1, None)
            root = self._roots[salt] = self._trie.new_root()
        indexed = _Indexed(root, salt)
        for token in output:
            self._make_room(indexed.tip_depth + 1, indexed)
            self._trie.extend(indexed, token)
        self._cached.append(indexed)
        self._cached_tokens += len(indexed.tokens)

    def _make_room(self, nodes: int, adding: _Indexed | None) -> None:
        """Room for nodes more in the global store: the oldest requests evicted, then (one alone
        too long) the oldest suffixes of the one being added."""
        trie = self._trie
        while trie.size + nodes > self.max_global_nodes:
            if self._cached:
                self._evict_oldest()
            elif adding is not None and adding.window:
                trie.drop_oldest(adding)
            else:
                raise RuntimeError("suffix decoding: global node store full with nothing to evict")

    def _evict_oldest(self) -> None:
        indexed = self._cached.popleft()
        self._trie.remove(indexed)
        self._cached_tokens -= len(indexed.tokens)
        salt = indexed.salt
        self._salt_requests[salt] -= 1
        if not self._salt_requests[salt]:
            del self._salt_requests[salt]
            self._trie.free_root(self._roots.pop(salt))
