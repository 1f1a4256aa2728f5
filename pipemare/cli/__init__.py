"""The library's part of the ``pipemare`` command: Lightning's CLI and a quiet console."""
