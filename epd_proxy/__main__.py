from epd_proxy.cli import main

raise SystemExit(main())
