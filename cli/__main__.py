"""``python -m encache.cli`` = ``encache``."""
from encache.cli.app import main

main()
