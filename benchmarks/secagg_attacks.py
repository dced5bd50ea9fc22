"""An active server's attacks on SecAgg+ (#55), run through the project's protocol code.

Runs the attacks of ``tests/secagg/test_secagg_active.py`` (its helpers: only the
server is dishonest) at several round sizes and prints, for each, whether the server
read the victim's vector or a client refused:

- splitting the unmask requests (``t`` holders asked for the victim's seed share, the
  others for its key share), at the threshold the server computes, and at main's
  ``round(0.5 n)`` where that differs;
- every client but the victim sent ``fedex.clip = 2**40``;
- the victim forwarded only ``t - 1`` neighbours' shares, which are then called dropped.

    PYTHONPATH=src:tests/secagg:tests python benchmarks/secagg_attacks.py

To see the attacks succeed, run it against an older ``src`` (e.g. main at 817027c)
with this checkout's ``tests`` on the path.
"""

from __future__ import annotations

import numpy as np


def _outcome(fn, *args) -> str:
    try:
        recovered, truth = fn(*args)
    except ValueError as exc:
        return f"refused: {str(exc)[:110]}"
    if recovered is None:
        return "not recovered (too few shares)"
    if isinstance(truth, list):
        truth = truth[0]
    if recovered.dtype.kind == "f":
        err, top = np.max(np.abs(recovered - truth)), np.max(np.abs(truth))
        return f"read within {err:.1e} (values up to {top:.1e})"
    return "recovered exactly" if np.array_equal(recovered, truth) else "not recovered"


def main() -> None:
    from fedexlora.secagg.protocol import ServerSession
    from test_secagg_active import (
        _mains_threshold,
        read_victim_with_a_different_clip,
        split_unmask,
        withhold_and_call_dropped,
    )

    for k in (4, 5, 6, 8, 9, 10, 12):
        s = ServerSession(list(range(k)), 1)
        print(f"k={k}: {s.num_shares} shares, the server's threshold {s.threshold}: "
              f"split unmask -> {_outcome(split_unmask, k, s.threshold)}")  # fmt: skip
        old = _mains_threshold(s.num_shares)
        if old != s.threshold:
            print(f"    a server sending main's threshold {old}: {_outcome(split_unmask, k, old)}")
    print(f"clip 2^40 to all but the victim: {_outcome(read_victim_with_a_different_clip)}")
    for k in (4, 5, 9):
        print(f"k={k}: withhold shares, call dropped -> {_outcome(withhold_and_call_dropped, k)}")


if __name__ == "__main__":
    main()
