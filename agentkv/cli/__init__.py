"""The ``agentkv`` command (typer): ``app`` (commands), ``chat`` (the interactive loop), ``agent``
(agents named on the command line), ``config``, ``display`` (rich output) and ``serve``
(``agentkv serve``, the only importer of ``agentkv.server``)."""
