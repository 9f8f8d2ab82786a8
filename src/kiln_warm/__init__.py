"""The warm process of ``kiln run --server``: the server (:mod:`kiln_warm._serve`), what it
preloads (:mod:`kiln_warm._preload`), how it knows its imports are still fresh
(:mod:`kiln_warm._fresh`) and the set-up of each run's child (:mod:`kiln_warm._child`).

It stands above kiln (it imports kiln's command line and runs it in each child); the client,
``kiln server ls|stop`` and what client and server share are :mod:`kiln_server`, below kiln
and standard library only. Started as ``python -c "import kiln_warm._serve as s; s.main()"
SPEC`` by :func:`kiln_server.after_run`."""
