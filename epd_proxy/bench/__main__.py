from epd_proxy.bench.runner import main

raise SystemExit(main())
