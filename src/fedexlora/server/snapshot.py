"""The server's state as data: what :meth:`Server.state_dict` holds, parsed and checked.

Torch and the standard library only; :class:`fedexlora.server.Server` builds and loads it
(:mod:`fedexlora.server.state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedexlora.core.aggregation import Residual, residuals_from_flat
from fedexlora.core.state import AdapterState

__all__ = ["STATE_KEYS", "ServerStateMismatch", "check_state"]


class ServerStateMismatch(ValueError):
    """A well-formed server state that does not fit the server it is loaded into.

    Another method, other modules, other shapes or dtypes, or clients of other ranks
    (:meth:`Server.load_state_dict`); a malformed state raises a plain ``ValueError``.
    """


STATE_KEYS = (  # what Server.state_dict() holds
    "round",
    "version",
    "method",
    "client_version",
    "history_versions",
    "remainder_clients",
    "last_sizes",
    "sent_clients",
    "client_rank",
    "tensors",
)
_ROLES = ("U", "V", "dense")  # the tensors of a residual (Residual.tensors)


def _residual_parts(parsed: dict) -> list[tuple[str, dict[str, Residual]]]:
    """Every residual map of a parsed state, named by its prefix in ``tensors``."""
    parts = [("base_delta", parsed["base_delta"]), ("feedback", parsed["feedback"])]
    parts += [(f"history{v}", r) for v, r in parsed["history"].items()]
    parts += [(f"remainder{c}", r) for c, r in parsed["remainder"].items()]
    return parts


def _specs(flat: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(t.shape), t.dtype) for k, t in flat.items()}


def _compare_flat(part: str, got: Mapping[str, torch.Tensor], want: Mapping) -> list[str]:
    """What of ``got`` differs from ``want`` (``key -> (shape, dtype)``): keys, shapes, dtypes."""
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"{part}: missing {missing}")
    if extra:
        problems.append(f"{part}: unexpected {extra}")
    for k in sorted(set(want) & set(got)):
        shape, dtype = want[k]
        if tuple(got[k].shape) != shape:
            problems.append(f"{part}.{k}: shape {tuple(got[k].shape)}, expected {shape}")
        elif got[k].dtype != dtype:
            problems.append(f"{part}.{k}: dtype {got[k].dtype}, expected {dtype}")
    return problems


def _count(value, what: str, *, key: bool = False) -> int:
    """``value``, a non-negative int (as a JSON object's ``key``, its digits)."""
    if key and isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"server state: {what} must be a non-negative integer, got {value!r}")
    return value


