"""`python -m factory ...` = `factory ...`."""

from factory.cli import main

main()
