from yolofast.cli import main

raise SystemExit(main())
