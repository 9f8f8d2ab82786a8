"""Never stale, round 8: state set up outside the trace, read by the trace through a channel no
watcher of the key sees; closed by the guard (``kiln._keys._guard``: the process's inputs
beside the precise key), not by a watcher per channel.

The six changes of the round nobody had tuned to, and round 7's last two:

- a library's settings container set by the user's setup code (e3nn-jax's
  ``e3nn.config("spherical_harmonics_normalization", ...)`` edited in the setup module);
- a data file read with ``linecache.getline`` while tracing (the coefficient line edited);
- a virtual subclass registered with ``SomeABC.register(...)`` in another module, tested with
  ``isinstance`` while tracing (the registration removed);
- a layer registry held in a ``weakref.WeakValueDictionary``, filled at import (another class
  registered);
- ``decimal.getcontext().prec`` set in a setup module, ``Decimal`` arithmetic while tracing;
- an entry-point plugin added to an installed package reinstalled at the same version (its
  ``.dist-info``: a new ``entry_points.txt`` and ``RECORD``), discovered while tracing;
- a module imported from a zip archive, the archive rebuilt with an edited module;
- a ``np.memmap`` table opened at import in another module, the file rewritten (same size).

Each runs in fresh processes sharing a store, in two modes (as round 7): ``decorated``
(``kiln.jit`` in the source, plain ``jax.jit`` in the same process as the reference) and
``kiln run`` (``jax.jit`` in the source run as ``python -m kiln run prog.py``, the reference a
fresh plain ``python prog.py``). Runs: the original inputs cold, then warm (no trace); every
input changed (each value as the reference gives it: never stale; traced, verified); the
changed inputs again (no trace: the verified guard, or the new entry, is remembered); the
original inputs back (the original entries, no compile where the manifest holds).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROG = '''\
import decimal
import importlib.metadata
import linecache
import sys

sys.path.insert(0, "mods.zip")

import jax
import jax.numpy as jnp
import e3nn_jax as e3nn

import kiln
import layers  # noqa: F401 - fills registry.LAYERS
import plugins  # noqa: F401 - registers virtual subclasses
import setup_decimal  # noqa: F401 - decimal's context
import setup_e3nn  # noqa: F401 - e3nn's settings
import tables
import zmod
from registry import LAYERS
from shapes import Circle, Shape


def e3nn_settings(x):
    TRACE()
    return e3nn.spherical_harmonics("1e", x, normalize=False).array


def line_cache(x):
    TRACE()
    return x * float(linecache.getline("coeffs.txt", 2))


def virtual_subclass(x):
    TRACE()
    return x * (2.0 if isinstance(Circle(), Shape) else 5.0)


def weak_registry(x):
    TRACE()
    return x * LAYERS["act"].scale


def decimal_context(x):
    TRACE()
    return x * float(decimal.Decimal(1) / decimal.Decimal(3))


def entry_points(x):
    TRACE()
    found = importlib.metadata.entry_points(group="kilntest.scales")
    return x * sum(ep.load() for ep in sorted(found, key=lambda ep: ep.name))


def zip_module(x):
    TRACE()
    return x * zmod.scale()


def memmap_table(x):
    TRACE()
    return x * tables.coeff()


x = jnp.array([1.0, 2.0, 3.0])
parts = sys.argv[1].split(",")  # "kiln", "jax" or both
for fn in (e3nn_settings, line_cache, virtual_subclass, weak_registry, decimal_context,
           entry_points, zip_module, memmap_table):
    if "kiln" in parts:
        call(fn.__name__, kiln.jit(fn), x)
    if "jax" in parts:
        call(fn.__name__ + ":jax", jax.jit(fn), x)
report()
'''
NAMES = ("e3nn_settings", "line_cache", "virtual_subclass", "weak_registry", "decimal_context",
         "entry_points", "zip_module", "memmap_table")
# changes that only the guard sees: back to the original inputs, their original entries load
# with no trace (the manifest of the others, the files their trace read, replaced the entry)
GUARDED = ("e3nn_settings", "virtual_subclass", "weak_registry", "decimal_context",
           "zip_module", "memmap_table", "entry_points")
MODES: dict[str, tuple[str, list[tuple[str, tuple[str, ...]]]]] = {
    "decorated": (PROG, [("kiln,jax", ("prog.py",))]),
    "kiln run": (PROG.replace("kiln.jit(fn)", "jax.jit(fn)"),
                 [("kiln", ("-m", "kiln", "run", "prog.py")), ("jax", ("prog.py",))]),
}


def _inputs(prog: Any, changed: bool) -> None:
    """Write every input of the program, original or changed (a file only where its content
    changes, as a user's edit does: ``linecache`` checks the size and time of what it read)."""

    def write(name: str, text: str) -> None:
        path = prog.dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    norm = "integral" if changed else "component"
    write("setup_e3nn.py", f'import e3nn_jax as e3nn\n\n'
                                f'e3nn.config("spherical_harmonics_normalization", "{norm}")\n')
    write("coeffs.txt", f"# coefficients\n{'3.0' if changed else '2.0'}\n")
    write("shapes.py", "import abc\n\n\nclass Shape(abc.ABC):\n    pass\n\n\n"
                            "class Circle:\n    pass\n")
    write("plugins.py", "from shapes import Circle, Shape\n\n"
                             + ("" if changed else "Shape.register(Circle)\n"))
    write("registry.py", "import weakref\n\nLAYERS = weakref.WeakValueDictionary()\n")
    write("layers.py", "from registry import LAYERS\n\n\nclass Double:\n    scale = 2.0\n\n\n"
                            "class Triple:\n    scale = 3.0\n\n\n"
                            f"LAYERS['act'] = {'Triple' if changed else 'Double'}\n")
    write("setup_decimal.py", f"import decimal\n\ndecimal.getcontext().prec = "
                                   f"{2 if changed else 5}\n")
    write("kplug_src.py", "BASE = 1.0\nEXTRA = 10.0\n")
    _dist_info(prog.dir / "site" / "site-packages", changed)
    zmod = f"SCALE = {5.0 if changed else 2.0}\n\n\ndef scale():\n    return SCALE\n"
    if not (prog.dir / "mods.zip").exists() or zipfile.ZipFile(
            prog.dir / "mods.zip").read("zmod.py").decode() != zmod:
        with zipfile.ZipFile(prog.dir / "mods.zip", "w") as zf:
            zf.writestr("zmod.py", zmod)
    write("tables.py", 'import numpy as np\n\nTABLE = np.memmap("table.bin", '
                            'dtype=np.float32, mode="r")\n\n\n'
                            "def coeff():\n    return float(TABLE[1])\n")
    table = np.array([1.0, 7.0 if changed else 4.0, 1.0], np.float32)
    if not (prog.dir / "table.bin").exists() or (prog.dir / "table.bin").read_bytes() != (
            table.tobytes()):
        table.tofile(prog.dir / "table.bin")


def _dist_info(site: Path, changed: bool) -> None:
    """``kplug`` 1.0 as an installer leaves it (its source is ``kplug_src.py`` in the
    program's folder, an editable install's): reinstalled with another entry point, at the
    same version."""
    folder = site / "kplug-1.0.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": "Metadata-Version: 2.1\nName: kplug\nVersion: 1.0\n",
        "entry_points.txt": "[kilntest.scales]\nbase = kplug_src:BASE\n"
                            + ("extra = kplug_src:EXTRA\n" if changed else ""),
        "top_level.txt": "kplug_src\n",
    }
    if (folder / "entry_points.txt").exists() and (
            (folder / "entry_points.txt").read_text() == files["entry_points.txt"]):
        return
    rows = []
    for name, text in files.items():
        (folder / name).write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(f"kplug-1.0.dist-info/{name},sha256={digest.decode()},{len(text)}")
    rows.append("kplug-1.0.dist-info/RECORD,,")
    (folder / "RECORD").write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("mode", list(MODES), ids=[m.replace(" ", "-") for m in MODES])
