"""The fleet: which instances exist (registry, roster, discovery), which may take traffic (health, prober), and which one a call goes to (routing, scheduler)."""
