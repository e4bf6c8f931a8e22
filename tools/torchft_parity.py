"""Check that the ``torchft`` compatibility package (``compat/torchft``) offers torchft's public API.

Walks the public surface of a ``torchft`` package -- torchft 0.2.0 (installed in the venv)
and torchft-nightly (the 0.3 API, unpacked next to the venv) -- for the modules a trainer
calls (``MODULES``): every public name, and for classes and functions their parameter
names, and for classes their public methods and their parameter names. Each must exist in
the compatibility package with the same parameters, or be listed in ``compat/parity.toml``
with the reason it differs.

Each package is imported in its own subprocess (``--dump PATH``: PATH first on
``sys.path``), since all of them are named ``torchft``.

Usage::

    python tools/torchft_parity.py --compat DIR [--reference DIR | --installed] [--label NAME]

prints the differences not listed in ``compat/parity.toml`` and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import inspect
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARITY = ROOT / "compat" / "parity.toml"

#: the torchft modules a trainer calls
MODULES = (
    "torchft",
    "torchft.manager",
    "torchft.process_group",
    "torchft.optim",
    "torchft.ddp",
    "torchft.data",
    "torchft.local_sgd",
    "torchft.checkpointing",
    "torchft.coordination",
)

#: one entry of a surface: kind ("class", "function", "attribute", "module", "missing")
#: and, for callables, the parameter names in order (``*name``/``**name`` for varargs)
Entry = dict[str, Any]


def _params(obj: Any) -> list[str] | None:
    """The parameter names of a callable (None when it has no inspectable signature)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            out.append(p.name)
    return out


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "attribute"


def _own(obj: Any) -> bool:
    """Whether ``obj`` is defined in a ``torchft`` module (not re-exported from torch or typing)."""
    mod = getattr(obj, "__module__", None) or ""
    return mod == "torchft" or mod.startswith("torchft.")


