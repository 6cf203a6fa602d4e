"""The Prometheus side: metric families built per scrape, and the HTTP server."""
