"""envpool's Atari engine for a host without network: a stripped bundle of wheels that travels with the tree.

``python -m benchmarks.atari_bundle build WHEELS [--game pong,breakout]`` writes ``.wheels-atari/``
(git-ignored) from the wheels in ``WHEELS`` (``pip download --no-deps`` of the names in
:data:`WHEELS` and envpool 1.2.5's): envpool holding only its Atari module (its wheel carries
MuJoCo, VizDoom, Procgen, ... modules Atari does not use: 53 MB), envpool-assets holding only
the games' ROMs (62 MB with every asset), and the pure or small wheels envpool's Atari path
imports (gymnasium, dm-env and theirs). Each stripped wheel is a valid wheel again (its RECORD
rewritten), so pip could install it too.

``python -m benchmarks.atari_bundle install DIR`` (on the host) unpacks into ``DIR`` every
wheel of the bundle whose module this Python cannot already import (the host's own numpy, jax
and others stay in charge), without pip or network; then ``PYTHONPATH=DIR``.
``python -m benchmarks.atari_bundle check`` steps the game once through the demo's envpool
engine and prints what it got. ``benchmarks/device_engines.sh`` does all three on the host
and runs ``benchmarks/rollouts_engines.py``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import os
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, ".wheels-atari")

#: Distribution (as its wheel's file name starts) -> the module it installs. numpy and jax are
#: the host's; cloudpickle is jaxtransport's own dependency (installed where it runs).
WHEELS = {
    "envpool": "envpool",
    "envpool_assets": "envpool_assets",
    "gymnasium": "gymnasium",
    "farama_notifications": "farama_notifications",
    "dm_env": "dm_env",
    "dm_tree": "tree",
    "absl_py": "absl",
    "optree": "optree",
    "wrapt": "wrapt",
    "attrs": "attr",
    "typing_extensions": "typing_extensions",
}

# envpool's package: what its Atari path imports (the rest of envpool/ is other engines).
_ENVPOOL_KEEP = ("envpool/__init__.py", "envpool/registration.py", "envpool/py.typed", "envpool/python/",
                 "envpool/atari/")
_ENTRY = '"""Entry point for the envs\' registration: Atari only (a stripped copy, benchmarks/atari_bundle.py)."""\n\n' \
         "import envpool.atari.registration  # noqa: F401\n"


def _dist(name: str) -> str:
    """The distribution a wheel file is of (``envpool_assets-0.3.0-py3-none-any.whl`` -> ``envpool_assets``)."""
    return os.path.basename(name).split("-")[0]


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _keep(dist: str, member: str, games: tuple[str, ...]) -> bool:
    if dist == "envpool":
        return member.startswith(_ENVPOOL_KEEP) or member == "envpool/entry.py" or ".dist-info/" in member
    if dist == "envpool_assets":
        if member.startswith("envpool_assets/atari/roms/"):
            return os.path.basename(member) in {f"{g}.bin" for g in games}
        return member == "envpool_assets/__init__.py" or ".dist-info/" in member
    return True


def _rewrite(src: str, dst: str, games: tuple[str, ...]) -> None:
    """Copy the wheel ``src`` to ``dst`` keeping what :func:`_keep` keeps, with a new RECORD."""
    dist = _dist(src)
    records: list[str] = []
    record_path = None
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_path = name
                continue
            if "__pycache__/" in name or not _keep(dist, name, games):
                continue
            data = zin.read(name)
            if dist == "envpool" and name == "envpool/entry.py":
                data = _ENTRY.encode()
            zout.writestr(info, data)
            records.append(_record_line(name, data))
        if record_path is None:
            raise ValueError(f"{src}: no RECORD: not a wheel")
        records.append(f"{record_path},,")
        zout.writestr(record_path, "\n".join(records) + "\n")


def build(wheels: str, games: tuple[str, ...] = ("pong",), out: str = BUNDLE) -> list[str]:
    """Write the bundle into ``out`` from the wheels in ``wheels``, keeping the ROMs of
    ``games``; returns the files written."""
    found = {}
    for f in sorted(os.listdir(wheels)):
        if f.endswith(".whl") and _dist(f) in WHEELS:
            found[_dist(f)] = os.path.join(wheels, f)
    missing = sorted(set(WHEELS) - set(found))
    if missing:
        raise SystemExit(f"{wheels} lacks the wheels of {', '.join(missing)}: "
                         f"pip download --no-deps -d {wheels} envpool==1.2.5 envpool-assets==0.3.0 "
                         "gymnasium farama-notifications dm-env dm-tree absl-py optree wrapt attrs typing_extensions")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        if f.endswith(".whl"):
            os.remove(os.path.join(out, f))
    written = []
    for dist, path in found.items():
        dst = os.path.join(out, os.path.basename(path))
        _rewrite(path, dst, tuple(games))
        written.append(dst)
    return written


def install(into: str, bundle: str = BUNDLE) -> list[str]:
    """Unpack into ``into`` each wheel of ``bundle`` whose module this Python cannot import."""
    os.makedirs(into, exist_ok=True)
    done = []
    for f in sorted(os.listdir(bundle)):
        if not f.endswith(".whl"):
            continue
        module = WHEELS.get(_dist(f))
        if module is None:
            continue
        if importlib.util.find_spec(module) is not None:
            print(f"  {f}: {module} already importable here, not unpacked", flush=True)
            continue
        with zipfile.ZipFile(os.path.join(bundle, f)) as z:
            z.extractall(into)
        done.append(f)
        print(f"  {f}: unpacked", flush=True)
    return done


def check(game: str = "pong") -> None:
    """Step ``game`` through the demo's envpool engine (one actor, random actions) and print it."""
    from jaxtransport.rollouts import _atari as atari

    spec = atari.Spec(atari.game_id(game, "envpool"), 8, 84, 0, "envpool")
    actor = atari.make_actor(spec, 0)
    try:
        seconds = actor.random_steps(200)
        print(f"{spec.game_id} through envpool: observations {actor._obs.shape} {actor._obs.dtype}, "
              f"{actor.actions} actions, {8 * 200 / seconds:,.0f} env steps/s on one thread", flush=True)
    finally:
        actor.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write .wheels-atari/ from downloaded wheels")
    b.add_argument("wheels", help="a folder holding the wheels (pip download --no-deps)")
    b.add_argument("--game", default="pong,breakout",
                   help="the ROMs to keep, comma-separated (envpool-assets' roms/<game>.bin)")
    i = sub.add_parser("install", help="unpack the bundle's wheels this Python lacks into DIR")
    i.add_argument("dir")
    c = sub.add_parser("check", help="step the game once through the envpool engine")
    c.add_argument("--game", default="pong")
    args = p.parse_args(argv)
    if args.cmd == "build":
        files = build(args.wheels, tuple(g for g in args.game.split(",") if g))
        total = sum(os.path.getsize(f) for f in files)
        for f in files:
            print(f"  {os.path.relpath(f, ROOT)} {os.path.getsize(f) / 2**20:.2f} MiB")
        print(f"{len(files)} wheels, {total / 2**20:.1f} MiB in {os.path.relpath(BUNDLE, ROOT)}/")
    elif args.cmd == "install":
        install(args.dir)
    else:
        check(args.game)
    return 0


if __name__ == "__main__":
    sys.exit(main())
