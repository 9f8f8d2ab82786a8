"""``python -m kiln``: the ``kiln`` command line (see :mod:`kiln._cli`, :mod:`kiln_cli`)."""

if __name__ == "__main__":
    import kiln_server  # (kiln run --server first offers the run to a warm process)

    def _load():  # type: ignore[no-untyped-def]
        from kiln._cli import main

        return main

    raise SystemExit(kiln_server.command_line(_load))
