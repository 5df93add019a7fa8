"""``python -m tandem_lit.demo [recipe]``: build (or find) the demo models, print the report."""

from tandem_lit.demo.build import main

main()
