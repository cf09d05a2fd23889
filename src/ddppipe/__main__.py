from ddppipe.cli.main import main

raise SystemExit(main())
