"""``python -m vacancyd.cli``, the same as ``python -m vacancyd``."""

from vacancyd.cli import main

raise SystemExit(main())
