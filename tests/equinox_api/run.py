"""equinox's own ``tests/test_jit.py`` run under the jax.jit swap, cold and warm: equinox's
``filter_jit``, its ``jax.jit`` a ``kiln.jit``, must pass them as on JAX, bar ``differences.txt``.

equinox's tests are not in its wheel: this script takes them from an equinox source, at the tag
of the installed equinox, or from the copy of them at ``v0.13.8`` in this repository
(``equinox_tests/``, next to this file), into a folder of their own, and runs
``tests/test_jit.py`` three times:

1. **plain**: ``python -m pytest tests/test_jit.py`` (equinox on JAX's own ``jax.jit``);
2. **cold**: ``python -m kiln run -m pytest tests/test_jit.py`` (the swap: kiln run's default)
   on an empty store (``KILN_CACHE_DIR``): every ``jax.jit`` outside JAX itself, the one
   inside equinox's ``filter_jit`` included, is a ``kiln.jit``;
3. **warm**: the same command again, on the store the cold run filled.

Usage (no network: ``SRC`` is an equinox git directory, a checkout, or a folder holding its
``tests/``; without ``--equinox`` or ``KILN_EQUINOX_SRC``, the copy in ``equinox_tests/``, which
only an equinox of its version may run)::

    PYTHONPATH=src python tests/equinox_api/run.py [--equinox SRC] [--out DIR] [--json PATH]
                                                   [--without-trace-counts]

``KILN_EQUINOX_SRC`` gives ``SRC`` too. The files taken are ``tests/__init__.py``,
``tests/conftest.py``, ``tests/helpers.py`` and ``tests/test_jit.py`` at tag
``v<equinox.__version__>``, unchanged; the folder's ``pytest.ini`` is equinox's pytest
settings (``filterwarnings``) without its ``--jaxtyping-packages=equinox,beartype...`` option
(a runtime type checker over equinox's own code; beartype is not installed here, and it
checks annotations, not jit). ``EQX_GETKEY_SEED=0`` fixes the ``getkey`` fixture's seed
(equinox draws it at random otherwise), so each run builds the same programs.

A failure of the cold or warm run that ``differences.txt`` (next to this file) does not list
for that run makes the exit status 1; docs/drop-in.md says why each listed one fails.
``--without-trace-counts`` then runs cold and warm once more (on a store of their own) with
equinox's ``assert num_traces == N`` lines removed (in the copy), to show that what those tests
compute is right when a warm start skips the traces they count; no failure may remain.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FILES = ("tests/__init__.py", "tests/conftest.py", "tests/helpers.py", "tests/test_jit.py")
# equinox's [tool.pytest.ini_options], less --jaxtyping-packages (see the module docstring)
PYTEST_INI = """\
[pytest]
filterwarnings =
    error
    ignore:Setting `jax_pmap_shmap_merge` is deprecated:DeprecationWarning
