from ddppipe.cli import main

raise SystemExit(main())
