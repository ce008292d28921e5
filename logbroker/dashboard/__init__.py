"""The dashboard HTTP port: health, readiness, metrics, rate-limit statistics, the operator page
and user management (a Klein app with injected dependencies)."""
