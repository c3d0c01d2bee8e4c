from kugetsu.cli import main

raise SystemExit(main())
