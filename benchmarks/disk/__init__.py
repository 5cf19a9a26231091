"""The disk tier and cold start: read methods, decode against the host budget, simulated tiers, load time."""
