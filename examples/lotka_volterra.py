"""Fit the Lotka-Volterra predator-prey model to the Hudson's Bay hare/lynx data.

The program and its data ship with kiln, in the ``kiln_demo`` package
(``src/kiln_demo/lotka_volterra.py`` and ``hudson_bay.csv`` here), so that ``kiln demo`` runs
it from an installed kiln too. This file runs that program::

    python examples/lotka_volterra.py --jit jax    # compiles every time
    python examples/lotka_volterra.py --jit kiln   # compiles once, then loads

The last line printed is one JSON object, e.g.
``{"time_to_first_result_s": ..., "params": {"a": ..., ...}, "loss": ...}``. Imported (by the
tests and benchmarks), this module offers the program's ``load_data``, ``make_fit``, ``main``.
"""

import runpy

if __name__ == "__main__":
    # as ``python -m kiln_demo.lotka_volterra``: the program's clock starts before it imports
    # jax, as when it runs on its own
    runpy.run_module("kiln_demo.lotka_volterra", run_name="__main__", alter_sys=True)
else:
    from kiln_demo.lotka_volterra import (
        DEFAULT_DATA,
        INITIAL_GUESS,
        PARAM_NAMES,
        compile_timings,
        load_data,
        main,
        make_fit,
    )

    __all__ = [
        "DEFAULT_DATA",
        "INITIAL_GUESS",
        "PARAM_NAMES",
        "compile_timings",
        "load_data",
        "main",
        "make_fit",
    ]
