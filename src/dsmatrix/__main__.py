from dsmatrix.cli import main

raise SystemExit(main())
