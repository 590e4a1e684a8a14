"""What the tests share besides fixtures (those are in tests/conftest.py): the processes and in-process workers they
start, client loads, training programs, stand-in runtimes. Imported as `support.x` (pytest's `pythonpath`)."""
