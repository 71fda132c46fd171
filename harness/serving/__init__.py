"""Network serving: the WebSocket endpoint (``server``), its wire protocol (``protocol``), the
hardening it applies to every connection (``guards``) and the bundled viewer client (``client``).

Above the drivers: the server runs sessions through the same ``drivers.serve_run`` path as ``serve``
without ``--listen``, one client session per driver session.
"""
