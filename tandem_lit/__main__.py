"""``python -m tandem_lit`` is the ``tandem-lit`` command (for launchers that start a Python module,
e.g. ``torchrun -m tandem_lit fit ...``)."""

from tandem_lit.cli import main

main()
