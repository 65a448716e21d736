"""`python -m dynar.train`: see dynar/train/cli.py."""
from .cli import main

raise SystemExit(main())