def test_state_set_up_outside_the_trace(tmp_path: Any, xp: Any, mode: str) -> None:
    prog = xp.Program(tmp_path)
    prog.base_env = {"PYTHONPATH": str(prog.dir / "site" / "site-packages")}
    source, processes = MODES[mode]
    prog.write("prog.py", source)

    def run(changed: bool) -> dict[str, Any]:
        _inputs(prog, changed)
        r: dict[str, Any] = {}
        for parts, main in processes:
            env: dict[str, str | None] = {}
            if "kiln" not in parts:  # the reference: a store of its own, never used
                env["KILN_CACHE_DIR"] = str(tmp_path / "reference")
            r.update(prog.run(parts, env=env, main=main).results)
        for name in NAMES:
            rec, ref = r[name], r[name + ":jax"]
            assert "error" not in rec, (name, rec["error"])
            np.testing.assert_allclose(rec["leaves"][0], ref["leaves"][0], rtol=1e-6,
                                       err_msg=f"{name} (changed={changed})")
        return r

    cold = run(False)
    for name in NAMES:
        xp.assert_cold(cold[name])
    warm = run(False)
    for name in NAMES:
        xp.assert_warm(warm[name])
    changed = run(True)
    for name in NAMES:
        assert changed[name]["traces"] == 1, (name, changed[name])
        assert cold[name]["leaves"] != changed[name]["leaves"], name  # (each input mattered)
    for name in GUARDED:  # the key matched: verified once (the module changed: compiled)
        assert changed[name]["verifies"] == 1, (name, changed[name])
    again = run(True)
    for name in NAMES:
        xp.assert_warm(again[name])
    back = run(False)
    for name in GUARDED:
        xp.assert_warm(back[name])
