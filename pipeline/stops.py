"""Stop strings on the host: cut a finished completion before the first stop string it contains.

    cut = cut_at_stop(decode, token_ids, stops)   # None when no stop string occurs

The check runs once per row, when the row is handed back (its tokens are already on the host): it adds no
device read. The text is cut before the earliest stop string (as vLLM does by default); the token ids
are the longest prefix of the completion whose decoded text is a prefix of the cut text, and the
completion becomes exactly that decoded text, so `completion` and `completion_token_ids` always agree.
A stop string that spans tokens is found in the decoded text; one that begins inside a token (the
token "ab\\n" with the stop "\\n") drops that whole token, whose text before the stop would otherwise have
no token ids of its own.

As vLLM's detokenizer, a stop string is not looked for in the text of a row's first `min_tokens` tokens: a
match counts only when it ends in the text of a later token (it may begin earlier); `stop_at` is that rule,
for the cut here and the feed's early end alike.

Not here: ending a row early (`pipeline.generate.feed`: a row whose newest tokens complete a stop string
is finished at once, and its output is then cut here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCut:
    text: str  # the completion before the stop string
    num_tokens: int  # keep token_ids[:num_tokens]
    stop: str  # the stop string found


def stop_at(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends past its first `after` characters: (where it begins, the
    string), or None. `after`: the length of the text of the tokens before min_tokens (vLLM's rule)."""
    found = []
    for stop in stops:
        place = text.find(stop, max(0, after - len(stop) + 1))  # the first match that ends past `after`
        if place >= 0:
            found.append((place, stop))
    return min(found) if found else None


def cut_at_stop(decode: Callable[[list[int]], str], token_ids: list[int], stops: Sequence[str],
                include: bool = False, min_tokens: int = 0) -> StopCut | None:
    """The completion cut before its first stop string (after it with `include`: vLLM's
    include_stop_str_in_output), or None when it holds none; a stop string counts only once it ends in the text
    of a token after the first `min_tokens` (vLLM's min_tokens)."""
    if not stops or len(token_ids) <= min_tokens:
        return None
    text = decode(token_ids)
    match = stop_at(text, stops, len(decode(token_ids[:min_tokens])) if min_tokens else 0)
    if match is None:
        return None
    place, stop = match
    if include:
        place += len(stop)
    before = text[:place]
    low, high = 0, len(token_ids)  # the longest prefix whose text fits before the stop: binary search
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode(token_ids[:middle])) <= place:
            low = middle
        else:
            high = middle - 1
    while low > 0 and not before.startswith(decode(token_ids[:low])):
        low -= 1  # a prefix that decodes differently on its own (merged characters): step back
    return StopCut(decode(token_ids[:low]), low, stop)
