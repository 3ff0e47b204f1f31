"""Stop strings on the host: cut a finished completion before the first stop string it contains.

    cut = cut_at_stop(decode, token_ids, stops)   # None when no stop string occurs

The check runs once per row, when the row is handed back (its tokens are already on the host): it adds no
device read. The text is cut before the earliest stop string (as vLLM does by default); the token ids
are the longest prefix of the completion whose decoded text is a prefix of the cut text, and the
completion becomes exactly that decoded text, so `completion` and `completion_token_ids` always agree.
A stop string that spans tokens is found in the decoded text; one that begins inside a token (the
token "ab\\n" with the stop "\\n") drops that whole token, whose text before the stop would otherwise have
no token ids of its own.

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


def cut_at_stop(decode: Callable[[list[int]], str], token_ids: list[int], stops: Sequence[str],
                include: bool = False) -> StopCut | None:
    """The completion cut before its first stop string (after it with `include`: vLLM's
    include_stop_str_in_output), or None when it holds none."""
    if not stops or not token_ids:
        return None
    text = decode(token_ids)
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    if not found:
        return None
    place, stop = min(found)
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
