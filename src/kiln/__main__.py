"""``python -m kiln``: the ``kiln`` command line (see :mod:`kiln._cli`)."""

from kiln._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
