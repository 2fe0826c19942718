from epd_proxy.tools.bench.runner import main

raise SystemExit(main())
