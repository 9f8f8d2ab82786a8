"""The program ``kiln demo`` runs: a Lotka-Volterra fit (``lotka_volterra.py``) and its data.

Shipped with kiln, so that ``kiln demo`` works from an installed package; it needs the
``examples`` extra (equinox, diffrax, optimistix). Nothing in ``kiln`` imports it: ``kiln demo``
runs ``lotka_volterra.py`` as a script in fresh processes.

It is a package of its own, not ``kiln.demo``: kiln counts the code of its own files by kiln's
version and never hashes it (``kiln._keys._libraries``), while this program must be hashed
like any user program, so that in a checkout an edit of it is never answered with a stale
executable.
"""
