"""JAX's own jit tests through kiln: `kiln.jit` in place of `jax.jit` in the test file only,
or the whole file under the jax.jit swap itself, `kiln run --jit`; both must keep jax.jit's
results, bar the differences listed in `differences.txt`.

`api_test.py` is JAX's `tests/api_test.py` at tag jax-v0.10.2 (commit
990e6a0b84138346e6a38785412f36356e0e5dc3), unchanged, under its Apache-2.0 header.

Two ways to run it, each twice on one store by `.ci/run`: cold (empty), then warm (filled)::

    # kiln.jit in the file: while it is imported, its `import jax` and `from jax import jit`
    # get a stand-in module, the real `jax` in every attribute but `jit`, which is `kiln.jit`;
    # every other caller of `jax.jit` (kiln itself, `jax._src.test_util`, JAX's internals) keeps
    # the original. JAX's cache stays off (KILN_JAX_CACHE=0).
    KILN_CACHE_DIR=$(mktemp -d) python -m pytest -c tests/jax_api/pytest.ini tests/jax_api

    # the mode: `kiln run --jit` has replaced `jax.jit` before pytest imports the file, so its
    # `from jax import jit` and `jax.jit` are the swap's, as in any program run that way (JAX's
    # internals keep their own jit, by design); the stand-in stays off, and JAX's cache is
    # routed into the store as `kiln run` does by default
    KILN_CACHE_DIR=$(mktemp -d) python -m kiln run --jit -m pytest -c tests/jax_api/pytest.ini \
        tests/jax_api

`KILN_JAX_API_SWAP=0` (without `kiln run --jit`) runs the file on plain JAX (the reference
count). Each run ends with a line `jax_api (<how>, jax <version>): <passed> passed, <failed>
failed ...` and appends it, as JSON, to `$KILN_JAX_API_RESULTS` when that is set. With
`KILN_JAX_API_RUN=cold` (or `warm`) the run passes when every failure is listed for that run,
in the section of `differences.txt` for how it ran, and fails on any other. What fails and why:
docs/drop-in.md.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import sys
import types

# Under `kiln run --jit` kiln is imported and jax.jit is its swap before this file runs (the
# check must not import kiln: the setting below is read when kiln is).
_swap_module = sys.modules.get("kiln._jit._swap")
MODE = _swap_module is not None and _swap_module.is_replaced()

if not MODE:
    # JAX's test harness checks that a test leaves the compilation cache object as it found
    # it; kiln turns JAX's persistent cache on at its first function (docs/reference.md, "What
    # kiln changes in JAX's global state"), which would trip it in the first test that makes one. Set before kiln
    # is imported.
    os.environ.setdefault("KILN_JAX_CACHE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import kiln  # noqa: E402
from kiln._jit import _swap  # noqa: E402

SWAP = not MODE and os.environ.get("KILN_JAX_API_SWAP", "1") != "0"
HOW = "kiln run --jit" if MODE else "kiln.jit" if SWAP else "jax.jit"
TEST_MODULE = "api_test"


class _JaxWithKilnJit(types.ModuleType):
    """`jax`, except that `jit` is `kiln.jit`."""

    def __init__(self) -> None:
        super().__init__("jax", jax.__doc__)
        self.__dict__["jit"] = kiln.jit

    def __getattr__(self, name: str):
        return getattr(jax, name)


_stand_in = _JaxWithKilnJit()
_real_import = builtins.__import__


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _real_import(name, globals, locals, fromlist, level)
    if (
        name == "jax"
        and level == 0
        and globals is not None
        and str(globals.get("__name__", "")).rpartition(".")[2] == TEST_MODULE
    ):
        return _stand_in
    return module


if SWAP:
    builtins.__import__ = _import


_outcomes: dict[str, int] = {}
_failed: list[str] = []  # test names (no parameter suffix) of failed tests
HERE = os.path.dirname(os.path.abspath(__file__))


def _documented(how: str) -> dict[str, set[str]]:
    """differences.txt, the section of runs made ``how`` ("kiln.jit", "kiln run --jit"): test
    name -> the runs ("cold", "warm") it is documented to fail in. Lines before the first
    ``[section]`` header are kiln.jit's."""
    out: dict[str, set[str]] = {}
    section = "kiln.jit"
    with open(os.path.join(HERE, "differences.txt")) as f:
        for line in f:
            text = line.split("#", 1)[0].strip()
            if text.startswith("[") and text.endswith("]"):
                section = text[1:-1].strip()
                continue
            fields = text.split()
            if fields and section == how:
                out[fields[0]] = set(fields[1].split(","))
    return out


def pytest_runtest_logreport(report):
    # One outcome per test, as pytest's summary counts them: a subtest's report is not a test's,
    # a failed setup is a failure, a skip is reported at setup.
    if "subtest" in type(report).__name__.lower():
        return
    if (report.when == "call") or (report.when == "setup" and not report.passed):
        _outcomes[report.outcome] = _outcomes.get(report.outcome, 0) + 1
        if report.failed:
            _failed.append(re.sub(r"\d+$", "", report.nodeid.rpartition("::")[2]))


def _undocumented() -> list[str]:
    """Failures differences.txt does not list for this run (KILN_JAX_API_RUN: cold, warm) in
    the section of how it ran; on plain JAX, every failure."""
    run = os.environ.get("KILN_JAX_API_RUN", "")
    documented = _documented(HOW) if (SWAP or MODE) else {}
    return sorted({name for name in _failed if run not in documented.get(name, set())})


def pytest_sessionfinish(session, exitstatus):
    # KILN_JAX_API_RUN=cold|warm (.ci/run): the run passes when every failure is a documented
    # difference of that run, and fails on any other
    if os.environ.get("KILN_JAX_API_RUN") and exitstatus in (0, 1):
        session.exitstatus = 1 if _undocumented() else 0


def pytest_terminal_summary(terminalreporter):
    store = os.environ.get("KILN_CACHE_DIR", "")
    line = (
        f"jax_api ({HOW}, jax {jax.__version__}): "
        f"{_outcomes.get('passed', 0)} passed, {_outcomes.get('failed', 0)} failed, "
        f"{_outcomes.get('skipped', 0)} skipped"
    )
    terminalreporter.write_line(line)
    if os.environ.get("KILN_JAX_API_RUN"):
        terminalreporter.write_line(
            f"jax_api: failures not in differences.txt [{HOW}] for a "
            f"{os.environ['KILN_JAX_API_RUN']} run: {_undocumented() or 'none'}")
    results = os.environ.get("KILN_JAX_API_RESULTS")
    if results:
        with open(results, "a") as f:
            f.write(json.dumps({"mode": HOW, "store": store, "jax": jax.__version__,
                                **_outcomes}) + "\n")


@pytest.fixture(autouse=True, scope="session")
def _check_swap():
    if SWAP or MODE:
        module = next(m for n, m in sys.modules.items() if n.rpartition(".")[2] == TEST_MODULE)
        jit = _swap.swapped_jit if MODE else kiln.jit
        assert module.jit is jit and module.jax.jit is jit, "the swap did not take"
    if MODE:
        # JAX's harness checks that each test leaves JAX's compilation cache object as it found
        # it; under `kiln run` (JAX's cache routed into the store) jax makes that object at its
        # first compile, which would be inside the first test: one eager operation makes it now
        (jnp.zeros(2) + 1).block_until_ready()
    yield
