"""``python -m kiln``: the ``kiln`` command line (see :mod:`kiln._cli`, :mod:`kiln_cli`)."""

if __name__ == "__main__":
    import kiln_cli  # (kiln run --server first offers the run to a warm process)

    raise SystemExit(kiln_cli.main())
