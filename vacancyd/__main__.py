from vacancyd.cli import main

raise SystemExit(main())
