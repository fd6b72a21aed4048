"""`python -m attnprobe` runs the command line."""

from .cli import main

main()
