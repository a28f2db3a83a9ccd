"""The gateway's live dashboard: ``GET /dashboard`` (a static page) polling
``GET /dashboard/api/state`` (the fleet's instances and this gateway's last minutes)."""