"""
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", "-p",
          "no:xdist", "-p", "no:randomly", "tests/test_jit.py")
RUNS = ("plain", "cold", "warm")
# equinox's FILES at this tag, unchanged, in this repository (equinox_tests/README.md)
VENDORED = HERE / "equinox_tests"
VENDORED_TAG = "v0.13.8"
VENDORED_COMMIT = "dfadb04884a0fc067fb85282c994f8e5c106941f"


def _load_children() -> Any:
    """``tests/children.py``, the suite's harness for child processes (loaded by path: this
    script runs outside pytest)."""
    spec = importlib.util.spec_from_file_location("kiln_test_children",
                                                  HERE.parent / "children.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


children = _load_children()


def _git(src: Path) -> list[str] | None:
    """``git`` arguments reaching the repository at ``src`` (a git directory or a checkout)."""
    if (src / "HEAD").is_file() and (src / "objects").is_dir():
        return ["git", f"--git-dir={src}"]
    if (src / ".git").exists():
        return ["git", "-C", str(src)]
    return None


def fetch(src: Path, tag: str, out: Path) -> str:
    """Write equinox's test files at ``tag`` from ``src`` into ``out``; what they came from."""
    git = _git(src)
    for name in FILES:
        dest = out / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if git is None:
            shutil.copyfile(src / name, dest)
        else:
            dest.write_bytes(subprocess.run([*git, "show", f"{tag}:{name}"], check=True,
                                            capture_output=True).stdout)
    (out / "pytest.ini").write_text(PYTEST_INI)
    if src.resolve() == VENDORED:
        return f"{VENDORED_TAG} (commit {VENDORED_COMMIT}), the copy in {VENDORED}"
    if git is None:
        return f"{src} (a folder: its files as they are)"
    commit = subprocess.run([*git, "rev-parse", f"{tag}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    return f"{tag} (commit {commit})"


def _env(store: Path) -> dict[str, str]:
    # the kiln under test: a checkout's src/ when PYTHONPATH names it (children.KILN_SRC)
    return children.child_env(KILN_CACHE_DIR=str(store), JAX_PLATFORMS="cpu",
                              EQX_GETKEY_SEED="0", PYTHONDONTWRITEBYTECODE="1")


def run(kind: str, folder: Path, store: Path) -> dict[str, Any]:
    """One run of ``tests/test_jit.py`` in ``folder`` (``kind``: plain, cold or warm): its
    outcome per test."""
    # (outside ``folder``: pytest lists it, and a report left there by the cold run would be
    # a new name in a listing the warm run's guard holds: every function verified once)
    reports = folder.parent / f"{folder.name}-reports"
    reports.mkdir(exist_ok=True)
    xml = reports / f"{kind}-{store.name}.xml"
    # (one command line for cold and warm: it is an input of kiln's guard, and another one
    # would verify every function once, tracing it; the report is renamed after)
    report = folder / f"report-{store.name}.xml"
    report.unlink(missing_ok=True)
    head = ("-m", "kiln", "run") if kind != "plain" else ()
    proc = children.run_child([sys.executable, *head, *PYTEST, f"--junitxml={report}"],
                              cwd=folder, env=_env(store), timeout=1800)
    if report.exists():
        report.replace(xml)
    if not xml.exists():
        raise RuntimeError(f"{kind} run did not finish:\n{proc.stdout[-4000:]}"
                           f"\n{proc.stderr[-4000:]}")
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcomes[case.get("name", "?")] = "failed" if failed else (
            "skipped" if skipped else "passed")
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("kiln: hits:")]
    return {"outcomes": outcomes, "kiln": summary[-1] if summary else None}


def documented() -> dict[str, set[str]]:
    """``differences.txt``: test id -> the runs it fails in by design."""
    out: dict[str, set[str]] = {}
    for line in (HERE / "differences.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, runs, _ = line.split(maxsplit=2)
            out[name] = set(runs.split(","))
    return out


def without_trace_counts(folder: Path) -> None:
    """Remove equinox's ``assert num_traces == N`` lines from the copy in ``folder``."""
    path = folder / "tests" / "test_jit.py"
    text = re.sub(r"^(\s*)assert num_traces == \d+\s*$", r"\1pass", path.read_text(),
                  flags=re.M)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--equinox", type=Path,
                        default=os.environ.get("KILN_EQUINOX_SRC") or VENDORED,
                        help="equinox's git directory, a checkout, or a folder with tests/ "
                        f"(default: KILN_EQUINOX_SRC, else the copy at {VENDORED_TAG} in "
                        f"{VENDORED})")
    parser.add_argument("--out", type=Path, help="the folder for the tests and the store "
                        "(default: a temporary one, removed after)")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("--without-trace-counts", action="store_true",
                        help="also run warm with `assert num_traces == N` removed")
    args = parser.parse_args(argv)
    import equinox

    tag = f"v{equinox.__version__}"
    if args.equinox.resolve() == VENDORED and tag != VENDORED_TAG:
        parser.error(f"the copy in {VENDORED} is equinox's tests at {VENDORED_TAG}, and the "
                     f"installed equinox is {equinox.__version__}: give --equinox SRC (an "
                     "equinox source with its tag) or install that version")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        origin = fetch(args.equinox, tag, folder)
        store = folder / "store"
        shutil.rmtree(store, ignore_errors=True)
        print(f"equinox tests/test_jit.py at {origin}; equinox {equinox.__version__}")
        results = {kind: run(kind, folder, store) for kind in RUNS}
        if args.without_trace_counts:
            # edited test functions are other programs: a store of their own, cold then warm
            # (no failure is documented for these runs)
            without_trace_counts(folder)
            store = folder / "store-no-trace-counts"
            shutil.rmtree(store, ignore_errors=True)
            for kind in ("cold", "warm"):
                results[f"{kind}-no-trace-counts"] = run(kind, folder, store)
        listed = documented()
        bad = []
        for kind, result in results.items():
            outcomes = result["outcomes"]
            failed = sorted(n for n, o in outcomes.items() if o == "failed")
            passed = sum(o == "passed" for o in outcomes.values())
            print(f"equinox test_jit ({kind}): {passed} passed, {len(failed)} failed"
                  + (f"; {result['kiln']}" if result["kiln"] else ""))
            for name in failed:
                runs = listed.get(name, set())
                why = "documented" if kind in runs else "NOT DOCUMENTED"
                print(f"  FAILED {name} ({why})")
                if why != "documented":
                    bad.append((kind, name))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    if bad:
        print(f"{len(bad)} failures not in {HERE / 'differences.txt'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