def public_names(module: Any) -> list[str]:
    """A module's public names: ``__all__`` when it has one, else the public classes and
    functions defined in the module itself (not those it imports)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(str(n) for n in names)
    return sorted(
        n for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
        and getattr(v, "__module__", None) == module.__name__
    )


def _methods(cls: type, own_only: bool) -> dict[str, Any]:
    """The public methods and properties of a class (when ``own_only``: those of the class
    itself and of its torchft bases, not those inherited from torch or the standard library)."""
    out: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if own_only and base is not cls and not _own(base):
            continue
        for n, v in vars(base).items():
            if n.startswith("_") and n != "__init__":
                continue
            out[n] = v
        # dataclass fields without a default are instance attributes only
        for n in getattr(base, "__dataclass_fields__", {}):
            if not n.startswith("_") and n not in out:
                out[n] = _FIELD
    return out


#: stands for a dataclass field in ``_methods``
_FIELD = object()


def _entry(obj: Any) -> Entry:
    if isinstance(obj, property) or obj is _FIELD:
        return {"kind": "property"}
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    kind = _kind(obj)
    e: Entry = {"kind": kind}
    if kind == "class":
        e["params"] = _params(obj.__init__)
    elif kind == "function":
        e["params"] = _params(obj)
    return e


def dump(modules: tuple[str, ...] = MODULES, reference: bool = True) -> dict[str, Entry]:
    """The surface of the ``torchft`` importable now: ``"module:name"`` and
    ``"module:Class.method"`` -> entry. ``reference``: walk each module's public names
    and torchft's own methods; otherwise (the package under check) record every method,
    inherited or not, so that lookups find them."""
    out: dict[str, Entry] = {}
    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            out[f"{modname}:"] = {"kind": "missing", "error": str(e)}
            continue
        out[f"{modname}:"] = {"kind": "module"}
        names = public_names(mod) if reference else [n for n in dir(mod) if not n.startswith("_")]
        for n in names:
            if not hasattr(mod, n):
                continue
            obj = getattr(mod, n)
            out[f"{modname}:{n}"] = _entry(obj)
            if inspect.isclass(obj):
                for m, v in _methods(obj, own_only=reference).items():
                    if m != "__init__":
                        out[f"{modname}:{n}.{m}"] = _entry(v)
    return out


def dump_in_subprocess(path: Path | None, role: str = "reference", python: str = sys.executable,
                       timeout: float = 300) -> dict[str, Entry]:
    """Run ``dump`` in a fresh interpreter with ``path`` first on ``sys.path`` (None: the
    interpreter's own torchft); ``role``: "reference" (torchft) or "compat"."""
    cmd = [python, "-W", "ignore", str(Path(__file__).resolve()), "--dump"]
    if path is not None:
        cmd += ["--path", str(path)]
    cmd += ["--role", role]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/")
    if res.returncode != 0:
        raise RuntimeError(f"dumping torchft's surface failed ({cmd}):\n{res.stderr[-4000:]}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def differs(ref: Entry, got: Entry | None) -> str | None:
    """Why ``got`` (the compat package's entry) does not stand in for ``ref`` (torchft's),
    or None when it does: missing; a class/function replaced by something else; a
    parameter of torchft's missing, or at another position among the positional ones; or a
    required parameter torchft's callers do not pass."""
    if got is None or got["kind"] == "missing":
        return "missing"
    if ref["kind"] in ("class", "function") and got["kind"] not in ("class", "function"):
        return f"is a {got['kind']}, torchft's is a {ref['kind']}"
    rp, gp = ref.get("params"), got.get("params")
    if rp is None or gp is None:
        return None
    rp = [p for p in rp if p not in ("self", "cls")]
    gp = [p for p in gp if p not in ("self", "cls")]
    star_kw = any(p.startswith("**") for p in gp)
    missing = [p for p in rp if not p.startswith("*") and p not in gp]
    if missing and not star_kw:
        return "parameters missing: " + ", ".join(missing)
    moved = [p for i, p in enumerate(rp) if not p.startswith("*") and p in gp and gp.index(p) != i
             and i < len(gp) and not gp[i].startswith("*")]
    if moved:
        return "parameters at other positions: " + ", ".join(moved) + f" (torchft {rp}, compat {gp})"
    return None


def load_allowed(path: Path = PARITY) -> dict[str, str]:
    """``compat/parity.toml``: ``"module:name"`` pattern (fnmatch) -> why it differs."""
    data = tomllib.loads(path.read_text())
    return {str(k): str(v) for k, v in data.get("differs", {}).items()}


def compare(ref: Mapping[str, Entry], got: Mapping[str, Entry], allowed: Mapping[str, str]) -> list[str]:
    """The differences of ``got`` from ``ref`` that no pattern of ``allowed`` covers."""
    out = []
    for key in sorted(ref):
        why = differs(ref[key], got.get(key))
        if why is None:
            continue
        if any(fnmatch.fnmatchcase(key, pat) for pat in allowed):
            continue
        out.append(f"{key}: {why}")
    return out


def nightly_dir(environ: Mapping[str, str] = os.environ, prefix: str = sys.prefix,
                path: list[str] | None = None) -> Path | None:
    """The folder holding torchft-nightly's ``torchft/``: RALLYPOINT_TORCHFT_NIGHTLY, else
    ``torchft-nightly`` beside the running venv (``<sys.prefix>/torchft-nightly``) or beside
    a venv it is layered over (a ``lib/pythonX/site-packages`` on ``sys.path``); None when absent."""
    cands = [environ.get("RALLYPOINT_TORCHFT_NIGHTLY"), str(Path(prefix) / "torchft-nightly")]
    for p in sys.path if path is None else path:
        site = Path(p)
        if site.name == "site-packages" and site.parent.parent.name == "lib":
            cands.append(str(site.parent.parent.parent / "torchft-nightly"))
    for cand in cands:
        if cand and (Path(cand) / "torchft" / "__init__.py").is_file():
            return Path(cand)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", action="store_true", help="print this interpreter's torchft surface as JSON")
    ap.add_argument("--path", type=Path, help="with --dump: put this folder first on sys.path")
    ap.add_argument("--role", choices=("reference", "compat"), default="reference")
    ap.add_argument("--compat", type=Path, help="folder where the compat package is installed")
    ap.add_argument("--reference", type=Path, help="folder holding the reference torchft (default: installed)")
    ap.add_argument("--unlisted", action="store_true", help="also print allowed patterns that match nothing")
    args = ap.parse_args(argv)
    if args.dump:
        if args.path is not None:
            sys.path.insert(0, str(args.path))
        print(json.dumps(dump(reference=args.role == "reference")))
        return 0
    if args.compat is None:
        ap.error("--compat DIR is required (pip install --no-deps --target DIR compat/torchft)")
    ref = dump_in_subprocess(args.reference)
    got = dump_in_subprocess(args.compat, role="compat")
    allowed = load_allowed()
    bad = compare(ref, got, allowed)
    for line in bad:
        print(line)
    if args.unlisted:
        for pat in allowed:
            if not any(fnmatch.fnmatchcase(k, pat) for k in ref):
                print(f"(unused pattern) {pat}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
