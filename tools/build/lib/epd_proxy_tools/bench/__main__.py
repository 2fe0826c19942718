from epd_proxy_tools.bench.runner import main

raise SystemExit(main())