def _parse_state(state: Mapping, *, assign: bool) -> dict:
    """A :meth:`Server.state_dict` turned back into the server's fields, or ``ValueError``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"server state must be a mapping, got {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"server state lacks {missing}")
    extra = sorted(str(k) for k in state if k not in STATE_KEYS)
    if extra:
        raise ValueError(f"server state has unexpected keys {extra}")
    out: dict = {"method": state["method"]}
    if not isinstance(out["method"], str):
        raise ValueError(f"server state: method must be a string, got {out['method']!r}")
    out["round"] = _count(state["round"], "round")
    out["version"] = _count(state["version"], "version")

    def mapping(key: str) -> Mapping:
        if not isinstance(state[key], Mapping):
            raise ValueError(f"server state: {key} must be a mapping, got {state[key]!r}")
        return state[key]

    def ids(key: str) -> list[int]:
        if not isinstance(state[key], (list, tuple)):
            raise ValueError(f"server state: {key} must be a list, got {state[key]!r}")
        return [_count(v, f"each of {key}") for v in state[key]]

    out["client_version"] = {
        _count(c, "a client id", key=True): _count(v, f"client_version of {c}")
        for c, v in mapping("client_version").items()
    }
    out["client_rank"] = {
        _count(c, "a client id", key=True): _count(v, f"client_rank of {c}")
        for c, v in mapping("client_rank").items()
    }
    last_sizes = {}
    for name, sizes in mapping("last_sizes").items():
        if not isinstance(sizes, (list, tuple)) or len(sizes) != 2:
            raise ValueError(f"server state: last_sizes of {name!r} must be [bytes, dense bytes]")
        last_sizes[str(name)] = (_count(sizes[0], "last_sizes"), _count(sizes[1], "last_sizes"))
    out["last_sizes"] = last_sizes
    history_versions = sorted(ids("history_versions"))
    remainder_clients, sent_clients = ids("remainder_clients"), ids("sent_clients")

    tensors = mapping("tensors")
    groups: dict[str, dict[str, torch.Tensor]] = {"state": {}, "base_delta": {}, "feedback": {}}
    groups.update({f"history{v}": {} for v in history_versions})
    groups.update({f"remainder{c}": {} for c in remainder_clients})
    groups.update({f"sent{c}": {} for c in sent_clients})
    adapters = {"state", *(f"sent{c}" for c in sent_clients)}  # the rest hold residuals
    stray = []
    for key, t in tensors.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"server state: tensors must map names to tensors, got {key!r}")
        head, _, rest = key.partition(".")
        module, _, role = rest.rpartition(".")
        if head in groups and rest and (head in adapters or (module and role in _ROLES)):
            if head not in adapters and t.ndim != 2:
                raise ValueError(f"server state: residual tensor {key!r} is not 2-D")
            groups[head][key] = t if assign else t.detach().clone()
        else:
            stray.append(key)
    if stray:
        raise ValueError(f"server state has unexpected tensors {sorted(stray)[:8]}")
    roles: dict[str, set[str]] = {}
    for head, group in groups.items():
        if head not in adapters:
            for key in group:
                residual, _, role = key.rpartition(".")
                roles.setdefault(residual, set()).add(role)
    odd = sorted(
        f"{r} {sorted(got)}" for r, got in roles.items() if got not in ({"dense"}, {"U", "V"})
    )
    if odd:
        raise ValueError(f"server state: residuals need U and V, or dense; got {odd[:8]}")

    def adapter(prefix: str) -> AdapterState:
        cut = len(prefix) + 1
        return AdapterState.from_flat({k[cut:]: t for k, t in groups[prefix].items()})

    try:
        out["state"] = adapter("state")
        out["base_delta"] = residuals_from_flat("base_delta", groups["base_delta"])
        out["feedback"] = residuals_from_flat("feedback", groups["feedback"])
        out["history"] = {
            v: residuals_from_flat(f"history{v}", groups[f"history{v}"]) for v in history_versions
        }
        out["remainder"] = {
            c: residuals_from_flat(f"remainder{c}", groups[f"remainder{c}"])
            for c in remainder_clients
        }
        out["sent"] = {c: adapter(f"sent{c}") for c in sent_clients}
    except ValueError as exc:  # a residual without U or V, a stray adapter key
        raise ValueError(f"server state: {exc}") from None
    for part, residuals in _residual_parts(out):
        for name, r in residuals.items():
            if r.U is not None and r.U.shape[1] != r.V.shape[0]:
                raise ValueError(
                    f"server state: residual {part}.{name} has factors of shapes "
                    f"{tuple(r.U.shape)} and {tuple(r.V.shape)}"
                )
    empty = [v for v, res in out["history"].items() if not res]
    if empty:
        raise ValueError(f"server state: history versions {empty} have no residuals")
    if out["version"] > out["round"]:
        raise ValueError(f"server state: version {out['version']} is past round {out['round']}")
    late = [v for v in history_versions if v >= out["version"]]
    late += [v for v in out["client_version"].values() if v > out["version"]]
    if late:
        raise ValueError(
            f"server state: versions {sorted(set(late))} are past version {out['version']}"
        )
    return out


def check_state(server, s: dict) -> None:
    """Raises :class:`ServerStateMismatch` naming what of a parsed state is not ``server``'s.

    ``s`` is what :func:`_parse_state` returned; ``server`` a
    :class:`~fedexlora.server.Server` (its method, layers, clients and their ranks).
    """
    if s["method"] != server.method:
        raise ServerStateMismatch(
            f"server state is for method {s['method']!r}, not {server.method!r}"
        )
    layers = server.layers
    problems = _compare_flat("state", s["state"].to_flat(), _specs(server.state.to_flat()))
    for part, residuals in _residual_parts(s):
        for name, r in residuals.items():
            info = layers.get(name)
            if info is None:
                problems.append(f"{part}.{name}: no such module")
            elif tuple(r.shape) != tuple(info.shape):
                problems.append(
                    f"{part}.{name}: shape {tuple(r.shape)}, expected {tuple(info.shape)}"
                )
    problems += [f"last_sizes.{k}: no such module" for k in s["last_sizes"] if k not in layers]
    clients = set(s["client_version"]) | set(s["remainder"]) | set(s["sent"])
    clients |= set(s["client_rank"])
    problems += [
        f"client {c}: the server has {server.num_clients} clients"
        for c in sorted(clients)
        if c >= server.num_clients
    ]
    for c in sorted(set(s["remainder"]) | set(s["sent"])):
        if c not in server.client_layers:
            problems.append(f"client {c}: a heterogeneous view, but the client has the global rank")
    for c, view in s["sent"].items():
        if c in server.client_layers:
            problems += _compare_flat(f"sent{c}", view.to_flat(), _view_specs(server, c))
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ServerStateMismatch(
            "server state does not match this server: " + "; ".join(problems[:8]) + more
        )


def _view_specs(server, c: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor of the view client ``c`` (another rank) trains from."""
    out = _specs(server.state.to_flat())
    for name, info in server.client_layers[c].items():
        d, n = server.layers[name].shape
        if f"lora.{name}.A" in out:
            out[f"lora.{name}.A"] = ((info.rank, n), out[f"lora.{name}.A"][1])
        out[f"lora.{name}.B"] = ((d, info.rank), out[f"lora.{name}.B"][1])
    return out
